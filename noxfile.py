"""The build-and-validate pipeline of custom-esimd-kernels-vllm.

    nox -s lint tests                                   CPU checks (the README's test command)
    nox -s build -- --target cuda-sm90 [--container]    compile the DSO, write dist/provenance.json
    nox -s wheel verify                                 bdist wheel + SHA256SUMS; clean-venv check
    nox -s image                                        CPU test image; the test suite inside it
    nox -s kernels bench                                GPU host: tests/gpu, the benchmark
    nox -s overlay e2e gsm8k                            vLLM overlay, serving E2E, GSM8K gate
    nox -s pipeline [-- --no-venv]                      all steps in order -> dist/run-record.*

Every step writes ``dist/steps/<step>.json`` (status, reason, artifacts with SHA256);
``pipeline`` runs the steps in order, stops at the first failure and gathers the records into
``dist/run-record.json`` and ``dist/run-record.md``, with one log per step in ``dist/logs/``.
Targets, flags and macros live in ``build_targets.py`` only. docs/pipeline.md has the details.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import inspect
import json
import platform
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import nox
import nox.command

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
import build_targets  # noqa: E402  (the repository root is not on sys.path under nox)

PACKAGE = "custom_esimd_kernels_vllm"
DIST = ROOT / "dist"
STEPS_DIR = DIST / "steps"
LOGS_DIR = DIST / "logs"
WORK = ROOT / ".work" / "pipeline"
PROVENANCE = DIST / "provenance.json"
IN_PACKAGE_PROVENANCE = ROOT / PACKAGE / "provenance.json"
SHA256SUMS = DIST / "SHA256SUMS"
IMAGES = ROOT / "docker" / "images.py"

# NOTES: torch is pinned everywhere the pipeline installs it: an unpinned `torch` would resolve
# to a multi-GB CUDA build, while 2.13.0 resolves to the CPU wheel on the CI hosts.
TORCH_PIN = "torch==2.13.0"
BUILD_REQUIREMENTS = ROOT / "docker" / "requirements-build.txt"
CUDA_TOOLKIT = ROOT / "docker" / "cuda-toolkit.txt"
# Sources whose SHA256s go into the manifest: everything that decides the DSO's bytes.
PROVENANCE_SOURCES = ("csrc", "setup.py", "build_targets.py", "pyproject.toml")
# The one build command (setup.py holds the compiler invocations, build_targets.py the flags).
BUILD_COMMAND = ("python", "setup.py", "build_ext", "--inplace")
# What `tests` installs besides the pinned torch: the optional-dependency groups of
# pyproject.toml that the suites import, nox (tests/pipeline load this file) and the build tools
# (tests/pipeline build the DSO twice where nvcc exists).
TEST_EXTRAS = ("test", "bench")
# Order of `nox -s pipeline` (the design card's order).
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

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "venv"


# --------------------------------------------------------------------------------------------
# Step records
# --------------------------------------------------------------------------------------------


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def rel(path: Path) -> str:
    path = Path(path).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


class Step:
    """The record one session leaves in dist/steps/<name>.json."""

    current: Step | None = None

    def __init__(self, name: str) -> None:
        self.name = name
        self.path = STEPS_DIR / f"{name}.json"
        self.path.unlink(missing_ok=True)
        self.artifacts: dict[str, str] = {}
        self.details: dict[str, object] = {}
        self.start = time.monotonic()

    def artifact(self, path: Path) -> str:
        digest = sha256(path)
        self.artifacts[rel(path)] = digest
        return digest

    def write(self, status: str, reason: str = "") -> None:
        STEPS_DIR.mkdir(parents=True, exist_ok=True)
        record = {
            "step": self.name,
            "status": status,
            "reason": reason,
            "duration_s": round(time.monotonic() - self.start, 1),
            "artifacts": self.artifacts,
            "details": self.details,
        }
        self.path.write_text(json.dumps(record, indent=2) + "\n")


def step(func):
    """Wrap a session so that it always leaves a record: passed, skipped (with the reason of
    ``session.skip``) or failed (with the error)."""

    @functools.wraps(func)
    def wrapper(session: nox.Session) -> None:
        rec = Step.current = Step(session.name)
        try:
            func(session)
        except BaseException as exc:
            if type(exc).__name__ == "_SessionSkip":
                rec.write("skipped", " ".join(map(str, exc.args)))
            elif type(exc).__name__ == "_SessionQuit":  # session.error(message)
                rec.write("failed", " ".join(map(str, exc.args)))
            else:
                rec.write("failed", f"{type(exc).__name__}: {exc}".strip())
            raise
        rec.write("passed")

    return wrapper


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def has_venv(session: nox.Session) -> bool:
    return session.venv_backend != "none"


def install(session: nox.Session, *args: str) -> None:
    """pip install with torch pinned; without a virtualenv (GPU hosts, images) install nothing:
    the interpreter is expected to be provisioned already."""
    if not has_venv(session):
        session.log(f"no virtualenv: not installing {' '.join(args)}")
        return
    constraints = WORK / "constraints.txt"
    constraints.parent.mkdir(parents=True, exist_ok=True)
    constraints.write_text(TORCH_PIN + "\n")
    session.install("-c", str(constraints), *args)


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def extras(*names: str) -> list[str]:
    """Requirements of the given optional-dependency groups of pyproject.toml."""
    groups = pyproject()["project"].get("optional-dependencies", {})
    return [req for name in names for req in groups.get(name, [])]


def requirements_file(path: Path) -> list[str]:
    lines = (ln.split("#")[0].strip() for ln in path.read_text().splitlines())
    return [ln for ln in lines if ln]


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


def load_module(relpath: str):
    """Import a pipeline module by path (docker/images.py, ci/nox_*.py); None when absent."""
    path = ROOT / relpath
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(f"_qsa_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def images():
    return load_module("docker/images.py")  # export_tree only: the SDK lives in the session venv


def provenance_module():
    # By path: importing the package would import torch, which the nox interpreter lacks.
    return load_module(f"{PACKAGE}/qsa_ops/provenance.py")


def parse_build_args(session: nox.Session) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nox -s build --")
    parser.add_argument(
        "--target", default=build_targets.DEFAULT_TARGET, choices=build_targets.TARGETS
    )
    parser.add_argument("--container", action="store_true", help="build inside the target's image")
    return parser.parse_args(session.posargs)


# --------------------------------------------------------------------------------------------
# Sessions
# --------------------------------------------------------------------------------------------


@nox.session
@step
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check over the repository; bash -n over the shell scripts."""
    install(session, "ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    scripts = sorted(ROOT.glob("docker/*.sh")) + [ROOT / ".ci" / "run"]
    for script in scripts:
        if script.is_file():
            session.run("bash", "-n", str(script), external=True)


@nox.session
@step
def tests(session: nox.Session) -> None:
    """The CPU test suite (GPU tests are skipped with their reason on a CPU host)."""
    install(session, TORCH_PIN, *extras(*TEST_EXTRAS), "nox", "-r", str(BUILD_REQUIREMENTS))
    junit = DIST / "junit-tests.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)
    # NOTES: pytest exits 5 when it collects nothing; nox treats every non-zero exit as a
    # failure, so an empty or mis-pointed suite fails this step instead of passing silently.
    session.run(
        "python",
        "-m",
        "pytest",
        "tests",
        "-ra",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        *session.posargs,
    )
    Step.current.artifact(junit)


@nox.session
@step
def build(session: nox.Session) -> None:
    """Compile the DSO for one target and write dist/provenance.json.

    nox -s build -- --target cuda-sm90 [--container]
    """
    args = parse_build_args(session)
    target = build_targets.TARGETS[args.target]
    if args.container:
        build_in_container(session, target)
    else:
        require_toolchain(session, target)  # before any install: fail fast
        install(session, "-r", str(BUILD_REQUIREMENTS))
        build_native(session, target)


def require_toolchain(session: nox.Session, target: build_targets.Target) -> str:
    path = shutil.which(target.toolchain)
    if path is None:
        session.error(
            f"target {target.name} needs the compiler `{target.toolchain}` on PATH, which this "
            f"host does not have. Build it in its image: nox -s build -- --target {target.name} "
            f"--container (recipe docker/{target.container_image}.Dockerfile)"
        )
    return path


def toolchain_versions(session: nox.Session, target: build_targets.Target) -> dict[str, str]:
    def py(code: str) -> str:
        return session.run("python", "-c", code, silent=True, external=True).strip()

    versions = {
        target.toolchain: provenance_module().tool_version([target.toolchain, "--version"]),
        "host_compiler": provenance_module().tool_version(["g++", "--version"]),
        "python": py("import platform; print(platform.python_version())"),
    }
    for dist in ("torch", "setuptools"):
        versions[dist] = py(f"import importlib.metadata as m; print(m.version({dist!r}))")
    return versions


def diff_keys(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def built_dso() -> Path:
    found = sorted((ROOT / PACKAGE).glob("_C.so"))
    if len(found) != 1:
        raise RuntimeError(f"expected one {PACKAGE}/_C.so after the build, found {found}")
    return found[0]


def build_native(session: nox.Session, target: build_targets.Target) -> None:
    require_toolchain(session, target)
    if target.toolchain != "nvcc":
        session.error(
            f"`{target.toolchain}` is here, but setup.py compiles only the CUDA sources of "
            f"cuda-sm90: there are no SYCL sources for {target.name} in csrc/ yet"
        )
    provenance = provenance_module()

    # A clean build every time: stale objects must never reach a wheel.
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    for old in (ROOT / PACKAGE).glob("_C.so"):
        old.unlink()
    IN_PACKAGE_PROVENANCE.unlink(missing_ok=True)
    session.log(f"compiling {target.name} with {target.toolchain} (about a minute on 2 cores) ...")
    start = time.monotonic()
    sources = provenance.source_digests(ROOT, PROVENANCE_SOURCES)
    output = session.run(*BUILD_COMMAND, silent=True)
    changed = diff_keys(sources, provenance.source_digests(ROOT, PROVENANCE_SOURCES))
    if changed:
        session.error(f"sources changed during the build, so the DSO matches neither: {changed}")
    # setup.py prints every compiler command it runs: the manifest keeps them verbatim.
    commands = [ln for ln in output.splitlines() if ln.split(" ", 1)[0] == target.toolchain]
    for line in commands:
        session.log(f"  {line[:200]}{' ...' if len(line) > 200 else ''}")
    session.log(f"compiled in {time.monotonic() - start:.0f} s")
    dso = built_dso()
    manifest = provenance.make_manifest(
        target={
            "name": target.name,
            "toolchain": target.toolchain,
            "arch_flags": list(target.arch_flags),
            "flags": list(target.flags),
            "macros": dict(sorted(target.macros.items())),
        },
        toolchain=toolchain_versions(session, target),
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
    PROVENANCE.parent.mkdir(parents=True, exist_ok=True)
    PROVENANCE.write_text(text)
    IN_PACKAGE_PROVENANCE.write_text(text)  # shipped in the wheel next to the DSO
    session.log(f"{rel(dso)}  sha256 {manifest['dso']['sha256']}")
    Step.current.artifact(dso)
    Step.current.artifact(PROVENANCE)
    Step.current.details.update(target=target.name, dso_sha256=manifest["dso"]["sha256"])


def build_image(session: nox.Session, image: str, requirements: list[str], **extra) -> str:
    """Build ``image`` (and the base image when absent) through docker/images.py; its id."""
    install(session, "docker")
    result = WORK / f"{image}.json"
    result.unlink(missing_ok=True)
    cmd = ["python", str(IMAGES), "build", image, "--context", str(WORK / "ctx" / image)]
    cmd += [f"--requirement={r}" for r in requirements]
    cmd += [f"--extra-wheel={w}" for w in extra.get("wheels", [])]
    cmd += [f"--extra-file={f}" for f in extra.get("files", [])]
    session.run(*cmd, "--result", str(result), external=True)
    return json.loads(result.read_text())["id"]


def run_in_image(
    session: nox.Session,
    image: str,
    command: str,
    mounts: dict[Path, str],
    workdir: str,
    log: Path,
    after=None,
) -> None:
    """Run ``command`` in a fresh, offline container of ``image``, output in ``log``; call
    ``after()`` either way, then fail the session if the command failed."""
    LOGS_DIR.mkdir(parents=True, exist_ok=True)
    session.log(f"{image}: {command}  (log {rel(log)})")
    cmd = ["python", str(IMAGES), "run", image, "--workdir", workdir, "--log", str(log)]
    cmd += [f"--mount={host}:{guest}" for host, guest in mounts.items()]
    try:
        session.run(*cmd, command, external=True)
        failed = False
    except nox.command.CommandFailed:
        failed = True
    if log.is_file():
        Step.current.artifact(log)
    if after is not None:
        after()
    if failed:
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.is_file() else []
        session.error(f"`{command}` failed inside {image}; see {rel(log)}:\n" + "\n".join(tail))


def build_in_container(session: nox.Session, target: build_targets.Target) -> None:
    """Build inside the target's image by running this same session there (nox --no-venv), then
    compare the container's DSO with the native build's (made first when absent)."""
    cuda = target.toolchain == "nvcc"
    image_id = build_image(
        session,
        target.container_image,
        [*requirements_file(BUILD_REQUIREMENTS), "nox"],
        wheels=requirements_file(CUDA_TOOLKIT) if cuda else [],
        files=[CUDA_TOOLKIT] if cuda else [],
    )
    native = json.loads(PROVENANCE.read_text()) if PROVENANCE.is_file() else {}
    sources = provenance_module().source_digests(ROOT, PROVENANCE_SOURCES)
    if native.get("target", {}).get("name") != target.name or native.get("sources") != sources:
        session.log("no native build of these sources for this target: building it first")
        require_toolchain(session, target)
        install(session, "-r", str(BUILD_REQUIREMENTS))
        build_native(session, target)
        native = json.loads(PROVENANCE.read_text())

    # NOTES: the container builds at the same absolute path as this checkout, because nvcc
    # derives the mangled names of anonymous namespaces from the source file's absolute path.
    src = images().export_tree(WORK / "container-src")
    out = DIST / "container" / target.name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    log = LOGS_DIR / f"build-container-{target.name}.log"
    command = (
        f"nox --no-venv -s build -- --target {target.name}"
        f" && cp dist/provenance.json {PACKAGE}/_C.so /out/"
    )
    run_in_image(
        session, target.container_image, command, {src: str(ROOT), out: "/out"}, str(ROOT), log
    )
    inside_dso = next(out.glob("_C.so"))
    inside = json.loads((out / "provenance.json").read_text())
    inside["git"] = {**native["git"], "note": "exported from the host checkout"}
    inside["build"]["container"] = {"image": target.container_image, "image_id": image_id}
    (out / "provenance.json").write_text(json.dumps(inside, indent=2) + "\n")
    Step.current.artifact(out / "provenance.json")
    Step.current.artifact(inside_dso)

    comparison = compare_builds(native, inside, inside_dso)
    native["container"] = comparison
    PROVENANCE.write_text(json.dumps(native, indent=2) + "\n")
    IN_PACKAGE_PROVENANCE.write_text(PROVENANCE.read_text())
    Step.current.artifact(PROVENANCE)
    Step.current.details.update(target=target.name, container=comparison)
    verdict = "IDENTICAL to" if comparison["identical"] else "DIFFERENT from"
    session.log(f"container DSO {comparison['sha256']}")
    session.log(f"is {verdict} the native DSO {native['dso']['sha256']}")
    for why in comparison["why"]:
        session.log(f"  why: {why}")
    if comparison["identical"]:
        for diff in comparison["input_differences"]:
            session.log(f"  (same bytes despite {diff})")


def compare_builds(native: dict, inside: dict, inside_dso: Path) -> dict:
    """Native vs container DSO: equal SHA256 or not, every input that differs between the two
    manifests (toolchain versions, target flags, source digests, compiler commands) and, when
    the bytes differ, the ELF sections whose bytes differ."""
    differences = []
    for key in ("toolchain", "target", "sources"):
        a, b = native.get(key, {}), inside.get(key, {})
        differences += [
            f"{key}.{name}: native {a.get(name)!r} vs container {b.get(name)!r}"
            for name in diff_keys(a, b)
        ]
    result = {
        "image_dso": rel(inside_dso),
        "sha256": inside["dso"]["sha256"],
        "identical": inside["dso"]["sha256"] == native["dso"]["sha256"],
        "input_differences": differences,
        "why": [],
    }
    if not result["identical"]:
        native_dso = DIST / "native" / native["target"]["name"] / Path(native["dso"]["path"]).name
        sections = elf_section_diff(native_dso, inside_dso)
        result["why"] = differences + [
            "ELF sections that differ: " + (", ".join(sections) or "none (layout only)")
        ]
    return result


def elf_section_diff(a: Path, b: Path) -> list[str]:
    """Names of the ELF sections whose size or bytes differ between two shared objects."""

    def sections(path: Path) -> dict[str, bytes]:
        data = path.read_bytes()
        import struct

        (shoff,) = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
        heads = [
            struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
        ]
        strtab = heads[shstrndx]
        names = data[strtab[4] : strtab[4] + strtab[5]]

        def name(off: int) -> str:
            return names[off : names.index(b"\0", off)].decode()

        return {
            name(h[0]): (data[h[4] : h[4] + h[5]] if h[1] != 8 else h[5].to_bytes(8, "little"))
            for h in heads[1:]
        }

    sa, sb = sections(a), sections(b)
    return [s for s in sorted(set(sa) | set(sb)) if sa.get(s) != sb.get(s)]


@nox.session
@step
def wheel(session: nox.Session) -> None:
    """bdist wheel of the built DSO with provenance.json inside the package; dist/SHA256SUMS."""
    if not PROVENANCE.is_file():
        session.error("no dist/provenance.json: run `nox -s build` first")
    manifest = json.loads(PROVENANCE.read_text())
    dso = ROOT / manifest["dso"]["path"]
    if not dso.is_file() or sha256(dso) != manifest["dso"]["sha256"]:
        session.error(f"{rel(dso)} is missing or changed since `nox -s build`: build again")
    IN_PACKAGE_PROVENANCE.write_text(PROVENANCE.read_text())
    install(session, "-r", str(BUILD_REQUIREMENTS))
    for old in DIST.glob("*.whl"):
        old.unlink()
    session.run(
        "python",
        "-m",
        "pip",
        "wheel",
        ".",
        "--no-deps",
        "--no-build-isolation",
        "--wheel-dir",
        str(DIST),
        env={"QSA_TARGET": manifest["target"]["name"]},
    )
    (whl,) = DIST.glob("*.whl")
    members = wheel_members(whl)
    dso_member = f"{PACKAGE}/{dso.name}"
    prov_member = f"{PACKAGE}/provenance.json"
    for member in (dso_member, prov_member):
        if member not in members:
            session.error(f"{whl.name} lacks {member}: the package data must include it")
    if members[dso_member] != manifest["dso"]["sha256"]:
        session.error(
            f"{whl.name} carries a DSO with SHA256 {members[dso_member]}, not the built "
            f"{manifest['dso']['sha256']}: the wheel build recompiled it differently"
        )
    lines = [f"{sha256(whl)}  {whl.name}", f"{manifest['dso']['sha256']}  {dso.name}"]
    lines.append(f"{sha256(PROVENANCE)}  {PROVENANCE.name}")
    SHA256SUMS.write_text("\n".join(lines) + "\n")
    for path in (whl, SHA256SUMS):
        Step.current.artifact(path)
    Step.current.details.update(wheel=whl.name, dso_sha256=members[dso_member])


def wheel_members(whl: Path) -> dict[str, str]:
    with zipfile.ZipFile(whl) as zf:
        return {
            n: hashlib.sha256(zf.read(n)).hexdigest() for n in zf.namelist() if not n.endswith("/")
        }


@nox.session
@step
def verify(session: nox.Session) -> None:
    """Install the wheel into a clean venv, import it, and check that the SHA256 of the DSO it
    loads equals the manifest, the wheel's member, SHA256SUMS and the installed file."""
    if not has_venv(session):
        session.skip("verify installs the wheel into a fresh virtualenv; run it without --no-venv")
    wheels = sorted(DIST.glob("*.whl"))
    if len(wheels) != 1 or not SHA256SUMS.is_file():
        session.error("expected one dist/*.whl and dist/SHA256SUMS: run `nox -s build wheel` first")
    whl = wheels[0]
    sums = dict(reversed(ln.split("  ", 1)) for ln in SHA256SUMS.read_text().splitlines())
    if sums.get(whl.name) != sha256(whl):
        session.error(f"{whl.name} does not match its SHA256SUMS entry")
    manifest = json.loads(PROVENANCE.read_text())
    install(session, TORCH_PIN)
    install(session, str(whl), *extras("test"))
    # Run from an empty directory so that the checkout's sources cannot shadow the install.
    scratch = WORK / "verify"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    with session.chdir(scratch):
        out = session.run("python", "-m", f"{PACKAGE}.qsa_ops.provenance", "--check", silent=True)
        evidence = json.loads(out[out.index("{") :])
        loaded = Path(evidence["dso"]["path"]).resolve()
        venv = Path(session.virtualenv.location).resolve()
        if venv not in loaded.parents:
            session.error(f"the DSO loaded from {loaded}, not from the wheel installed in {venv}")
        dso_name = Path(manifest["dso"]["path"]).name
        checks = {
            "module reports": evidence["dso"]["sha256"],
            "installed file": sha256(loaded),
            "manifest": manifest["dso"]["sha256"],
            "wheel member": wheel_members(whl)[f"{PACKAGE}/{dso_name}"],
            "SHA256SUMS": sums.get(dso_name),
        }
        for what, digest in checks.items():
            session.log(f"{what:>15}: {digest}")
        if len(set(checks.values())) != 1:
            session.error(f"DSO SHA256 mismatch: {checks}")
        Step.current.details.update(dso_sha256=checks["manifest"], agreeing=list(checks))
        session.run("python", "-c", f"from {PACKAGE} import qsa_ops; print(qsa_ops.build_info())")
        # The CPU suite against the installed package; `tests` already ran it with the full
        # property-test budget, so the "dev" profile (a tenth of the examples) is enough here.
        session.run(
            "python", "-m", "pytest", str(ROOT / "tests" / "cpu"), "-q", "-p", "no:cacheprovider",
            env={"HYPOTHESIS_PROFILE": "dev"},
        )  # fmt: skip


@nox.session
@step
def image(session: nox.Session) -> None:
    """Focused image validation: build the CPU test image from the local base image and run the
    test suite (`nox --no-venv -s tests`) inside it, offline."""
    requirements = [TORCH_PIN, *extras(*TEST_EXTRAS), "nox", *requirements_file(BUILD_REQUIREMENTS)]
    build_image(session, "qsa-test-cpu", requirements)
    src = images().export_tree(WORK / "image-src")
    log = LOGS_DIR / "image-tests.log"

    def keep_inner_record() -> None:
        inner = src / "dist" / "steps" / "tests.json"
        if inner.is_file():
            Step.current.details["tests_in_image"] = json.loads(inner.read_text())

    command = "nox --no-venv -s tests"
    run_in_image(session, "qsa-test-cpu", command, {src: "/src"}, "/src", log, keep_inner_record)
    summary = [ln for ln in log.read_text(errors="replace").splitlines() if " passed" in ln]
    session.log("inside qsa-test-cpu: " + (summary[-1].strip("= ") if summary else "done"))


@nox.session(python=False)
@step
def kernels(session: nox.Session) -> None:
    """GPU host, system python (no index needed): tests/gpu against the built DSO."""
    ok, why = cuda_device()
    if not ok:
        session.skip(why)
    session.run("python", "-m", f"{PACKAGE}.qsa_ops.provenance", "--check")
    junit = DIST / "junit-kernels.xml"
    session.run(
        "python", "-m", "pytest", "tests/gpu", "-ra", f"--junitxml={junit}", *session.posargs
    )
    Step.current.artifact(junit)


@nox.session(python=False)
@step
def bench(session: nox.Session) -> None:
    """GPU host, system python: the benchmark harness (python -m custom_esimd_kernels_vllm.bench)."""
    ok, why = cuda_device()
    if not ok:
        session.skip(why)
    if (
        importlib.util.find_spec(f"{PACKAGE}.bench.__main__", None) is None
        and not (ROOT / PACKAGE / "bench" / "__main__.py").is_file()
    ):
        session.skip("not available yet: custom_esimd_kernels_vllm/bench/__main__.py is missing")
    session.run("python", "-m", f"{PACKAGE}.bench", *session.posargs)


def delegated(module_path: str, name: str):
    """A session implemented in another module (ci/nox_vllm.py, ci/nox_gsm8k.py) as
    ``name(session)`` or ``name(session, record)``; ``record`` has ``artifact(path)`` and
    ``details``. Recorded as skipped ("not available yet") while the module is missing."""

    def session_func(session: nox.Session) -> None:
        module = load_module(module_path)
        func = getattr(module, name, None)
        if func is None:
            session.skip(f"not available yet: {module_path} does not define {name}(session)")
        if len(inspect.signature(func).parameters) >= 2:
            func(session, Step.current)
        else:
            func(session)

    session_func.__name__ = name
    session_func.__doc__ = f"Implemented by {module_path}:{name}(session)."
    # Without the module there is nothing to install: skip without creating a virtualenv.
    return nox.session(name=name, python=None if (ROOT / module_path).is_file() else False)(
        step(session_func)
    )


overlay = delegated("ci/nox_vllm.py", "overlay")
e2e = delegated("ci/nox_vllm.py", "e2e")
gsm8k = delegated("ci/nox_gsm8k.py", "gsm8k")


# --------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------


@nox.session(python=False)
def pipeline(session: nox.Session) -> None:
    """Run the steps in order, stop at the first failure, write dist/run-record.{json,md}.

    nox -s pipeline -- [--no-venv] [--steps lint,tests,...] [--target cuda-sm90] [--container]
    """
    parser = argparse.ArgumentParser(prog="nox -s pipeline --")
    parser.add_argument("--steps", default=",".join(PIPELINE))
    parser.add_argument("--no-venv", action="store_true", help="run every step with nox --no-venv")
    parser.add_argument("--target", default=build_targets.DEFAULT_TARGET)
    parser.add_argument("--container", action="store_true", help="build step inside the image")
    args = parser.parse_args(session.posargs)
    steps = [s for s in args.steps.split(",") if s]
    LOGS_DIR.mkdir(parents=True, exist_ok=True)
    provenance = provenance_module()
    record = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {
            "node": platform.node(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        },
        "git": provenance.git_state(ROOT),
        "args": session.posargs,
        "steps": [],
    }
    failed = None
    for name in steps:
        if failed:
            record["steps"].append(
                {"step": name, "status": "not run", "reason": f"stopped after {failed} failed"}
            )
            continue
        posargs = (
            ["--target", args.target] + (["--container"] if args.container else [])
            if name == "build"
            else []
        )
        entry = run_step(session, name, posargs, args.no_venv)
        record["steps"].append(entry)
        if entry["status"] == "failed":
            failed = name
    record["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    record["result"] = "failed" if failed else "passed"
    (DIST / "run-record.json").write_text(json.dumps(record, indent=2) + "\n")
    (DIST / "run-record.md").write_text(markdown(record))
    print(markdown(record), flush=True)
    session.log(f"run record: {rel(DIST / 'run-record.md')} and {rel(DIST / 'run-record.json')}")
    if failed:
        log = LOGS_DIR / f"{failed}.log"
        tail = log.read_text(errors="replace").splitlines()[-40:] if log.is_file() else []
        print("\n".join([f"--- last lines of {rel(log)} ---", *tail]), flush=True)
        session.error(f"pipeline stopped: step {failed} failed (log {rel(log)})")


def run_step(session: nox.Session, name: str, posargs: list[str], no_venv: bool) -> dict:
    """Run `nox -s <name>` with its output in dist/logs/<name>.log and a progress line every
    30 s; read back the step's record."""
    log_path = LOGS_DIR / f"{name}.log"
    cmd = [sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), "-s", name]
    cmd += (["--no-venv"] if no_venv else []) + (["--", *posargs] if posargs else [])
    (STEPS_DIR / f"{name}.json").unlink(missing_ok=True)
    session.log(f"[{name}] {' '.join(cmd[1:])}  (log {rel(log_path)})")
    start = last = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in proc.stdout:
            log.write(line)
            now = time.monotonic()
            if line.startswith("nox >") or now - last >= 30:
                last = now
                session.log(f"[{name} {now - start:5.0f} s] {line.rstrip()[:160]}")
        code = proc.wait()
    duration = round(time.monotonic() - start, 1)
    path = STEPS_DIR / f"{name}.json"
    rec = json.loads(path.read_text()) if path.is_file() else {}
    status = rec.get("status", "failed")
    reason = rec.get("reason", "")
    if code != 0 and status != "failed":
        status, reason = "failed", f"nox exited {code}; {reason}".strip("; ")
    elif code == 0 and not rec:
        status, reason = "failed", "the step left no record in dist/steps/"
    artifacts = dict(rec.get("artifacts", {}))
    artifacts[rel(log_path)] = sha256(log_path)
    session.log(f"[{name}] {status.upper()} in {duration:.0f} s {reason}".rstrip())
    return {
        "step": name,
        "status": status,
        "reason": reason,
        "duration_s": duration,
        "exit_code": code,
        "log": rel(log_path),
        "artifacts": artifacts,
        "details": rec.get("details", {}),
    }


def markdown(record: dict) -> str:
    lines = [
        f"# Pipeline run record: {record['result']}",
        "",
        f"Started {record['started']}, finished {record['finished']} on {record['host']['node']}"
        f" ({record['host']['machine']}, Python {record['host']['python']}); commit "
        f"{record['git'].get('commit')} (dirty: {record['git'].get('dirty')}).",
        "",
        "| step | status | duration | reason | log |",
        "|---|---|---|---|---|",
    ]
    for s in record["steps"]:
        duration = f"{s['duration_s']:.0f} s" if "duration_s" in s else ""
        reason = s.get("reason", "").replace("|", "\\|").replace("\n", " ")[:300]
        lines.append(
            f"| {s['step']} | {s['status']} | {duration} | {reason} | {s.get('log', '')} |"
        )
    lines += ["", "## Artifacts", "", "| step | artifact | SHA256 |", "|---|---|---|"]
    for s in record["steps"]:
        for path, digest in s.get("artifacts", {}).items():
            lines.append(f"| {s['step']} | {path} | `{digest}` |")
    return "\n".join(lines) + "\n"
