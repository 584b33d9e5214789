"""Fixtures of the vLLM end-to-end suite (run by ``nox -s e2e`` in a vLLM environment)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Appended, not prepended: a module of ci/ must never shadow an installed distribution
# (ci/packaging.py would shadow `packaging`, which transformers and vLLM import).
for path in (ROOT / "ci", Path(__file__).resolve().parent):
    if str(path) not in sys.path:
        sys.path.append(str(path))


@pytest.fixture(scope="session")
def tiny_qwen4exp(tmp_path_factory) -> Path:
    from make_tiny_qwen4exp import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("qwen4exp-tp1"), tp=1)


@pytest.fixture(scope="session")
def tiny_qwen4exp_tp2(tmp_path_factory) -> Path:
    from make_tiny_qwen4exp import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("qwen4exp-tp2"), tp=2)


@pytest.fixture(scope="session")
def tiny_qwen4exp_mixed(tmp_path_factory) -> Path:
    from make_tiny_qwen4exp import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("qwen4exp-mixed"), tp=1, mixed=True)
