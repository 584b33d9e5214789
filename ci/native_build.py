"""The native build of the DSO: refuse a target that cannot be built here, compile it with
the one build command in a clean tree, and write its manifest (dist/provenance.json, and the
copy the wheel ships). Used by the build step (ci/build_steps.py) and by the container build
(ci/containers.py), which makes the native build first when there is none.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import build_targets
from ci.layout import (
    BUILD_COMMAND,
    DIST,
    IN_PACKAGE_PROVENANCE,
    PACKAGE,
    PROVENANCE_JSON,
    ROOT,
    provenance,
    pyproject,
    rel,
)
from ci.step_env import Env, Failed


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
