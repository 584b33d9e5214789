"""Fixtures of the GPU suite: the compiled CUDA backend required, cases built on the CUDA device.

Tests here carry the ``gpu`` marker; tests/conftest.py skips them (with the reason) where
torch sees no CUDA device. On a CUDA machine a missing or broken build is a failure, not a
skip: the suite exists to validate the compiled kernels.

Watchdog: where ``QSA_GPU_WATCHDOG`` names a file and ``QSA_GPU_TEST_LIMIT_S`` a limit (the
pipeline's kernels step sets both), every test writes its id there, and one that has not
returned within the limit (seconds) ends the process with every thread's stack written after its id. A kernel that never finishes
holds the process in a wait that no signal interrupts: without this the whole step's limit
passes in silence and no later test runs either.
"""

from __future__ import annotations

import faulthandler
import os

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


@pytest.fixture(scope="session")
def _watchdog_log():
    path, limit = os.environ.get("QSA_GPU_WATCHDOG"), os.environ.get("QSA_GPU_TEST_LIMIT_S")
    if not (path and limit):
        yield None
        return
    with open(path, "w") as log:
        yield log, float(limit)


@pytest.fixture(autouse=True)
def _watchdog(request, _watchdog_log):
    if _watchdog_log is None:
        yield
        return
    log, limit = _watchdog_log
    log.write(f"{request.node.nodeid}\n")
    log.flush()
    faulthandler.dump_traceback_later(limit, exit=True, file=log)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
