"""A targeted profiler capture of one call: how many device kernels, device-to-host copies,
host-synchronising ATen ops and CPU events it takes."""

from __future__ import annotations

from collections import Counter

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from .impls import Args, Impl
from .timing import synchronize

# ATen ops that read device values on the host (.item()/int(t) and boolean-mask indexing)
HOST_SYNC_OPS = frozenset({"aten::_local_scalar_dense", "aten::nonzero"})
MEMCPY_DTOH_MARKERS = ("Memcpy DtoH", "Device -> Pageable", "Device -> Pinned")


def _is_memcpy_dtoh(name: str) -> bool:
    return any(m in name for m in MEMCPY_DTOH_MARKERS)


def _is_memory_event(name: str) -> bool:
    return name.startswith("Memcpy") or name.startswith("Memset")


def capture(impl: Impl, args: Args, device: torch.device, top: int = 8) -> dict[str, object]:
    """Run ``impl`` once (already warm) under torch.profiler and count its events."""
    impl.call(args)  # warm: first-call work (compilation, caches) is not what we count
    synchronize(device)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        impl.call(args)
        synchronize(device)
    events = list(prof.events())
    device_events = [e for e in events if e.device_type != DeviceType.CPU]
    cpu_events = [e for e in events if e.device_type == DeviceType.CPU]
    kernels = [e for e in device_events if not _is_memory_event(e.name)]
    names = Counter(e.name for e in kernels)
    return {
        "device_events": len(device_events),
        "device_kernels": len(kernels),
        "memcpy_dtoh": sum(_is_memcpy_dtoh(e.name) for e in device_events),
        "host_sync_ops": sum(e.name in HOST_SYNC_OPS for e in cpu_events),
        "cpu_events": len(cpu_events),
        "top_kernels": [[name[:120], n] for name, n in names.most_common(top)],
        "note": "one warm call; device events are CUDA activities (kernels, memcpy, memset)",
    }
