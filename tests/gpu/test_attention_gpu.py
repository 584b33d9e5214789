"""sparse_paged_attention on the CUDA kernels against the float64 checker and the reference."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import DEVICE, assert_fully_written, reference_attention, row_subset

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import ops, testing

pytestmark = pytest.mark.gpu


def run_cuda(case: testing.AttentionCase) -> torch.Tensor:
    before = testing.snapshot(case)
    assert case.out.isnan().all()
    result = qsa_ops.sparse_paged_attention(*case.args())
    assert result is case.out
    assert_fully_written(case.out, repr(case))
    testing.assert_inputs_unchanged(case, before)
    return case.out


def check_rows(case: testing.AttentionCase, out: torch.Tensor, limit: int = 16) -> float:
    rows = case.q.shape[0]
    picked = sorted({int(i) for i in torch.linspace(0, rows - 1, min(rows, limit)).round()})
    sub = row_subset(case, picked)
    return testing.check_attention(sub, out.index_select(0, torch.as_tensor(picked, device=DEVICE)))


def assert_close_reference(case: testing.AttentionCase, out: torch.Tensor) -> None:
    want = reference_attention(case).double()
    norm = want.norm().item()
    err = (out.double() - want).norm().item() / norm if norm else out.double().norm().item()
    assert err < testing.ATTENTION_TOLERANCE, f"{case!r}: relative error {err:.3e} vs the reference"


@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("name", testing.ATTENTION_CASES)
def test_seed_case(cuda_backend, name, R):
    case = testing.make_attention_case(name, R, DEVICE, seed=R)
    out = run_cuda(case)
    testing.check_attention(case, out)
    assert_close_reference(case, out)


@pytest.mark.parametrize("R", [1, 2, 3, 4, 8, 9])
@pytest.mark.parametrize("lead", [0, 8])
def test_decode_paths(cuda_backend, R, lead):
    """The decode-size kernel (65 CTAs per row up to 2 rows, 33 up to 8, when the grid fits
    at once; R = 9 is the cluster kernel) on every seed pattern at once: holes, duplicates,
    a short row, an empty row, a row of an invalid request; lead=8: K/V at a non-zero storage
    offset (16 bytes: contract v2's caches are 16-byte aligned)."""
    names = ["full_width_2051", "duplicates", "valid_width_32", "empty", "holes"]
    case = testing.random_attention_case(R, 3, 8, 12, device=DEVICE, seed=40 + R, lead=lead)
    for i in range(R):  # rows of each kind
        kind = names[i % len(names)]
        row = case.logical_indices[i]
        if kind == "duplicates":
            row[1::2] = row[0::2][: row[1::2].numel()]
        elif kind == "valid_width_32":
            row[32:] = -1
        elif kind == "empty":
            row[:] = -1
        elif kind == "holes":
            row[::3] = -1
    if R > 1:
        case.token_to_req[R - 1] = -1  # an invalid request: a zero row
    if torch.cuda.get_device_properties(DEVICE).multi_processor_count >= 132:
        want = 65 if R <= 2 else 33 if R <= 8 else None
        if want is not None:
            assert ops.attention_splits(R) == want
    out = run_cuda(case)
    check_rows(case, out)
    assert_close_reference(case, out)


@pytest.mark.parametrize("scale", [None, 0.01, 0.2, 1.0])
def test_softmax_scale(cuda_backend, scale):
    case = testing.make_attention_case("full_width_2051", 2, DEVICE, seed=5)
    case.softmax_scale = scale
    out = run_cuda(case)
    testing.check_attention(case, out)


@pytest.mark.parametrize("R", [1, 3, 17, 64, 263, 600])
@pytest.mark.parametrize("lead", [0, 8])
def test_random_bad_values(cuda_backend, R, lead):
    """Holes, negatives, entries past the page table, page ids -1 / P, invalid requests;
    lead=8 puts K/V at a non-zero (16-byte) storage offset."""
    case = testing.random_attention_case(R, 4, 6, 9, device=DEVICE, seed=R + lead, lead=lead)
    out = run_cuda(case)
    check_rows(case, out)
    assert_close_reference(case, out)


@pytest.mark.parametrize("splits", [1, 2, 7, 32])
@pytest.mark.parametrize("R", [1, 5])
def test_forced_splits(cuda_backend, monkeypatch, splits, R):
    """Every split count merges to the same function (the heuristic picks one of these)."""
    monkeypatch.setenv(ops.SPLITS_ENV, str(splits))
    case = testing.random_attention_case(
        R, 2, 8, 12, device=DEVICE, seed=splits, valid_fraction=0.9
    )
    out = run_cuda(case)
    testing.check_attention(case, out)


@pytest.mark.parametrize("value", ["many", "-2", "3x"])
def test_split_knob_refuses_malformed_values(cuda_backend, monkeypatch, value):
    """The library parses QSA_ATTN_SPLITS once for the op and for ops.attention_splits."""
    monkeypatch.setenv(ops.SPLITS_ENV, value)
    message = f"QSA_ATTN_SPLITS must be a non-negative integer, got '{value}'"
    with pytest.raises(ValueError, match=message):
        ops.attention_splits(4)
    case = testing.make_attention_case("full_width_2051", 2, DEVICE, seed=6)
    with pytest.raises(RuntimeError, match=message):
        qsa_ops.sparse_paged_attention(*case.args())
    assert case.out.isnan().all()


def test_scale_rows_256(cuda_backend):
    case = testing.scale_attention_case(65536, 256, DEVICE, seed=4)
    out = run_cuda(case)
    check_rows(case, out, limit=8)
    assert_close_reference(case, out)


def test_zero_rows(cuda_backend):
    case = testing.random_attention_case(0, 2, 4, 4, device=DEVICE, seed=1)
    out = qsa_ops.sparse_paged_attention(*case.args())
    assert out.shape == (0, 3, 256)


def test_deterministic(cuda_backend):
    case = testing.make_attention_case("full_width_2051", 1, DEVICE, seed=9)
    first = run_cuda(case).clone()
    for _ in range(5):
        testing.poison_(case.out)
        qsa_ops.sparse_paged_attention(*case.args())
        assert torch.equal(case.out, first)


def test_decode_counters_across_calls(cuda_backend, monkeypatch):
    """The decode-size kernel's row counters are never reset (each call adds one epoch): calls
    of 65 splits (R = 1, 2), 33 (R = 8) and the cluster kernel's (R = 9, and 16 forced splits:
    counters of its own) interleaved on one stream give each call's first result bit for bit,
    many times over."""
    runs = [(1, None), (8, None), (2, None), (9, None), (9, "16")]

    def call(i: int, case: testing.AttentionCase) -> torch.Tensor:
        splits = runs[i][1]
        if splits is None:
            monkeypatch.delenv(ops.SPLITS_ENV, raising=False)
        else:
            monkeypatch.setenv(ops.SPLITS_ENV, splits)
        testing.poison_(case.out)
        return qsa_ops.sparse_paged_attention(*case.args())

    cases = [
        testing.random_attention_case(R, 3, 8, 12, device=DEVICE, seed=70 + i, valid_fraction=0.8)
        for i, (R, _) in enumerate(runs)
    ]
    firsts = [call(i, case).clone() for i, case in enumerate(cases)]
    for case, first in zip(cases, firsts, strict=True):
        testing.check_attention(case, first)
    for round_ in range(40):
        for i, case in enumerate(cases):
            assert torch.equal(call(i, case), firsts[i]), f"round {round_}, {case!r}"


def test_refusals_on_cuda(cuda_backend):
    case = testing.make_attention_case("valid_width_32", 1, DEVICE)
    args = list(case.args())
    args[1] = case.k_cache[..., :128]  # (a contiguous copy is valid since contract v2)
    with pytest.raises(ValueError, match="k_cache"):
        qsa_ops.sparse_paged_attention(*args)
    args = list(case.args())
    args[6] = 256
    with pytest.raises(ValueError, match="page_size"):
        qsa_ops.sparse_paged_attention(*args)
    assert case.out.isnan().all()
