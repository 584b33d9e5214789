"""The B/C/B protocol over measurement units (pure Python; the units are callables that
return seconds per call, so the protocol is tested with synthetic units)."""

from __future__ import annotations

from collections.abc import Callable

from .stats import Pair

Unit = Callable[[], float]


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
