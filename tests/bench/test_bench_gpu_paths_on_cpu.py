"""The CUDA-only paths of the harness, driven on CPU with stand-ins: a graph unit that replays
eagerly and a "kernel" that is the public op on its CPU (reference) backend. This checks the
wiring (the public ABI call, graph-mode B/C/B, the reports' graph and target sections, the
plot) without a GPU; the GPU run checks the real thing."""

from __future__ import annotations

import json

import pytest
import torch

from custom_esimd_kernels_vllm.bench import cases, impls, report, runner
from custom_esimd_kernels_vllm.bench.timing import EagerUnit


class ReplayUnit(EagerUnit):
    """Stands in for GraphUnit: the same calls, replayed eagerly from copy 0 each time."""

    mode = "graph"
    captures = 0

    def __init__(self, impl, copies, calls, device):
        super().__init__(impl, copies, calls, device)
        ReplayUnit.captures += 1

    def __call__(self) -> float:
        self.cursor = 0
        return super().__call__()


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(runner, "graph_supported", lambda device: True)
    monkeypatch.setattr(runner, "GraphUnit", ReplayUnit)
    monkeypatch.setattr(impls, "kernel_status", lambda device: (True, ""))
    ReplayUnit.captures = 0


def _run(spec):
    cfg = runner.BenchConfig(
        device=torch.device("cpu"), pairs=2, warmup_units=1, max_copies=2, cache_bytes=1 << 20,
        memory_budget=64 << 20, compile="none",
    )  # fmt: skip
    return runner.run_case(spec, cfg, 1e10, runner.CompileLedger())


@pytest.mark.parametrize("op", ["attention", "selection"])
def test_graph_mode_and_kernel_wiring(fake_gpu, op, tmp_path):
    target = cases.CaseSpec(op, "scale", "R=2 ctx=4K", 2, 4096, target_us=1e9, profile=True)
    result = _run(target)
    assert not result["errors"], result["errors"]
    assert list(result["impls"]) == ["kernel", "ref-vectorised", "ref-rowwise"]
    assert result["impls"]["kernel"]["check"]["ok"]  # the public op, reference backend
    graph = result["modes"]["graph"]
    assert graph["candidate"] == "kernel"
    assert [c["baseline"] for c in graph["comparisons"]] == ["ref-vectorised"]  # no rowwise
    assert [c["baseline"] for c in result["modes"]["eager"]["comparisons"]] == [
        "ref-vectorised", "ref-rowwise",
    ]  # fmt: skip
    assert ReplayUnit.captures >= 2
    assert set(result["profile"]) == {"kernel", "ref-vectorised", "ref-rowwise"}

    other = _run(cases.CaseSpec(op, "scale", "R=2 ctx=8K", 2, 8192))
    data = {
        "environment": {"device_name": "test device", "torch": torch.__version__, "git": {}},
        "config": {
            "warmup_units": 1,
            "pairs": 2,
            "unit_s": 2e-3,
            "rotation_factor": 2.0,
            "cache_bytes": 1 << 20,
        },  # fmt: skip
        "copy_bandwidth": {"bandwidth_bytes_per_s": 1e10},
        "cases": [result, other],
        "notes": [],
    }
    paths = report.write_all(data, tmp_path, "bench-test")
    md = paths["md"].read_text()
    assert "## Performance-table cases" in md and "| yes |" in md
    assert "## Latency — CUDA-graph replay" in md and "kernel vs ref-vectorised" in md
    assert paths["png"].stat().st_size > 10_000
    assert json.loads(paths["json"].read_text())["cases"][0]["modes"]["graph"]["samples_s"]


def test_failing_implementation_is_recorded_not_fatal(fake_gpu, monkeypatch):
    def broken(name, op):
        impl = make(name, op)
        if name != "kernel":
            return impl

        def call(args):
            raise RuntimeError("launch failed: too many resources requested")

        return impls.Impl(name, call, graphable=True)

    make = impls.make
    monkeypatch.setattr(impls, "make", broken)
    result = _run(cases.CaseSpec("selection", "scale", "R=1 ctx=4K", 1, 4096))
    assert "launch failed" in result["impls"]["kernel"]["error"]
    assert result["modes"]["eager"]["candidate"] == "ref-vectorised"
    assert result["modes"]["graph"]["candidate"] == "ref-vectorised"
