"""--help only prints, at every entry point: a step's help neither runs the step nor touches its
record or log, through ``python3 -m ci.pipeline STEP --help``, ``nox -s STEP -- --help`` and
``nox -s pipeline -- --help``; the repository's scripts (scripts/gpu_session.sh included)
print their usage and leave the tree as it was."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ci import layout, records

ROOT = Path(__file__).resolve().parents[2]
HELP = ("--help", "-h")


@pytest.fixture
def guarded(pipeline, tmp_path, monkeypatch):
    """Step records and logs in tmp_path, one old record and log per step, and every step
    function replaced by one that fails the test if it runs."""
    monkeypatch.setattr(layout, "STEPS_DIR", tmp_path / "steps")
    monkeypatch.setattr(layout, "LOGS_DIR", tmp_path / "logs")
    monkeypatch.setattr(records, "_run", None)
    (tmp_path / "steps").mkdir()
    (tmp_path / "logs").mkdir()
    for name, step in list(pipeline.STEPS.items()):
        (tmp_path / "steps" / f"{name}.json").write_text('{"status": "passed"}\n')
        (tmp_path / "logs" / f"{name}.log").write_text("evidence\n")

        def ran(env, name=name):
            raise AssertionError(f"--help ran step {name}")

        ran.__doc__ = step.func.__doc__
        monkeypatch.setitem(pipeline.STEPS, name, dataclasses.replace(step, func=ran))
    return tmp_path


def untouched(root: Path) -> bool:
    steps = {p.name: p.read_text() for p in (root / "steps").iterdir()}
    logs = {p.name: p.read_text() for p in (root / "logs").iterdir()}
    return set(steps.values()) == {'{"status": "passed"}\n'} and set(logs.values()) == {
        "evidence\n"
    }


@pytest.mark.parametrize("flag", HELP)
def test_a_steps_help_only_prints(pipeline, guarded, capsys, flag):
    for name in pipeline.STEPS:
        assert pipeline.main([name, flag]) == 0
        out = capsys.readouterr().out
        assert f"usage: python3 -m ci.pipeline {name}" in out, out
        assert "".join(pipeline.STEPS[name].summary.split()) in "".join(out.split())
        assert "record:" not in out
    assert untouched(guarded)


def test_the_steps_help_names_their_arguments(pipeline, capsys):
    assert "--target" in pipeline.STEPS["build"].help("build")
    assert "--wheel" in pipeline.STEPS["kernels"].help("kernels")
    assert "pytest" in pipeline.STEPS["kernels"].help("kernels")
    assert "[PYTEST ARGS]" in pipeline.STEPS["tests"].help("tests")
    assert "gsm8k_gate.py --help" in pipeline.STEPS["gsm8k"].help("gsm8k")


def test_the_pipelines_help_begins_no_run(pipeline, guarded, capsys):
    assert pipeline.start_pipeline(["--help"]) is None
    assert "--steps" in capsys.readouterr().out
    assert records.current_run() is None
    assert untouched(guarded)


def test_nox_sessions_help_only_prints(pipeline, guarded, capsys, nox_sessions):
    class Session:
        bin_paths: list[str] = []
        posargs = ["--help"]

        def skip(self, reason):
            raise AssertionError(f"skipped: {reason}")

        error = skip

        def notify(self, *args):
            raise AssertionError(f"queued {args}")

    for name in [*pipeline.STEPS, "pipeline", "record"]:
        Session.name = name
        nox_sessions[name](Session())
        assert "usage" in capsys.readouterr().out
    assert untouched(guarded)
    assert not (layout.DIST / "run-record.json").exists() or records.current_run() is None


def test_nox_list_shows_whole_sentences(nox_sessions):
    """`nox -l` shows the first line of each session's docstring: it must be the whole
    summary, a sentence that ends."""
    for name, func in nox_sessions.items():
        first = func.__doc__.strip().split("\n")[0]
        paragraph = " ".join(func.__doc__.strip().split("\n\n")[0].split())
        assert first == paragraph and first.endswith("."), (name, first)


SCRIPTS = [
    ["ci/gsm8k_gate.py"],
    ["ci/nox_gsm8k.py"],
    ["ci/nox_vllm.py"],
    ["ci/vllm_server.py"],
    ["ci/make_tiny_qwen4exp.py"],
    ["ci/readme_figures.py"],
    ["docker/images.py"],
    ["scripts/gather_floor.py"],
    ["scripts/select_drain_model.py"],
    ["-m", "ci.pipeline"],
    ["-m", "ci.pipeline", "build"],
    ["-m", "ci.pipeline", "tests"],
    ["-m", "ci.pipeline", "wheel"],
    ["-m", "ci.pipeline", "kernels"],
    ["-m", "custom_esimd_kernels_vllm.qsa_ops.provenance"],
    ["-m", "custom_esimd_kernels_vllm.bench"],
]


def snapshot(tree: Path) -> dict[str, tuple[int, int]]:
    return {
        p.relative_to(tree).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in tree.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_scripts_help_prints_and_leaves_the_tree_as_it_was(images, tmp_path):
    src = images.export_tree(tmp_path / "src")
    before = snapshot(src)
    environ = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(src)}
    for argv in SCRIPTS:
        res = subprocess.run(
            [sys.executable, *argv, "--help"],
            cwd=src,
            capture_output=True,
            text=True,
            env=environ,
            timeout=120,
        )
        assert res.returncode == 0, (argv, res.stdout + res.stderr)
        assert "usage:" in res.stdout, (argv, res.stdout)
    for args in (
        ["--help"],
        ["validate", "--help"],
        ["bench", "-h"],
        ["record", "--help"],
        ["ab", "--help"],
    ):
        res = subprocess.run(
            ["bash", "scripts/gpu_session.sh", *args],
            cwd=src,
            capture_output=True,
            text=True,
            env={**environ, "PYTHON": sys.executable},
            timeout=60,
        )
        assert res.returncode == 0 and "usage:" in res.stdout, (args, res.stdout + res.stderr)
    assert snapshot(src) == before
