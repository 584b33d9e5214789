"""Benchmark and profiler harness of the QSA operators.

``python -m custom_esimd_kernels_vllm.bench`` (see docs/bench.md): B/C/B latency of the CUDA
kernels against the PyTorch references (vectorised, torch.compile'd, row-by-row), percent of
the memory floor, profiler counts, and results/bench-<device>.{json,md,png}.
"""
