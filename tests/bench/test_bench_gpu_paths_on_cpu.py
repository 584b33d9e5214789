"""The CUDA-only paths of the harness, driven on CPU with stand-ins: a graph unit that replays
eagerly and a "kernel" that is the public op on its CPU (reference) backend. This checks the
wiring (the public ABI call, graph-mode B/C/B, the reports' graph and target sections, the
plot) without a GPU; the GPU run checks the real thing."""

from __future__ import annotations

import json
import re

import pytest
import torch

from custom_esimd_kernels_vllm.bench import cases, impls, report, run
from custom_esimd_kernels_vllm.bench.timing import EagerUnit


class ReplayUnit(EagerUnit):
    """Stands in for GraphUnit: the same calls, replayed eagerly from copy 0 each time."""

    mode = "graph"
    captures = 0

    def __init__(self, call, copies, calls, device):
        super().__init__(call, copies, calls, device)
        ReplayUnit.captures += 1

    def __call__(self) -> float:
        self.cursor = 0
        return super().__call__()


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(run, "graph_supported", lambda device: True)
    monkeypatch.setattr(run, "GraphUnit", ReplayUnit)
    monkeypatch.setattr(impls, "kernel_status", lambda device: (True, ""))
    ReplayUnit.captures = 0


def _run(spec):
    cfg = run.BenchConfig(
        device=torch.device("cpu"), pairs=2, warmup_units=1, max_copies=2, cache_bytes=1 << 20,
        memory_budget=64 << 20, compile="none",
    )  # fmt: skip
    return run.run_case(spec, cfg, 1e10, run.CompileLedger())


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
    # the kernel's reading beside each baseline of its pairings, next to the pooled median
    row = next(line for line in md.splitlines() if "R=2 ctx=4K" in line and "| yes |" in line)
    per_pairing = row.split("| yes |")[1].split("|")[0].strip()
    assert re.fullmatch(r"[0-9.,]+ \(ref-vectorised\)", per_pairing), row
    assert "## Latency — CUDA-graph replay" in md and "kernel vs ref-vectorised" in md
    assert paths["png"].stat().st_size > 10_000
    assert json.loads(paths["json"].read_text())["cases"][0]["modes"]["graph"]["samples_s"]


def test_failing_implementation_is_recorded_not_fatal(fake_gpu, monkeypatch):
    def broken(name, op, up=None):
        impl = make(name, op, up)
        if name != "kernel":
            return impl

        def call(args):
            raise RuntimeError("launch failed: too many resources requested")

        return impls.Impl(name, call, graphable=True, check=op)

    make = impls.make
    monkeypatch.setattr(impls, "make", broken)
    result = _run(cases.CaseSpec("selection", "scale", "R=1 ctx=4K", 1, 4096))
    assert "launch failed" in result["impls"]["kernel"]["error"]
    assert result["modes"]["eager"]["candidate"] == "ref-vectorised"
    assert result["modes"]["graph"]["candidate"] == "ref-vectorised"


def test_decode_step(tmp_path):
    dec = run.decode_step(torch.device("cpu"), rows=(1, 2), context=2048, layers=2, reps=2)
    assert "skipped" not in dec and dec["backend"] == "reference"
    assert dec["ops"] == ["select", "attention"]
    assert [e["rows"] for e in dec["rows"]] == [1, 2]
    for e in dec["rows"]:
        assert "error" not in e, e.get("error")
        assert e["check"]["ok"]  # 2048 tokens listed per row, a finite attention output
        assert e["eager"]["host_us_per_layer"] > 0 and e["eager"]["gpu_us_per_layer"] > 0
        assert e["eager"]["add_us"] > 0  # add_ timed in the same interleaved reps
        assert "graph" not in e  # no CUDA graphs on CPU
    assert dec["targets"] == {"graph_step_over_kernel_sum": 1.15, "eager_host_us_per_layer": 40.0}
    # the graph half of the report, from a hand-made graph entry
    dec["rows"][0]["graph"] = {"gpu_us_per_layer": 9.9, "host_us_per_layer": 1.0,
                               "ops_alone_us_per_layer": {"select": 4.0, "attention": 5.0},
                               "kernel_sum_us_per_layer": 9.0, "ratio": 1.1,
                               "met": True}  # fmt: skip
    md = report.markdown({"environment": {}, "config": {"warmup_units": 1, "pairs": 1,
                          "unit_s": 1e-3, "rotation_factor": 2, "cache_bytes": 1},
                          "cases": [], "decode_step": dec})  # fmt: skip
    assert "## Decode step" in md and "4.0 + 5.0 = 9.0" in md and "graph <= 1.15x: met" in md
    assert "select + attention (graph, alone)" in md and "`add_` µs (same reps)" in md
    assert "update" not in md


