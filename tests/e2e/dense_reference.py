"""Dense reference of the tiny QSA checkpoint: transformers' Qwen3 with the same weights.

For a row that sees at most 2051 tokens, QSA selection keeps every token, so QSA equals
dense attention up to summation order. The reference rounds q, k, v and the attention
output to float16 as the QSA caches and operators do, computing everything else in float32;
the QSA-only weights (``index_wq``, ``index_wk``) are ignored.
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
