"""Kernel timings on the GPU: CUDA-graph replay, median, against the PyTorch reference.

    python scripts/gpu_timing.py [--json PATH] [--splits-sweep]

A development tool of the kernels (the benchmark harness in custom_esimd_kernels_vllm.bench
makes the official numbers). Each case captures ``CALLS`` back-to-back calls in one CUDA graph
and reports the median replay time / CALLS over ``REPS`` replays, for the CUDA kernels and the
eager reference; plus the device-to-device copy bandwidth (bytes read + written).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics

import torch

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import _cuda, testing

CALLS = 20
REPS = 30


def graph_time_us(fn, calls: int = CALLS, reps: int = REPS) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # warm-up on the capture stream: workspaces exist before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def eager_time_us(fn, calls: int = 3, reps: int = 5) -> float:
    """Events around eager calls (the reference is not capturable: it copies a CPU scalar)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def kernel_breakdown(fn, calls: int = 10) -> dict[str, float]:
    """Device time per call of each QSA kernel (torch.profiler / CUPTI), in us."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if "qsa" in e.key and total:
            name = e.key.split("(")[0].split("::")[-1]
            times[name] = times.get(name, 0.0) + total / calls
    return times


def copy_bandwidth_gbs() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)  # warm the clocks up
    us = graph_time_us(lambda: dst.copy_(src), calls=10, reps=10)
    return 2 * src.numel() / (us * 1e-6) / 1e9


def with_backend(name, fn):
    def call():
        os.environ["QSA_BACKEND"] = name
        fn()

    return call


def select_cases():
    sat = testing.make_select_case("p8192_saturated", 1, "cuda", seed=1, integer=False)
    yield "select R=1 P8192 saturated", sat, 8.0, 2303 * 256
    yield "select R=1 ctx 131072", testing.scale_select_case(131072, 1, "cuda"), 15.0, 32768 * 256
    yield (
        "select R=64 ctx 32768 (64 requests)",
        testing.scale_select_case(32768, 64, "cuda", requests=64),
        60.0,
        64 * 8192 * 256,
    )


def attention_cases():
    ctx = 262144  # 256 MiB of K/V: rows do not live in L2
    for R, target in ((1, 5.0), (64, 45.0), (256, 150.0)):
        case = testing.scale_attention_case(ctx, R, "cuda", seed=R)
        yield f"attention R={R} width 2051", case, target, R * 2051 * 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--splits-sweep", action="store_true")
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--breakdown", action="store_true", help="per-kernel device time")
    parser.add_argument("--only", default="", help="run only cases whose name contains this")
    parser.add_argument("--no-bandwidth", action="store_true")
    args = parser.parse_args()
    bw = float("nan") if args.no_bandwidth else copy_bandwidth_gbs()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth {bw:.0f} GB/s (read+write)")
    rows = []
    for name, case, target, nbytes in itertools.chain(select_cases(), attention_cases()):
        if args.only not in name:
            continue
        op = (
            qsa_ops.select_paged_tokens
            if name.startswith("select")
            else qsa_ops.sparse_paged_attention
        )
        cuda_us = graph_time_us(with_backend("cuda", lambda op=op, case=case: op(*case.args())))
        ref_us = None
        if not args.no_reference:
            ref_us = eager_time_us(
                with_backend("reference", lambda op=op, case=case: op(*case.args())),
                calls=2,
                reps=5,
            )
        gbs = nbytes / (cuda_us * 1e-6) / 1e9
        row = dict(case=name, cuda_us=cuda_us, target_us=target, reference_us=ref_us,
                   bytes=nbytes, gbs=gbs, pct_copy_bw=100 * gbs / bw)  # fmt: skip
        rows.append(row)
        ref = f"{ref_us:9.1f} us ({ref_us / cuda_us:5.1f}x)" if ref_us else ""
        print(
            f"{name:40s} {cuda_us:8.2f} us (target {target:5.0f}) {gbs:7.0f} GB/s {ref}", flush=True
        )
        if args.breakdown:
            os.environ["QSA_BACKEND"] = "cuda"
            row["kernels_us"] = kernel_breakdown(lambda op=op, case=case: op(*case.args()))
            print("    " + "  ".join(f"{k} {v:.2f}" for k, v in row["kernels_us"].items()))
    if args.splits_sweep:
        for R in (1, 2, 8, 64, 256):
            case = testing.scale_attention_case(262144, R, "cuda", seed=R)
            line = []
            for sp in (1, 2, 4, 8, 12, 16, 24, 32):
                os.environ[_cuda.SPLITS_ENV] = str(sp)
                us = graph_time_us(
                    with_backend(
                        "cuda", lambda case=case: qsa_ops.sparse_paged_attention(*case.args())
                    )
                )
                line.append(f"{sp}:{us:.1f}")
                rows.append(dict(case=f"attention R={R} splits={sp}", cuda_us=us))
            os.environ.pop(_cuda.SPLITS_ENV)
            print(
                f"splits sweep R={R} (auto {_cuda.attention_splits(R)}): {' '.join(line)}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(device=torch.cuda.get_device_name(), copy_gbs=bw, rows=rows), f, indent=1
            )


if __name__ == "__main__":
    main()
