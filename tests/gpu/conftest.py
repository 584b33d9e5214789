"""Fixtures of the GPU suite: the CUDA backend forced on, cases built on the CUDA device.

Tests here carry the ``gpu`` marker; tests/conftest.py skips them (with the reason) where
torch sees no CUDA device. On a CUDA machine a missing or broken build is a failure, not a
skip: the suite exists to validate the compiled kernels.
"""

from __future__ import annotations

import pytest

from custom_esimd_kernels_vllm.qsa_ops import dispatch


@pytest.fixture
def cuda_backend(monkeypatch):
    """QSA_BACKEND=cuda for the test; fails when the compiled kernels cannot run."""
    ok, reason = dispatch.cuda_status()
    if not ok:
        pytest.fail(f"a CUDA device is present but the CUDA backend cannot run: {reason}")
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    return "cuda"
