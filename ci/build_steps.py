"""The packaging steps: ``build`` (the DSO and its manifest, natively or inside the
target's image), ``wheel`` (the bdist wheel carrying exactly that DSO; dist/SHA256SUMS) and
``verify`` (the wheel in a fresh virtualenv: every SHA256 of the DSO agrees, tests/cpu passes
against the install).
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import build_targets
from ci import containers
from ci.layout import (
    BUILD_REQUIREMENTS,
    DIST,
    IN_PACKAGE_PROVENANCE,
    PACKAGE,
    PROVENANCE_JSON,
    ROOT,
    SHA256SUMS,
    TORCH_PIN,
    WORK,
    extras,
    provenance,
    rel,
    sha256_file,
)
from ci.native_build import build_native, require_buildable, source_date_epoch
from ci.step_env import Env, Failed, Skipped
from ci.wheels import provenance_check, the_wheel, wheel_members


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="build")
    parser.add_argument(
        "--target", default=build_targets.DEFAULT_TARGET, choices=build_targets.TARGETS
    )
    parser.add_argument("--container", action="store_true", help="build inside the target's image")
    return parser


def build_args(argv: Sequence[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build(env: Env) -> None:
    """Compile the DSO for one target and write dist/provenance.json."""
    args = build_args(env.posargs)
    target = build_targets.TARGETS[args.target]
    require_buildable(target)  # before any install: fail fast
    if args.container:
        containers.build_in_container(env, target)
    else:
        env.install("-r", BUILD_REQUIREMENTS)
        build_native(env, target)


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
    """The wheel in a clean venv: every SHA256 of its DSO agrees; tests/cpu against it.

    The SHA256 of the DSO the installed package loads must equal the manifest's, the wheel
    member's, SHA256SUMS' and the installed file's."""
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
