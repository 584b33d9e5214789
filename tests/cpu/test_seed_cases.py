"""The seed's validation cases (contract section 5) at R = 1 and R = 2, through the public
API on CPU tensors (the PyTorch reference kernels), checked by the independent float64 checkers;
plus poisoning, unchanged inputs and agreement with the reference."""

from __future__ import annotations

import pytest
import torch

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import reference, testing

DEVICE = "cpu"


@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("name", testing.SELECT_CASES)
def test_select_seed_case_exact(name, R):
    case = testing.make_select_case(name, R, DEVICE, seed=R)
    before = testing.snapshot(case)
    assert (case.out == testing.POISON_INT32).all()
    result = qsa_ops.select_paged_tokens(*case.args())
    assert result is case.out
    testing.check_selection(case, case.out, exact=True)
    testing.assert_inputs_unchanged(case, before)


@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize(
    "name", [n for n in testing.SELECT_CASES if n not in ("exact_ties", "all_zero_scores")]
)
def test_select_seed_case_random_data(name, R):
    case = testing.make_select_case(name, R, DEVICE, seed=10 + R, integer=False)
    before = testing.snapshot(case)
    qsa_ops.select_paged_tokens(*case.args())
    testing.check_selection(case, case.out, exact=False)
    testing.assert_inputs_unchanged(case, before)


@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("name", testing.ATTENTION_CASES)
def test_attention_seed_case(name, R):
    case = testing.make_attention_case(name, R, DEVICE, seed=R)
    before = testing.snapshot(case)
    assert case.out.isnan().all()
    result = qsa_ops.sparse_paged_attention(*case.args())
    assert result is case.out
    testing.check_attention(case, case.out)
    testing.assert_inputs_unchanged(case, before)


@pytest.mark.parametrize("scale", [None, 0.01, 0.2, 1])
def test_attention_softmax_scale(scale):
    case = testing.make_attention_case("full_width_2051", 2, DEVICE, seed=5)
    case.softmax_scale = scale
    qsa_ops.sparse_paged_attention(*case.args())
    testing.check_attention(case, case.out)


def test_seed_case_details():
    """Spot checks of what the seed cases are meant to exercise."""
    sat = testing.make_select_case("p8192_saturated", 1)
    assert sat.compressed_key_cache.shape[0] == 8192
    qsa_ops.select_paged_tokens(*sat.args())
    assert (sat.out >= 0).all()  # 2303 visible blocks: 512 chosen + 3 tail = full width
    assert sat.out[0, -3:].tolist() == [2303 * 4, 2303 * 4 + 1, 2303 * 4 + 2]

    cross = testing.make_select_case("cross_page_tail", 1)
    qsa_ops.select_paged_tokens(*cross.args())
    row = cross.out[0]
    assert int((row >= 0).sum()) == 519
    assert sorted(row[:516].tolist()) == list(range(516)) and row[516:519].tolist() == [
        516,
        517,
        518,
    ]

    empty = testing.make_select_case("empty", 2)
    qsa_ops.select_paged_tokens(*empty.args())
    assert empty.out[0, :4].tolist() == [0, 1, 2, -1] and (empty.out[1] == -1).all()

    zero = testing.make_select_case("all_zero_scores", 1)
    qsa_ops.select_paged_tokens(*zero.args())
    assert zero.out[0, :2048].tolist() == list(range(2048))  # all ties: lower j first


def test_duplicate_physical_page_tie_order():
    """Logical pages 0 and 1 map to one physical page: blocks j and j + 128 have equal
    scores, so j + 128 is chosen only together with j, and always after it."""
    case = testing.make_select_case("dup_physical_page", 1)
    qsa_ops.select_paged_tokens(*case.args())
    position = {j: k for k, j in enumerate((case.out[0, :2048:4] // 4).tolist())}
    pairs = [j for j in range(128) if j + 128 in position]
    assert pairs, "the case must choose both blocks of some pair"
    for j in pairs:
        assert j in position and position[j] < position[j + 128]


@pytest.mark.parametrize("name", testing.SELECT_CASES)
def test_public_select_equals_reference(name):
    case = testing.make_select_case(name, 2, integer=False, seed=3)
    qsa_ops.select_paged_tokens(*case.args())
    ref = case.new_out()
    reference.select_paged_tokens_ref(*case.ref_args()[:-1], ref)
    assert torch.equal(case.out, ref)


@pytest.mark.parametrize("name", testing.ATTENTION_CASES)
def test_public_attention_equals_reference(name):
    case = testing.make_attention_case(name, 2, seed=3)
    qsa_ops.sparse_paged_attention(*case.args())
    ref = case.new_out()
    reference.sparse_paged_attention_ref(*case.ref_args()[:-2], ref, case.softmax_scale)
    assert torch.equal(case.out, ref)


@pytest.mark.parametrize("context, rows", [(8192, 3), (32768, 2), (131072, 1)])
def test_scale_cases(context, rows):
    sel = testing.scale_select_case(context, rows, seed=1, requests=2)
    qsa_ops.select_paged_tokens(*sel.args())
    testing.check_selection(sel, sel.out, exact=False)
    assert (sel.out[:, :2048] >= 0).all()  # >= 2048 visible blocks: 512 chosen
    att = testing.scale_attention_case(context, rows, seed=1)
    qsa_ops.sparse_paged_attention(*att.args())
    testing.check_attention(att, att.out)
