"""The one timer of the benchmark: statistics, the B/C/B protocol, L2 rotation, measurement
units (CUDA events around eager calls, CUDA-graph replay), host time per call, the copy
bandwidth and the profiler capture.

Vocabulary:

* a *unit* is one timed measurement of ``calls`` back-to-back calls; its value is seconds per
  call. Eager units are timed with CUDA events on the current stream (the wall clock on CPU,
  whose ops are synchronous) and include the host overhead; graph units capture ``calls``
  calls in one CUDA graph and time one replay.
* a *pair* is the triple baseline, candidate, baseline (B/C/B) run back to back, so that slow
  drift of the machine (clocks, temperature) shows up as a difference between the two baseline
  units instead of biasing the comparison.
* *rotation*: calls cycle through copies of the inputs so that the L2 cache does not keep the
  working set between calls (H200: 60 MB of L2). Copy ``k`` computes exactly what the original
  case computes but reads it at other addresses:

  1. *compact*: the pool (physical pages) is reduced to the pages the page table references
     (valid entries, in ``[0, P)``); the page table is renumbered accordingly;
  2. *tile*: the compact pool is repeated ``S`` times (``S`` slabs, within a memory budget);
  3. *remap*: copy ``k`` uses slab ``k mod S``: valid entry ``x`` becomes
     ``slab * U + rank(x)``. Invalid entries stay invalid: negatives unchanged, entries
     ``>= P`` moved to ``>= S * U`` (the new pool size).

  When the budget allows ``S >= copies`` every copy reads the same values (``exact``: its
  results equal the original's). Otherwise copies beyond ``S`` also permute the pages inside
  their slab (same structure, other values) and ``exact`` is False. The small per-row tensors
  (q, the index buffer, positions, the gate, out) are cloned per copy; the caches, the index
  rows, selection's out and a padded page table are the same views of each copy's buffers as
  of the original's (the layout is kept).

The statistics, the protocol and the rotation plan are pure arithmetic, unit-tested on
synthetic samples.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from .cases import ROW_VIEWS, CaseInputs, padded_rows, pool_views, row_views

Args = dict[str, torch.Tensor]
Unit = Callable[[], float]

# ----------------------------------------------------------------------------------------
# statistics
# ----------------------------------------------------------------------------------------


def quantile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default, "linear"); ``q`` in [0, 1]."""
    if not samples:
        raise ValueError("quantile of an empty sample")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    xs = sorted(samples)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Summary:
    """Per-call latency summary of a list of units, in seconds."""

    n: int
    mean: float
    median: float
    p10: float
    p90: float
    min: float
    max: float

    @property
    def spread(self) -> float:
        """p90 - p10, the reported spread."""
        return self.p90 - self.p10

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def summarize(samples: Sequence[float]) -> Summary:
    if not samples:
        raise ValueError("cannot summarize an empty sample")
    return Summary(
        n=len(samples),
        mean=sum(samples) / len(samples),
        median=quantile(samples, 0.5),
        p10=quantile(samples, 0.1),
        p90=quantile(samples, 0.9),
        min=min(samples),
        max=max(samples),
    )


@dataclass(frozen=True)
class Pair:
    """One B/C/B triple of per-call latencies (seconds)."""

    baseline_before: float
    candidate: float
    baseline_after: float

    @property
    def baseline(self) -> float:
        """The baseline this pair compares against: the mean of its two baseline units."""
        return 0.5 * (self.baseline_before + self.baseline_after)

    @property
    def speedup(self) -> float:
        """baseline / candidate (> 1: the candidate is faster)."""
        return self.baseline / self.candidate if self.candidate > 0 else math.inf

    @property
    def win(self) -> bool:
        """The candidate beat *both* baseline units around it (the strict reading)."""
        return self.candidate < min(self.baseline_before, self.baseline_after)


@dataclass(frozen=True)
class Comparison:
    """Result of N B/C/B pairs."""

    pairs: int
    speedup_median: float  # median over pairs of baseline / candidate
    speedup_p10: float
    speedup_p90: float
    wins: int  # pairs where the candidate beat both baseline units
    drift_pct: float  # 100 * (sum(second baselines) / sum(first baselines) - 1)
    baseline_latency: Summary  # both baseline units of every pair
    candidate_latency: Summary

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def compare(pairs: Sequence[Pair]) -> Comparison:
    if not pairs:
        raise ValueError("a B/C/B comparison needs at least one pair")
    speedups = [p.speedup for p in pairs]
    before = sum(p.baseline_before for p in pairs)
    after = sum(p.baseline_after for p in pairs)
    return Comparison(
        pairs=len(pairs),
        speedup_median=quantile(speedups, 0.5),
        speedup_p10=quantile(speedups, 0.1),
        speedup_p90=quantile(speedups, 0.9),
        wins=sum(p.win for p in pairs),
        drift_pct=100.0 * (after / before - 1.0) if before > 0 else math.nan,
        baseline_latency=summarize(
            [x for p in pairs for x in (p.baseline_before, p.baseline_after)]
        ),
        candidate_latency=summarize([p.candidate for p in pairs]),
    )


