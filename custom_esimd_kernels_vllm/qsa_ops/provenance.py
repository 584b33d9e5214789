"""Build provenance: what went into the compiled ops, and which file is actually loaded.

The one place for the project's build facts (stdlib only, so that ``setup.py``, the pipeline
and the GSM8K gate can import this file by path without torch):

- :data:`SOURCES`, :func:`source_files`, :func:`source_sha256`: the inputs of the DSO and the
  hash over them (the build embeds it, the manifest and the GPU validation record repeat it);
- :func:`sha256_file`: the one file hash; :func:`git_state`: the one "dirty checkout" rule;
- :func:`tool_version`, :func:`make_manifest`: the toolchain and the manifest of a build;
- :data:`DSO_NAME`, :func:`dso_files`: the name of the compiled file.

The pipeline's ``build`` step writes the manifest (``dist/provenance.json``) and the wheel carries
it inside the package as ``custom_esimd_kernels_vllm/provenance.json``. It records the target,
the toolchain versions, flags and macros, the SHA256 of every source file, the git commit and
dirty flag, and the path and SHA256 of the DSO.

At run time this module answers one question: *is the DSO this process loaded the one the
manifest describes?* ::

    from custom_esimd_kernels_vllm.qsa_ops import provenance
    provenance.loaded_dso()      # {"path": ..., "sha256": ...} of the loaded DSO
    provenance.read_manifest()   # the shipped manifest, or None in a source checkout
    provenance.check()           # raises ProvenanceError on any mismatch

    python -m custom_esimd_kernels_vllm.qsa_ops.provenance [--check]
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

PACKAGE = "custom_esimd_kernels_vllm"
# The compiled ops: one LibTorch stable-ABI library, loaded with torch.ops.load_library.
DSO_NAME = "_C.so"
MANIFEST_NAME = "provenance.json"
SCHEMA = 1
# Everything that decides the DSO's bytes (files or directories, relative to the checkout).
SOURCES = ("csrc", "setup.py", "build_targets.py", "pyproject.toml")

_PACKAGE_DIR = Path(__file__).resolve().parent.parent


class ProvenanceError(RuntimeError):
    """The loaded DSO, the manifest and the file on disk do not agree."""


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Run time
# --------------------------------------------------------------------------------------------


def manifest_path() -> Path:
    return _PACKAGE_DIR / MANIFEST_NAME


def read_manifest() -> dict[str, Any] | None:
    """The manifest shipped inside the installed package, or None (e.g. a source checkout)."""
    path = manifest_path()
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def dso_files(package_dir: str | Path = _PACKAGE_DIR) -> list[Path]:
    """The compiled ops files in ``package_dir`` (normally one)."""
    package_dir = Path(package_dir)
    return sorted(package_dir.glob(DSO_NAME))


def loaded_dso() -> dict[str, Any]:
    """Path and SHA256 of the compiled ops file this process loaded.

    Imports the op layer (which loads its DSO) and looks the file up in
    ``torch.ops.loaded_libraries``; raises ImportError, with the reason, when no DSO is loaded.
    Loading it needs no GPU.
    """
    importlib.import_module(f"{PACKAGE}.qsa_ops")
    torch = sys.modules.get("torch")
    loaded = getattr(getattr(torch, "ops", None), "loaded_libraries", ())
    found = sorted(Path(p).resolve() for p in loaded if Path(p).name == DSO_NAME)
    if not found:
        raise ImportError(
            f"no {DSO_NAME} is loaded: {PACKAGE}.qsa_ops did not load one from {_PACKAGE_DIR} "
            f"(files there: {[p.name for p in dso_files()] or 'none'})"
        )
    return {"module": DSO_NAME, "path": str(found[0]), "sha256": sha256_file(found[0])}


def check() -> dict[str, Any]:
    """Verify that the loaded DSO is the one the shipped manifest names; return the evidence.

    Compares the SHA256 of the imported module file with ``manifest["dso"]["sha256"]`` and
    checks that the file name matches. Raises ProvenanceError on a mismatch or a missing
    manifest, ImportError when the DSO does not load.
    """
    manifest = read_manifest()
    if manifest is None:
        raise ProvenanceError(
            f"no {MANIFEST_NAME} in {_PACKAGE_DIR}: this installation was not built by the "
            "pipeline (nox -s build wheel), so its DSO has no recorded provenance"
        )
    dso = loaded_dso()
    expected = manifest["dso"]
    if Path(dso["path"]).name != Path(expected["path"]).name:
        raise ProvenanceError(
            f"loaded DSO {dso['path']} is not the file the manifest names ({expected['path']})"
        )
    if dso["sha256"] != expected["sha256"]:
        raise ProvenanceError(
            f"loaded DSO {dso['path']} has SHA256 {dso['sha256']}, "
            f"manifest says {expected['sha256']} (built from commit "
            f"{manifest.get('git', {}).get('commit')})"
        )
    return {"dso": dso, "manifest_dso": expected, "target": manifest["target"]["name"]}


def summary() -> dict[str, Any]:
    """A JSON-able report that never raises: manifest fields, loaded DSO, and whether they match."""
    out: dict[str, Any] = {"manifest": None, "dso": None, "matches_manifest": None}
    manifest = read_manifest()
    if manifest is not None:
        out["manifest"] = {
            "target": manifest["target"]["name"],
            "git": manifest.get("git"),
            "dso": manifest["dso"],
        }
    try:
        out["dso"] = loaded_dso()
    except ImportError as exc:
        out["dso_error"] = f"{type(exc).__name__}: {exc}"
    if out["manifest"] is not None and out["dso"] is not None:
        out["matches_manifest"] = out["dso"]["sha256"] == manifest["dso"]["sha256"]
    return out


# --------------------------------------------------------------------------------------------
# Build time
# --------------------------------------------------------------------------------------------


def source_files(root: str | Path, paths: Iterable[str | Path] = SOURCES) -> list[str]:
    """Every file under ``paths`` (files or directories) as sorted relative POSIX paths,
    skipping caches; a missing path raises FileNotFoundError."""
    root = Path(root)
    files: set[Path] = set()
    for entry in paths:
        p = root / entry
        if p.is_dir():
            files.update(f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts)
        elif p.is_file():
            files.add(p)
        else:
            raise FileNotFoundError(f"provenance source {entry!r} does not exist under {root}")
    return sorted(f.relative_to(root).as_posix() for f in files)


def source_digests(root: str | Path, paths: Iterable[str | Path] = SOURCES) -> dict[str, str]:
    """``{relative path: sha256}`` of :func:`source_files`."""
    return {name: sha256_file(Path(root) / name) for name in source_files(root, paths)}


def listing_sha256(digests: Mapping[str, str]) -> str:
    """The hash of a ``{path: sha256}`` listing (``sha256sum`` format, sorted by path)."""
    listing = "".join(f"{sha}  {name}\n" for name, sha in sorted(digests.items()))
    return hashlib.sha256(listing.encode()).hexdigest()


def source_sha256(root: str | Path) -> str:
    """The one source hash of the DSO: :func:`listing_sha256` over the :data:`SOURCES`."""
    return listing_sha256(source_digests(root))


# An exported tree (the container build's copy of the working tree) has no git metadata: the
# exporter hands the checkout's git_state() to the build through this variable (JSON).
GIT_STATE_ENV = "QSA_GIT_STATE"


def exported_git_state(value: str) -> dict[str, Any]:
    """The git_state() given in ``QSA_GIT_STATE``; ValueError naming it when malformed."""
    try:
        state = json.loads(value)
    except ValueError:
        state = None
    if not isinstance(state, dict) or not {"commit", "dirty"} <= set(state):
        raise ValueError(
            f"{GIT_STATE_ENV} must be a JSON object with 'commit' and 'dirty' (the exported "
            f"checkout's git_state()), got {value[:200]!r}"
        )
    return state


def git_state(root: Path) -> dict[str, Any]:
    """Commit and dirty flag of the checkout at ``root``; outside git, the exporter's state from
    ``QSA_GIT_STATE`` when set, else ``commit: None``."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, check=True, capture_output=True, text=True
        ).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        changes = git("status", "--porcelain", "-z", "--untracked-files=normal")
    except (OSError, subprocess.CalledProcessError) as exc:
        if os.environ.get(GIT_STATE_ENV):
            return exported_git_state(os.environ[GIT_STATE_ENV])
        return {"commit": None, "dirty": None, "note": f"not a git checkout: {exc}"}
    dirty_paths = [entry[3:] for entry in changes.split("\0") if len(entry) > 3]
    return {"commit": commit, "dirty": bool(dirty_paths), "dirty_paths": dirty_paths}


