"""References of the tiny QSA checkpoint on transformers' Qwen3 with the same weights.

``DenseReference``:
For a row that sees at most 2051 tokens, QSA selection keeps every token, so QSA equals
dense attention up to summation order. The reference rounds q, k, v and the attention
output to float16 as the QSA caches and operators do, computing everything else in float32;
the QSA-only weights (``index_wq``, ``index_wk``) are ignored.

``SparseReference`` (rows past 2051 tokens): the same model with QSA attention written
from docs/vllm.md and docs/contract.md, sharing no code with the integration.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

ATTENTION_NAME = "qsa_fp16_dense"


def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).to(t.dtype)


@functools.cache
def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fp16_attention(module, query, key, value, attention_mask, **kwargs):
        out, weights = sdpa_attention_forward(
            module, _fp16(query), _fp16(key), _fp16(value), attention_mask, **kwargs
        )
        return _fp16(out), weights

    AttentionInterface.register(ATTENTION_NAME, fp16_attention)


class DenseReference:
    def __init__(self, model_dir: str | Path) -> None:
        from transformers import Qwen3ForCausalLM
        from transformers.utils import logging

        _register_attention()
        logging.set_verbosity_error()  # the QSA-only weights are expected to be unused
        self.model = Qwen3ForCausalLM.from_pretrained(
            str(model_dir), attn_implementation=ATTENTION_NAME, dtype=torch.float32
        ).eval()

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([list(prompt_ids)])
        out = self.model(input_ids=ids, use_cache=True)
        past, tokens = out.past_key_values, []
        for _ in range(max_new_tokens):
            token = int(torch.argmax(out.logits[0, -1]))
            tokens.append(token)
            if len(tokens) == max_new_tokens:
                break
            out = self.model(
                input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True
            )
            past = out.past_key_values
        return tokens


# ------------------------------------------------------------------------------------------
# The sparse (QSA) reference: transformers' Qwen3 whose attention is QSA, written from the
# model's definition (docs/vllm.md) and the operator contract (docs/contract.md) alone. It
# imports nothing of custom_esimd_kernels_vllm: no paging, no reference operators, no rule.
# ------------------------------------------------------------------------------------------

SPARSE_NAME = "qsa_fp16_sparse"
TOKEN_TOPK, RATIO, INDEX_DIM, INDEX_HEADS, ATTN_HEADS = 2048, 4, 128, 4, 3
BLOCK_TOPK = TOKEN_TOPK // RATIO
SCORE_SCALE = torch.tensor(INDEX_DIM**-0.5, dtype=torch.float32)


def _parity_fold(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis as fold(x) = fold(x[0::2]) + fold(x[1::2]) (the contract's
    halving-fold order stated by index parity), float32 adds."""
    if x.shape[-1] == 1:
        return x[..., 0]
    return _parity_fold(x[..., 0::2]) + _parity_fold(x[..., 1::2])


def _compressed_keys(keys: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """keys [N, 256] float16 -> [N // 4, 128] float16: W_ik times the mean of each block's keys."""
    blocks = keys.shape[0] // RATIO
    k = keys[: blocks * RATIO].float().view(blocks, RATIO, -1)
    mean = (((k[:, 0] + k[:, 1]) + k[:, 2]) + k[:, 3]) * 0.25
    out = torch.empty(blocks, w.shape[0], dtype=torch.float16)
    for s in range(0, blocks, 64):
        out[s : s + 64] = _parity_fold(w[None] * mean[s : s + 64, None, :]).half()
    return out


def _selected(iq: torch.Tensor, ck: torch.Tensor, visible: int) -> torch.Tensor:
    """Token positions one row attends to: the top-512 blocks by score (ties: lower block
    first), each as its 4 tokens, then the 0..3 tail tokens."""
    blocks = visible // RATIO
    picked = torch.empty(0, dtype=torch.long)
    if blocks:
        keys = ck[:blocks].float()
        score = torch.zeros(blocks)
        for h in range(INDEX_HEADS):
            score = score + torch.relu((iq[h].float()[None, :] * keys).sum(dim=-1))
        score = score * SCORE_SCALE + 0.0
        order = torch.sort(score, descending=True, stable=True).indices[:BLOCK_TOPK]
        picked = (order[:, None] * RATIO + torch.arange(RATIO)).reshape(-1)
    return torch.cat([picked, torch.arange(blocks * RATIO, visible)])


@functools.cache
def _register_sparse_attention() -> None:
    from transformers import AttentionInterface

    def qsa_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        # query [1, Hq, T, 256]; key/value [1, G, N, 256] (every stored token)
        hidden = module.qsa_hidden[0]  # [T, hidden], the attention's input
        wq, wk = module.qsa_index_wq, module.qsa_index_wk
        _, _, rows, dim = query.shape
        groups, stored = key.shape[1], key.shape[2]
        iq = (hidden @ wq.T).view(rows, groups * INDEX_HEADS, INDEX_DIM).half()
        q, k, v = query[0].half(), key[0].half(), value[0].half()
        out = torch.zeros(rows, groups * ATTN_HEADS, dim)
        for g in range(groups):
            ck = _compressed_keys(k[g], wk[g * INDEX_DIM : (g + 1) * INDEX_DIM])
            for r in range(rows):
                visible = min(stored - rows + r + 1, stored)
                idx = _selected(iq[r, g * INDEX_HEADS : (g + 1) * INDEX_HEADS], ck, visible)
                module.qsa_last_count = idx.numel()
                keys, values = k[g, idx].float(), v[g, idx].float()
                heads = q[g * ATTN_HEADS : (g + 1) * ATTN_HEADS, r].float()  # [3, 256]
                p = torch.softmax((heads @ keys.T) * scaling, dim=-1)
                out[r, g * ATTN_HEADS : (g + 1) * ATTN_HEADS] = (p @ values).half().float()
        return out[None], None

    AttentionInterface.register(SPARSE_NAME, qsa_attention)


class SparseReference(DenseReference):
    """transformers' Qwen3 with QSA attention; the QSA weights read from the checkpoint."""

    def __init__(self, model_dir: str | Path) -> None:
        from safetensors.torch import load_file
        from transformers import Qwen3ForCausalLM
        from transformers.utils import logging

        _register_sparse_attention()
        logging.set_verbosity_error()
        self.model = Qwen3ForCausalLM.from_pretrained(
            str(model_dir), attn_implementation=SPARSE_NAME, dtype=torch.float32
        ).eval()
        weights = load_file(str(Path(model_dir) / "model.safetensors"))
        for i, layer in enumerate(self.model.model.layers):
            attn = layer.self_attn
            attn.qsa_index_wq = weights[f"model.layers.{i}.self_attn.index_wq.weight"].float()
            attn.qsa_index_wk = weights[f"model.layers.{i}.self_attn.index_wk.weight"].float()
            attn.register_forward_pre_hook(_stash_hidden, with_kwargs=True)

    def last_row_tokens(self) -> int:
        """Tokens the last row of the last layer attended to (its selection's size)."""
        return self.model.model.layers[-1].self_attn.qsa_last_count


def _stash_hidden(module, args, kwargs):
    module.qsa_hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