def test_nothing_of_the_bench_names_the_retired_update_operator():
    from pathlib import Path

    import custom_esimd_kernels_vllm.bench as bench

    for f in Path(bench.__file__).parent.glob("*.py"):
        assert "update_caches" not in f.read_text(), f.name


@pytest.mark.parametrize("layout", ["vllm_bf16_784", "vllm_fp8_784"])
def test_graph_mode_on_vllm_layouts(fake_gpu, layout):
    # the public op with contract v2's keywords (scales, gate) on vLLM's layout; the references
    # run once for the check and are not timed
    for op in ("attention", "selection"):
        spec = cases.CaseSpec(op, "dtype", "R=2 ctx=4K", 2, 4096, layout=layout, target_us=1e9)
        result = _run(spec)
        assert not result["errors"], result["errors"]
        assert list(result["impls"]) == ["kernel"]
        assert result["impls"]["kernel"]["check"]["ok"], result["impls"]["kernel"]["check"]
        assert "seed layout only" in result["skipped"]["ref-vectorised"]
        graph = result["modes"]["graph"]
        assert graph["candidate"] == "kernel" and graph["comparisons"] == []
        assert len(graph["samples_s"]["kernel"]) == 4  # timed alone: 2 x pairs units
        assert result["spec"]["layout"] == layout and result["floor"]["total"] > 0


def test_validation_run_grid_holds_the_dtype_cases():
    from custom_esimd_kernels_vllm.bench import cli

    _, grid, budget = cli.configure(cli.parse_args(["--validation", "x.json", "--device", "cpu"]))
    assert budget == cli.VALIDATION_TIME_BUDGET_S
    assert {c.layout for c in grid} == {"seed", "vllm_bf16_784", "vllm_fp8_784"}
    assert [c.group for c in cli.execution_order(grid)][:2] == ["seed", "seed"]


def test_a_failing_reference_loses_the_checks_not_the_timings(fake_gpu, monkeypatch, tmp_path):
    make = impls.make

    def no_reference(name, op, up=None):
        impl = make(name, op, up)
        if name != "ref-vectorised":
            return impl

        def call(args):
            raise RuntimeError("\"index_select_cuda\" not implemented for 'Float8_e4m3fn'")

        return impls.Impl(name, call, graphable=True, check=op)

    monkeypatch.setattr(impls, "make", no_reference)
    spec = cases.CaseSpec("attention", "dtype", "R=1 ctx=4K", 1, 4096, layout="vllm_fp8_784")
    result = _run(spec)
    assert "not implemented" in result["reference_error"]
    assert result["impls"]["kernel"]["check"]["ok"] is None
    assert result["modes"]["graph"]["latency"]["kernel"]["median"] > 0
    data = {"environment": {}, "config": {"warmup_units": 1, "pairs": 1, "unit_s": 1e-3,
            "rotation_factor": 2, "cache_bytes": 1}, "cases": [result]}  # fmt: skip
    assert "the reference failed, nothing compared" in report.markdown(data)


def test_page_compaction_keeps_float8_bits():
    from custom_esimd_kernels_vllm.bench import timing
    from custom_esimd_kernels_vllm.qsa_ops import contract

    pool = torch.randn(5, 2, 3).to(contract.FP8)
    got = timing._select_pages(pool, torch.tensor([4, 1]))
    assert got.dtype == contract.FP8
    assert torch.equal(got.view(torch.uint8), pool.view(torch.uint8)[[4, 1]])
