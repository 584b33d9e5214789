"""What ran: device, versions, commit and the compiled module's identity (DSO SHA256)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

COMMIT_ENV = "QSA_COMMIT"
DEFAULT_L2_BYTES = 60 * 1024 * 1024  # H200 (used when the device does not report its L2)


def strip_paths(text: str) -> str:
    """``/any/dir/file.py`` -> ``file.py``: results are committed and must not carry machine
    paths, and messages of torch or of the loader may."""
    return re.sub(r"(?<![\w.])/(?:[\w.+-]+/)+", "", text)


def device_slug(device: torch.device) -> str:
    """File-name stem of the device: e.g. ``nvidia-h200`` or ``cpu``."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "cuda"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return (
        int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))
        or DEFAULT_L2_BYTES
    )


def git_commit(root: Path) -> dict[str, object]:
    """``{"commit", "dirty", "source"}`` from --commit / QSA_COMMIT / git, else unknown."""
    if os.environ.get(COMMIT_ENV):
        return {"commit": os.environ[COMMIT_ENV], "dirty": None, "source": COMMIT_ENV}
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        return {"commit": head, "dirty": bool(status.strip()), "source": "git"}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None, "source": "unknown (no git, no QSA_COMMIT)"}


def _build_identity() -> dict[str, object]:
    """qsa_ops.build_info() and the loaded DSO's SHA256 (never raises)."""

    out: dict[str, object] = {}
    try:
        from ..qsa_ops import build_info

        out["build_info"] = json.loads(strip_paths(json.dumps(build_info(), default=str)))
    except Exception as exc:  # recorded; the benchmark still runs
        out["build_info_error"] = strip_paths(f"{type(exc).__name__}: {exc}")
    try:
        from ..qsa_ops import provenance

        dso = provenance.loaded_dso()
        out["dso"] = {"file": Path(dso["path"]).name, "sha256": dso["sha256"]}
    except Exception as exc:  # no DSO on a CPU-only install
        out["dso"] = None
        out["dso_error"] = strip_paths(f"{type(exc).__name__}: {exc}")
    return out


def collect(device: torch.device, commit: str | None = None) -> dict[str, object]:
    root = Path(__file__).resolve().parents[2]
    info: dict[str, object] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
        "git": {"commit": commit, "dirty": None, "source": "--commit"}
        if commit
        else git_commit(root),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["sm_count"] = props.multi_processor_count
        info["memory_bytes"] = props.total_memory
        info["l2_bytes"] = l2_bytes(device)
        info["capability"] = f"{props.major}.{props.minor}"
        info["driver"] = _nvidia_smi_driver()
    info.update(_build_identity())
    return info


def _nvidia_smi_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
        return out.strip().splitlines()[0] if out.strip() else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
