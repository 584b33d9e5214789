"""``qsa_ops.select_paged_tokens`` against transformers' own Qwen4Exp indexer, on the tiny
checkpoint's real activations (no server): the indexer query and the compressed block keys of
each QSA layer are taken from transformers' bfloat16 forward of a 2,600-token prompt, the
compressed keys are put in a paged cache of vLLM's shape ([P, C, 1, 128], pages shuffled), and
the operator's selected token set of every row must equal the set transformers' indexer keeps,
wherever the gap between the 512th and 513th block score exceeds the float32 rounding bound of
the scores (both score the same bfloat16 values in float32; only the summation order differs).
Rows with at most 512 visible blocks keep them all in both."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from client import prompt  # noqa: E402

from custom_esimd_kernels_vllm import qsa_ops  # noqa: E402
from custom_esimd_kernels_vllm.qsa_ops.contract import WIDTH  # noqa: E402

LENGTH = 2600
CK_PAGE = 64  # compressed keys per page: not the seed's 128 (vLLM's pages vary)
MIN_CHECKED = 0.9  # of the sparse rows, at least this share must be decidable


def _capture(model_dir):
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen4_exp import modeling_qwen4_exp as tf

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    captured = []

    def hook(module, args, kwargs, output):
        hidden, (cos, sin) = args[0], args[1]
        captured.append((module, hidden, cos, sin, output))

    handles = [
        layer.self_attn.indexer.register_forward_hook(hook, with_kwargs=True)
        for layer in model.model.layers
        if hasattr(layer, "self_attn")
    ]
    ids = prompt(LENGTH, seed=7)
    with torch.no_grad():
        model(torch.tensor([ids]), use_cache=False)
    for h in handles:
        h.remove()
    layers = []
    with torch.no_grad():
        for idx, hidden, cos, sin, mask in captured:
            qk = idx.index_qk_proj(hidden)
            q, k = qk.split([idx.index_n_heads * idx.index_head_dim, idx.index_head_dim], dim=-1)
            q = idx.q_layernorm(q.view(1, LENGTH, idx.index_n_heads, idx.index_head_dim))
            q = tf.apply_rotary_pos_emb(q, cos=cos, sin=sin, unsqueeze_dim=2)[0]
            blocks = LENGTH // 4
            pooled = k[0, : blocks * 4].view(blocks, 4, -1).float().mean(1).to(k.dtype)
            pooled = idx.k_layernorm(pooled)
            starts = torch.arange(blocks) * 4
            keys = tf.apply_rotary_pos_emb(
                pooled.unsqueeze(1), cos=cos[0, starts], sin=sin[0, starts]
            ).squeeze(1)
            layers.append((q.contiguous(), keys.contiguous(), mask[0, 0]))
    return layers


def _select(q, keys):
    blocks, dim = keys.shape
    pages = math.ceil(blocks / CK_PAGE)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(pages + 3, generator=gen)[:pages]  # physical page of logical page
    cache = torch.zeros(pages + 3, CK_PAGE, 1, dim, dtype=keys.dtype)
    for logical, physical in enumerate(order.tolist()):
        chunk = keys[logical * CK_PAGE : (logical + 1) * CK_PAGE]
        cache[physical, : chunk.shape[0], 0] = chunk
    rows = q.shape[0]
    out = torch.empty(rows, WIDTH, dtype=torch.int32)
    qsa_ops.select_paged_tokens(
        q,
        cache,
        order.to(torch.int32).view(1, -1),
        torch.zeros(rows, dtype=torch.int32),
        torch.arange(rows, dtype=torch.int64),
        torch.tensor([LENGTH], dtype=torch.int32),
        2048,
        4,
        out,
    )
    return out


def test_selection_equals_transformers_indexer(tiny_qwen4exp):
    for layer, (q, keys, mask) in enumerate(_capture(tiny_qwen4exp)):
        out = _select(q, keys)
        checked = sparse = 0
        for row in range(q.shape[0]):
            visible = (row + 1) // 4
            ours = set(out[row][out[row] >= 0].tolist())
            keep = mask[row] == 0 if mask.is_floating_point() else mask[row]
            theirs = set(keep.nonzero().flatten().tolist())
            if visible <= 512:
                assert ours == theirs, f"layer {layer}, row {row}: dense row differs"
                continue
            sparse += 1
            products = q[row].double()[:, None, :] * keys[:visible].double()[None]  # [4, vis, 128]
            scores = products.sum(-1).relu().sum(0) / math.sqrt(128)
            bound = products.abs().sum(-1).sum(0) * 2.0**-20 / math.sqrt(128)  # generous fp32
            ranked, order = scores.sort(descending=True)
            margin = ranked[511] - ranked[512]
            if margin <= bound[order[511]] + bound[order[512]]:
                continue
            checked += 1
            assert ours == theirs, (
                f"layer {layer}, row {row}: selected sets differ ({len(ours ^ theirs)} tokens) "
                f"with score margin {margin.item():.3g}"
            )
            assert len(ours) == 2048 + (row + 1) % 4
        assert sparse > 500
        assert checked >= MIN_CHECKED * sparse, (
            f"layer {layer}: only {checked} of {sparse} sparse rows have a decidable margin"
        )
