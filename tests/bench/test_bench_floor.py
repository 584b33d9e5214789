"""Bytes-moved arithmetic of the memory floor, and the token/key counts behind it."""

from __future__ import annotations

import pytest
import torch

from custom_esimd_kernels_vllm.bench.cases import (
    KEY_BYTES,
    KV_TOKEN_BYTES,
    attention_bytes,
    count_attention_tokens,
    count_selection_keys,
    floor_bytes,
    packed_kv_views,
    percent_of_floor,
    selection_bytes,
)
from custom_esimd_kernels_vllm.qsa_ops.contract import WIDTH


def test_constants():
    assert KV_TOKEN_BYTES == 1024  # 256 K + 256 V float16 values
    assert KEY_BYTES == 256  # 128 float16 values


def test_attention_bytes_r1_full_width():
    fb = attention_bytes(rows=1, requests=1, max_pages=16, distinct_tokens=2051)
    assert fb.read == {
        "q": 3 * 256 * 2,
        "kv_tokens": 2051 * 1024,
        "logical_indices": 2051 * 4,
        "page_table": 16 * 4,
        "token_to_req": 4,
    }
    assert fb.written == {"out": 1536}
    assert fb.total == 1536 + 2051 * 1024 + 8204 + 64 + 4 + 1536
    assert fb.seconds(1e12) == pytest.approx(fb.total / 1e12)


def test_selection_bytes_r64_32k():
    blocks = 64 * 8192
    fb = selection_bytes(rows=64, requests=64, max_pages=64, distinct_keys=blocks)
    expected = 64 * 1024 + blocks * 256 + 64 * 64 * 4 + 64 * 4 + 64 * 8 + 64 * 4 + 64 * 2051 * 4
    assert fb.total == expected
    assert fb.written == {"out": 64 * 2051 * 4}


def test_percent_of_floor():
    assert percent_of_floor(1e-6, 2e-6) == 50.0
    assert percent_of_floor(1e-6, 0.0) != percent_of_floor(1e-6, 0.0)  # NaN


def _attention_inputs(indices, page_table, token_to_req, pages):
    kv = torch.zeros(pages, 512, 512, dtype=torch.float16)
    k, v = packed_kv_views(kv)
    rows = len(indices)
    idx = torch.full((rows, WIDTH), -1, dtype=torch.int32)
    for r, row in enumerate(indices):
        idx[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return {
        "q": torch.zeros(rows, 3, 256, dtype=torch.float16),
        "k_cache": k,
        "v_cache": v,
        "logical_indices": idx,
        "page_table": torch.tensor(page_table, dtype=torch.int32),
        "token_to_req": torch.tensor(token_to_req, dtype=torch.int32),
    }


def test_count_attention_tokens_distinct_vs_occurrences():
    t = _attention_inputs(
        # row 0: token 5 twice (duplicate), 511/512 cross a page, -2 hole, 1536 past M=3?
        indices=[[5, 5, 511, 512, -2, 3 * 512, 1030], [5, 700], [1, 2]],
        # request 0: pages 4, 1, -1 (logical page 2 is a hole); request 1: pages 4, 0, 2
        page_table=[[4, 1, -1], [4, 0, 2]],
        token_to_req=[0, 1, 7],  # row 2: invalid request
        pages=5,
    )
    distinct, occurrences = count_attention_tokens(t)
    # row 0 valid: 5, 5, 511 (page 4), 512 (page 1); 1030 is on logical page 2 = -1: hole
    # row 1 valid: 5 (page 4: the same physical token as row 0's 5), 700 (page 0)
    assert occurrences == 6
    assert distinct == 4  # (4, 5), (4, 511), (1, 0), (0, 188)
    fb = floor_bytes("attention", t)
    assert fb.read["kv_tokens"] == 4 * 1024
    assert fb.counts == {"distinct_tokens": 4, "valid_entries": 6}


def test_count_selection_keys_shared_and_unusable():
    # one request, pages [3, 3, -1, 9] (9 >= P: unusable); two rows at different positions
    t = {
        "q": torch.zeros(2, 4, 128, dtype=torch.float16),
        "compressed_key_cache": torch.zeros(5, 128, 1, 128, dtype=torch.float16),
        "page_table": torch.tensor([[3, 3, -1, 9]], dtype=torch.int32),
        "token_to_req": torch.tensor([0, 0], dtype=torch.int32),
        "query_positions": torch.tensor([2047, 10_000], dtype=torch.int64),
        "sequence_lengths": torch.tensor([1500], dtype=torch.int32),
    }
    distinct, usable = count_selection_keys(t)
    # row 0: n = 1500 -> nb = 375 blocks: 0..127 page 3, 128..255 page 3 again, 256..374 on -1
    # row 1: clamped to n = 1500 as well
    assert usable == 2 * 256
    assert distinct == 128  # logical pages 0 and 1 share physical page 3
    fb = floor_bytes("selection", t)
    assert fb.read["compressed_keys"] == 128 * 256
    assert fb.counts == {"distinct_keys": 128, "usable_blocks": 512}
    assert count_selection_keys(t, chunk_elements=1) == (distinct, usable)  # row chunks agree


def test_floor_bytes_per_dtype():
    # float8 K/V: 512 B per token; the gate is read in q's dtype
    fb = attention_bytes(1, 1, 16, 2051, q_bytes=2, kv_bytes=1, gate=True)
    assert fb.read["kv_tokens"] == 2051 * 512 and fb.read["gate"] == 3 * 256 * 2
    assert fb.total == attention_bytes(1, 1, 16, 2051).total - 2051 * 512 + 1536
    # float8 indexer: q and keys 1 byte per element
    fb8 = selection_bytes(1, 1, 64, 8192, elem_bytes=1)
    fb16 = selection_bytes(1, 1, 64, 8192)
    assert fb8.read["compressed_keys"] == 8192 * 128 and fb8.read["q"] == 4 * 128
    assert fb16.total - fb8.total == 8192 * 128 + 4 * 128


@pytest.mark.parametrize("layout", ["vllm_bf16_784", "vllm_fp8_784", "bf16_packed_512"])
def test_floor_of_built_layouts(layout):
    from custom_esimd_kernels_vllm.bench import cases

    lay = cases.layout_of(layout)
    att = cases.build(cases.CaseSpec("attention", "dtype", "x", 2, 4096, layout=layout), "cpu")
    fb = floor_bytes("attention", att.tensors)
    per_token = 512 * (1 if layout == "vllm_fp8_784" else 2)
    assert fb.counts["distinct_tokens"] == 2 * 2051  # distinct pages per request, distinct rows
    assert fb.read["kv_tokens"] == 2 * 2051 * per_token
    assert fb.read["gate"] == 2 * 3 * 256 * 2
    assert fb.read["page_table"] == 2 * -(-4096 // lay.page_size) * 4  # the pad is not read
    assert fb.read["logical_indices"] == 2 * 2051 * 4  # the 2051 columns of [T, 2052]
    sel = cases.build(cases.CaseSpec("selection", "dtype", "y", 2, 4096, layout=layout), "cpu")
    fs = floor_bytes("selection", sel.tensors)
    assert fs.counts == {"distinct_keys": 2 * 1024, "usable_blocks": 2 * 1024}
    key = 128 * (1 if layout == "vllm_fp8_784" else 2)
    assert fs.read["compressed_keys"] == 2 * 1024 * key
