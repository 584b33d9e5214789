"""The TP=2 check of a QSA attention block (tests/gpu/tp2_check.py) on two CPU processes
(gloo, the PyTorch reference kernels): the sharded block equals the one-process run. The same
script runs on two GPUs with NCCL (tests/gpu/test_multi_gpu.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]


def _tp2_check():
    spec = importlib.util.spec_from_file_location(
        "tp2_check", ROOT / "tests" / "gpu" / "tp2_check.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not dist.is_gloo_available(), reason="torch.distributed has no gloo backend")
def test_tp2_block_on_two_cpu_processes(tmp_path):
    record = tmp_path / "tp2.json"
    results = _tp2_check().spawn("cpu", record, timeout=240)
    for res in results:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(record.read_text())
    assert result["passed"] and result["bit_identical"], result
    assert result["world_size"] == 2 and result["backend"] == "gloo"
