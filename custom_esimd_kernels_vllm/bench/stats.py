"""Statistics of the B/C/B protocol: pure Python, no torch, unit-tested on synthetic samples.

A *unit* is one timed measurement of ``calls`` back-to-back calls; its per-call latency is the
unit's time divided by ``calls``. A *pair* is the triple baseline, candidate, baseline (B/C/B)
run back to back, so that slow drift of the machine (clocks, temperature) shows up as a
difference between the two baseline units instead of biasing the comparison.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


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
    drift_pct: (
        float  # second baseline vs first, mean over pairs: 100 * (sum(after) / sum(before) - 1)
    )
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