# ----------------------------------------------------------------------------------------
# the B/C/B protocol (units are callables returning seconds per call)
# ----------------------------------------------------------------------------------------


def run_pairs(baseline: Unit, candidate: Unit, pairs: int, warmup_units: int) -> list[Pair]:
    """``warmup_units`` excluded units of each, then ``pairs`` triples baseline, candidate,
    baseline."""
    if pairs < 1:
        raise ValueError(f"pairs must be >= 1, got {pairs}")
    for _ in range(warmup_units):
        baseline()
        candidate()
    result = []
    for _ in range(pairs):
        before = baseline()
        cand = candidate()
        after = baseline()
        result.append(Pair(before, cand, after))
    return result


def run_solo(unit: Unit, samples: int, warmup_units: int) -> list[float]:
    """Timing without a baseline (a case with a single implementation)."""
    for _ in range(warmup_units):
        unit()
    return [unit() for _ in range(samples)]


# ----------------------------------------------------------------------------------------
# L2 rotation
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RotationPlan:
    copies: int  # copies of the inputs, used round-robin call after call
    slabs: int  # distinct physical slabs of the pool
    compact_pages: int  # pages per slab (U)
    slab_bytes: int  # bytes of one slab
    bytes_per_call: int  # floor bytes of one call (what one call must touch)
    target_bytes: int  # what the copies together should exceed (2 x L2)
    exact: bool

    @property
    def touched_bytes(self) -> int:
        """Distinct bytes the copies touch in total, at most (when not exact, the permuted
        copies share the slabs, so the tiled pool bounds it)."""
        total = self.copies * self.bytes_per_call
        return total if self.exact else min(total, self.slabs * self.slab_bytes)

    @property
    def beats_cache(self) -> bool:
        return self.touched_bytes >= self.target_bytes

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["touched_bytes"] = self.touched_bytes
        d["beats_cache"] = self.beats_cache
        return d


