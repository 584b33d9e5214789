"""CI without a GPU: every kernel source compiles with nvcc for the cuda-sm90 target.

Flags come from build_targets.py, exactly as setup.py uses them (the contract's constants from
csrc/qsa/contract.h). Needs nvcc, not a
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


def test_contract_header_refuses_a_redefinition(tmp_path):
    """The contract's constants are defined once (csrc/qsa/contract.h): a -D from the command
    line that disagrees is a compile error, not a silent second definition."""
    cmd = [TARGET.toolchain, *TARGET.arch_flags, *TARGET.flags, "-DQSA_WIDTH=2048", "-Icsrc",
           "-c", SOURCES[0], "-o", str(tmp_path / "out.o")]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode != 0 or "redefined" in result.stderr, result.stderr
