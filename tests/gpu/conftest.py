"""Fixtures of the GPU suite: the compiled CUDA backend required, cases built on the CUDA device.

Tests here carry the ``gpu`` marker; tests/conftest.py skips them (with the reason) where
torch sees no CUDA device. On a CUDA machine a missing or broken build is a failure, not a
skip: the suite exists to validate the compiled kernels.
"""

from __future__ import annotations

import pytest

from custom_esimd_kernels_vllm.qsa_ops import ops


@pytest.fixture
def cuda_backend():
    """The compiled kernels serve CUDA tensors (chosen at import); fails when they cannot."""
    if ops.BACKEND != "cuda":
        pytest.fail(
            f"a CUDA device is present but the CUDA backend cannot run: {ops.LIBRARY_ERROR}"
        )
    return "cuda"
