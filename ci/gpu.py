"""The GPU host's pipeline steps: ``kernels`` (the validation of the CPU machine's wheel,
installed unrebuilt) and ``bench``. Run by ci/pipeline.py; without a CUDA device both are
recorded as skipped with the reason.

    python3 -m ci.pipeline kernels --wheel dist/X.whl [--record PATH] [--checks A,B] [PYTEST ARGS]
    python3 -m ci.pipeline bench [--wheel dist/X.whl] [BENCH ARGS]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from ci.layout import DIST, GPU_RECORD, PACKAGE, ROOT, WORK, provenance, sha256_file
from ci.step_env import Env, Failed, Skipped, now_utc
from ci.wheels import install_wheel, provenance_check, the_wheel


def cuda_device() -> tuple[bool, str]:
    """Whether this host has a usable CUDA device, and why not."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False, "no CUDA device on this host (nvidia-smi not found)"
    res = subprocess.run([smi, "-L"], capture_output=True, text=True)
    gpus = [ln for ln in res.stdout.splitlines() if ln.startswith("GPU ")]
    if res.returncode != 0 or not gpus:
        return False, f"no CUDA device on this host (nvidia-smi -L: {res.stderr.strip() or 'none'})"
    return True, gpus[0]


GPU_CHECKS = ("provenance", "tests", "memcheck", "racecheck", "timing")
SANITIZER_CORPUS = ROOT / "tests" / "gpu" / "sanitizer_corpus.py"


def sanitizer(env: Env, pyenv: dict[str, str], cwd: Path, tool: str) -> None:
    """compute-sanitizer memcheck over every kernel, racecheck over the kernels that share
    memory between warps (selection, both attention kernels), on the bad-input corpus; exit
    code 99 when the tool reports an error."""
    if shutil.which("compute-sanitizer") is None:
        raise Failed("compute-sanitizer is not on PATH")
    racecheck = ("--tool", "racecheck", "--racecheck-report", "all", "--kernel-name")
    runs = {
        "memcheck": [("--tool", "memcheck", "--kernel-name", "kns=qsa", "all")],
        "racecheck": [
            (*racecheck, "kns=select_kernel", "select"),
            (*racecheck, "kns=attention", "attention"),  # both attention kernels
        ],
    }[tool]
    for *flags, mode in runs:
        env.run(
            "compute-sanitizer",
            "--error-exitcode",
            "99",
            *flags,
            env.python(),
            SANITIZER_CORPUS,
            mode,
            env={**pyenv, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
            cwd=cwd,
            timeout=300,
        )


def wheel_manifest(site: Path) -> dict[str, Any]:
    """The provenance manifest of the wheel installed in ``site``."""
    return json.loads((site / PACKAGE / provenance.MANIFEST_NAME).read_text())


def built_commit(manifest: dict[str, Any]) -> str | None:
    """The commit a wheel was built from, as its manifest records it (None if it has none)."""
    commit = (manifest.get("git") or {}).get("commit")
    return None if commit is None else str(commit)


def bench_json(
    env: Env, path: Path, pyenv: dict[str, str], cwd: Path, commit: str
) -> dict[str, Any]:
    """The timing section of the validation record: the package's benchmark, as JSON, naming
    the commit the wheel was built from (the GPU host's tree may have no git history)."""
    out_dir = path.parent / "bench"
    env.run("python", "-m", f"{PACKAGE}.bench", "--validation", path, "--out-dir", out_dir,
            "--commit", commit, env=pyenv, cwd=cwd, timeout=600)  # fmt: skip
    data = json.loads(path.read_text())
    missing = upstream_missing(data)
    if missing:  # the section is kept in the record; the check fails
        raise Failed(missing)
    return data


def upstream_missing(timing: dict[str, Any]) -> str:
    """Why a timing section has no upstream baseline ("" where it has one): a record compares
    the kernels with vLLM's in the same dtype, so a benchmark that could not load them (a
    stated skip in the benchmark itself) fails the record's timing check."""
    up = timing.get("upstream") or {}
    if up.get("available"):
        return ""
    return (
        f"timing: upstream: expected vLLM's QSA kernels beside ours, got none "
        f"({up.get('skip') or 'no upstream section'}); give QSA_UPSTREAM or install vllm "
        f"(docs/bench.md, 'The upstream baseline')"
    )


def junit_cases(path: Path) -> tuple[dict[str, int], list[dict[str, str]]]:
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag, name in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            if case.find(tag) is not None:
                outcome = name
                break
        counts[outcome] += 1
        cases.append(
            {
                "id": f"{case.get('classname')}::{case.get('name')}",
                "outcome": "error" if outcome == "errors" else outcome,
                # seconds: what the next run's device time must cover
                "time_s": round(float(case.get("time") or 0.0), 2),
            }
        )
    return counts, cases


GPU_INFO = """import json, platform, torch
from custom_esimd_kernels_vllm import qsa_ops
print(json.dumps({"gpu": torch.cuda.get_device_name(),
    "compute_capability": ".".join(map(str, torch.cuda.get_device_capability())),
    "torch": torch.__version__, "torch_cuda": torch.version.cuda,
    "python": platform.python_version(), "build_info": qsa_ops.build_info()}, default=str))"""


def kernels_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kernels", epilog="Other arguments go to pytest (tests/gpu)."
    )
    parser.add_argument("--wheel", type=Path, help="the wheel to validate (default: dist/*.whl)")
    parser.add_argument("--record", type=Path, default=GPU_RECORD, help="validation record")
    parser.add_argument(
        "--checks",
        default=",".join(GPU_CHECKS[1:]),
        help="the checks to run now (default: all): a record of the same wheel keeps the "
        "results of the others, so one validation may be split over several runs",
    )
    return parser


