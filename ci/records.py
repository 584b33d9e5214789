"""Step records and the run record.

:func:`run_step` runs one step and writes its record ``dist/steps/<step>.json`` (passed,
skipped, failed or not run; the reason; duration, log and artifacts with SHA256; the step's
details). :func:`begin_run` starts a pipeline run in this process, after which a step that
follows a failed one is recorded as not run; :func:`write_run_record` gathers the records into
``dist/run-record.{json,md}``.

Above ci/step_env.py; the driver (ci/pipeline.py) imports it.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

from ci import layout
from ci.layout import ROOT, provenance, rel
from ci.step_env import Env, Failed, Skipped, now_utc

_run: dict[str, Any] | None = None  # the `nox -s pipeline` run in progress in this process


def current_run() -> dict[str, Any] | None:
    """The pipeline run in progress in this process (None outside one): its steps, arguments,
    the first failed step and what earlier steps left for later ones."""
    return _run


def run_step(name: str, func: Callable[[Env], None], bin_dir=None, posargs=()) -> Env:
    """Run one step and leave its record in dist/steps/<name>.json; re-raise Skipped/Failed.
    Inside a pipeline run, a step after a failed one is recorded as not run."""
    env = Env(name, bin_dir, posargs)
    path = layout.STEPS_DIR / f"{name}.json"
    path.unlink(missing_ok=True)
    env.log_path.unlink(missing_ok=True)
    start = time.monotonic()

    def write(status: str, reason: str = "") -> None:
        record = {"step": name, "status": status, "reason": reason}
        if status != "not run":
            if env.log_path.is_file():
                env.artifact(env.log_path)
            record.update(
                duration_s=round(time.monotonic() - start, 1),
                log=rel(env.log_path) if env.log_path.is_file() else None,
                artifacts=env.artifacts,
                details=env.details,
            )
        layout.STEPS_DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")

    if _run is not None and _run["failed"]:
        reason = f"stopped after {_run['failed']} failed"
        write("not run", reason)
        raise Skipped(reason)
    env.log(f"step {name} started {now_utc()}")  # every record that ran has a log
    try:
        func(env)
    except Skipped as exc:
        env.log(f"skipped: {exc}")
        write("skipped", str(exc))
        raise
    except BaseException as exc:
        write("failed", str(exc) if isinstance(exc, Failed) else f"{type(exc).__name__}: {exc}")
        if _run is not None:
            _run["failed"] = name
        raise
    write("passed")
    return env


def begin_run(steps: Sequence[str], args: Sequence[str]) -> None:
    """Begin a pipeline run of ``steps`` in this process; earlier step records are removed
    (the run record holds this run's steps only)."""
    global _run
    for old in layout.STEPS_DIR.glob("*.json"):
        old.unlink()
    _run = {"started": now_utc(), "args": list(args), "steps": list(steps), "failed": None}


def write_run_record(known: Sequence[str]) -> dict[str, Any]:
    """dist/run-record.{json,md} from the step records of this run (outside a run: of every
    step of ``known`` that has a record)."""
    steps_dir = layout.STEPS_DIR
    names = _run["steps"] if _run else [s for s in known if (steps_dir / f"{s}.json").is_file()]
    steps = []
    for name in names:
        path = steps_dir / f"{name}.json"
        steps.append(
            json.loads(path.read_text())
            if path.is_file()
            else {
                "step": name,
                "status": "failed",
                "reason": "no step record: the session "
                "failed before the step began (see the console output)",
            }
        )
    wheel = next((s["details"] for s in steps if s["step"] == "wheel" and s.get("details")), {})
    record = {
        "started": (_run or {}).get("started"),
        "finished": now_utc(),
        "host": {
            "node": platform.node(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        },
        "git": provenance.git_state(ROOT),
        "args": (_run or {}).get("args", []),
        "result": "failed" if any(s["status"] == "failed" for s in steps) else "passed",
        "wheel": {k: wheel[k] for k in ("wheel", "wheel_sha256", "dso_sha256") if k in wheel},
        "steps": steps,
    }
    layout.DIST.mkdir(parents=True, exist_ok=True)
    (layout.DIST / "run-record.json").write_text(json.dumps(record, indent=2) + "\n")
    (layout.DIST / "run-record.md").write_text(markdown(record))
    return record


def markdown(record: dict[str, Any]) -> str:
    git = record.get("git", {})
    lines = [
        f"# Pipeline run record: {record['result']}",
        "",
        f"Started {record['started']}, finished {record['finished']} on {record['host']['node']}"
        f" ({record['host']['machine']}, Python {record['host']['python']}); commit "
        f"{git.get('commit')} (dirty: {git.get('dirty')}).",
        "",
    ]
    wheel = record.get("wheel") or {}
    if wheel:
        lines += [
            f"Wheel `{wheel.get('wheel')}` SHA256 `{wheel.get('wheel_sha256')}`; "
            f"DSO SHA256 `{wheel.get('dso_sha256')}`.",
            "",
        ]
    lines += ["| step | status | duration | reason | log |", "|---|---|---|---|---|"]
    for s in record["steps"]:
        duration = f"{s['duration_s']:.0f} s" if "duration_s" in s else ""
        reason = s.get("reason", "").replace("|", "\\|").replace("\n", " ")[:300]
        lines.append(
            f"| {s['step']} | {s['status']} | {duration} | {reason} | {s.get('log') or ''} |"
        )
    lines += ["", "## Artifacts", "", "| step | artifact | SHA256 |", "|---|---|---|"]
    for s in record["steps"]:
        for path, digest in s.get("artifacts", {}).items():
            lines.append(f"| {s['step']} | {path} | `{digest}` |")
    return "\n".join(lines) + "\n"


def failure_summary(record: dict[str, Any], lines: int = 40) -> str:
    """The failed step, its cause and the end of its log (printed by `nox -s pipeline`)."""
    failed = next(s for s in record["steps"] if s["status"] == "failed")
    log = ROOT / failed["log"] if failed.get("log") else None
    tail = log.read_text(errors="replace").splitlines()[-lines:] if log and log.is_file() else []
    where = f" (log {failed['log']})" if log else ""
    return "\n".join(
        [
            f"--- end of {failed.get('log')} ---",
            *tail,
            f"pipeline stopped: step {failed['step']} failed{where}: {failed['reason']}",
        ]
    )
