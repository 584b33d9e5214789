"""The grid and the builders: shapes the contract accepts, the seed cases' numbers."""

from __future__ import annotations

import pytest
import torch

from custom_esimd_kernels_vllm.bench import cases
from custom_esimd_kernels_vllm.bench.cases import floor_bytes
from custom_esimd_kernels_vllm.bench.impls import ALL, attention_kwargs, select
from custom_esimd_kernels_vllm.qsa_ops import contract, testing


def test_default_grid():
    grid = cases.grid("default")
    assert len(grid) == 5 + 2 * 4 * 3 + 2 * 3 * 4  # seeds, scale, dtype variants
    assert len({c.key for c in grid}) == len(grid)
    seeds = [c for c in grid if c.group == "seed"]
    assert [c.width for c in seeds if c.op == "attention"] == [32, 1024, 2051]
    # the decode-latency targets: 4 attention, 5 selection; the float8 ones: 2 + 1
    assert sum(c.target for c in grid) == 9 + 3
    dtype = [c for c in grid if c.group == "dtype"]
    assert {c.layout for c in dtype} == set(cases.DTYPE_VARIANTS)
    assert {(c.op, c.rows, c.context) for c in dtype} == {
        (op, r, cases.VARIANT_CONTEXTS[op][r]) for op in cases.OPS for r in cases.SCALE_ROWS
    }
    assert all(c.layout == "seed" for c in grid if c.group != "dtype")
    assert {c.op for c in cases.grid("default", ("selection",))} == {"selection"}
    with pytest.raises(ValueError, match="grid must be one of"):
        cases.grid("nope")
    with pytest.raises(ValueError, match="ops must be among"):
        cases.grid("default", ("attn",))


def _validate(op, t):
    if op == "attention":
        names = ("q", "k_cache", "v_cache", "logical_indices", "page_table", "token_to_req")
        contract.validate_attention_args(
            *(t[n] for n in names), t["k_cache"].shape[1], t["out"], **attention_kwargs(t)
        )
    else:
        names = ("q", "compressed_key_cache", "page_table", "token_to_req", "query_positions",
                 "sequence_lengths")  # fmt: skip
        contract.validate_select_args(*(t[n] for n in names), 2048, 4, t["out"])


@pytest.mark.parametrize("spec", cases.quick_cases() + cases.seed_cases(), ids=lambda s: s.key)
def test_builders_make_valid_arguments(spec):
    t = cases.build(spec, torch.device("cpu")).tensors
    _validate(spec.op, t)
    assert t["q"].shape[0] == spec.rows


def test_seed_case_numbers():
    by_name = {c.name: c for c in cases.seed_cases()}
    tail = cases.build(by_name["seed cross-page tail (129 blocks / 519 tokens)"], "cpu")
    fb = floor_bytes("selection", tail.tensors)
    assert fb.counts["usable_blocks"] == 129  # 519 tokens = 129 blocks + 3 tail tokens
    sat = by_name["seed P8192 saturated (2303 blocks / 2051 tokens)"]
    built = cases.build(sat, "cpu")
    assert built.pages == 8192
    assert floor_bytes("selection", built.tensors).counts["usable_blocks"] == 2303
    w1024 = cases.build(by_name["seed R=1 width 1024"], "cpu").tensors["logical_indices"]
    assert int((w1024 >= 0).sum()) == 1024 and bool((w1024[:, 1024:] == -1).all())


def test_scale_builder_decode_batch():
    spec = cases.CaseSpec("attention", "scale", "x", 3, 8192)
    t = cases.build(spec, "cpu").tensors
    assert t["page_table"].shape == (3, 16)
    assert t["page_table"].unique().numel() == 48  # distinct pages: the pool has room
    idx = t["logical_indices"]
    assert all(idx[r].unique().numel() == 2051 for r in range(3))  # distinct tokens
    assert int(idx.max()) < 8192
    sel = cases.build(cases.CaseSpec("selection", "scale", "y", 2, 8192), "cpu").tensors
    assert sel["query_positions"].tolist() == [8191, 8191]
    assert sel["sequence_lengths"].tolist() == [8192, 8192]


def test_attention_pool_cap_shares_pages():
    table = cases.random_page_table(4, 16, 20, torch.Generator().manual_seed(0), "cpu")
    assert table.shape == (4, 16) and int(table.max()) < 20
    assert all(table[b].unique().numel() == 16 for b in range(4))  # distinct within a request


