"""Every case builder of qsa_ops.testing accepts R = 0 rows, as the operators do: the case
builds, its output is empty, and the public API on CPU tensors runs it and the checkers
accept the (empty) result."""

from __future__ import annotations

import pytest

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import testing


@pytest.mark.parametrize("name", testing.SELECT_CASES)
def test_select_case_without_rows(name):
    case = testing.make_select_case(name, 0)
    assert tuple(case.out.shape) == (0, testing.WIDTH)
    assert case.sequence_lengths.numel() >= 1
    assert qsa_ops.select_paged_tokens(*case.args()) is case.out
    testing.check_selection(case, case.out, exact=True)


@pytest.mark.parametrize("name", testing.ATTENTION_CASES)
def test_attention_case_without_rows(name):
    case = testing.make_attention_case(name, 0)
    assert case.out.shape[0] == 0
    assert qsa_ops.sparse_paged_attention(*case.args()) is case.out
    testing.check_attention(case, case.out)


def test_random_and_scale_cases_without_rows():
    cases = [
        testing.random_select_case(0, 2, 3, 4),
        testing.scale_select_case(1024, 0),
    ]
    for case in cases:
        qsa_ops.select_paged_tokens(*case.args())
        testing.check_selection(case, case.out, exact=False)
    for case in [testing.random_attention_case(0, 2, 3, 4), testing.scale_attention_case(1024, 0)]:
        qsa_ops.sparse_paged_attention(*case.args())
        testing.check_attention(case, case.out)