def tool_version(argv: Sequence[str]) -> str:
    """The version line of a tool (last non-empty line of ``argv`` output for nvcc-style
    banners, first line otherwise); raises FileNotFoundError when the tool is absent."""
    res = subprocess.run(list(argv), check=True, capture_output=True, text=True)
    lines = [ln.strip() for ln in (res.stdout or res.stderr).splitlines() if ln.strip()]
    release = [ln for ln in lines if "release" in ln]
    return release[0] if release else lines[0]


def make_manifest(
    *,
    target: Mapping[str, Any],
    toolchain: Mapping[str, str],
    sources: Mapping[str, str],
    git: Mapping[str, Any],
    dso_path: Path,
    root: Path,
    build: Mapping[str, Any],
    version: str,
) -> dict[str, Any]:
    """Assemble the manifest written to ``dist/provenance.json`` and shipped in the wheel."""
    dso_path = Path(dso_path)
    rel = dso_path.resolve().relative_to(Path(root).resolve()).as_posix()
    aggregate = listing_sha256(sources)
    return {
        "schema": SCHEMA,
        "package": PACKAGE.replace("_", "-"),
        "version": version,
        "target": dict(target),
        "toolchain": dict(toolchain),
        "build": dict(build),
        "host": {"machine": platform.machine(), "system": platform.system()},
        "git": dict(git),
        "sources": dict(sorted(sources.items())),
        "sources_sha256": aggregate,
        "dso": {"path": rel, "sha256": sha256_file(dso_path), "size": dso_path.stat().st_size},
    }


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m custom_esimd_kernels_vllm.qsa_ops.provenance",
        description="Print the build provenance of the installed QSA kernels.",
        epilog="exit codes: 0 summary printed or check passed, 1 check failed, 2 usage error",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 unless the loaded DSO's SHA256 equals the shipped manifest's",
    )
    args = parser.parse_args(argv)
    if not args.check:
        print(json.dumps(summary(), indent=2))
        return 0
    try:
        evidence = check()
    except (ProvenanceError, ImportError) as exc:
        print(f"provenance check FAILED: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(evidence, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