def test_impl_selection_on_cpu():
    chosen, skipped = select("selection", 2, torch.device("cpu"), compile_skip="off")
    assert [i.name for i in chosen] == ["ref-vectorised", "ref-rowwise"]
    assert set(skipped) == {"kernel", "upstream", "upstream-score", "ref-compiled"}
    chosen, skipped = select("attention", 64, torch.device("cpu"), compile_skip=None)
    assert [i.name for i in chosen] == ["ref-compiled", "ref-vectorised"]
    assert "R <= 8" in skipped["ref-rowwise"]
    assert set(ALL) - {"upstream-score"} == set(skipped) | {i.name for i in chosen}


def test_validation_subset():
    subset = cases.target_cases()
    assert sum(c.group != "dtype" for c in subset) == 9  # the seed and scale targets
    extra = {(c.op, c.layout, c.rows, c.context, c.target_us) for c in subset if c.group == "dtype"}
    assert extra == {
        ("attention", "vllm_bf16_784", 64, 32768, None),
        ("attention", "vllm_fp8_784", 64, 32768, 25.0),
        ("attention", "vllm_fp8_784", 256, 32768, 72.0),
        ("selection", "vllm_bf16_784", 1, 131072, None),
        ("selection", "vllm_fp8_784", 1, 131072, 11.0),
    }
    assert all(c.in_validation for c in subset)


def test_variants_are_the_testing_layouts():
    assert cases.layout_of("vllm_bf16_784") is testing.LAYOUTS["vllm_bf16_784"]
    assert cases.layout_of("vllm_fp8_784") is testing.LAYOUTS["vllm_fp8_784"]
    packed = cases.layout_of("bf16_packed_512")
    vllm = testing.LAYOUTS["vllm_bf16_784"]
    assert (packed.page_size, packed.keys_per_page, packed.layers, packed.table_pad) == (
        512, 128, 1, 0,
    )  # fmt: skip
    assert (packed.dtype, packed.gate, packed.index_stride) == (vllm.dtype, vllm.gate, 2052)
    with pytest.raises(ValueError, match="layout must be one of"):
        cases.layout_of("fp4")
    assert cases.dtype_names(cases.layout_of("vllm_fp8_784")) == {
        "q": "bf16", "kv": "fp8", "index": "fp8",
    }  # fmt: skip


@pytest.mark.parametrize("layout", list(cases.VARIANTS))
@pytest.mark.parametrize("op", cases.OPS)
def test_layout_builders(op, layout):
    lay = cases.layout_of(layout)
    spec = cases.CaseSpec(op, "dtype", "x", 3, 4096, width=2000, layout=layout)
    built = cases.build(spec, "cpu")
    t = built.tensors
    _validate(op, t)
    assert built.layout is lay and built.pool.shape[1] == lay.layers
    if op == "attention":
        k, v = t["k_cache"], t["v_cache"]
        assert k.dtype == v.dtype == lay.cache_dtype and t["q"].dtype == lay.dtype
        assert k.shape[1] == lay.page_size
        # vLLM's block-outermost layout: the page stride spans the layers' pages
        assert k.stride(0) == lay.layers * lay.page_size * 512
        assert v.data_ptr() - k.data_ptr() == 256 * k.element_size()
        assert (t.get("k_scale"), t.get("v_scale")) == lay.scales
        assert ("gate" in t) == lay.gate
        idx = t["logical_indices"]
        assert idx.stride(0) == lay.index_stride and idx.data_ptr() == t["index_buffer"].data_ptr()
        if lay.index_stride > contract.WIDTH:  # vLLM's count column
            assert t["index_buffer"][:, contract.WIDTH].tolist() == [2000] * 3
    else:
        ck = t["compressed_key_cache"]
        assert ck.dtype == t["q"].dtype == lay.select_dtype and ck.shape[1] == lay.keys_per_page
        assert ck.stride(0) == lay.layers * lay.keys_per_page * 128
        assert t["out"].stride(0) == lay.index_stride
        assert t["out"].data_ptr() == t["out_base"].data_ptr()
    assert t["page_table"].stride(0) == t["page_table"].shape[1] + lay.table_pad


def test_float8_values_are_drawn_in_chunks():
    g = torch.Generator().manual_seed(0)
    x = cases.random_values((3, 2, 4), contract.FP8, g, "cpu")
    assert x.dtype == contract.FP8 and x.shape == (3, 2, 4)
    assert x.float().abs().max() > 0 and torch.isfinite(x.float()).all()
