"""B/C/B statistics on synthetic samples."""

from __future__ import annotations

import math

import numpy as np
import pytest

from custom_esimd_kernels_vllm.bench.timing import (
    Pair,
    compare,
    quantile,
    run_pairs,
    run_solo,
    summarize,
)


@pytest.mark.parametrize("q", [0.0, 0.1, 0.25, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("n", [1, 2, 5, 10, 31])
def test_quantile_matches_numpy_linear(q, n):
    xs = list(np.random.default_rng(n).normal(size=n))
    assert quantile(xs, q) == pytest.approx(float(np.quantile(xs, q)), rel=1e-12, abs=1e-12)


def test_quantile_rejects_empty_and_bad_q():
    with pytest.raises(ValueError, match="empty"):
        quantile([], 0.5)
    with pytest.raises(ValueError, match=r"q must be in \[0, 1\]"):
        quantile([1.0], 1.5)


def test_summarize():
    s = summarize([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (s.n, s.mean, s.median, s.min, s.max) == (5, 3.0, 3.0, 1.0, 5.0)
    assert s.p10 == pytest.approx(1.4) and s.p90 == pytest.approx(4.6)
    assert s.spread == pytest.approx(3.2)


def test_compare_constant_speedup_no_drift():
    pairs = [Pair(10.0, 2.0, 10.0)] * 7
    c = compare(pairs)
    assert c.pairs == 7 and c.wins == 7
    assert c.speedup_median == c.speedup_p10 == c.speedup_p90 == 5.0
    assert c.drift_pct == 0.0
    assert c.baseline_latency.n == 14 and c.candidate_latency.median == 2.0


def test_compare_drift_and_strict_wins():
    # the baseline slows by 10 % inside every pair; the candidate sits between the two units
    # in the second pair, so only the first pair is a win (strict: beat both baseline units)
    pairs = [Pair(1.0, 0.5, 1.1), Pair(1.0, 1.05, 1.1), Pair(2.0, 1.0, 2.2)]
    c = compare(pairs)
    assert c.wins == 2
    assert c.drift_pct == pytest.approx(100 * (4.4 / 4.0 - 1))
    speedups = sorted([1.05 / 0.5, 1.05 / 1.05, 2.1 / 1.0])
    assert c.speedup_median == pytest.approx(speedups[1])
    assert Pair(1.0, 1.0, 1.0).win is False  # a tie is not a win


def test_compare_slower_candidate():
    c = compare([Pair(1.0, 4.0, 1.0), Pair(1.0, 2.0, 1.0)])
    assert c.wins == 0 and c.speedup_median == pytest.approx(0.375)


def test_compare_needs_pairs_and_handles_zero():
    with pytest.raises(ValueError, match="at least one pair"):
        compare([])
    assert math.isinf(Pair(1.0, 0.0, 1.0).speedup)


def test_run_pairs_order_and_excluded_warmup():
    log = []

    def unit(name, value):
        def run():
            log.append(name)
            return value

        return run

    pairs = run_pairs(unit("B", 3.0), unit("C", 1.0), pairs=2, warmup_units=2)
    assert log == ["B", "C", "B", "C"] + ["B", "C", "B"] * 2
    assert pairs == [Pair(3.0, 1.0, 3.0)] * 2
    with pytest.raises(ValueError, match="pairs must be >= 1"):
        run_pairs(unit("B", 1.0), unit("C", 1.0), pairs=0, warmup_units=0)


def test_run_solo():
    values = iter(range(10))
    assert run_solo(lambda: float(next(values)), samples=3, warmup_units=2) == [2.0, 3.0, 4.0]
