"""The step environment: what one pipeline step runs in and how its commands run.

A step is ``func(env)``. :class:`Env` runs the step's commands (in its virtualenv when it has
one), tees their output into ``dist/logs/<step>.log``, prints a heartbeat with the elapsed time
whenever a command has been silent for 30 s, and turns a failed command into :class:`Failed`
carrying the command's last meaningful error line. A step that cannot run on this host raises
:class:`Skipped` with the reason. Every pip install honours one setting,
``QSA_PIP_EXTRA_INDEX`` (see :func:`pip_source_env`); the first install checks that the pinned
CPU torch resolves and fails at once, naming the setting, when it does not.

Above ci/layout.py only; the steps and the records import it.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ci import layout
from ci.layout import PIP_SOURCE, PIP_SOURCE_EXAMPLE, ROOT, TORCH_PIN, WORK, rel, sha256_file

HEARTBEAT_S = 30.0


class Skipped(Exception):
    """The step cannot run on this host; the message (the reason) is recorded."""


class Failed(Exception):
    """The step failed; the message (its cause) is recorded."""


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# --------------------------------------------------------------------------------------------
# Where packages come from
# --------------------------------------------------------------------------------------------


def pip_source_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """pip's environment for ``QSA_PIP_EXTRA_INDEX``: a directory is added to PIP_FIND_LINKS,
    anything else (an index URL such as https://download.pytorch.org/whl/cpu) to
    PIP_EXTRA_INDEX_URL; empty when the setting is unset (pip's own configuration applies)."""
    environ = os.environ if environ is None else environ
    value = environ.get(PIP_SOURCE, "").strip()
    if not value:
        return {}
    local = Path(value).expanduser()
    key, value = (
        ("PIP_FIND_LINKS", str(local)) if local.is_dir() else ("PIP_EXTRA_INDEX_URL", value)
    )
    present = environ.get(key, "").split()
    return {key: " ".join(present if value in present else [*present, value])}


_pip_source_ok = False


def require_pip_source(env: Env) -> None:
    """Fail at once, naming the setting, when pip cannot resolve the pinned CPU torch."""
    global _pip_source_ok
    if _pip_source_ok:
        return
    env.log(
        f"checking that pip can resolve {TORCH_PIN} ({PIP_SOURCE}={os.environ.get(PIP_SOURCE, '')!r})"
    )
    try:
        env.run(
            "python",
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-deps",
            "--ignore-installed",
            "--quiet",
            TORCH_PIN,
            silent=True,
        )
    except Failed as exc:
        raise Failed(
            f"{TORCH_PIN} (the CPU build of torch, which PyPI does not carry) is not available "
            f"from pip's sources: set {PIP_SOURCE} to a package index or a wheel directory that "
            f"has it, e.g. {PIP_SOURCE}={PIP_SOURCE_EXAMPLE} (README, Set up). pip: {exc}"
        ) from None
    _pip_source_ok = True


# --------------------------------------------------------------------------------------------
# Running commands
# --------------------------------------------------------------------------------------------

_ERROR = re.compile(r"(?i)\b(error|failed|failure|exception|cannot|refus\w*|not found|no such)\b")
_NOISE = re.compile(r"^(=|-{3}|\$ )|short test summary info|^\[\w+\] \$ ")


def error_line(lines: Sequence[str]) -> str:
    """The last meaningful error line of a command's output (else its last non-empty line)."""
    stripped = [ln.strip() for ln in lines if ln.strip()]
    for line in reversed(stripped):
        if _ERROR.search(line) and not _NOISE.search(line):
            return line[:400]
    return stripped[-1][:400] if stripped else "(no output)"


def _stop_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM, then SIGKILL, to the command's process group (a no-op once it is gone)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.2)


class Env:
    """Where one step runs: its virtualenv's bin directory (None: this interpreter, nothing is
    installed), its arguments, its log, artifacts and details. Offers the part of nox's session
    interface the ci/ modules use (run, install, log, skip, error, posargs, bin)."""

    def __init__(self, name: str, bin_dir: str | Path | None = None, posargs=()) -> None:
        self.name = name
        self.bin_dir = Path(bin_dir) if bin_dir else None
        self.posargs = list(posargs)
        self.log_path = layout.LOGS_DIR / f"{name}.log"
        self.artifacts: dict[str, str] = {}
        self.details: dict[str, Any] = {}

    # --- the session interface --------------------------------------------------------------
    @property
    def venv_backend(self) -> str:
        return "venv" if self.bin_dir else "none"

    @property
    def bin(self) -> str:
        if self.bin_dir is None:
            raise Failed(f"step {self.name} runs without a virtualenv (no bin directory)")
        return str(self.bin_dir)

    def skip(self, reason: str) -> None:
        raise Skipped(reason)

    def error(self, reason: str) -> None:
        raise Failed(reason)

    def log(self, message: str) -> None:
        line = f"[{self.name}] {message}"
        print(line, flush=True)
        self._append(line + "\n")

    def artifact(self, path: str | Path) -> str:
        digest = sha256_file(path)
        self.artifacts[rel(path)] = digest
        return digest

    # --- commands ---------------------------------------------------------------------------
    def _append(self, text: str) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as f:
            f.write(text)

    def python(self) -> str:
        return str(self.bin_dir / "python") if self.bin_dir else sys.executable

    def environ(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.update(pip_source_env())
        if self.bin_dir is not None:
            env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
            env["VIRTUAL_ENV"] = str(self.bin_dir.parent)
            env.pop("PYTHONHOME", None)
        env.update(extra or {})
        return env

    def run(
        self,
        *cmd: str | Path,
        env: dict[str, str] | None = None,
        cwd: str | Path = ROOT,
        silent: bool = False,
        timeout: float | None = None,
        external: bool = True,  # nox's flag, accepted: programs are found on PATH here
    ) -> str:
        """Run ``cmd`` in its own process group; return its output (stdout and stderr).

        Output goes to the step log (and the console unless ``silent``); a heartbeat line
        every 30 s of silence; raises Failed with the last meaningful error line on a non-zero
        exit or after ``timeout`` seconds. The process group never outlives the call.
        """
        argv = [str(c) for c in cmd]
        if argv[0] == "python":
            argv[0] = self.python()
        environ = self.environ(env)
        argv[0] = shutil.which(argv[0], path=environ["PATH"]) or argv[0]
        shown = " ".join(argv)
        short = " ".join(
            [Path(argv[0]).name, *((a.splitlines() or [""])[0][:60] for a in argv[1:4])]
        )
        self.log(f"$ {shown[:300]}{' ...' if len(shown) > 300 else ''}")
        lines: list[str] = []
        tail: collections.deque[str] = collections.deque(maxlen=400)
        start = time.monotonic()
        last = [start]
        expired = threading.Event()
        done = threading.Event()
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            start_new_session=True,
        )

        def heartbeat() -> None:
            while not done.wait(1.0):
                now = time.monotonic()
                if now - last[0] >= HEARTBEAT_S:
                    last[0] = now
                    print(
                        f"[{self.name}] ... {now - start:.0f} s, still running: {short}", flush=True
                    )
                if timeout is not None and now - start > timeout:
                    expired.set()
                    _stop_group(proc)
                    return

        beat = threading.Thread(target=heartbeat, daemon=True)
        beat.start()
        try:
            with open(self.log_path, "a") as log:
                for line in proc.stdout:
                    log.write(line)
                    lines.append(line)
                    tail.append(line)
                    if not silent:
                        sys.stdout.write(line)
                        sys.stdout.flush()
                    last[0] = time.monotonic()
            code = proc.wait()
        finally:
            done.set()
            _stop_group(proc)  # whatever the command left running in its group goes too
        elapsed = time.monotonic() - start
        if expired.is_set():
            raise Failed(f"`{short}` timed out after {timeout:.0f} s: {error_line(tail)}")
        if code != 0:
            raise Failed(f"`{short}` exited {code} after {elapsed:.0f} s: {error_line(tail)}")
        return "".join(lines)

    def install(self, *args: str | Path, env: dict[str, str] | None = None) -> None:
        """pip install with torch pinned to its CPU build; without a virtualenv (GPU hosts,
        images) nothing is installed: the interpreter is expected to be provisioned."""
        if self.bin_dir is None:
            self.log(f"no virtualenv: not installing {' '.join(map(str, args))}")
            return
        require_pip_source(self)
        constraints = WORK / "constraints.txt"
        constraints.parent.mkdir(parents=True, exist_ok=True)
        constraints.write_text(TORCH_PIN + "\n")
        self.run(
            "python",
            "-m",
            "pip",
            "install",
            "--progress-bar",
            "off",
            "-c",
            constraints,
            *args,
            env=env,
        )
