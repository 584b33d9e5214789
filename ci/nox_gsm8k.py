"""`nox -s gsm8k`: the GSM8K strict gate as a pipeline step (called by ci/pipeline.py).

    nox -s gsm8k                                    CPU mechanics check: tiny checkpoint, real vLLM
    nox -s gsm8k -- --base-url URL [GATE ARGS]      gate a running server (GPU runner, real model)
    GSM8K_GATE_ARGS="--base-url URL ..." nox -s pipeline      the same, inside the pipeline

The mechanics check runs in the interpreter that has vLLM (``python ci/nox_gsm8k.py mechanics``,
started by the session): it makes the tiny checkpoint, serves it with ``ci/vllm_server.py`` and
checks, on the real server, that

1. ``tiny-qsa.json`` (threshold 0.0) passes;
2. the same questions with a threshold just above the achieved accuracy fail with exit code 1;
3. parity mode against the same server twice passes (greedy completions are repeatable);
4. once the server is stopped, the gate reports an error (exit code 2), not a pass.

Results land in ``results/gsm8k/<run>/`` (result.json, config.json, questions.jsonl) plus
``results/gsm8k/mechanics.json``; the session adds them to its step record.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CI = Path(__file__).resolve().parent
ROOT = CI.parent
RESULTS = ROOT / "results" / "gsm8k"
TINY_CONFIG = CI / "gsm8k" / "configs" / "tiny-qsa.json"
RELEASE_CONFIG = CI / "gsm8k" / "configs" / "qwen4exp-qsa-tp8.json"
GATE_REQUIREMENTS = CI / "gsm8k" / "requirements.txt"
# The tiny checkpoint is vLLM's own Qwen4Exp (ci/make_tiny_qwen4exp.py), QSA on our operators:
# bfloat16 (vLLM's QSA requires it: the server's default arguments), prefix caching off (vLLM
# 0.32.0 serves an all-QSA model only so).
TINY_SERVER_ARGS = ("--no-enable-prefix-caching",)


def _load(name: str) -> Any:
    """Import a sibling script of ci/ by path (ci/ is not a package)."""
    path = CI / f"{name}.py"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------
# The mechanics check (runs inside the vLLM interpreter)
# --------------------------------------------------------------------------------------------


def run_mechanics(
    out_root: Path, model_dir: Path | None = None, python: str = sys.executable
) -> dict:
    """Gate the tiny checkpoint on a real vLLM server; return a summary whose ``ok`` is True
    only when every expectation held. Writes ``out_root/mechanics.json``."""
    gate = _load("gsm8k_gate")
    server_mod = _load("vllm_server")
    config = gate.load_config(TINY_CONFIG)
    out_root.mkdir(parents=True, exist_ok=True)
    checks: list[dict[str, Any]] = []

    def check(run: str, outcome: Any, want: str, what: str, exit_code: int | None = None) -> None:
        """Record one run: its status and exit code must be the expected ones."""
        code = outcome.exit_code if exit_code is None else exit_code
        want_code = gate.GateResult(want, "", {}).exit_code
        ok = outcome.status == want and code == want_code
        checks.append(
            {
                "run": run,
                "what": what,
                "expected": want,
                "status": outcome.status,
                "exit_code": code,
                "ok": ok,
                "message": outcome.message,
            }
        )
        verdict = "as expected" if ok else "UNEXPECTED"
        print(f"[gsm8k] {run}: {verdict} ({want}, exit {code}): {outcome.message}", flush=True)

    def progress(line: str) -> None:
        print(f"[gsm8k] {line}", flush=True)

    scratch = Path(tempfile.mkdtemp(prefix="qsa-gsm8k-"))
    try:
        if model_dir is None:
            model_dir = _load("make_tiny_qwen4exp").make_checkpoint(scratch / "tiny-model")
        with server_mod.VLLMServer(model_dir, python=python, extra_args=TINY_SERVER_ARGS) as url:
            live = dataclasses.replace(config, base_url=url)
            first = gate.run_gate(
                live, out_root / config.name, config_path=TINY_CONFIG, progress=progress
            )
            check(config.name, first, "passed", "threshold 0.0 on the tiny checkpoint")
            accuracy = first.result.get("accuracy", 0.0)
            total = first.result.get("total") or config.num_questions
            above = min(1.0, accuracy + 1.0 / total)
            if accuracy < 1.0:  # the failing path, through the command line and its exit code
                out = out_root / f"{config.name}-above-threshold"
                argv = ["--config", str(TINY_CONFIG), "--base-url", url, "--output-dir", str(out)]
                code = gate.main([*argv, "--threshold", repr(above), "--tolerance", "0", "--quiet"])
                saved = json.loads((out / "result.json").read_text())
                second = gate.GateResult(saved["status"], saved["message"], saved)
                what = f"threshold {above:.4f} > achieved {accuracy:.4f}"
                check(out.name, second, "failed", what, exit_code=code)
            parity = dataclasses.replace(
                live, parity=dataclasses.replace(config.parity, base_url=url)
            )
            third = gate.run_gate(
                parity,
                out_root / f"{config.name}-parity",
                config_path=TINY_CONFIG,
                progress=progress,
            )
            check(
                f"{config.name}-parity",
                third,
                "passed",
                "the same server twice: identical completions",
            )
        dead = dataclasses.replace(config, base_url=url, retries=1, backoff_s=0.1, timeout_s=5)
        fourth = gate.run_gate(
            dead, out_root / f"{config.name}-server-down", config_path=TINY_CONFIG
        )
        check(f"{config.name}-server-down", fourth, "error", "the stopped server must not pass")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {
        "ok": all(c["ok"] for c in checks) and len(checks) >= 3,
        "achieved_accuracy": accuracy,
        "config": str(TINY_CONFIG.relative_to(ROOT)),
        "checks": checks,
    }
    (out_root / "mechanics.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# --------------------------------------------------------------------------------------------
# The nox session
# --------------------------------------------------------------------------------------------


def _has_vllm(python: str) -> bool:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        return (
            subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


def vllm_python(session: Any, serving_python: str | None = None) -> tuple[str | None, str]:
    """An interpreter that can import vLLM and where it came from, or (None, why there is none).
    ``serving_python``: the interpreter of the e2e step of the same pipeline run (its serving
    recipe installed, the overlay applied and served through), tried after $QSA_VLLM_PYTHON."""
    candidates = []
    if os.environ.get("QSA_VLLM_PYTHON"):
        candidates.append(("$QSA_VLLM_PYTHON", os.environ["QSA_VLLM_PYTHON"]))
    if serving_python:
        candidates.append(("the e2e step of this pipeline run", serving_python))
    candidates.append(("the default vLLM venv", str(ROOT / ".venv-vllm" / "bin" / "python")))
    if session.venv_backend == "none" and shutil.which("python"):
        candidates.append(("this host's python", shutil.which("python")))
    for origin, python in candidates:
        if _has_vllm(python):
            return python, origin
    if session.venv_backend != "none" and (CI / "nox_vllm.py").is_file():
        # NOTES: a fresh checkout has no vLLM interpreter yet: this session's own virtualenv
        # gets the serving recipe of the E2E step (the same pins), so the gate never
        # depends on a venv left behind by another step.
        _load("nox_vllm").install_serving_env(session)
        python = str(Path(session.bin) / "python")
        if _has_vllm(python):
            return python, "this session's virtualenv (the E2E serving recipe)"
        candidates.append(("this session's virtualenv", python))
    tried = ", ".join(f"{python} ({origin})" for origin, python in candidates)
    return None, f"none of these interpreters can import vllm: {tried}; see docs/vllm.md"


def _record(record: Any, started: float) -> dict[str, Any]:
    """Add this run's result and config files to the step record; return the summaries."""
    summaries = {}
    for path in sorted(RESULTS.glob("**/*.json*")):  # result, config, questions logs
        if path.suffix not in (".json", ".jsonl") or path.stat().st_mtime < started:
            continue
        if record is not None:
            record.artifact(path)
        if path.name == "result.json":
            result = json.loads(path.read_text())
            summaries[path.parent.name] = {
                key: result.get(key)
                for key in (
                    "status",
                    "accuracy",
                    "correct",
                    "total",
                    "threshold",
                    "tolerance",
                    "message",
                )
            }
    if record is not None:
        record.details["gsm8k"] = summaries
    return summaries


