"""The row-by-row baseline agrees with the reference (it is measured, so it must be right)."""

from __future__ import annotations

import pytest
import torch

from custom_esimd_kernels_vllm.bench.impls import (
    select_paged_tokens_rowwise,
    sparse_paged_attention_rowwise,
)
from custom_esimd_kernels_vllm.qsa_ops import reference, testing


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("integer", [True, False])
def test_selection_rowwise_equals_reference(seed, integer):
    case = testing.random_select_case(R=5, B=3, M=4, P=6, seed=seed, integer=integer)
    args = case.ref_args()[:-1]
    ref = reference.select_paged_tokens_ref(*args, torch.empty_like(case.out))
    got = select_paged_tokens_rowwise(*args, torch.full_like(case.out, -7))
    if integer:  # exact in any summation order, ties included
        assert torch.equal(got, ref)
    else:
        testing.check_selection(case, got, exact=False)


@pytest.mark.parametrize(
    "name", ["p8192_saturated", "dup_physical_page", "exact_ties", "multi_request"]
)
def test_selection_rowwise_seed_cases(name):
    case = testing.make_select_case(name, 2)
    args = case.ref_args()[:-1]
    ref = reference.select_paged_tokens_ref(*args, torch.empty_like(case.out))
    assert torch.equal(select_paged_tokens_rowwise(*args, torch.full_like(case.out, -7)), ref)


@pytest.mark.parametrize("seed", range(4))
def test_attention_rowwise_matches_reference(seed):
    case = testing.random_attention_case(R=4, B=2, M=3, P=5, seed=seed)
    args = case.ref_args()[:-2]
    got = sparse_paged_attention_rowwise(*args, torch.full_like(case.out, float("nan")))
    testing.check_attention(case, got)
