"""scripts/gather_floor.py on the CPU: its clean skip without a GPU (the measurement itself runs
on the GPU host: NOTES-kernels.md, v48)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_script_skips_without_a_gpu(capsys, monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # its own path entry when run
    spec = importlib.util.spec_from_file_location("gather_floor", ROOT / "scripts/gather_floor.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "floor.json"
    assert mod.main(["--out", str(out)]) == 0
    assert "skipped: no CUDA device" in capsys.readouterr().out
    assert not out.exists()
