"""CPU checks of the integration's torch-only parts (no vLLM needed): cache carving, cache
writes under any batching, the per-rank config check and the tiny checkpoint's determinism."""

from __future__ import annotations

import hashlib

import pytest
import torch

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops.contract import (
    CK_PAGE,
    COMPRESS_RATIO,
    HEAD_DIM,
    INDEX_DIM,
    KV_PAGE,
    KV_STRIDES,
    V_OFFSET,
    WIDTH,
)
from custom_esimd_kernels_vllm.vllm import paging
from custom_esimd_kernels_vllm.vllm.qsa_config import QSAConfig


def test_carve_gives_the_contract_layout():
    cache = paging.allocate(3)
    assert cache.kv_pages.shape == (3, KV_PAGE, 2 * HEAD_DIM)
    assert cache.k_cache.stride() == KV_STRIDES and cache.v_cache.stride() == KV_STRIDES
    assert cache.v_cache.storage_offset() - cache.k_cache.storage_offset() == V_OFFSET
    assert cache.ck_cache.shape == (3, CK_PAGE, 1, INDEX_DIM) and cache.ck_cache.is_contiguous()
    assert cache.ck_cache.data_ptr() == cache.kv_pages.data_ptr() + 3 * paging.KV_PAGE_ELEMENTS * 2
    assert paging.PAGE_BYTES == 512 * 1024 + 128 * 256
    # the operators accept the views as they are
    q = torch.randn(2, 3, HEAD_DIM).half()
    idx = torch.full((2, WIDTH), -1, dtype=torch.int32)
    idx[:, 0] = 0
    out = torch.empty(2, 3, HEAD_DIM, dtype=torch.float16)
    page_table = torch.tensor([[1]], dtype=torch.int32)
    token_to_req = torch.zeros(2, dtype=torch.int32)
    qsa_ops.sparse_paged_attention(
        q, cache.k_cache, cache.v_cache, idx, page_table, token_to_req, KV_PAGE, out
    )


@pytest.mark.parametrize(
    "flat, match",
    [
        (torch.zeros(paging.PAGE_ELEMENTS * 2, dtype=torch.float32), "float16"),
        (torch.zeros(paging.PAGE_ELEMENTS * 2 - 1, dtype=torch.float16), "must hold"),
    ],
)
def test_carve_refuses_wrong_buffers(flat, match):
    with pytest.raises(ValueError, match=match):
        paging.carve(flat, 2)


def _run(cache, k, v, slots, wk, step):
    for start in range(0, len(slots), step):
        sl = slice(start, start + step)
        paging.write_kv(cache, k[sl], v[sl], slots[sl])
        paging.write_compressed_keys(cache, slots[sl], wk)


@pytest.mark.parametrize("step, n", [(1, 520), (3, 1100), (4, 1100), (7, 1100), (1100, 1100)])
def test_cache_writes_do_not_depend_on_batching(step, n):
    torch.manual_seed(0)
    pages = [5, 2, 7]  # a request over non-consecutive physical pages
    positions = torch.arange(n)
    page_of = torch.tensor(pages)[positions // KV_PAGE]
    slots = page_of * KV_PAGE + positions % KV_PAGE
    k, v = torch.randn(n, HEAD_DIM).half(), torch.randn(n, HEAD_DIM).half()
    wk = torch.randn(INDEX_DIM, HEAD_DIM) / 16
    whole = paging.allocate(8)
    _run(whole, k, v, slots, wk, n)
    cache = paging.allocate(8)
    _run(cache, k, v, slots, wk, step)
    assert torch.equal(cache.kv_pages, whole.kv_pages)
    blocks = n // COMPRESS_RATIO
    expected = paging.compress_keys(k[: blocks * 4].view(blocks, 4, HEAD_DIM), wk)
    for j in range(blocks):
        page, slot = pages[j // CK_PAGE], j % CK_PAGE
        assert torch.equal(cache.ck_cache[page, slot, 0], expected[j]), f"block {j}"
        assert torch.equal(whole.ck_cache[page, slot, 0], expected[j]), f"block {j}"
    packed = cache.kv_pages[torch.tensor(pages)].reshape(-1, 2 * HEAD_DIM)[:n]
    assert torch.equal(packed[:, :HEAD_DIM], k) and torch.equal(packed[:, HEAD_DIM:], v)


@pytest.mark.parametrize("tp, heads", [(1, (3, 1, 4)), (2, (6, 2, 8)), (8, (24, 8, 32))])
def test_rank_contract_accepts_exact_splits(tp, heads):
    num_heads, kv, index = heads
    config = {
        "num_attention_heads": num_heads,
        "num_key_value_heads": kv,
        "head_dim": 256,
        "index_n_heads": index,
    }
    QSAConfig.from_hf(config).check_rank(tp)


def test_rank_contract_refusal_names_the_fields():
    config = {
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "index_n_heads": 8,
    }
    with pytest.raises(ValueError, match=r"num_attention_heads must be 3 \* TP = 3, got 6"):
        QSAConfig.from_hf(config).check_rank(1)
    with pytest.raises(ValueError, match="head_dim must be 256, got 128"):
        QSAConfig.from_hf(config).check_rank(2)
    with pytest.raises(ValueError, match="lacks field"):
        QSAConfig.from_hf({"num_attention_heads": 3})


def test_tiny_checkpoint_is_deterministic(tmp_path):
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    from make_tiny_model import make_checkpoint

    def digest(path):
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}

    first = digest(make_checkpoint(tmp_path / "a", tp=1, seed=0))
    assert first == digest(make_checkpoint(tmp_path / "b", tp=1, seed=0))
    assert (
        first["model.safetensors"]
        != digest(make_checkpoint(tmp_path / "c", seed=1))["model.safetensors"]
    )
