"""scripts/select_drain_model.py: the model reproduces the records it is calibrated on
(NOTES-kernels.md, eighteenth session; v57), so that its ranking of levers is worth reading."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model():
    spec = importlib.util.spec_from_file_location(
        "select_drain_model", ROOT / "scripts/select_drain_model.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("gpu,tol", [("H200", 0.02), ("H100", 0.02)])
def test_the_recorded_launch_is_the_measured_one(model, gpu, tol):
    path, launch = model.RECORDS[gpu]
    mb, bw, ours_us = model.record_case(path)
    t = model.model_us(mb, bw, 0.060, launch)
    assert abs(t / ours_us - 1) < tol, (gpu, launch, t, ours_us)


def test_every_row_selected_once_and_the_bytes_conserved(model):
    mb, bw, _ = model.record_case(model.RECORDS["H200"][0])
    items, parts = model.rows_in_parts(256, mb / 256, tail_rows=32, tail_parts=4)
    assert sum(m for _, m in items) == pytest.approx(mb)
    assert sum(parts.values()) == len(items) and len(parts) == 256
    # with no fixed costs and no per-SM cap the launch is the bytes at HBM's rate
    t = model.launch_us(items, parts, bw, 1e9, pro=0.0, arr=0.0, sel=0.0)
    assert t == pytest.approx(mb / bw, rel=1e-6)


def test_prints_its_table(model, capsys):
    assert model.main(["--rmax", "60"]) == 0
    out = capsys.readouterr().out
    assert "| v57: one CTA per row, two per SM (one wave) |" in out and "measured:" in out
