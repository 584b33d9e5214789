"""transformers' own Qwen4Exp (``Qwen4ExpForCausalLM`` of transformers 5.16-5.19) on a tiny
checkpoint: the E2E suite's reference for vLLM serving the same files through our operators.
It imports nothing of the package."""

from __future__ import annotations

import torch


def _load(model_dir, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager"
    ).eval()


@torch.no_grad()
def _logprobs(model, ids: list[int]) -> list[float]:
    logits = model(torch.tensor([ids]), use_cache=False).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


def transformers_logprobs(
    model_dir, prompts: dict[int, list[int]]
) -> dict[int, tuple[list[float], list[float]]]:
    """Teacher-forced log-probs of each prompt's ids[1:], from the bfloat16 and the float32
    forward of the same weights: ``{key: (bf16, fp32)}``."""
    out: dict[int, list[list[float]]] = {key: [] for key in prompts}
    for dtype in (torch.bfloat16, torch.float32):
        model = _load(model_dir, dtype)
        for key, ids in prompts.items():
            out[key].append(_logprobs(model, ids))
        del model
    return {key: (v[0], v[1]) for key, v in out.items()}