def chosen_checks(value: str) -> tuple[str, ...]:
    """The --checks list, refused with the known names when one is unknown."""
    names = tuple(n for n in value.split(",") if n)
    unknown = [n for n in names if n not in GPU_CHECKS[1:]]
    if unknown or not names:
        raise Failed(f"--checks takes names of {', '.join(GPU_CHECKS[1:])}, got {value!r}")
    return names


def earlier_record(path: Path, wheel_sha256: str) -> dict[str, Any]:
    """The record at ``path`` when it validated the same wheel (else empty): the results of the
    checks this run does not repeat."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if (record.get("wheel") or {}).get("sha256") == wheel_sha256 else {}


def bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench",
        epilog="Other arguments go to python -m custom_esimd_kernels_vllm.bench (its --help "
        "lists them).",
    )
    parser.add_argument("--wheel", type=Path, help="run the benchmark on this wheel")
    return parser


# A GPU test that has not returned after this many seconds ends the suite's process
# (tests/gpu/conftest.py's watchdog), and the check names it; each test's seconds are in the
# record's cases.
GPU_TEST_LIMIT_S = 180


def gpu_tests(env: Env, pyenv: dict[str, str], scratch: Path, junit: Path, pytest_args) -> None:
    """tests/gpu under the per-test watchdog; a stop names the test that never returned."""
    watchdog = scratch / "gpu-test-watchdog.log"
    # unbuffered: pytest's progress reaches the log as it happens (a pipe buffers a partial
    # line, so a stopped run showed only the last full line of dots)
    environ = {**pyenv, "QSA_GPU_WATCHDOG": str(watchdog), "PYTHONUNBUFFERED": "1",
               "QSA_GPU_TEST_LIMIT_S": str(GPU_TEST_LIMIT_S)}  # fmt: skip
    try:
        env.run("python", "-m", "pytest", ROOT / "tests" / "gpu", "-ra", "--durations=15",
                "-p", "no:cacheprovider", f"--junitxml={junit}", *pytest_args, env=environ,
                cwd=scratch, timeout=900)  # fmt: skip
    except Failed as exc:
        hung = watchdog_stop(watchdog)
        if hung:
            kept = DIST / watchdog.name  # the stacks outlive the scratch directory
            shutil.copyfile(watchdog, kept)
            raise Failed(f"{hung}; stacks in {kept.relative_to(ROOT)} ({exc})") from None
        raise


def watchdog_stop(log: Path) -> str:
    """The watchdog's verdict in ``log``: the test that never returned, or "" (none stopped)."""
    if not log.is_file():
        return ""
    lines = log.read_text(errors="replace").splitlines()
    stop = next((i for i, line in enumerate(lines) if line.startswith("Timeout (")), None)
    if not stop:  # no stop, or a stop before any test id
        return ""
    return f"no result from {lines[stop - 1]} within {GPU_TEST_LIMIT_S} s"


def record_command(wheel: str, run_now: tuple[str, ...], pytest_args: list[str]) -> str:
    """The command a validation record names: the checks run and, where the suite ran, the
    pytest arguments that chose a part of it (``-k select``)."""
    command = f"python3 -m ci.pipeline kernels --wheel {wheel}"
    if set(run_now) != set(GPU_CHECKS[1:]):
        command += f" --checks {','.join(run_now)}"
    if pytest_args and "tests" in run_now:
        command += " " + " ".join(pytest_args)
    return command


