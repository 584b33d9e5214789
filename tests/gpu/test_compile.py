"""CI without a GPU: every kernel source compiles with nvcc for the cuda-sm90 target.

Flags and macros come from build_targets.py, exactly as setup.py uses them. Needs nvcc, not a
GPU, so it carries no ``gpu`` marker; it is skipped where nvcc is not on PATH.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from build_targets import TARGETS  # noqa: E402

TARGET = TARGETS["cuda-sm90"]
SOURCES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*.cu"))

pytestmark = pytest.mark.skipif(
    shutil.which(TARGET.toolchain) is None, reason=f"{TARGET.toolchain} not on PATH"
)


def test_sources_found():
    assert "csrc/qsa/select_paged_tokens.cu" in SOURCES
    assert "csrc/qsa/sparse_paged_attention.cu" in SOURCES


@pytest.mark.parametrize("source", SOURCES)
def test_nvcc_compiles(source, tmp_path):
    cmd = [
        TARGET.toolchain,
        *TARGET.arch_flags,
        *TARGET.flags,
        *TARGET.macro_flags(),
        "-Icsrc",
        "-Xptxas=-warn-spills",
        "-c",
        source,
        "-o",
        str(tmp_path / "out.o"),
    ]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr}"
    assert "spill" not in result.stderr, f"register spills in {source}:\n{result.stderr}"


def test_missing_macros_refused(tmp_path):
    """Without the contract macros the sources refuse to compile (one list, in build_targets)."""
    cmd = [TARGET.toolchain, *TARGET.arch_flags, *TARGET.flags, "-Icsrc", "-c", SOURCES[0]]
    result = subprocess.run(
        [*cmd, "-o", str(tmp_path / "out.o")], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "QSA contract macros missing" in result.stderr
