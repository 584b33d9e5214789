"""Property-based tests over random R, B, M, P, page tables with holes and duplicates,
positions and lengths (including bad values), checked by the independent float64 checkers.

Budgets scale with the hypothesis profile (tests/conftest.py): about 1,100 examples in the
default ``ci`` profile.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import contract, reference, testing

INT32 = (-(2**31), 2**31 - 1)
EXAMPLES = settings.default.max_examples  # 100 in the ci profile


def _budget(weight: float) -> settings:
    return settings(max_examples=max(1, int(weight * EXAMPLES)))


@st.composite
def select_params(draw, max_rows=5, max_pages=3):
    R = draw(st.integers(0, max_rows))
    B = draw(st.integers(0, 3))
    M = draw(st.integers(0, max_pages))
    P = draw(st.integers(0, 5))
    page_entry = st.one_of(
        st.integers(-1, P), st.integers(0, max(P - 1, 0)), st.sampled_from(INT32)
    )
    page_table = draw(
        st.lists(st.lists(page_entry, min_size=M, max_size=M), min_size=B, max_size=B)
    )
    lengths = draw(
        st.lists(
            st.one_of(st.integers(-4, M * contract.KV_PAGE + 9), st.sampled_from(INT32)),
            min_size=B,
            max_size=B,
        )
    )
    rows_req = draw(
        st.lists(
            st.one_of(st.integers(0, max(B - 1, 0)), st.sampled_from([-1, B, *INT32])),
            min_size=R,
            max_size=R,
        )
    )
    positions = draw(
        st.lists(
            st.one_of(
                st.integers(-5, M * contract.KV_PAGE + 20), st.sampled_from([-(2**63), 2**63 - 1])
            ),
            min_size=R,
            max_size=R,
        )
    )
    seed = draw(st.integers(0, 2**16))
    return dict(
        R=R,
        B=B,
        M=M,
        P=P,
        seed=seed,
        page_table=page_table if B else torch.zeros(0, M, dtype=torch.int32),
        token_to_req=rows_req,
        query_positions=positions,
        sequence_lengths=lengths,
    )


def _run_select(case: testing.SelectCase):
    before = testing.snapshot(case)
    out = qsa_ops.select_paged_tokens(*case.args())
    testing.assert_inputs_unchanged(case, before)
    return out


@_budget(4.0)
@given(select_params())
def test_select_exact_on_small_integers(params):
    """Values in {-2..2}: every float32 sum is exact, so the output is exactly determined,
    including the tie order (mass ties: many equal and many zero scores)."""
    case = testing.random_select_case(integer=True, **params)
    testing.check_selection(case, _run_select(case), exact=True)


@_budget(2.0)
@given(select_params())
def test_select_valid_top_k_on_random_data(params):
    case = testing.random_select_case(integer=False, **params)
    testing.check_selection(case, _run_select(case), exact=False)


@_budget(1.0)
@given(select_params(max_rows=3, max_pages=2), st.integers(0, 4))
def test_select_row_independent(params, row):
    """A row's output does not depend on the other rows of the batch."""
    case = testing.random_select_case(integer=True, **params)
    _run_select(case)
    R = case.q.shape[0]
    if R == 0:
        return
    r = row % R
    one = torch.empty_like(case.out[r : r + 1])
    reference.select_paged_tokens_ref(
        case.q[r : r + 1], case.compressed_key_cache, case.page_table, case.token_to_req[r : r + 1],
        case.query_positions[r : r + 1], case.sequence_lengths, one,
    )  # fmt: skip
    assert torch.equal(one, case.out[r : r + 1])


@st.composite
def attention_params(draw):
    R = draw(st.integers(0, 4))
    B = draw(st.integers(0, 3))
    M = draw(st.integers(0, 4))
    P = draw(st.integers(0, 4))
    page_entry = st.one_of(
        st.integers(-1, P), st.integers(0, max(P - 1, 0)), st.sampled_from(INT32)
    )
    page_table = draw(
        st.lists(st.lists(page_entry, min_size=M, max_size=M), min_size=B, max_size=B)
    )
    rows_req = draw(
        st.lists(
            st.one_of(st.integers(0, max(B - 1, 0)), st.sampled_from([-1, B])),
            min_size=R,
            max_size=R,
        )
    )
    return dict(
        R=R,
        B=B,
        M=M,
        P=P,
        seed=draw(st.integers(0, 2**16)),
        valid_fraction=draw(st.sampled_from([0.0, 0.01, 0.3, 0.9, 1.0])),
        bad_values=draw(st.booleans()),
        softmax_scale=draw(st.sampled_from([None, 0.02, 0.125, 1])),
        lead=draw(st.sampled_from([0, 8, 1000])),
        page_table=page_table if B else torch.zeros(0, M, dtype=torch.int32),
        token_to_req=rows_req,
    )


@_budget(2.5)
@given(attention_params())
def test_attention_matches_float64(params):
    case = testing.random_attention_case(**params)
    before = testing.snapshot(case)
    out = qsa_ops.sparse_paged_attention(*case.args())
    testing.check_attention(case, out)
    testing.assert_inputs_unchanged(case, before)


@_budget(1.5)
@given(
    st.sampled_from(["select", "attention"]),
    st.sampled_from(["dtype", "shape", "contiguity", "rows", "overlap"]),
    st.integers(0, 6),
    st.integers(1, 3),
)
def test_refusals_never_write(op, kind, which, R):
    """Whatever argument is broken, and however, the call raises and writes nothing."""
    if op == "select":
        case = testing.make_select_case("multi_request", R)
        args = list(case.args())
        slots = [0, 1, 2, 3, 4, 5, 8]
        fn = qsa_ops.select_paged_tokens
    else:
        case = testing.make_attention_case("holes_dups_cross_page", R)
        args = list(case.args())
        slots = [0, 3, 4, 5, 7]
        fn = qsa_ops.sparse_paged_attention
    i = slots[which % len(slots)]
    t = args[i]
    if kind == "dtype":
        args[i] = t.to(torch.float64)
    elif kind == "shape":
        args[i] = t.reshape(-1)[: max(t.numel() - 1, 0)] if t.dim() > 1 else t.unsqueeze(0)
    elif kind == "contiguity":
        args[i] = torch.stack([t, t], dim=-1)[..., 0] if t.numel() > 1 else t.expand(2)
    elif kind == "rows":  # one more row than the tensors it must agree with
        if (op, i) in (("select", 1), ("attention", 4)):
            i += 1  # P pages (selection) and B (attention) are free: nothing else is sized by them
        args[i] = torch.cat([args[i], args[i][:1]])
    else:  # an input passed as `out` as well
        out_slot = 8 if op == "select" else 7
        args[out_slot] = args[0] if i == out_slot else t
    out = case.out
    before = out.detach().clone()
    try:
        fn(*args)
    except (TypeError, ValueError):
        pass
    else:
        raise AssertionError(f"{op}: broken argument {i} ({kind}) was accepted")
    assert torch.equal(out.view(torch.uint8), before.view(torch.uint8)), (
        "a refused call wrote into out"
    )
