"""Ours against vLLM 0.32.0's own Triton QSA kernels on upstream's own inputs (issue: contract
v2 kernels): identical bfloat16 and float8 tensors in vLLM's layouts (784/1568-token pages
whose page stride spans other layers, separate K/V, the [T, 2052] index buffer viewed as
[T, 2051], strided page-table rows).

* attention: ours within 2e-2 of upstream's output (its own tests' tolerance) and within the
  contract's 2e-3 of float64 (testing.check_attention);
* selection: upstream's Triton scores equal the exact scores of small-integer data, and our
  chosen blocks equal upstream's scores + a top-k as sets (ties at the 512th score may go
  either way).

Upstream's two files come from ``$QSA_UPSTREAM`` (a vLLM wheel, zip or extracted tree) or an
installed vLLM, loaded as the benchmark loads them (bench/upstream.py); without them the
tests skip with the reason.
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import DEVICE

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.bench import upstream as upstream_source
from custom_esimd_kernels_vllm.qsa_ops import contract, reference, testing

pytestmark = pytest.mark.gpu

UPSTREAM_TOLERANCE = 2e-2  # vLLM's own QSA attention tests: rtol/atol 2e-2
GATE_OPEN = 30.0  # sigmoid(30) == 1.0 in float32: upstream always gates, some layouts do not
# vLLM's layouts with the [T, 2052] index buffer that upstream's attention reads
ATTENTION_LAYOUTS = ("vllm_bf16_784", "vllm_bf16_1568_separate", "vllm_fp8_784")
SELECT_LAYOUTS = ("vllm_bf16_784", "vllm_fp8_784")


@pytest.fixture(scope="module")
def upstream():
    up = upstream_source.load()
    if not up.ok:
        pytest.skip(f"vLLM's kernels not loadable: {up.skip}")
    return up


def _index_buffer(case: testing.AttentionCase) -> torch.Tensor:
    """The [R, 2052] buffer whose first 2051 columns are the case's logical_indices, with the
    count column upstream reads as its tile-loop bound (every entry: holes are -1 there)."""
    idx = case.logical_indices
    assert idx.stride() == (contract.WIDTH + 1, 1), idx.stride()
    buf = idx.as_strided((idx.shape[0], contract.WIDTH + 1), idx.stride())
    buf[:, contract.WIDTH] = contract.WIDTH
    return buf


@pytest.mark.parametrize("R", [1, 7, 64])
@pytest.mark.parametrize("layout", ATTENTION_LAYOUTS)
def test_attention_matches_upstream(cuda_backend, upstream, layout, R):
    lay = testing.LAYOUTS[layout]
    case = testing.random_attention_case(
        R, 3, 5, 9, device=DEVICE, seed=300 + R, bad_values=False, valid_fraction=0.9,
        layout=lay, name=f"{layout} R={R}",
    )  # fmt: skip
    buf = _index_buffer(case)
    gate = case.gate if case.gate is not None else torch.full_like(case.q, GATE_OPEN)
    ours = qsa_ops.sparse_paged_attention(*case.args(), **case.kwargs())
    theirs = torch.full_like(case.q, float("nan"))
    k_scale, v_scale = lay.scales
    upstream.attention.qsa_sparse_paged_attention(
        case.q, case.k_cache, case.v_cache, buf, case.page_table, case.token_to_req, False,
        theirs, k_scale, v_scale, output_gate=gate.contiguous(),
    )  # fmt: skip
    torch.cuda.synchronize()
    testing.check_attention(case, ours)
    diff = (ours.double() - theirs.double()).norm() / theirs.double().norm()
    assert diff < UPSTREAM_TOLERANCE, f"{case!r}: ours vs upstream {float(diff):.2e}"


def _upstream_scores(up, case: testing.SelectCase, visible_blocks: torch.Tensor):
    """Upstream's decode launcher on the case (one page-table row per query row, as its
    request-major decode batch needs): its float32 scores, captured in place of its top-k."""
    rows = case.q.shape[0]
    table = case.page_table[case.token_to_req.long()].contiguous()
    captured = {}

    def keep(logits, *args):
        captured["logits"] = logits.clone()

    saved = up.indexer._topk
    up.indexer._topk = keep
    try:
        up.indexer.qsa_select_paged_decode(
            case.q, case.compressed_key_cache, table, visible_blocks, contract.TOKEN_TOPK,
            contract.COMPRESS_RATIO, 1,
            torch.empty(rows, contract.BLOCK_TOPK, dtype=torch.int32, device=DEVICE),
        )  # fmt: skip
    finally:
        up.indexer._topk = saved
    return captured["logits"]


def _exact_scores(case: testing.SelectCase, row: int, blocks: int) -> torch.Tensor:
    """sum over heads of ReLU(q . k) of the row's first ``blocks`` blocks, float64."""
    C = case.compressed_key_cache.shape[1]
    b = int(case.token_to_req[row])
    cols = torch.arange(blocks, device=DEVICE)
    pages = case.page_table[b].long()[cols // C]
    keys = case.compressed_key_cache[pages, cols % C, 0].double()  # [blocks, 128]
    return (case.q[row].double() @ keys.T).clamp_min(0).sum(0)


@pytest.mark.parametrize("R", [1, 5, 33])
@pytest.mark.parametrize("layout", SELECT_LAYOUTS)
def test_selection_matches_upstream_scores_and_topk(cuda_backend, upstream, layout, R):
    lay = testing.LAYOUTS[layout]
    C = lay.keys_per_page
    M = 7  # 7 pages of 196 blocks: 1,372 blocks, more than the 512 kept
    lengths = [M * C * contract.COMPRESS_RATIO, 3001]  # 1,372 and 750 blocks
    case = testing.random_select_case(
        R, 2, M, 20, device=DEVICE, seed=400 + R, integer=True, bad_values=False,
        token_to_req=[r % 2 for r in range(R)],
        query_positions=[lengths[r % 2] - 1 - 5 * r for r in range(R)],
        sequence_lengths=lengths, name=f"{layout} R={R}", layout=lay,
    )  # fmt: skip
    ours = qsa_ops.select_paged_tokens(*case.args())
    lengths = case.sequence_lengths.long()[case.token_to_req.long()]
    visible = reference.visible_tokens(case.query_positions, lengths)
    blocks = (visible // contract.COMPRESS_RATIO).to(torch.int32)
    logits = _upstream_scores(upstream, case, blocks)
    torch.cuda.synchronize()
    for r in range(R):
        n = int(blocks[r])
        exact = _exact_scores(case, r, n)
        assert torch.equal(logits[r, :n].double(), exact), f"{case!r} row {r}: upstream scores"
        chosen = ours[r, : contract.TOKEN_TOPK]
        chosen = chosen[chosen >= 0] // contract.COMPRESS_RATIO
        ours_set = set(chosen.unique().tolist())
        k = min(contract.BLOCK_TOPK, n)
        assert len(ours_set) == k, f"{case!r} row {r}: {len(ours_set)} blocks, expected {k}"
        if k == 0:
            continue
        threshold = float(torch.topk(exact, k).values[-1])
        must = set(torch.nonzero(exact > threshold).flatten().tolist())
        may = set(torch.nonzero(exact >= threshold).flatten().tolist())
        assert must <= ours_set <= may, (
            f"{case!r} row {r}: the chosen blocks are not upstream's top {k} "
            f"(missing {sorted(must - ours_set)[:5]}, extra {sorted(ours_set - may)[:5]})"
        )


def test_layouts_are_vllms():
    """The layouts fed here are vLLM's: index rows of 2052 where upstream reads a count
    column, page strides spanning other layers."""
    for name in ATTENTION_LAYOUTS:
        lay = testing.LAYOUTS[name]
        assert lay.index_stride == contract.WIDTH + 1 and lay.layers > 1, name
    for name in SELECT_LAYOUTS:
        assert testing.LAYOUTS[name].layers > 1, name
