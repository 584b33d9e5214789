"""Parts of the Qwen4Exp integration that run without a server: the tiny checkpoint builder,
the load-time shape refusal, and the PyTorch equivalents of upstream's CUDA/Triton-only
pieces (each against a direct restatement of what the upstream kernel computes)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from custom_esimd_kernels_vllm.vllm import qwen4exp, qwen4exp_cpu

# --------------------------------------------------------------------------------------------
# the tiny checkpoint
# --------------------------------------------------------------------------------------------


def _digest(path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.iterdir())
        if p.is_file()
    }


def test_tiny_qwen4exp_is_deterministic(tmp_path):
    pytest.importorskip("transformers")
    from make_tiny_qwen4exp import make_checkpoint

    a = make_checkpoint(tmp_path / "a", tp=1, seed=0)
    b = make_checkpoint(tmp_path / "b", tp=1, seed=0)
    assert _digest(a) == _digest(b)
    c = make_checkpoint(tmp_path / "c", tp=1, seed=1)
    assert _digest(c)["model.safetensors"] != _digest(a)["model.safetensors"]
    config = json.loads((a / "config.json").read_text())
    assert config["architectures"] == ["Qwen4ExpForCausalLM"]
    assert config["model_type"] == "qwen4_exp_text"
    assert config["torch_dtype" if "torch_dtype" in config else "dtype"] == "bfloat16"


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("mixed", [False, True])
def test_tiny_qwen4exp_config_is_the_contract_per_rank(tp, mixed):
    pytest.importorskip("transformers")
    from make_tiny_qwen4exp import VOCAB_SIZE, make_config

    config = make_config(tp, mixed, VOCAB_SIZE, 0, 1)
    assert config.num_attention_heads // tp == 3
    assert config.num_key_value_heads // tp == 1
    assert config.head_dim == 256
    assert (config.indexer_n_heads, config.indexer_kv_heads, config.indexer_head_dim) == (4, 1, 128)
    assert (config.indexer_budget, config.indexer_compress_ratio) == (2048, 4)
    assert config.hc_count > 1 and config.num_experts > 1
    rotary = int(config.head_dim * config.rope_parameters["partial_rotary_factor"])
    assert rotary == 64
    expected = ["linear_attention", "indexed_attention"] if mixed else ["indexed_attention"] * 2
    assert config.layer_types == expected


# --------------------------------------------------------------------------------------------
# load-time refusal
# --------------------------------------------------------------------------------------------

CONTRACT = dict(
    num_heads=3,
    num_kv_heads=1,
    head_dim=256,
    index_heads=4,
    index_kv_heads=1,
    index_dim=128,
    token_topk=2048,
    compress_ratio=4,
    tp_size=8,
)


def test_contract_ranks_are_accepted():
    qwen4exp.check_rank_shapes(**CONTRACT)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_heads": 6, "tp_size": 4}, r"query heads per rank 6 \(the operators take 3\)"),
        ({"num_kv_heads": 2}, r"KV heads per rank 2 \(the operators take 1\)"),
        ({"head_dim": 128}, r"head dim 128 \(the operators take 256\)"),
        ({"index_heads": 8}, r"indexer heads 8 \(the operators take 4\)"),
        ({"token_topk": 1024}, r"indexer budget 1024 \(the operators take 2048\)"),
        ({"compress_ratio": 8}, r"compression ratio 8 \(the operators take 4\)"),
    ],
)
def test_other_ranks_are_refused_with_the_numbers(change, message):
    with pytest.raises(qwen4exp.QSAShapeError, match=message):
        qwen4exp.check_rank_shapes(**{**CONTRACT, **change})


def test_routing_switch(monkeypatch):
    monkeypatch.delenv(qwen4exp.ROUTING_ENV, raising=False)
    assert qwen4exp.routing_enabled()
    monkeypatch.setenv(qwen4exp.ROUTING_ENV, "0")
    assert not qwen4exp.routing_enabled()
    monkeypatch.setenv(qwen4exp.ROUTING_ENV, "off")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        qwen4exp.routing_enabled()


# --------------------------------------------------------------------------------------------
# PyTorch equivalents
# --------------------------------------------------------------------------------------------


def test_token_to_req_indices():
    qsl = torch.tensor([0, 3, 3, 7], dtype=torch.int32)  # request 1 is empty
    out = torch.full((10,), -5, dtype=torch.int32)
    got = qwen4exp_cpu.token_to_req_indices(qsl, out, 7, 9)
    assert got.tolist() == [0, 0, 0, 2, 2, 2, 2, 0, 0]
    assert out[9].item() == -5  # nothing past num_tokens


def _gemma_norm(x, w, eps, groups):
    n, d = x.shape
    xf = x.float().view(n, groups, d // groups)
    y = xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps)
    return (y.view(n, d) * (1 + w.float())).to(x.dtype)


def test_hyperconnection_glue():
    gen = torch.Generator().manual_seed(0)
    n, hc, h = 5, 2, 8
    x = torch.randn(n, hc * h, generator=gen).to(torch.bfloat16)
    w = torch.randn(hc * h, generator=gen).to(torch.bfloat16) * 0.1
    gate = torch.randn(n, hc * h, generator=gen).to(torch.bfloat16)
    block = torch.randn(n, h, generator=gen).to(torch.bfloat16)
    inj = torch.randn(n, hc, generator=gen).to(torch.bfloat16)

    norm = qwen4exp_cpu.grouped_gemma_rmsnorm(x, w, 1e-6, hc)
    torch.testing.assert_close(norm, _gemma_norm(x, w, 1e-6, hc), atol=1e-2, rtol=1e-2)
    silu = qwen4exp_cpu.hc_silu(x, hc)
    torch.testing.assert_close(silu, torch.nn.functional.silu(x.float() / hc).to(x.dtype))
    mix = qwen4exp_cpu.hc_gate_mix(x, gate, hc)
    want = (torch.sigmoid(gate.float()) * x.float()).view(n, hc, h).mean(1).to(x.dtype)
    torch.testing.assert_close(mix, want)
    combined = qwen4exp_cpu.hc_combine(x, block, inj, hc)
    weights = 2 * torch.sigmoid(inj.float() / hc)
    want = x.float().view(n, hc, h) + block.float()[:, None] * weights[..., None]
    torch.testing.assert_close(combined, want.view(n, -1).to(x.dtype))
    unit = qwen4exp_cpu.hc_combine(x, block, None, hc)
    want = (x.float().view(n, hc, h) + block.float()[:, None]).view(n, -1).to(x.dtype)
    torch.testing.assert_close(unit, want)
    out, y = qwen4exp_cpu.hc_combine_norm(x, block, inj, w, 1e-6, hc)
    torch.testing.assert_close(out, combined)
    torch.testing.assert_close(y, qwen4exp_cpu.grouped_gemma_rmsnorm(combined, w, 1e-6, hc))


def test_store_cache_rows_skips_bad_slots():
    cache = torch.zeros(3, 4, 1, 2)
    rows = torch.arange(10, dtype=torch.float32).view(5, 2)
    slots = torch.tensor([0, 5, -1, 11, 12])  # 12 is past the cache
    qwen4exp_cpu.store_cache_rows(cache, slots, rows)
    flat = cache.view(12, 2)
    assert flat[0].tolist() == [0, 1] and flat[5].tolist() == [2, 3] and flat[11].tolist() == [6, 7]
    assert flat[[1, 2, 3, 4, 6, 7, 8, 9, 10]].abs().sum() == 0


def test_compress_groups_pools_ring_and_step_rows():
    # one request, ring of 8 slots (block 1), positions 0..5 cached before, step = 6..9
    ratio, dim, ring = 4, 3, 8
    keys_all = torch.arange(10 * dim, dtype=torch.float32).view(10, dim).to(torch.bfloat16)
    cache = torch.zeros(2, ring, 1, dim, dtype=torch.bfloat16)
    for pos in range(6):
        cache[1, pos % ring, 0] = keys_all[pos]
    step = keys_all[6:10].view(4, 1, dim)
    positions = torch.arange(6, 10)
    compressed_slots = torch.tensor([-1, 1, -1, -1])  # position 7 completes block 1
    pooled, first = qwen4exp_cpu.compress_groups(
        step,
        positions.view(-1, 1, 1).expand(-1, 1, 3),
        cache,
        torch.tensor([[1]], dtype=torch.int32),
        torch.zeros(4, dtype=torch.int32),
        torch.tensor([0, 4], dtype=torch.int32),
        positions,
        compressed_slots,
        ratio,
    )
    want = keys_all[4:8].float().sum(0) / ratio
    torch.testing.assert_close(pooled[1, 0], want.to(torch.bfloat16))
    assert first[1].tolist() == [4, 4, 4]
    assert pooled[[0, 2, 3]].abs().sum() == 0


@pytest.mark.parametrize("scales", [None, (0.5, 2.0)])
def test_store_kv_packs_k_then_v(scales):
    pages, page, dim = 3, 4, 8
    dtype = torch.bfloat16 if scales is None else torch.uint8
    kv = torch.zeros(pages, 1, page, 2 * dim, dtype=dtype)  # the owner's [P, H, N, K | V]
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(3, 1, dim, generator=gen).to(torch.bfloat16)
    value = torch.randn(3, 1, dim, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([5, -1, 9])
    qwen4exp_cpu.store_kv(key, value, kv, slots, scales)
    stored = kv if scales is None else kv.view(torch.float8_e4m3fn)
    k_scale, v_scale = scales or (1.0, 1.0)
    for row, slot in ((0, 5), (2, 9)):
        got = stored[slot // page, 0, slot % page].float()
        want_k = (key[row, 0].float() / k_scale).to(stored.dtype).float()
        want_v = (value[row, 0].float() / v_scale).to(stored.dtype).float()
        assert torch.equal(got[:dim], want_k) and torch.equal(got[dim:], want_v)
    assert (
        stored.float().abs().sum()
        == stored[1, 0, 1].float().abs().sum() + stored[2, 0, 1].float().abs().sum()
    )


# --------------------------------------------------------------------------------------------
# the routed attention on vLLM's pages
# --------------------------------------------------------------------------------------------


def test_routed_attention_reads_vllm_pages_and_zeroes_padding():
    """``forward_qsa`` on one layer's view of a block-outermost cache (two layers per block,
    [P, H, N, K | V] each) with 3 padded rows, as vLLM pads a CUDA graph's batch: the real
    rows == softmax attention over the selected tokens gathered through the block table, gated;
    the padded rows are zeros whatever the buffer held."""
    from types import SimpleNamespace

    from custom_esimd_kernels_vllm.qsa_ops.contract import WIDTH

    gen = torch.Generator().manual_seed(2)
    page, pages, real, rows, heads, dim = 16, 4, 5, 8, 3, 256
    cache = torch.randn(pages, 2, 1, page, 2 * dim, generator=gen).to(torch.bfloat16)
    kv_cache = cache[:, 1]  # the second layer's pages: strided, one block apart
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)  # logical page -> physical
    selected = torch.full((rows, WIDTH + 1), -1, dtype=torch.int32)  # upstream's [T, 2052]
    for r in range(real):
        picked = torch.randperm(3 * page, generator=gen)[: 7 + 5 * r]
        selected[r, : picked.numel()] = picked.to(torch.int32)
    query = torch.randn(rows, heads, dim, generator=gen).to(torch.bfloat16)
    gate = torch.randn(rows, heads * dim, generator=gen).to(torch.bfloat16)
    output = torch.full((rows, heads, dim), 7.0, dtype=torch.bfloat16)  # stale values
    impl = qwen4exp._make_impl_cls(object)()
    impl.num_heads, impl.head_size, impl.kv_cache_dtype, impl.scale = heads, dim, "auto", 0.0625
    layer = SimpleNamespace(topk_indices_buffer=selected)
    metadata = SimpleNamespace(num_actual_tokens=real, block_table=table)
    to_req = torch.zeros(rows, dtype=torch.int32)
    impl.forward_qsa(layer, query, None, None, kv_cache, metadata, output, to_req, False, gate)

    assert output[real:].abs().sum() == 0
    for r in range(real):
        tokens = selected[r][selected[r] >= 0].long()
        rows_kv = kv_cache[table[0, tokens // page].long(), 0, tokens % page].float()
        keys, values = rows_kv[:, :dim], rows_kv[:, dim:]
        weights = torch.softmax(query[r].float() @ keys.T * impl.scale, dim=-1)
        attn = (weights @ values).to(torch.bfloat16).float()
        want = attn * torch.sigmoid(gate[r].view(heads, dim).float())
        torch.testing.assert_close(output[r].float(), want, atol=2e-2, rtol=2e-2)
