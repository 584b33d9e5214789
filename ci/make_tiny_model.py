"""Make a tiny ``Qwen38QSAForCausalLM`` checkpoint locally (no hub): config, weights, tokenizer.

    python ci/make_tiny_model.py OUT_DIR [--tp 1|2] [--seed 0]

* config.json: a Qwen3 config (``model_type: qwen3``, so transformers' Qwen3 loads the same
  weights as a dense reference) with ``architectures: [Qwen38QSAForCausalLM]`` and the QSA
  fields (custom_esimd_kernels_vllm.vllm.qsa_config). Per tensor-parallel rank it is exactly
  the operator contract: ``--tp 1`` gives 3 query heads, 1 KV head of dim 256 and 4 indexer
  heads of dim 128; ``--tp 2`` gives 6 / 2 / 8 (3 / 1 / 4 per rank at TP=2).
* model.safetensors: random float32 weights from ``--seed`` (2 layers, hidden 256).
* tokenizer.json: a byte-level BPE tokenizer trained on ci/e2e/corpus.txt.

Deterministic: the same arguments give byte-identical files (checked by tests/e2e).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

CORPUS = Path(__file__).resolve().parent / "e2e" / "corpus.txt"
VOCAB_SIZE = 1024
HIDDEN = 256
INTERMEDIATE = 512
LAYERS = 2
HEAD_DIM = 256
INDEX_DIM = 128
BOS, EOS = "<|bos|>", "<|eos|>"


def make_config(tp: int, vocab_size: int, bos_id: int, eos_id: int) -> dict:
    return {
        "architectures": ["Qwen38QSAForCausalLM"],
        "model_type": "qwen3",
        "torch_dtype": "float32",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 3 * tp,
        "num_key_value_heads": tp,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "max_position_embeddings": 4096,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "index_n_heads": 4 * tp,
        "index_head_dim": INDEX_DIM,
        "qsa_token_topk": 2048,
        "qsa_compress_ratio": 4,
        "qsa_compression": "mean_attention_key",
    }


def make_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float32) * std).contiguous()

    def linear(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return normal(out_f, in_f, std=gain / math.sqrt(in_f))

    def norm(n: int) -> torch.Tensor:
        return 1.0 + normal(n, std=0.1)

    h, heads, kv = (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    weights = {"model.embed_tokens.weight": normal(config["vocab_size"], h, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update(
            {
                p + "input_layernorm.weight": norm(h),
                p + "self_attn.q_proj.weight": linear(heads * HEAD_DIM, h),
                p + "self_attn.k_proj.weight": linear(kv * HEAD_DIM, h),
                p + "self_attn.v_proj.weight": linear(kv * HEAD_DIM, h),
                p + "self_attn.o_proj.weight": linear(h, heads * HEAD_DIM),
                p + "self_attn.q_norm.weight": norm(HEAD_DIM),
                p + "self_attn.k_norm.weight": norm(HEAD_DIM),
                p + "self_attn.index_wq.weight": linear(config["index_n_heads"] * INDEX_DIM, h),
                p + "self_attn.index_wk.weight": linear(kv * INDEX_DIM, HEAD_DIM),
                p + "post_attention_layernorm.weight": norm(h),
                p + "mlp.gate_proj.weight": linear(config["intermediate_size"], h),
                p + "mlp.up_proj.weight": linear(config["intermediate_size"], h),
                p + "mlp.down_proj.weight": linear(h, config["intermediate_size"]),
            }
        )
    weights["model.norm.weight"] = norm(h)
    # NOTES: gain 4 spreads the logits (std ~4) so greedy choices are far from ties that
    # float32 summation order could flip between vLLM and the references.
    weights["lm_head.weight"] = linear(config["vocab_size"], h, gain=4.0)
    return weights


def train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.read_text().splitlines(), trainer=trainer)
    return tokenizer


def make_checkpoint(out: Path, tp: int = 1, seed: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(VOCAB_SIZE)
    tokenizer.save(str(out / "tokenizer.json"))
    bos_id, eos_id = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "model_max_length": 4096,
            },
            indent=2,
        )
        + "\n"
    )
    config = make_config(tp, VOCAB_SIZE, bos_id, eos_id)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(make_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tp", type=int, default=1, choices=(1, 2), help="heads for TP=1 or TP=2")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    make_checkpoint(args.out, args.tp, args.seed)
    print(f"tiny QSA checkpoint (tp={args.tp}, seed={args.seed}) written to {args.out}")


if __name__ == "__main__":
    main()