def kernels(env: Env) -> None:
    """GPU host: the CPU machine's wheel, unrebuilt, validated; results/gpu-validation.json.

    The wheel is installed as it is and goes through the provenance check, tests/gpu,
    compute-sanitizer (memcheck, racecheck) and the benchmark's timing."""
    args, pytest_args = kernels_parser().parse_known_args(env.posargs)  # the rest: pytest's
    run_now = chosen_checks(args.checks)
    ok, why = cuda_device()
    if not ok:
        env.details["checks"] = {name: f"skipped: {why}" for name in GPU_CHECKS}
        raise Skipped(why)
    whl = the_wheel(args.wheel)
    site, pyenv = install_wheel(env, whl)
    scratch = WORK / "kernels"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    evidence = provenance_check(env, pyenv, site, scratch)
    manifest = wheel_manifest(site)
    commit = str(built_commit(manifest))
    checks = env.details["checks"] = {"provenance": "passed"}
    junit, timing = DIST / "junit-kernels.xml", DIST / "gpu-timing.json"
    junit.unlink(missing_ok=True)
    timing.unlink(missing_ok=True)
    steps = {
        "tests": lambda: gpu_tests(env, pyenv, scratch, junit, pytest_args),
        "memcheck": lambda: sanitizer(env, pyenv, scratch, "memcheck"),
        "racecheck": lambda: sanitizer(env, pyenv, scratch, "racecheck"),
        "timing": lambda: bench_json(env, timing, pyenv, scratch, commit),
    }
    earlier = earlier_record(args.record, sha256_file(whl))
    for name, func in steps.items():
        if name not in run_now:
            checks[name] = (earlier.get("checks") or {}).get(name, "not run")
            continue
        try:
            func()
            checks[name] = "passed"
        except Failed as exc:  # the record names no machine's directories
            checks[name] = "failed: " + str(exc).replace(f"{ROOT}/", "")
    try:
        out = env.run("python", "-c", GPU_INFO, env=pyenv, cwd=scratch, silent=True)
        # paths relative to the checkout: the record names no machine's directories
        info = json.loads(out.splitlines()[-1].replace(f"{ROOT}/", ""))
    except Failed as exc:  # still write the record: the checks above are the evidence
        info = {"gpu_info_error": str(exc)}
        checks["gpu_info"] = f"failed: {exc}"
    if "tests" in run_now:
        counts, cases = junit_cases(junit) if junit.is_file() else ({}, [])
    else:
        counts, cases = earlier.get("tests") or {}, earlier.get("cases") or []
    if "timing" in run_now:
        # kept where the benchmark wrote it, also when its check failed (no upstream)
        timing_data = json.loads(timing.read_text()) if timing.is_file() else None
    else:
        timing_data = earlier.get("timing")
    source = provenance.source_sha256(ROOT)
    command = record_command(whl.name, run_now, pytest_args)
    record = {
        "command": command,
        "date": now_utc(),
        "runs": [*earlier.get("runs", []), {"date": now_utc(), "checks": list(run_now)}],
        "wheel": {"name": whl.name, "sha256": sha256_file(whl)},
        "dso": {"name": Path(evidence["dso"]["path"]).name, "sha256": evidence["dso"]["sha256"]},
        "built_from": {
            "git": manifest.get("git"),
            "sources_sha256": manifest["sources_sha256"],
            "target": manifest["target"]["name"],
            "toolchain": manifest["toolchain"],
        },
        "checkout": {
            "git": provenance.git_state(ROOT),
            "source_sha256": source,
            "matches_wheel": source == manifest["sources_sha256"],
        },
        **info,
        "checks": checks,
        "tests": counts,
        "timing": timing_data,
        "cases": cases,
    }
    args.record.parent.mkdir(parents=True, exist_ok=True)
    args.record.write_text(json.dumps(record, indent=1, default=str) + "\n")
    env.artifact(args.record)
    env.details.update(
        checks=checks,
        tests=counts,
        wheel_sha256=record["wheel"]["sha256"],
        dso_sha256=record["dso"]["sha256"],
    )
    failed = {k: v for k, v in checks.items() if v != "passed"}
    if failed:
        raise Failed("GPU validation: " + "; ".join(f"{k} {v}" for k, v in failed.items()))
    if not record["checkout"]["matches_wheel"]:
        raise Failed(
            f"the wheel was built from sources {manifest['sources_sha256']}, this "
            f"checkout's tests are of {source}: validate the wheel of this checkout"
        )


def bench(env: Env) -> None:
    """GPU host: the benchmark, python -m custom_esimd_kernels_vllm.bench ARGS.

    It runs on the wheel when one is given with --wheel or lies in dist/, else on the
    checkout's build."""
    args, rest = bench_parser().parse_known_args(env.posargs)  # the rest: the benchmark's
    ok, why = cuda_device()
    if not ok:
        raise Skipped(why)
    pyenv: dict[str, str] = {}
    if args.wheel or list(DIST.glob("*.whl")):
        site, pyenv = install_wheel(env, the_wheel(args.wheel))
        # the commit the wheel was built from (the GPU host's tree may have no git history,
        # or another commit's), as the timing check names it
        commit = built_commit(wheel_manifest(site))
        if commit and not any(a == "--commit" or a.startswith("--commit=") for a in rest):
            rest = [*rest, "--commit", str(commit)]
    env.run("python", "-m", f"{PACKAGE}.bench", *rest, env=pyenv)
