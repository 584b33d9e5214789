"""The checkers catch what they must (a checker that passes everything proves nothing), and
the case builders build what the contract describes."""

from __future__ import annotations

import pytest
import torch

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import contract, testing


@pytest.fixture(scope="module")
def selected():
    case = testing.make_select_case("cross_page_tail", 2)
    qsa_ops.select_paged_tokens(*case.args())
    testing.check_selection(case, case.out)
    return case


def _mutated(case, edit):
    out = case.out.clone()
    edit(out)
    return out


def _swap_blocks(out):
    a, b = out[0, 0:4].clone(), out[0, 4:8].clone()
    out[0, 0:4], out[0, 4:8] = b, a


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda o: o.__setitem__((0, 5), -7), "expected token"),
        (lambda o: o.__setitem__((1, 2050), testing.POISON_INT32), "expected -1 padding"),
        (lambda o: o.__setitem__((0, 516), 999), "expected tail token 516"),
        (lambda o: o[0, 4:8].copy_(o[0, 0:4]), "chosen twice"),
        (
            lambda o: o[0, 0:4].copy_(torch.tensor([600, 601, 602, 603])),
            "not a usable visible block",
        ),
        (lambda o: o.__setitem__((0, 0), 1), "first token of a block"),
        (_swap_blocks, "expected block"),
    ],
)
def test_check_selection_catches(selected, edit, message):
    with pytest.raises(AssertionError, match=message) as info:
        testing.check_selection(selected, _mutated(selected, edit), exact=True)
    assert "cross_page_tail" in str(info.value) and "row" in str(info.value)


def test_check_selection_tolerance_mode():
    case = testing.make_select_case("cross_page_tail", 1, integer=False, seed=4)
    qsa_ops.select_paged_tokens(*case.args())
    testing.check_selection(case, case.out, exact=False)
    kb = 129  # 129 usable blocks < 512: all chosen
    assert (case.out[0, : 4 * kb] >= 0).all() and case.out[0, 4 * kb + 3] == -1
    # descending order within tolerance: reverse the chosen blocks
    rev = case.out.clone()
    rev[0, : 4 * kb] = rev[0, : 4 * kb].view(kb, 4).flip(0).reshape(-1)
    with pytest.raises(AssertionError, match="order not descending"):
        testing.check_selection(case, rev, exact=False)


def test_check_selection_not_top_k():
    case = testing.make_select_case("p8192_saturated", 1, integer=False, seed=2)
    qsa_ops.select_paged_tokens(*case.args())
    usable, scores, *_ = testing.expected_selection_row(case, 0)
    chosen = (case.out[0, :2048:4] // 4).tolist()
    worst = min((j for j in usable if j not in set(chosen)), key=lambda j: scores[usable.index(j)])
    bad = case.out.clone()
    bad[0, 2044:2048] = torch.arange(4 * worst, 4 * worst + 4)
    with pytest.raises(AssertionError, match="not a top-512"):
        testing.check_selection(case, bad, exact=False)


def test_check_attention_catches():
    case = testing.make_attention_case("holes_dups_cross_page", 2)
    qsa_ops.sparse_paged_attention(*case.args())
    testing.check_attention(case, case.out)
    nan = case.out.clone()
    nan[1, 2, 3] = float("nan")
    with pytest.raises(AssertionError, match=r"non-finite outputs .* first at \[1, 2, 3\]"):
        testing.check_attention(case, nan)
    off = case.out.clone()
    off[0] *= 1.01
    with pytest.raises(AssertionError, match="relative error .* worst at"):
        testing.check_attention(case, off)


def test_check_attention_empty_rows_must_be_zero():
    case = testing.make_attention_case("empty", 1)
    out = torch.zeros_like(case.out)
    testing.check_attention(case, out)
    out[0, 0, 0] = 1e-4
    with pytest.raises(AssertionError, match="no valid entry and must be zero"):
        testing.check_attention(case, out)


def test_poison():
    assert testing.poison_(torch.zeros(3, dtype=torch.float16)).isnan().all()
    assert (testing.poison_(torch.zeros(3, dtype=torch.int32)) == testing.POISON_INT32).all()


@pytest.mark.parametrize("lead", [0, 7])
def test_packed_kv_layout(lead):
    buffer, k, v = testing.packed_kv(3, "cpu", lead=lead)
    assert k.stride() == v.stride() == contract.KV_STRIDES
    assert (k.storage_offset(), v.storage_offset()) == (lead, lead + 256)
    assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    kv = buffer[lead:].view(3, contract.KV_PAGE, contract.PACKED_TOKEN_STRIDE)
    k2, v2 = contract.kv_views(kv)
    assert (k2.stride(), v2.stride()) == (contract.KV_STRIDES, contract.KV_STRIDES)
    assert (k2.storage_offset(), v2.storage_offset()) == (lead, lead + 256)
    # token t of page p: K = buffer[lead + p*262144 + t*512 : +256], V the next 256
    buffer.copy_(torch.arange(buffer.numel()) % 2048)
    assert torch.equal(k[1, 5, 0], buffer[lead + 262144 + 5 * 512 :][:256])
    assert torch.equal(v[1, 5, 0], buffer[lead + 262144 + 5 * 512 + 256 :][:256])


def test_cases_are_reproducible():
    a = testing.random_select_case(3, 2, 2, 3, seed=5)
    b = testing.random_select_case(3, 2, 2, 3, seed=5)
    for name, t in a.inputs().items():
        assert torch.equal(t, b.inputs()[name])
    with pytest.raises(KeyError, match="unknown selection case"):
        testing.make_select_case("nope", 1)
    with pytest.raises(KeyError, match="unknown attention case"):
        testing.make_attention_case("nope", 1)
