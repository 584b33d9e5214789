"""The pipeline's bookkeeping: session list and order, step records, the run record."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ISSUE_ORDER = ["lint", "tests", "build", "wheel", "verify", "kernels", "bench", "overlay", "e2e", "gsm8k"]  # fmt: skip


class FakeSession:
    def __init__(self, name):
        self.name = name


def test_pipeline_order_is_the_design_order(noxfile):
    assert list(noxfile.PIPELINE) == ISSUE_ORDER


def test_every_step_is_a_session(noxfile):
    import nox.registry

    registered = set(nox.registry.get())
    assert set(ISSUE_ORDER) | {"image", "pipeline"} <= registered


@pytest.fixture
def steps_dir(noxfile, tmp_path, monkeypatch):
    monkeypatch.setattr(noxfile, "STEPS_DIR", tmp_path)
    return tmp_path


def run_wrapped(noxfile, name, body):
    wrapped = noxfile.step(body)
    try:
        wrapped(FakeSession(name))
    except Exception as exc:  # the wrapper re-raises after writing the record
        return exc
    return None


def test_step_records_a_pass_with_artifacts(noxfile, steps_dir, tmp_path):
    artifact = tmp_path / "a.bin"
    artifact.write_bytes(b"abc")

    def body(session):
        noxfile.Step.current.artifact(artifact)

    assert run_wrapped(noxfile, "demo", body) is None
    rec = json.loads((steps_dir / "demo.json").read_text())
    assert rec["status"] == "passed"
    assert list(rec["artifacts"].values()) == [
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    ]


def test_step_records_a_skip_with_its_reason(noxfile, steps_dir):
    from nox.sessions import _SessionSkip

    def body(session):
        raise _SessionSkip("no CUDA device on this host (nvidia-smi not found)")

    assert isinstance(run_wrapped(noxfile, "kernels", body), _SessionSkip)
    rec = json.loads((steps_dir / "kernels.json").read_text())
    assert rec["status"] == "skipped"
    assert rec["reason"] == "no CUDA device on this host (nvidia-smi not found)"


def test_step_records_an_error_as_a_failure(noxfile, steps_dir):
    from nox.sessions import _SessionQuit

    def body(session):
        raise _SessionQuit("target bmg-g21 needs the compiler `icpx`")

    run_wrapped(noxfile, "build", body)
    rec = json.loads((steps_dir / "build.json").read_text())
    assert (rec["status"], rec["reason"]) == ("failed", "target bmg-g21 needs the compiler `icpx`")

    def crash(session):
        raise RuntimeError("boom")

    run_wrapped(noxfile, "build", crash)
    rec = json.loads((steps_dir / "build.json").read_text())
    assert (rec["status"], rec["reason"]) == ("failed", "RuntimeError: boom")


def test_markdown_lists_every_step_and_artifact(noxfile):
    record = {
        "result": "failed",
        "started": "2026-01-01T00:00:00Z",
        "finished": "2026-01-01T00:10:00Z",
        "host": {"node": "ci", "machine": "x86_64", "python": "3.11.7"},
        "git": {"commit": "abc", "dirty": False},
        "steps": [
            {"step": "build", "status": "passed", "duration_s": 61.0, "log": "dist/logs/build.log",
             "artifacts": {"dist/provenance.json": "e" * 64}},
            {"step": "kernels", "status": "skipped", "duration_s": 1.0, "reason": "no CUDA | device",
             "log": "dist/logs/kernels.log", "artifacts": {}},
            {"step": "bench", "status": "not run", "reason": "stopped after wheel failed"},
        ],
    }  # fmt: skip
    text = noxfile.markdown(record)
    assert "# Pipeline run record: failed" in text
    assert "| build | passed | 61 s |  | dist/logs/build.log |" in text
    assert "| kernels | skipped | 1 s | no CUDA \\| device |" in text
    assert "| bench | not run |" in text
    assert f"| build | dist/provenance.json | `{'e' * 64}` |" in text


def test_elf_section_diff_names_the_changed_sections(noxfile, tmp_path):
    true = Path(shutil.which("true")).resolve()
    false = Path(shutil.which("false")).resolve()
    copy = tmp_path / "true"
    copy.write_bytes(true.read_bytes())
    assert noxfile.elf_section_diff(true, copy) == []
    differ = noxfile.elf_section_diff(true, false)
    assert ".text" in differ and ".rodata" in differ  # other code, other strings


def test_export_tree_copies_sources_but_no_build_outputs(images, tmp_path):
    dest = images.export_tree(tmp_path / "src")
    assert (dest / "noxfile.py").is_file()
    assert (dest / "custom_esimd_kernels_vllm" / "qsa_ops" / "provenance.py").is_file()
    leaked = [
        p for p in dest.rglob("*") if p.suffix == ".so" or p.name in (".venv", ".nox", "dist")
    ]
    assert leaked == []


def cuda_host() -> bool:
    return shutil.which("nvidia-smi") is not None


@pytest.mark.skipif(cuda_host(), reason="on a GPU host `kernels` runs the GPU suite: too long here")
def test_pipeline_records_skips_and_stops_at_the_first_failure(images, tmp_path):
    """Run the real `nox -s pipeline` in a copy of the repository on steps that need no venv:
    GPU steps are recorded as skipped with the reason, an unknown step fails, the rest is not
    run, and the run record lands in dist/."""
    pytest.importorskip("nox")
    src = images.export_tree(tmp_path / "src")
    res = subprocess.run(
        [sys.executable, "-m", "nox", "-s", "pipeline", "--", "--steps", "kernels,nosuchstep,bench"],
        cwd=src, capture_output=True, text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    assert res.returncode != 0, res.stdout + res.stderr
    record = json.loads((src / "dist" / "run-record.json").read_text())
    steps = {s["step"]: s for s in record["steps"]}
    assert record["result"] == "failed"
    assert steps["kernels"]["status"] == "skipped"
    assert "no CUDA device" in steps["kernels"]["reason"]
    assert steps["nosuchstep"]["status"] == "failed"
    assert steps["bench"] == {"step": "bench", "status": "not run", "reason": "stopped after nosuchstep failed"}  # fmt: skip
    log = src / steps["kernels"]["log"]
    assert log.is_file() and steps["kernels"]["artifacts"][steps["kernels"]["log"]]
    assert (src / "dist" / "run-record.md").read_text().startswith("# Pipeline run record: failed")


@pytest.mark.skipif(shutil.which("icpx") is not None, reason="icpx is installed on this host")
def test_a_target_without_its_compiler_fails_fast_naming_it(images, tmp_path):
    pytest.importorskip("nox")
    src = images.export_tree(tmp_path / "src")
    res = subprocess.run(
        [sys.executable, "-m", "nox", "-s", "build", "--", "--target", "bmg-g21"],
        cwd=src, capture_output=True, text=True,
    )  # fmt: skip
    assert res.returncode != 0
    assert "target bmg-g21 needs the compiler `icpx` on PATH" in res.stderr + res.stdout
    rec = json.loads((src / "dist" / "steps" / "build.json").read_text())
    assert rec["status"] == "failed" and "icpx" in rec["reason"]


def test_the_oneapi_image_fails_fast_when_intel_repo_is_unreachable(images, monkeypatch):
    monkeypatch.setattr(images, "ONEAPI_REPO", "http://127.0.0.1:9/oneapi")
    with pytest.raises(images.ImageError, match="not reachable from this host"):
        images.require_oneapi_repo(timeout=2)
