"""The grid and the builders: shapes the contract accepts, the seed cases' numbers."""

from __future__ import annotations

import pytest
import torch

from custom_esimd_kernels_vllm.bench import cases
from custom_esimd_kernels_vllm.bench.cases import floor_bytes
from custom_esimd_kernels_vllm.bench.impls import ALL, select
from custom_esimd_kernels_vllm.qsa_ops import contract


def test_default_grid():
    grid = cases.grid("default")
    assert len(grid) == 5 + 2 * 4 * 3
    assert len({c.key for c in grid}) == len(grid)
    seeds = [c for c in grid if c.group == "seed"]
    assert [c.width for c in seeds if c.op == "attention"] == [32, 1024, 2051]
    assert sum(c.target for c in grid) == 6  # the kernels' performance table
    assert {c.op for c in cases.grid("default", ("selection",))} == {"selection"}
    with pytest.raises(ValueError, match="grid must be one of"):
        cases.grid("nope")
    with pytest.raises(ValueError, match="ops must be among"):
        cases.grid("default", ("attn",))


def _validate(op, t):
    if op == "attention":
        names = ("q", "k_cache", "v_cache", "logical_indices", "page_table", "token_to_req")
        contract.validate_attention_args(*(t[n] for n in names), 512, t["out"])
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
