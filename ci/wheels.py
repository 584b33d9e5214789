"""The wheel as an artifact: its members' SHA256, which wheel a step means, installing it
unrebuilt into a scratch directory, and checking that the installed package loads the DSO its
manifest names. Used by the verify step (ci/build_steps.py) and the GPU steps (ci/gpu.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path
from typing import Any

from ci.layout import DIST, PACKAGE, WORK
from ci.step_env import Env, Failed


def wheel_members(whl: Path) -> dict[str, str]:
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
