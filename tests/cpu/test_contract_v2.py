"""Contract v2 on the CPU: every seed case in every v2 layout and dtype (bfloat16, float8 K/V
with scales and an fp8 indexer, vLLM's page sizes with page strides spanning other layers,
separate K and V, strided index and page-table rows, the output gate) through the public
functions (the PyTorch reference on CPU tensors) against the independent float64 checkers."""

from __future__ import annotations

import pytest
import torch

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import contract, testing

LAYOUTS = sorted(testing.LAYOUTS)
# P = 8192 pages in a layout whose pages span other layers is a multi-GB buffer: the
# saturated case runs in the layouts of one layer (every dtype and keys-per-page among them).
BIG = {"p8192_saturated"}


def _select_layouts(name: str) -> list[str]:
    return [n for n in LAYOUTS if name not in BIG or testing.LAYOUTS[n].layers == 1]


@pytest.mark.parametrize(
    "name, layout", [(n, lay) for n in testing.SELECT_CASES for lay in _select_layouts(n)]
)
@pytest.mark.parametrize("R", [1, 3])
def test_select_v2_exact(name, layout, R):
    """Integer data: every float32 sum is exact in any order and in every dtype, so the
    output is exactly the checker's, tie order included."""
    case = testing.make_select_case(name, R, seed=R, layout=testing.LAYOUTS[layout])
    before = testing.snapshot(case)
    assert qsa_ops.select_paged_tokens(*case.args()) is case.out
    testing.check_selection(case, case.out, exact=True)
    testing.assert_inputs_unchanged(case, before)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_select_v2_is_the_seed_selection(layout):
    """On integer data the selection does not depend on the dtype or the layout: bit for bit
    the seed's output whenever the pages hold the same blocks."""
    lay = testing.LAYOUTS[layout]
    seed_lay = testing.Layout(keys_per_page=lay.keys_per_page)
    want = testing.make_select_case("exact_ties", 2, seed=4, layout=seed_lay)
    got = testing.make_select_case("exact_ties", 2, seed=4, layout=lay)
    qsa_ops.select_paged_tokens(*want.args())
    qsa_ops.select_paged_tokens(*got.args())
    assert torch.equal(got.out, want.out)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_select_v2_random(layout, seed):
    """Random data (holes, bad page ids, bad requests): a valid top-k within tolerance."""
    lay = testing.LAYOUTS[layout]
    case = testing.random_select_case(5, 3, 4, 9, seed=seed, layout=lay)
    qsa_ops.select_paged_tokens(*case.args())
    testing.check_selection(case, case.out, exact=False)


@pytest.mark.parametrize("name", testing.ATTENTION_CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("R", [1, 3])
def test_attention_v2(name, layout, R):
    case = testing.make_attention_case(name, R, seed=R, layout=testing.LAYOUTS[layout])
    before = testing.snapshot(case)
    assert qsa_ops.sparse_paged_attention(*case.args(), **case.kwargs()) is case.out
    testing.check_attention(case, case.out)
    testing.assert_inputs_unchanged(case, before)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_attention_v2_random(layout, seed):
    lay = testing.LAYOUTS[layout]
    case = testing.random_attention_case(4, 3, 3, 7, seed=seed, layout=lay)
    qsa_ops.sparse_paged_attention(*case.args(), **case.kwargs())
    testing.check_attention(case, case.out)


def test_attention_v2_packed_is_separate():
    """The same K/V values packed in one storage or in two give the same bits."""
    packed = testing.LAYOUTS["vllm_bf16_784"]
    separate = testing.Layout(**{**packed.__dict__, "kv": "separate"})
    a = testing.make_attention_case("full_width_2051", 2, seed=3, layout=packed)
    b = testing.make_attention_case("full_width_2051", 2, seed=3, layout=separate)
    qsa_ops.sparse_paged_attention(*a.args(), **a.kwargs())
    qsa_ops.sparse_paged_attention(*b.args(), **b.kwargs())
    assert torch.equal(a.out, b.out)


def test_attention_v2_gate_is_the_rounded_product():
    """out = dtype(float32(dtype(attn)) * sigmoid(float32(gate))), bit for bit."""
    lay = testing.LAYOUTS["bf16_gate"]
    case = testing.make_attention_case("valid_width_32", 3, seed=5, layout=lay)
    plain = case.new_out()
    qsa_ops.sparse_paged_attention(*case.args()[:7], plain)
    qsa_ops.sparse_paged_attention(*case.args(), **case.kwargs())
    want = (plain.float() * torch.sigmoid(case.gate.float())).to(torch.bfloat16)
    assert torch.equal(case.out, want)


def test_attention_v2_fp8_is_the_dequantised_cache():
    """float8 K/V with scales equals the same call on the dequantised values in float32
    caches' stead: bfloat16 caches holding exactly value * scale (exact for these scales)."""
    lay = testing.LAYOUTS["fp8_kv"]
    case = testing.make_attention_case("full_width_2051", 2, seed=6, layout=lay)
    qsa_ops.sparse_paged_attention(*case.args(), **case.kwargs())
    k = (case.k_cache.float() * case.k_scale).to(torch.bfloat16)
    v = (case.v_cache.float() * case.v_scale).to(torch.bfloat16)
    assert torch.equal(k.float(), case.k_cache.float() * case.k_scale)  # exact: powers of two
    out = case.new_out()
    args = list(case.args())
    args[1], args[2], args[7] = k, v, out
    qsa_ops.sparse_paged_attention(*args)
    assert torch.equal(out, case.out)


def test_attention_v2_empty_row_is_zero_with_gate():
    case = testing.make_attention_case("empty", 2, layout=testing.LAYOUTS["vllm_fp8_784"])
    qsa_ops.sparse_paged_attention(*case.args(), **case.kwargs())
    assert (case.out == 0).all()


def test_v2_layout_builders_are_what_they_say():
    """The builders' layouts: vLLM's spanning page stride, the [T, 2052] index buffer, strided
    page-table rows, separate K and V, dtypes."""
    lay = testing.LAYOUTS["vllm_fp8_784"]
    att = testing.make_attention_case("valid_width_32", 2, layout=lay)
    assert att.k_cache.shape[1] == 784 and att.k_cache.dtype == contract.FP8
    assert att.k_cache.stride(0) == 4 * 784 * 512 and att.k_cache.stride(1) == 512
    assert att.v_cache.data_ptr() - att.k_cache.data_ptr() == 256  # packed: V after K
    assert att.logical_indices.stride(0) == 2052
    assert att.page_table.stride(0) == att.page_table.shape[1] + 3
    assert att.gate is not None and att.gate.dtype == torch.bfloat16
    sel = testing.make_select_case("multi_request", 2, layout=lay)
    assert sel.compressed_key_cache.shape[1] == 196 and sel.q.dtype == contract.FP8
    assert sel.compressed_key_cache.stride(0) == 4 * 196 * 128
    assert sel.out.stride(0) == 2052
    sep = testing.make_attention_case(
        "valid_width_32", 1, layout=testing.LAYOUTS["vllm_fp8_800_separate"]
    )
    assert sep.v_storage is not None
    assert sep.k_cache.untyped_storage().data_ptr() != sep.v_cache.untyped_storage().data_ptr()
