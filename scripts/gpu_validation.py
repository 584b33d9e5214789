"""Write the GPU validation record (results/gpu-validation.json) after a device run.

    python scripts/gpu_validation.py --junit OUT/junit.xml --sanitizer OUT/sanitizer.json \
        --output results/gpu-validation.json

Called by ``bash scripts/gpu_session.sh validate``. The commit comes from ``git rev-parse``
where the checkout has git, else from the environment (QSA_COMMIT, QSA_TREE_DIRTY=0|1) as
set by whoever started the run; without either it is "unknown" and the tree counts as dirty.
source_sha256 is recomputed from csrc/ (the definition in setup.py) and must equal the one
the loaded module was built with.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from custom_esimd_kernels_vllm import qsa_ops  # noqa: E402
from custom_esimd_kernels_vllm.qsa_ops import provenance  # noqa: E402
from setup import source_sha256  # noqa: E402


def git_commit() -> tuple[str, bool]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout.strip() != ""  # fmt: skip
        return commit, dirty
    except (OSError, subprocess.CalledProcessError):
        commit = os.environ.get("QSA_COMMIT", "unknown")
        return commit, os.environ.get("QSA_TREE_DIRTY", "1") != "0" or commit == "unknown"


def junit_cases(path: Path) -> tuple[dict[str, int], list[dict[str, str]]]:
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None:
            outcome = "failed"
        elif case.find("error") is not None:
            outcome = "errors"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        counts[outcome] += 1
        cases.append(
            {"id": name, "outcome": outcome.rstrip("s") if outcome == "errors" else outcome}
        )
    return counts, cases


def nvcc_version() -> str:
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
        return out.strip().splitlines()[-1]
    except OSError:
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--junit", required=True)
    parser.add_argument("--sanitizer")
    parser.add_argument("--timing")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()

    info = qsa_ops.build_info()
    build = info["cuda_build"] or {}
    dso = provenance.loaded_dso()
    counts, cases = junit_cases(Path(args.junit))
    commit, dirty = git_commit()
    source = source_sha256(ROOT)
    record = {
        "command": "bash scripts/gpu_session.sh validate",
        "gpu": torch.cuda.get_device_name(),
        "compute_capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "dso_cuda_runtime": build.get("cuda_runtime"),
        "nvcc": nvcc_version(),
        "python": platform.python_version(),
        "commit": commit,
        "dirty": dirty,
        "source_sha256": source,
        "dso_source_sha256": build.get("source_sha256"),
        "source_sha256_matches_dso": build.get("source_sha256") == source,
        "dso_sha256": dso.get("sha256"),
        "arch": build.get("arch"),
        "macros": build.get("macros"),
        "tests": counts,
        "sanitizer": json.loads(Path(args.sanitizer).read_text()) if args.sanitizer else None,
        "timing": json.loads(Path(args.timing).read_text()) if args.timing else None,
        "cases": cases,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(record, indent=1) + "\n")
    ok = counts["failed"] == counts["errors"] == 0 and record["source_sha256_matches_dso"]
    if record["sanitizer"]:
        ok = ok and all(v == "clean" for v in record["sanitizer"].values())
    print(f"validation: {counts} sanitizer={record['sanitizer']} -> {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
