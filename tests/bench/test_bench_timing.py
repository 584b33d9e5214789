"""The timer's host-time and copy-bandwidth measurements on CPU."""

from __future__ import annotations

import torch

from custom_esimd_kernels_vllm.bench import timing


def test_host_seconds_per_call_counts_every_call():
    calls = []
    seconds = timing.host_seconds_per_call(lambda: calls.append(1), 7, 3, torch.device("cpu"))
    assert len(calls) == 1 + 7 * 3  # one untimed first call, then reps x calls
    assert 0 < seconds < 1e-3


def test_host_seconds_interleaved_alternates_the_functions():
    order = []
    seconds = timing.host_seconds_interleaved(
        {"a": lambda: order.append("a"), "b": lambda: order.append("b")}, 2, 3, torch.device("cpu")
    )
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * 3  # first calls, then rep by rep
    assert set(seconds) == {"a", "b"} and all(0 < v < 1e-3 for v in seconds.values())


def test_copy_bandwidth_is_measured_one_way():
    bw = timing.measure_copy_bandwidth(torch.device("cpu"), 1 << 20, reps=3)
    assert bw["bytes_moved"] == 2 * bw["bytes_copied"] == 2 << 20
    assert bw["bandwidth_bytes_per_s"] == bw["bytes_moved"] / bw["median_s"]
    assert bw["method"] == timing.COPY_METHOD and len(bw["samples_s"]) == 3