def plan(
    bytes_per_call: int,
    page_bytes: int,
    compact_pages: int,
    target_bytes: int,
    max_copies: int,
    memory_budget: int,
) -> RotationPlan:
    """How many copies and slabs (pure arithmetic; unit-tested)."""
    if max_copies < 1:
        raise ValueError(f"max_copies must be >= 1, got {max_copies}")
    per_call = max(1, bytes_per_call)
    copies = max(1, min(max_copies, math.ceil(target_bytes / per_call)))
    slab_bytes = max(1, compact_pages * page_bytes)
    slabs = max(1, min(copies, memory_budget // slab_bytes))
    return RotationPlan(
        copies=copies,
        slabs=slabs,
        compact_pages=compact_pages,
        slab_bytes=slab_bytes,
        bytes_per_call=bytes_per_call,
        target_bytes=target_bytes,
        exact=slabs >= copies,
    )


def remap_page_table(
    table: torch.Tensor, ranks: torch.Tensor, pages: int, slab: int, compact: int, slabs: int,
    perm: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Page table of one copy (see the module docstring). ``ranks[x]`` is the compact index of
    physical page ``x`` (only read for valid ``x``); ``perm`` permutes the compact pages."""
    t = table.long()
    valid = (t >= 0) & (t < pages)
    rank = ranks[t.clamp(0, max(pages - 1, 0))] if pages > 0 else torch.zeros_like(t)
    if perm is not None:
        rank = perm[rank]
    mapped = torch.where(valid, slab * compact + rank, t)
    mapped = torch.where(t >= pages, t - pages + slabs * compact, mapped)
    return mapped.to(table.dtype).contiguous()


def used_pages(inputs: CaseInputs) -> torch.Tensor:
    """Sorted distinct physical pages the page table references (valid entries only)."""
    table = inputs.tensors["page_table"].long()
    return torch.unique(table[(table >= 0) & (table < inputs.pages)])


def page_bytes(inputs: CaseInputs) -> int:
    return inputs.pool[0].numel() * inputs.pool.element_size() if inputs.pages else 0


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _select_pages(pool: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """``pool.index_select(0, pages)`` done on the bits (an integer view of the same element
    size): the same bytes for every dtype, float8 included, whatever kernels a backend has."""
    bits = pool.view(_BITS[pool.element_size()])
    return bits.index_select(0, pages).view(pool.dtype)


def make_copies(
    inputs: CaseInputs, rotation: RotationPlan, seed: int = 0
) -> tuple[list[Args], dict[str, object]]:
    """The argument sets of ``rotation.copies`` copies sharing one tiled pool."""
    t = inputs.tensors
    pool = inputs.pool
    pages = pool.shape[0]
    device = pool.device
    used = used_pages(inputs)
    compact = int(used.numel())
    ranks = torch.zeros(max(pages, 1), dtype=torch.long, device=device)
    if compact:
        ranks[used] = torch.arange(compact, device=device)
        compact_pool = pool if compact == pages else _select_pages(pool, used)
    else:  # nothing valid: keep one page so that every shape stays well formed
        compact_pool = pool[:1]
    slabs = rotation.slabs
    if slabs == 1 and compact == pages:  # every page used, one slab: the pool as it is
        tiled = pool
    elif slabs == 1:  # index_select made a new buffer already
        tiled = compact_pool.contiguous()
    else:
        tiled = compact_pool.repeat(slabs, *([1] * (pool.dim() - 1))).contiguous()
    g = torch.Generator(device=device)
    g.manual_seed(seed + 1)

    shared: Args = {inputs.pool_name: tiled, **pool_views(inputs.op, tiled)}
    views = {view for view, base in ROW_VIEWS if base in t}  # re-derived per copy
    per_copy_names = [n for n in t if n not in shared and n not in views and n != "page_table"]
    copies = []
    for k in range(rotation.copies):
        perm = None
        if k >= slabs and compact > 1:
            perm = torch.randperm(compact, generator=g, device=device)
        args = dict(shared)
        table = remap_page_table(
            t["page_table"], ranks, pages, k % slabs, max(compact, 1), slabs, perm
        )
        args["page_table"] = padded_rows(table, inputs.layout.table_pad)
        for name in per_copy_names:
            value = t[name]
            args[name] = value.clone() if k and isinstance(value, torch.Tensor) else value
        copies.append(row_views(args))
    info = {"original_pages": pages, "pool_pages": int(tiled.shape[0]), "pool_bytes": tiled.nbytes}
    return copies, info


# ----------------------------------------------------------------------------------------
# measurement units
# ----------------------------------------------------------------------------------------


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
    """``calls`` eager calls of ``call(args)``; the rotation cursor continues from unit to
    unit."""

    mode = "eager"

    def __init__(self, call: Callable[[Args], object], copies: list[Args], calls: int, device):
        self.call, self.copies, self.calls, self.device = call, copies, calls, device
        self.cursor = 0

    def _block(self) -> None:
        n = len(self.copies)
        for _ in range(self.calls):
            self.call(self.copies[self.cursor])
            self.cursor = (self.cursor + 1) % n

    def __call__(self) -> float:
        return time_block(self._block, self.device) / self.calls

    def close(self) -> None:
        pass


class GraphUnit:
    """``calls`` calls (copies 0, 1, ... cyclically) captured in one CUDA graph; a unit is
    one replay."""

    mode = "graph"

    def __init__(self, call: Callable[[Args], object], copies: list[Args], calls: int, device):
        self.call, self.copies, self.calls, self.device = call, copies, calls, device
        self.graph = self._capture()

    def _capture(self) -> torch.cuda.CUDAGraph:
        # NOTES: warm up on a side stream first (as torch.cuda.graphs recommends), so that
        # lazy initialisation (allocator, library handles, compiled kernels) is not captured,
        # and capture on that same stream, as vLLM does (it captures on the stream its warm-up
        # and profiling runs used). The ops keep their scratch and zeroed counters per
        # (device, stream): captured on a stream that never ran them eagerly (torch's default
        # capture stream), every captured call takes its own scratch from the graph's pool
        # and a captured zero fill of its counters, which each replay then runs as well.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for i in range(min(3, len(self.copies))):
                self.call(self.copies[i])
        torch.cuda.current_stream(self.device).wait_stream(side)
        synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            for i in range(self.calls):
                self.call(self.copies[i % len(self.copies)])
        synchronize(self.device)
        return graph

    def __call__(self) -> float:
        return time_block(self.graph.replay, self.device) / self.calls

    def host_seconds(self, reps: int = 20) -> float:
        """Median host time of one ``replay()`` call (what launching the graph costs)."""
        return host_seconds_per_call(self.graph.replay, 1, reps, self.device)

    def close(self) -> None:
        self.graph.reset()


def estimate_per_call(
    call: Callable[[Args], object], copies: list[Args], device, reps: int = 3
) -> float:
    """Median seconds of single eager calls (after the first call, which is not timed)."""
    times = [time_block(lambda i=i: call(copies[i % len(copies)]), device) for i in range(reps)]
    return statistics.median(times)


def host_seconds_interleaved(
    fns: dict[str, Callable[[], object]], calls: int, reps: int, device: torch.device
) -> dict[str, float]:
    """Per function, the median over ``reps`` of the host (wall-clock) time of ``calls``
    back-to-back calls, per call: what the caller's thread pays to issue the work, not the
    device time. The reps interleave the functions (rep 1 of each, then rep 2 of each, ...), so
    a drift of the host's speed during the run reaches every function alike and their ratios
    stay comparable. The device is synchronised before each rep (an empty queue) and after it.

    NOTES: measured one function after the other, add_ and selection came from different
    moments of the run: 1.59x in one run against 1.31-1.33x interleaved on the same host."""
    for fn in fns.values():
        fn()  # first-call work (caches, lazy init) is not what is measured
    synchronize(device)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - t0) / calls)
            synchronize(device)
    return {name: statistics.median(v) for name, v in samples.items()}


def host_seconds_per_call(
    fn: Callable[[], object], calls: int, reps: int, device: torch.device
) -> float:
    """host_seconds_interleaved of one function."""
    return host_seconds_interleaved({"fn": fn}, calls, reps, device)["fn"]


# ----------------------------------------------------------------------------------------
# copy bandwidth (the memory floor's denominator) and the profiler capture
# ----------------------------------------------------------------------------------------

COPY_METHOD = (
    "Tensor.copy_ of a contiguous uint8 buffer, device to device, timed with CUDA events "
    "around one eager call (wall clock on CPU), median of the timed calls after 3 warm-ups; "
    "bandwidth = (bytes read + bytes written) / median"
)


def measure_copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> dict[str, object]:
    """Device-to-device copy of ``nbytes``: bytes read + written over the median time. This is
    the only copy-bandwidth measurement of the project (the floor of every report)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)  # warm-up (clocks, first-touch)
    synchronize(device)
    times = [time_block(lambda: dst.copy_(src), device) for _ in range(reps)]
    median = statistics.median(times)
    return {
        "method": COPY_METHOD,
        "bytes_copied": nbytes,
        "bytes_moved": 2 * nbytes,
        "median_s": median,
        "min_s": min(times),
        "bandwidth_bytes_per_s": 2 * nbytes / median,
        "samples_s": times,
    }


# ATen ops that read device values on the host (.item()/int(t) and boolean-mask indexing)
HOST_SYNC_OPS = frozenset({"aten::_local_scalar_dense", "aten::nonzero"})
MEMCPY_DTOH_MARKERS = ("Memcpy DtoH", "Device -> Pageable", "Device -> Pinned")


def _is_memory_event(name: str) -> bool:
    return name.startswith("Memcpy") or name.startswith("Memset")


def profile_call(fn: Callable[[], object], device: torch.device, top: int = 8) -> dict[str, object]:
    """Run ``fn`` once (after one warm call) under torch.profiler: device kernels with their
    device time, device-to-host copies, host-synchronising ATen ops and CPU events."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm: first-call work (compilation, caches) is not what is counted
    synchronize(device)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    events = list(prof.events())
    device_events = [e for e in events if e.device_type != DeviceType.CPU]
    cpu_events = [e for e in events if e.device_type == DeviceType.CPU]
    kernels = [e for e in device_events if not _is_memory_event(e.name)]
    count, device_us = Counter(), Counter()
    for e in kernels:
        count[e.name] += 1
        device_us[e.name] += getattr(e, "device_time", 0.0) or 0.0
    return {
        "device_events": len(device_events),
        "device_kernels": len(kernels),
        "memcpy_dtoh": sum(any(m in e.name for m in MEMCPY_DTOH_MARKERS) for e in device_events),
        "host_sync_ops": sum(e.name in HOST_SYNC_OPS for e in cpu_events),
        "cpu_events": len(cpu_events),
        # [name, launches, device µs] of the most frequent kernels (the per-kernel breakdown)
        "top_kernels": [[n[:120], c, round(device_us[n], 3)] for n, c in count.most_common(top)],
        "note": "one warm call; device events are CUDA activities (kernels, memcpy, memset)",
    }
