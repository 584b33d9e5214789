"""Two clean builds of the DSO from the same sources give the same bytes (same SHA256).

Builds twice with the command the pipeline's `build` step runs (`python setup.py build_ext
--inplace`), in one scratch copy of the repository, wiping every output in between. The same
directory is used for both builds on purpose: nvcc derives the mangled names of anonymous
namespaces from the source file's absolute path, so the build path is a build input (the
container build uses the checkout's path for the same reason).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def build_once(src) -> str:
    shutil.rmtree(src / "build", ignore_errors=True)
    for old in (src / "custom_esimd_kernels_vllm").glob("_C.so"):
        old.unlink()
    res = subprocess.run(
        [sys.executable, "setup.py", "--quiet", "build_ext", "--inplace"],
        cwd=src, capture_output=True, text=True,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (dso,) = (src / "custom_esimd_kernels_vllm").glob("_C.so")
    return hashlib.sha256(dso.read_bytes()).hexdigest()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_two_clean_builds_give_the_same_dso(images, tmp_path):
    pytest.importorskip(
        "torch", reason="the build needs torch's headers (docker/requirements-build.txt)"
    )
    src = images.export_tree(tmp_path / "src", ROOT)
    first = build_once(src)
    second = build_once(src)
    assert first == second, f"two clean builds differ: {first} vs {second}"