def gsm8k(session: Any, record: Any = None, serving_python: str | None = None) -> None:
    """The pipeline step. ``record`` (optional) has ``artifact(path)`` and a ``details`` dict;
    ``serving_python`` (optional) is the e2e step's interpreter when it ran in the same pipeline.

    Gate arguments come from the session's posargs, else from ``$GSM8K_GATE_ARGS`` (so that
    ``nox -s pipeline`` on a GPU runner can gate its running server).
    """
    args = list(session.posargs) or shlex.split(os.environ.get("GSM8K_GATE_ARGS", ""))
    started = time.time() - 1
    try:
        if any(a == "--base-url" or a.startswith("--base-url=") for a in args):
            if session.venv_backend != "none":
                session.install("-r", str(GATE_REQUIREMENTS))
            if not any(a == "--config" or a.startswith("--config=") for a in args):
                args = ["--config", str(RELEASE_CONFIG), *args]
            session.run("python", str(CI / "gsm8k_gate.py"), *args)
            return
        python, origin = vllm_python(session, serving_python)
        if python is None:
            session.skip(f"GSM8K mechanics check needs vLLM: {origin}")
        session.log(
            f"GSM8K mechanics check on the tiny checkpoint with vLLM from {origin} ({python})"
        )
        session.run(
            python,
            str(CI / "nox_gsm8k.py"),
            "mechanics",
            "--out",
            str(RESULTS),
            *args,
            external=True,
        )
    finally:
        for name, summary in _record(record, started).items():
            session.log(f"{name}: {summary['status']} (accuracy {summary['accuracy']})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GSM8K gate mechanics check on a real vLLM server")
    parser.add_argument("command", choices=["mechanics"])
    parser.add_argument("--out", type=Path, default=RESULTS, help="results root")
    parser.add_argument(
        "--model-dir", type=Path, help="an existing tiny checkpoint (default: make one)"
    )
    args = parser.parse_args(argv)
    # A SIGTERM (a CI timeout, Ctrl-C of nox) unwinds the server's context manager: no orphans.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    summary = run_mechanics(args.out, args.model_dir)
    if not summary["ok"]:
        failed = [c["run"] for c in summary["checks"] if not c["ok"]]
        print(
            f"[gsm8k] mechanics check FAILED: {failed}; see {args.out / 'mechanics.json'}",
            file=sys.stderr,
        )
        return 1
    print(
        f"[gsm8k] mechanics check passed ({len(summary['checks'])} runs); {args.out / 'mechanics.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
