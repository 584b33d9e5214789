"""The ops on a partitioned device: streams of a green context that holds fewer SMs than the
device reports.

The library sizes its grids by the SMs of the stream's green context (its cooperative launches,
the selection's distributed select and the decode-size attention, only where their grid is
resident there; else their fallbacks, the last-CTA select and the cluster kernel). Everything
must stay exact, eager and in CUDA graphs captured on such a stream (the graph check runs in a
child process: a replay that waits for CTAs that never start would not finish). The green
context is made with the CUDA driver's own API, and for the graph check also with torch's
(tests/gpu/green_ctx.py); the tests skip, with the reason, where there is none.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpu_helpers import DEVICE, distributed_row_case, reference_attention, reference_select
from green_ctx import Unsupported, green_stream, on_stream

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import testing

pytestmark = pytest.mark.gpu

PARTITIONS = (16, 64)  # SMs asked for (the driver rounds up to its partition granularity)
GRAPH_CHECK = Path(__file__).with_name("green_ctx.py")
GRAPH_CHECK_TIMEOUT_S = 240


@pytest.fixture(scope="module", params=PARTITIONS, ids=lambda n: f"{n}sms")
def partition(request):
    """(stream of a green context of about ``param`` SMs, its SM count)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    try:
        with green_stream(request.param, DEVICE) as made:
            yield made
    except Unsupported as exc:
        pytest.skip(str(exc))


def _select_cases():
    yield distributed_row_case()
    yield testing.random_select_case(
        64, 3, 64, 96, device=DEVICE, seed=24, integer=True, name="rows of 2 CTAs"
    )
    yield testing.make_select_case("p8192_saturated", 1, DEVICE, seed=6)
    yield testing.random_select_case(140, 3, 7, 11, device=DEVICE, seed=20, integer=True)


@pytest.mark.parametrize("index", range(4))
def test_select_on_partition_exact(cuda_backend, partition, index):
    stream, _ = partition
    case = list(_select_cases())[index]
    want = reference_select(case)
    out = on_stream(stream, lambda: qsa_ops.select_paged_tokens(*case.args()))
    assert torch.equal(out, want), f"{case!r} differs from the reference on the partition"


@pytest.mark.parametrize("R", [1, 8, 64])
def test_attention_on_partition(cuda_backend, partition, R):
    """R = 1 and 8 take the decode-size kernel (cooperative) where its grid is resident on the
    partition, else the cluster kernel; R = 64 the cluster kernel."""
    stream, _ = partition
    case = testing.random_attention_case(R, 3, 8, 16, device=DEVICE, seed=R, valid_fraction=0.8)
    want = reference_attention(case).double()
    out = on_stream(stream, lambda: qsa_ops.sparse_paged_attention(*case.args()))
    err = (out.double() - want).norm().item() / want.norm().item()
    assert err < testing.ATTENTION_TOLERANCE, f"{case!r}: relative error {err:.3e}"


@pytest.mark.parametrize("api", ["driver", "torch"])
@pytest.mark.parametrize("sms", PARTITIONS)
def test_graph_on_partition(cuda_backend, sms, api):
    """Both ops (the distributed row, P8192, attention R = 1 and 8) captured into one graph
    on the partition's stream: 20 replays from poisoned outputs, each equal to the eager
    result there (tests/gpu/green_ctx.py, in a child process with a deadline per replay); the
    green context made by the driver's API or by torch's ``torch.cuda.GreenContext``."""
    try:
        run = subprocess.run(
            [sys.executable, str(GRAPH_CHECK), "--sms", str(sms), "--api", api],
            capture_output=True, text=True, timeout=GRAPH_CHECK_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"the graph check on {sms} SMs did not finish in {GRAPH_CHECK_TIMEOUT_S} s")
    lines = run.stdout.strip().splitlines()
    assert lines, f"the graph check printed nothing (rc {run.returncode}): {run.stderr[-2000:]}"
    result = json.loads(lines[-1])
    if "skipped" in result:
        pytest.skip(result["skipped"])
    assert run.returncode == 0 and result["ok"], f"{result} (rc {run.returncode})"
