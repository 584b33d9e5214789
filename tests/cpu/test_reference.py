"""The reference as the executable spec: bad values, degenerate sizes, duplicates, row
independence, and the absence of host synchronisation."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import contract, reference, testing

INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1


def _select(case):
    qsa_ops.select_paged_tokens(*case.args())
    testing.check_selection(case, case.out)
    return case.out


def _attend(case):
    qsa_ops.sparse_paged_attention(*case.args())
    testing.check_attention(case, case.out)
    return case.out


# ----------------------------------------------------------------------------------------
# selection: bad values and degenerate sizes
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "R, B, M, P",
    [(0, 1, 1, 1), (3, 0, 2, 2), (3, 2, 0, 2), (3, 2, 2, 0), (0, 0, 0, 0)],
)
def test_select_degenerate_sizes(R, B, M, P):
    case = testing.random_select_case(R, B, M, P, seed=7, integer=True)
    out = _select(case)
    assert out.shape == (R, contract.WIDTH)


def test_select_bad_values():
    case = testing.random_select_case(
        7,
        2,
        3,
        4,
        seed=3,
        integer=True,
        page_table=[[-1, 4, 2], [INT32_MAX, -(2**31), 3]],
        token_to_req=[-1, 2, INT32_MAX, 0, 1, 0, 1],
        query_positions=[10, 10, 10, INT64_MAX, -(2**63), 4 * 300 + 2, -1],
        sequence_lengths=[1200, -5],
    )
    out = _select(case)
    assert (out[:3] == -1).all()  # invalid requests
    assert (out[4] == -1).all()  # n = 0
    assert (out[6] == -1).all()  # negative length
    # row 3: n = 1200 visible tokens (position INT64_MAX, clamped to the length); only
    # logical page 2 (blocks 256..299) is usable
    blocks = out[3, : 4 * 44 : 4] // 4
    assert sorted(blocks.tolist()) == list(range(256, 300))
    assert (out[3, 4 * 44 :] == -1).all()


def test_select_tail_without_usable_pages():
    """Tail tokens are listed even when no block is usable (they are never read)."""
    case = testing.random_select_case(
        1,
        1,
        1,
        1,
        seed=1,
        page_table=[[-1]],
        token_to_req=[0],
        query_positions=[6],
        sequence_lengths=[7],
    )
    out = _select(case)
    assert out[0, :4].tolist() == [4, 5, 6, -1]


def test_select_positions_past_the_page_table():
    """Blocks whose logical page >= M are never chosen; the tail still follows 4 * nb."""
    case = testing.random_select_case(
        1, 1, 1, 2, seed=2, integer=True, page_table=[[1]], token_to_req=[0],
        query_positions=[4 * 200 + 1], sequence_lengths=[10_000],
    )  # fmt: skip
    out = _select(case)
    assert sorted((out[0, : 4 * 128 : 4] // 4).tolist()) == list(range(128))
    assert out[0, 512:514].tolist() == [800, 801] and (out[0, 514:] == -1).all()


# The reference works through its rows in chunks whose temporaries are allocated once per
# call: the whole call in one chunk (None), or chunks of 4 rows with a shorter last one.
ROWS_PER_CHUNK = (None, 4)


def _rows_per_chunk(monkeypatch, step: int | None) -> None:
    if step is not None:
        monkeypatch.setattr(
            reference,
            "_row_chunks",
            lambda rows, _: [slice(s, min(rows, s + step)) for s in range(0, rows, step)],
        )


@pytest.mark.parametrize("rows_per_chunk", ROWS_PER_CHUNK)
def test_select_rows_are_independent(rows_per_chunk, monkeypatch):
    case = testing.random_select_case(6, 3, 3, 5, seed=11)
    _rows_per_chunk(monkeypatch, rows_per_chunk)
    batch = _select(case).clone()
    for r in range(6):
        one = testing.random_select_case(6, 3, 3, 5, seed=11)
        args = list(one.ref_args())
        rows = slice(r, r + 1)
        args = [
            args[0][rows],
            args[1],
            args[2],
            args[3][rows],
            args[4][rows],
            args[5],
            one.out[rows],
        ]
        reference.select_paged_tokens_ref(*args)
        assert torch.equal(one.out[rows], batch[rows]), f"row {r} depends on other rows"


def test_select_tie_rule_on_equal_scores():
    """Constant keys: every block scores the same; the lowest 512 j win, ascending."""
    case = testing.random_select_case(
        1, 1, 6, 6, seed=0, integer=True, page_table=[[5, 4, 3, 2, 1, 0]], token_to_req=[0],
        query_positions=[6 * 512 - 1], sequence_lengths=[6 * 512],
    )  # fmt: skip
    case.compressed_key_cache.fill_(1)
    case.q.fill_(1)
    out = _select(case)
    assert out[0, :2048].tolist() == list(range(2048)) and (out[0, 2048:] == -1).all()


def test_select_negative_zero_ties_with_zero():
    """q = -0.0: blocks with positive keys score -0.0, blocks with negative keys +0.0; all
    are equal scores, so the order is j ascending."""
    case = testing.random_select_case(
        1, 1, 1, 1, seed=0, integer=True, page_table=[[0]], token_to_req=[0],
        query_positions=[4 * 6 - 1], sequence_lengths=[100],
    )  # fmt: skip
    case.q.fill_(-0.0)
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0], dtype=torch.float16)
    case.compressed_key_cache[0, :6, 0, :] = signs[:, None]
    scores = reference.block_scores(case.q, case.compressed_key_cache[0, :6, 0][None])
    assert (scores == 0).all() and not torch.signbit(scores).any()
    out = _select(case)
    assert out[0, :24].tolist() == list(range(24))


# ----------------------------------------------------------------------------------------
# attention: bad values, duplicates, degenerate sizes
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("R, B, M, P", [(0, 1, 1, 1), (2, 0, 1, 1), (2, 1, 0, 1), (2, 1, 1, 0)])
def test_attention_degenerate_sizes(R, B, M, P):
    case = testing.random_attention_case(R, B, M, P, seed=3)
    out = _attend(case)
    assert (out == 0).all()


def test_attention_invalid_rows_are_zero():
    case = testing.random_attention_case(3, 2, 2, 3, seed=5, token_to_req=[-1, 2, INT32_MAX])
    assert (_attend(case) == 0).all()


def test_attention_duplicates_count_per_occurrence():
    case = testing.random_attention_case(1, 1, 1, 1, seed=6, page_table=[[0]], token_to_req=[0])
    case.logical_indices.fill_(-1)
    case.logical_indices[0, [3, 100, 2050]] = torch.tensor([7, 7, 9], dtype=torch.int32)
    out = _attend(case).double()
    q = case.q[0].double()
    k7, k9 = case.k_cache[0, 7, 0].double(), case.k_cache[0, 9, 0].double()
    v7, v9 = case.v_cache[0, 7, 0].double(), case.v_cache[0, 9, 0].double()
    for h in range(3):
        s7, s9 = (q[h] @ k7) / 16, (q[h] @ k9) / 16
        w7, w9 = 2 * math.exp(s7), math.exp(s9)
        want = (w7 * v7 + w9 * v9) / (w7 + w9)
        assert torch.allclose(out[0, h], want, atol=2e-3, rtol=2e-3)


def test_attention_hole_positions_do_not_matter():
    case = testing.random_attention_case(2, 2, 3, 4, seed=8, bad_values=True)
    first = _attend(case).clone()
    perm = torch.randperm(contract.WIDTH, generator=torch.Generator().manual_seed(0))
    case.logical_indices.copy_(case.logical_indices[:, perm].clone())
    case.out.fill_(float("nan"))
    second = _attend(case)
    torch.testing.assert_close(second, first, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("rows_per_chunk", ROWS_PER_CHUNK)
def test_attention_rows_are_independent(rows_per_chunk, monkeypatch):
    case = testing.random_attention_case(5, 3, 2, 4, seed=9)
    _rows_per_chunk(monkeypatch, rows_per_chunk)
    batch = _attend(case).clone()
    for r in range(5):
        out = torch.empty_like(case.out[r : r + 1])
        reference.sparse_paged_attention_ref(
            case.q[r : r + 1], case.k_cache, case.v_cache, case.logical_indices[r : r + 1],
            case.page_table, case.token_to_req[r : r + 1], out,
        )  # fmt: skip
        assert torch.equal(out, batch[r : r + 1]), f"row {r} depends on other rows"


# ----------------------------------------------------------------------------------------
# no host synchronisation
# ----------------------------------------------------------------------------------------

# aten ops that read device values on the host or produce data-dependent shapes
_SYNCING_OPS = {
    "_local_scalar_dense",
    "item",
    "nonzero",
    "nonzero_static",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "equal",
    "is_nonzero",
    "repeat_interleave",  # the Tensor-repeats overload syncs; the int overload is fine
    "lift_fresh",  # torch.tensor(...) literal: a host-to-device copy on CUDA
    "lift_fresh_copy",
}


class _RecordSyncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if name in _SYNCING_OPS and not (
            name == "repeat_interleave" and not isinstance(args[1], torch.Tensor)
        ):
            self.found.append(str(func))
        if name in ("index", "index_put", "index_put_"):
            indices = args[1]
            if any(i is not None and i.dtype == torch.bool for i in indices):
                self.found.append(f"{func} with a boolean mask")
        return func(*args, **kwargs)


@pytest.mark.parametrize("name", ["multi_request", "dup_physical_page", "p8192_saturated"])
def test_select_reference_has_no_host_sync(name):
    case = testing.make_select_case(name, 2)
    with _RecordSyncs() as mode:
        reference.select_paged_tokens_ref(*case.ref_args())
    assert not mode.found, f"host-synchronising ops: {mode.found}"


@pytest.mark.parametrize("name", testing.ATTENTION_CASES)
def test_attention_reference_has_no_host_sync(name):
    case = testing.make_attention_case(name, 2)
    with _RecordSyncs() as mode:
        reference.sparse_paged_attention_ref(*case.ref_args())
    assert not mode.found, f"host-synchronising ops: {mode.found}"


def test_sync_recorder_catches_item():
    with _RecordSyncs() as mode:
        torch.ones(2).sum().item()
        x = torch.arange(4)
        x[x > 1]
        torch.tensor(1.0)
    assert len(mode.found) >= 3


def test_reference_traces_fullgraph():
    """Dynamo refuses .item()/.nonzero()/data-dependent shapes under fullgraph=True, so a
    full-graph trace of the reference proves it has none (aot_eager: no C++ compile)."""
    torch._dynamo.reset()
    sel = testing.make_select_case("multi_request", 2)
    want = sel.new_out()
    reference.select_paged_tokens_ref(*sel.ref_args()[:-1], want)
    compiled = torch.compile(reference.select_paged_tokens_ref, fullgraph=True, backend="aot_eager")
    compiled(*sel.ref_args())
    assert torch.equal(sel.out, want)

    att = testing.make_attention_case("holes_dups_cross_page", 2)
    want = att.new_out()
    reference.sparse_paged_attention_ref(*att.ref_args()[:-2], want)
    compiled = torch.compile(
        reference.sparse_paged_attention_ref, fullgraph=True, backend="aot_eager"
    )
    compiled(*att.ref_args())
    torch.testing.assert_close(att.out, want, atol=1e-3, rtol=1e-3)
