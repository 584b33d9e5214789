"""CPU checks of the integration's torch-only parts (no vLLM needed): cache views, cache
writes under any batching, the per-rank config check and the tiny checkpoint's determinism."""

from __future__ import annotations

import hashlib

import pytest
import torch

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import update_caches
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
from custom_esimd_kernels_vllm.qsa_ops.testing import update_slots
from custom_esimd_kernels_vllm.vllm import paging
from custom_esimd_kernels_vllm.vllm.qsa_config import QSAConfig


def test_views_are_the_contract_layout():
    views, ck = paging.allocate(3)
    assert views.packed.shape == (3, KV_PAGE, 2 * HEAD_DIM) and views.packed.is_contiguous()
    assert views.k_cache.stride() == KV_STRIDES and views.v_cache.stride() == KV_STRIDES
    assert views.v_cache.storage_offset() - views.k_cache.storage_offset() == V_OFFSET
    assert ck.shape == (3, CK_PAGE, 1, INDEX_DIM) and ck.is_contiguous()
    assert paging.KV_PAGE_BYTES == 512 * 1024 and paging.CK_PAGE_BYTES == 128 * 256
    # the operators accept the views as they are
    q = torch.randn(2, 3, HEAD_DIM).half()
    idx = torch.full((2, WIDTH), -1, dtype=torch.int32)
    idx[:, 0] = 0
    out = torch.empty(2, 3, HEAD_DIM, dtype=torch.float16)
    page_table = torch.tensor([[1]], dtype=torch.int32)
    token_to_req = torch.zeros(2, dtype=torch.int32)
    qsa_ops.sparse_paged_attention(
        q, views.k_cache, views.v_cache, idx, page_table, token_to_req, KV_PAGE, out
    )


def test_views_of_a_block_outermost_layout_are_refused():
    # two layers interleaved per block (BLNHC): the layer's page stride is two pages
    both = torch.zeros(4, 2, 1, KV_PAGE, 2 * HEAD_DIM, dtype=torch.float16)
    with pytest.raises(ValueError, match="VLLM_KV_CACHE_LAYOUT=LBNHC"):
        paging.kv_views(both[:, 0], "layer0")
    ck = torch.zeros(4, 2, 1, CK_PAGE, INDEX_DIM, dtype=torch.float16)
    with pytest.raises(ValueError, match="VLLM_KV_CACHE_LAYOUT=LBNHC"):
        paging.ck_view(ck[:, 0], "layer0")
    with pytest.raises(ValueError, match="needs float16"):
        paging.kv_views(torch.zeros(2, 1, KV_PAGE, 2 * HEAD_DIM), "layer0")


def _run(views, ck, k, v, slots, ck_slots, wk, step):
    for start in range(0, len(slots), step):
        sl = slice(start, start + step)
        update_caches(k[sl], v[sl], slots[sl], ck_slots[sl], wk, views.packed, ck)


@pytest.mark.parametrize("step, n", [(1, 520), (3, 1100), (4, 1100), (7, 1100), (1100, 1100)])
def test_cache_writes_do_not_depend_on_batching(step, n):
    torch.manual_seed(0)
    kv_pages, ck_pages = [5, 2, 7], [1, 6, 3]  # the two layers' own page ids
    slots, ck_slots = (torch.tensor(x) for x in update_slots(range(n), kv_pages, ck_pages))
    k, v = torch.randn(n, HEAD_DIM).half(), torch.randn(n, HEAD_DIM).half()
    wk = torch.randn(INDEX_DIM, HEAD_DIM) / 16
    whole = paging.allocate(8)
    _run(*whole, k, v, slots, ck_slots, wk, n)
    views, ck = paging.allocate(8)
    _run(views, ck, k, v, slots, ck_slots, wk, step)
    assert torch.equal(views.packed, whole[0].packed) and torch.equal(ck, whole[1])
    blocks = n // COMPRESS_RATIO
    expected = paging.compress_keys(k[: blocks * 4].view(blocks, 4, HEAD_DIM), wk)
    for j in range(blocks):
        page, slot = ck_pages[j // CK_PAGE], j % CK_PAGE
        assert torch.equal(ck[page, slot, 0], expected[j]), f"block {j}"
    packed = views.packed[torch.tensor(kv_pages)].reshape(-1, 2 * HEAD_DIM)[:n]
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
