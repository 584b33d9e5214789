"""``--quick`` runs the harness end to end on CPU and writes the three result files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from custom_esimd_kernels_vllm.bench import cases, cli


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert cli.main(["--quick", "--out-dir", str(out), "--no-progress"]) == 0
    return out


def test_quick_writes_json_md_png(quick_run):
    out = quick_run
    # NOTES: the CPU time of the run (all threads), not its wall time: on an idle 2-core
    # runner the wall time is at most that, while a loaded machine stretches the wall time
    # without saying anything about the harness (about 20 s of CPU time today).
    seconds = json.loads((out / "bench-cpu.json").read_text())["cpu_seconds"]
    assert seconds < 60, f"--quick used {seconds:.0f} s of CPU time (CI budget: 60 s)"
    assert sorted(p.name for p in out.iterdir()) == [
        "bench-cpu.json",
        "bench-cpu.md",
        "bench-cpu.png",
    ]
    assert (out / "bench-cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "bench-cpu.md").read_text()
    assert "## Latency — Eager" in md and "## B/C/B comparisons" in md and "## Profiler" in md


def test_quick_json_contents(quick_run):
    out = quick_run
    data = json.loads((out / "bench-cpu.json").read_text())
    env = data["environment"]
    for key in ("device_name", "torch", "cuda", "git", "date_utc"):
        assert key in env
    assert "dso" in env  # None on a CPU-only install, with the reason in dso_error
    assert data["copy_bandwidth"]["bandwidth_bytes_per_s"] > 0
    assert len(data["cases"]) == len(cases.quick_cases())
    for case in data["cases"]:
        assert not case["errors"], case["errors"]
        assert set(case["impls"]) == {"ref-vectorised", "ref-rowwise"}
        assert all(i["check"]["ok"] for i in case["impls"].values())
        assert "kernel" in case["skipped"] and "ref-compiled" in case["skipped"]
        eager = case["modes"]["eager"]
        assert eager["candidate"] == "ref-vectorised"
        (comp,) = eager["comparisons"]
        assert comp["baseline"] == "ref-rowwise" and comp["pairs"] == 3
        assert len(comp["units_s"]) == 3 and all(len(u) == 3 for u in comp["units_s"])
        assert len(eager["samples_s"]["ref-rowwise"]) == 6  # every raw sample kept
        assert case["floor"]["total"] > 0 and case["floor"]["seconds"] > 0
        assert case["rotation"]["copies"] == 2
        assert "graph" not in case["modes"]  # no CUDA graphs on CPU
    profiled = [c for c in data["cases"] if "profile" in c]
    assert profiled, "no case was profiled"
    for c in profiled:
        rowwise = c["profile"]["ref-rowwise"]
        assert rowwise["host_sync_ops"] > 0  # the row loop reads device values on the host
        assert c["profile"]["ref-vectorised"]["host_sync_ops"] == 0


def test_time_budget_stops_adding_cases(tmp_path):
    argv = ["--quick", "--ops", "selection", "--time-budget-s", "0", "--out-dir", str(tmp_path),
            "--no-progress", "--no-profile"]  # fmt: skip
    assert cli.main(argv) == 0
    data = json.loads((tmp_path / "bench-cpu.json").read_text())
    assert data["cases"] == []
    assert any("time budget of 0 s exceeded" in n for n in data["notes"])
    assert "time budget" in (tmp_path / "bench-cpu.md").read_text()


def test_a_partial_grid_writes_its_own_files():
    """A dtype-grid run on a GPU host must not overwrite the device's full benchmark."""
    cpu = torch.device("cpu")
    assert cli.default_stem("dtype", cpu) == "bench-dtype-cpu"
    assert cli.default_stem("seed", cpu) == "bench-seed-cpu"
    for grid in ("default", "targets", "quick"):
        assert cli.default_stem(grid, cpu) == "bench-cpu"


def test_module_entry_point_help():
    r = subprocess.run(
        [sys.executable, "-m", "custom_esimd_kernels_vllm.bench", "--help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    for flag in ("--quick", "--grid", "--ops", "--pairs", "--out-dir", "--graph", "--no-graph",
                 "--time-budget-s"):  # fmt: skip
        assert flag in r.stdout


def test_rerender_from_json(quick_run, tmp_path):
    src = quick_run / "bench-cpu.json"
    copy = tmp_path / "bench-cpu.json"
    copy.write_text(src.read_text())
    assert cli.main(["--from-json", str(copy)]) == 0
    assert (tmp_path / "bench-cpu.md").read_text() == (quick_run / "bench-cpu.md").read_text()
    assert (tmp_path / "bench-cpu.png").stat().st_size > 0


def test_quick_host_overhead_and_sections(quick_run):
    data = json.loads((quick_run / "bench-cpu.json").read_text())
    host = data["host_overhead"]
    for key in ("aten_add_us", "select_eager_us", "attention_eager_us", "select_ratio",
                "attention_ratio"):  # fmt: skip
        assert host[key] > 0, key
    assert host["backend"] == "reference"  # CPU: the public ops run the reference
    assert "## Host overhead" in (quick_run / "bench-cpu.md").read_text()
    assert "decode_step" in data and not data["upstream"]["available"]
    assert "Upstream (vLLM's own kernels): **skipped**" in (quick_run / "bench-cpu.md").read_text()


def test_validation_section(tmp_path):
    record = tmp_path / "timing.json"
    argv = ["--quick", "--ops", "selection", "--cases", "cross-page", "--out-dir", str(tmp_path),
            "--no-progress", "--no-profile", "--no-decode-step",
            "--validation", str(record)]  # fmt: skip
    assert cli.main(argv) == 0
    section = json.loads(record.read_text())
    assert section["schema"] == "qsa-bench-validation/1"
    assert section["copy_bandwidth_bytes_per_s"] > 0 and "events" in section["copy_method"]
    (row,) = section["cases"]
    assert row["op"] == "selection" and row["mode"] == "eager" and row["kernel_us"] is None
    assert row["references_us"]["ref-vectorised"] > 0
    assert section["host_overhead"]["select_ratio"] > 0
    assert section["bench_json"] == "bench-cpu.json"
