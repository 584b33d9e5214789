"""The ops on a partitioned device: streams of a green context that holds fewer SMs than the
device reports.

The library sizes its grids by the device's SM count, so there its cooperative launches (the
selection's distributed select, the decode-size attention) are refused and take their
fallbacks (the last-CTA select, the cluster kernel), and its one-CTA-per-SM grids run in
several waves. Everything must stay exact. (Graphs captured on such a stream are not covered:
NOTES-kernels.md, "The ops on a partitioned device".) The green context is made with the CUDA driver's
own API (ctypes), so the test needs no binding package; it skips, with the reason, where the
driver has no green contexts.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from gpu_helpers import DEVICE, reference_attention, reference_select

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import KV_PAGE, testing

pytestmark = pytest.mark.gpu

CU_DEV_RESOURCE_TYPE_SM = 1
CU_GREEN_CTX_DEFAULT_STREAM = 1
CU_STREAM_NON_BLOCKING = 1
CUDA_ERROR_NOT_SUPPORTED = 801
PARTITIONS = (16, 64)  # SMs asked for (the driver rounds up to its partition granularity)


class _SmResource(ctypes.Structure):
    """CUdevResource of cuda.h (resource ABI version 1: 144 bytes), its SM fields."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("_internal_padding", ctypes.c_ubyte * 92),
        ("sm_count", ctypes.c_uint),
        ("min_partition_size", ctypes.c_uint),
        ("coscheduled_alignment", ctypes.c_uint),
        ("_oversize", ctypes.c_ubyte * 36),
    ]


class _Driver:
    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            pytest.skip(f"no CUDA driver library to make a green context with: {exc}")

    def __call__(self, name: str, *args) -> None:
        fn = getattr(self.lib, name, None)
        if fn is None:
            pytest.skip(f"the CUDA driver has no {name} (green contexts need a 12.4+ driver)")
        rc = fn(*args)
        if rc == CUDA_ERROR_NOT_SUPPORTED:
            pytest.skip(f"{name}: green contexts are not supported on this device")
        assert rc == 0, f"{name} returned CUresult {rc}"


@pytest.fixture(scope="module", params=PARTITIONS, ids=lambda n: f"{n}sms")
def partition(request):
    """(stream of a green context of about ``param`` SMs, its SM count)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.zeros(1, device=DEVICE)  # the primary context exists and is current
    cu = _Driver()
    device = ctypes.c_int()
    cu("cuDeviceGet", ctypes.byref(device), torch.cuda.current_device())
    whole = _SmResource()
    cu("cuDeviceGetDevResource", device, ctypes.byref(whole), CU_DEV_RESOURCE_TYPE_SM)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    assert whole.sm_count == sms, f"CUdevResource layout: read {whole.sm_count} SMs, not {sms}"
    part, rest, groups = _SmResource(), _SmResource(), ctypes.c_uint(1)
    cu(
        "cuDevSmResourceSplitByCount",
        ctypes.byref(part),
        ctypes.byref(groups),
        ctypes.byref(whole),
        ctypes.byref(rest),
        0,
        request.param,
    )
    assert groups.value == 1 and 0 < part.sm_count < sms, (groups.value, part.sm_count)
    desc, ctx, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    cu("cuDevResourceGenerateDesc", ctypes.byref(desc), ctypes.byref(part), 1)
    cu("cuGreenCtxCreate", ctypes.byref(ctx), desc, device, CU_GREEN_CTX_DEFAULT_STREAM)
    cu("cuGreenCtxStreamCreate", ctypes.byref(stream), ctx, CU_STREAM_NON_BLOCKING, 0)
    yield torch.cuda.ExternalStream(stream.value), int(part.sm_count)
    torch.cuda.synchronize()
    cu("cuStreamDestroy_v2", stream)
    cu("cuGreenCtxDestroy", ctx)


def _on(stream, call):
    """call() on ``stream``, ordered after the default stream's work and waited for."""
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        result = call()
    stream.synchronize()
    return result


def _select_cases():
    # one row of 336 pages: on the whole device, every CTA of it selects (the distributed
    # select, a cooperative grid)
    yield testing.random_select_case(
        1, 1, 336, 340, device=DEVICE, seed=23, integer=True, bad_values=False,
        token_to_req=[0], query_positions=[336 * KV_PAGE - 1],
        sequence_lengths=[336 * KV_PAGE], name="distributed row",
    )  # fmt: skip
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
    out = _on(stream, lambda: qsa_ops.select_paged_tokens(*case.args()))
    assert torch.equal(out, want), f"{case!r} differs from the reference on the partition"


@pytest.mark.parametrize("R", [1, 8, 64])
def test_attention_on_partition(cuda_backend, partition, R):
    """R = 1 and 8 take the decode-size kernel on the whole device (cooperative), R = 64 the
    cluster kernel's one-wave variant."""
    stream, _ = partition
    case = testing.random_attention_case(R, 3, 8, 16, device=DEVICE, seed=R, valid_fraction=0.8)
    want = reference_attention(case).double()
    out = _on(stream, lambda: qsa_ops.sparse_paged_attention(*case.args()))
    err = (out.double() - want).norm().item() / want.norm().item()
    assert err < testing.ATTENTION_TOLERANCE, f"{case!r}: relative error {err:.3e}"
