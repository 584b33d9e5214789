"""Make a tiny ``Qwen4ExpForCausalLM`` checkpoint locally (no hub): config, weights, tokenizer.

    python ci/make_tiny_qwen4exp.py OUT_DIR [--tp 1|2] [--mixed] [--seed 0]

The config is transformers' own ``Qwen4ExpTextConfig`` (``model_type: qwen4_exp_text``,
``architectures: [Qwen4ExpForCausalLM]``), so vLLM's ``Qwen4ExpForCausalLM`` and transformers'
implementation load the same files. Every feature the config cannot switch off is kept, at its
smallest: hyper-connections (2 streams, rank 16), a mixture of experts (4 experts, 2 per token,
plus the shared expert). QSA is the real one: budget 2048, compression ratio 4, an indexer of
4 heads x 128 with 1 key head, partial RoPE 0.25 (rotary dim 64, what vLLM's fused path wants).
Per tensor-parallel rank the attention is exactly the operators' contract: ``--tp 1`` gives
3 query heads and 1 KV head of 256, ``--tp 2`` gives 6 / 2 (3 / 1 per rank at TP = 2); the
indexer is replicated on every rank, so it is 4 heads at either size.

``--mixed``: the first layer is a Gated DeltaNet (linear attention) layer, the second QSA
(vLLM runs a mixed model with prefix caching on); without it both layers are QSA.

Weights are bfloat16 (vLLM's QSA requires it), drawn from ``--seed`` with these choices:
* every embedding row shares one direction ``u`` (weight ``EMBED_COMMON``), and the indexer's
  query and key projections map ``u`` onto the un-rotated half of each 128-dim head
  (weight ``INDEX_COMMON``): every ReLU(q . k) is then well above 0, so the block scores
  have no exact-zero ties and spread far beyond bf16 rounding, and the selection of the
  top 512 blocks is decided by margins that both implementations resolve the same way;
* the LM head has gain 4 (logits with std ~4), so greedy tokens are far from ties.
Deterministic: the same arguments give byte-identical files (tests/e2e checks it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Run as a script, ci/ is sys.path[0], where a module of ci/ could shadow a distribution that
# transformers imports: take it off the path.
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    sys.path.pop(0)

import torch  # noqa: E402

CORPUS = HERE / "e2e" / "corpus.txt"
BOS, EOS = "<|bos|>", "<|eos|>"
VOCAB_SIZE = 1024
HIDDEN = 256
LAYERS = 2
HEAD_DIM = 256
INDEX_HEADS = 4
INDEX_DIM = 128
ROTARY_FACTOR = 0.25  # rotary dim 64 of 256 (and of the indexer's 128)
TOKEN_TOPK = 2048
COMPRESS_RATIO = 4
MAX_POSITIONS = 8192
EMBED_COMMON = 1.0
INDEX_COMMON = 0.15


def make_config(tp: int, mixed: bool, vocab_size: int, bos_id: int, eos_id: int):
    from transformers import Qwen4ExpTextConfig

    layer_types = (
        ["linear_attention", "indexed_attention"] if mixed else ["indexed_attention"] * LAYERS
    )
    config = Qwen4ExpTextConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        layer_types=layer_types,
        num_attention_heads=3 * tp,
        num_key_value_heads=tp,
        head_dim=HEAD_DIM,
        hidden_act="silu",
        output_gate_type="sigmoid",
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": ROTARY_FACTOR,
        },
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        hc_count=2,
        hc_lowrank=16,
        indexer_n_heads=INDEX_HEADS,
        indexer_kv_heads=1,
        indexer_head_dim=INDEX_DIM,
        indexer_budget=TOKEN_TOPK,
        indexer_compress_ratio=COMPRESS_RATIO,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    config.architectures = ["Qwen4ExpForCausalLM"]
    config.dtype = torch.bfloat16
    return config


def _fill(name: str, param: torch.Tensor, gen: torch.Generator, u: torch.Tensor) -> torch.Tensor:
    """The deterministic value of one parameter (float32), chosen by its name."""
    shape = tuple(param.shape)

    def normal(std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return normal(0.1)  # (1 + w) norms: gains around 1
    if name.endswith("A_log"):
        return torch.rand(*shape, generator=gen).mul(15.0).add(1.0).log()
    if name.endswith("dt_bias"):
        return torch.ones(shape)
    if name.endswith("conv1d.weight"):
        return normal(0.5)
    if name == "model.embed_tokens.weight":
        # one shared direction (module docstring), as long as the random part of a row
        return normal(1.0) + EMBED_COMMON * math.sqrt(HIDDEN) * u
    if name == "lm_head.weight":
        return normal(4.0 / math.sqrt(shape[1]))
    if name.endswith("indexer.index_qk_proj.weight"):
        w = normal(1.0 / math.sqrt(shape[1]))
        # Every head's un-rotated half reads u: a shared positive component of q . k.
        rotary = int(INDEX_DIM * (HEAD_DIM * ROTARY_FACTOR) / HEAD_DIM)
        for head in range(shape[0] // INDEX_DIM):
            rows = slice(head * INDEX_DIM + rotary, (head + 1) * INDEX_DIM)
            w[rows] += INDEX_COMMON * u
        return w
    if param.ndim == 3:  # fused experts [E, out, in]
        return normal(1.0 / math.sqrt(shape[2]))
    if param.ndim >= 2:
        return normal(1.0 / math.sqrt(shape[-1]))
    return normal(0.02)


def make_model(config, seed: int):
    from transformers import Qwen4ExpForCausalLM

    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(HIDDEN, generator=gen)
    u = u / u.norm()  # unit vector
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            param.copy_(_fill(name, param, gen, u))
    return model.to(torch.bfloat16)


def train_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on ci/e2e/corpus.txt (no hub)."""
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


def make_checkpoint(out: Path, tp: int = 1, mixed: bool = False, seed: int = 0) -> Path:
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
                "model_max_length": MAX_POSITIONS,
            },
            indent=2,
        )
        + "\n"
    )
    config = make_config(tp, mixed, VOCAB_SIZE, bos_id, eos_id)
    model = make_model(config, seed)
    model.save_pretrained(out, safe_serialization=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tp", type=int, default=1, choices=(1, 2), help="heads for TP=1 or TP=2")
    parser.add_argument("--mixed", action="store_true", help="linear-attention + QSA layers")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    make_checkpoint(args.out, args.tp, args.mixed, args.seed)
    print(f"tiny Qwen4Exp checkpoint (tp={args.tp}, mixed={args.mixed}) written to {args.out}")


if __name__ == "__main__":
    main()
