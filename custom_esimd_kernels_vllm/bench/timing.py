"""Timers and measurement units: eager (CUDA events around ``calls`` back-to-back calls, or
the wall clock on CPU) and CUDA-graph replay (``calls`` calls captured once, replayed).

Each unit returns seconds per call. Calls cycle through the rotated copies of the inputs.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

from .impls import Args, Impl


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_block(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds taken by ``fn`` on ``device``: CUDA events on the current stream (the block is
    synchronised at its end), or the wall clock on CPU (whose ops are synchronous)."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def calls_per_unit(
    per_call_s: float, unit_s: float, max_calls: int, max_unit_s: float, min_calls: int = 1
) -> int:
    """Calls so that one unit lasts about ``unit_s`` (at least ``min_calls``, e.g. one pass
    over the rotated copies), but at most ``max_calls`` and about ``max_unit_s``."""
    per_call_s = max(per_call_s, 1e-9)
    want = max(math.ceil(unit_s / per_call_s), min_calls)
    cap = max(1, min(max_calls, math.floor(max_unit_s / per_call_s)))
    return max(1, min(want, cap))


class EagerUnit:
    """``calls`` eager calls; the rotation cursor continues from unit to unit."""

    mode = "eager"

    def __init__(self, impl: Impl, copies: list[Args], calls: int, device: torch.device):
        self.impl, self.copies, self.calls, self.device = impl, copies, calls, device
        self.cursor = 0

    def _block(self) -> None:
        n = len(self.copies)
        for _ in range(self.calls):
            self.impl.call(self.copies[self.cursor])
            self.cursor = (self.cursor + 1) % n

    def __call__(self) -> float:
        return time_block(self._block, self.device) / self.calls

    def close(self) -> None:
        pass


class GraphUnit:
    """``calls`` calls (copies 0, 1, ... cyclically) captured in one CUDA graph; a unit is
    one replay."""

    mode = "graph"

    def __init__(self, impl: Impl, copies: list[Args], calls: int, device: torch.device):
        self.impl, self.copies, self.calls, self.device = impl, copies, calls, device
        self.graph = self._capture()

    def _capture(self) -> torch.cuda.CUDAGraph:
        # NOTES: warm up on a side stream first (as torch.cuda.graphs recommends), so that
        # lazy initialisation (allocator, library handles, compiled kernels) is not captured.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for i in range(min(3, len(self.copies))):
                self.impl.call(self.copies[i])
        torch.cuda.current_stream(self.device).wait_stream(side)
        synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(self.calls):
                self.impl.call(self.copies[i % len(self.copies)])
        synchronize(self.device)
        return graph

    def __call__(self) -> float:
        return time_block(self.graph.replay, self.device) / self.calls

    def close(self) -> None:
        self.graph.reset()


def estimate_per_call(impl: Impl, copies: list[Args], device: torch.device, reps: int = 3) -> float:
    """Median seconds of single eager calls (after the first call, which is not timed)."""
    times = [
        time_block(lambda i=i: impl.call(copies[i % len(copies)]), device) for i in range(reps)
    ]
    return statistics.median(times)


def measure_copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> dict[str, float]:
    """Device-to-device copy of ``nbytes``: bytes read + written over the median time."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    synchronize(device)
    times = [time_block(lambda: dst.copy_(src), device) for _ in range(reps)]
    median = statistics.median(times)
    return {
        "bytes_copied": nbytes,
        "bytes_moved": 2 * nbytes,
        "median_s": median,
        "min_s": min(times),
        "bandwidth_bytes_per_s": 2 * nbytes / median,
        "samples_s": times,
    }
