"""The QSA fields of a ``Qwen38QSAForCausalLM`` checkpoint config and their per-rank check.

A checkpoint is a Qwen3 config (``model_type: qwen3``: RMSNorm, q/k norm, RoPE, SwiGLU MLP)
whose attention is QSA. The extra fields are::

    "index_n_heads": 4 * num_key_value_heads   indexer query heads (4 per KV head)
    "index_head_dim": 128                      indexer head dimension
    "qsa_token_topk": 2048                     tokens chosen per query row
    "qsa_compress_ratio": 4                    tokens per compressed key
    "qsa_compression": "mean_attention_key"    how a compressed key is made (below)

Compression ``mean_attention_key``: the indexer key of token t is ``W_ik @ K_t`` where
``K_t`` is the token's cached attention key (float16, after k-norm and RoPE) and ``W_ik``
(``self_attn.index_wk.weight``, [128, 256] per KV head) is learned; a compressed key is the
mean of the indexer keys of its 4 tokens, i.e. ``W_ik @ mean(K_4j .. K_4j+3)`` in float32,
stored as float16. It is computed when the block's last token is written, from the K/V cache
alone, so the model keeps no compressor state and a recomputed or rewritten token (chunked
prefill, preemption, prefix caching) always yields the same key.

Tensor parallelism splits heads: every rank must hold exactly the operators' contract,
3 query heads, 1 KV head of dim 256 and 4 indexer heads of dim 128. The full model is
24 / 8 / 32 heads at TP8; the tiny test model is 3 / 1 / 4 at TP1 or 6 / 2 / 8 at TP2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..qsa_ops import contract

COMPRESSION = "mean_attention_key"


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


@dataclass(frozen=True)
class QSAConfig:
    num_heads: int  # query heads, whole model
    num_kv_heads: int
    head_dim: int
    index_heads: int
    index_dim: int
    token_topk: int
    compress_ratio: int
    compression: str

    @classmethod
    def from_hf(cls, config: Any) -> QSAConfig:
        """Read the QSA fields (ValueError naming a missing field)."""
        missing = [
            name
            for name in ("num_attention_heads", "num_key_value_heads", "head_dim", "index_n_heads")
            if _get(config, name) is None
        ]
        if missing:
            raise ValueError(f"QSA config lacks field(s) {', '.join(missing)}")
        return cls(
            num_heads=int(_get(config, "num_attention_heads")),
            num_kv_heads=int(_get(config, "num_key_value_heads")),
            head_dim=int(_get(config, "head_dim")),
            index_heads=int(_get(config, "index_n_heads")),
            index_dim=int(_get(config, "index_head_dim", contract.INDEX_DIM)),
            token_topk=int(_get(config, "qsa_token_topk", contract.TOKEN_TOPK)),
            compress_ratio=int(_get(config, "qsa_compress_ratio", contract.COMPRESS_RATIO)),
            compression=str(_get(config, "qsa_compression", COMPRESSION)),
        )

    def check_rank(self, tp_size: int) -> None:
        """ValueError unless one tensor-parallel rank of ``tp_size`` is exactly the contract."""
        problems = []
        for what, total, per_rank in (
            ("num_attention_heads", self.num_heads, contract.ATTN_HEADS),
            ("num_key_value_heads", self.num_kv_heads, 1),
            ("index_n_heads", self.index_heads, contract.INDEX_HEADS),
        ):
            if total != per_rank * tp_size:
                problems.append(
                    f"{what} must be {per_rank} * TP = {per_rank * tp_size}, got {total}"
                )
        for what, value, expected in (
            ("head_dim", self.head_dim, contract.HEAD_DIM),
            ("index_head_dim", self.index_dim, contract.INDEX_DIM),
            ("qsa_token_topk", self.token_topk, contract.TOKEN_TOPK),
            ("qsa_compress_ratio", self.compress_ratio, contract.COMPRESS_RATIO),
        ):
            if value != expected:
                problems.append(f"{what} must be {expected}, got {value}")
        if self.compression != COMPRESSION:
            problems.append(f"qsa_compression must be {COMPRESSION!r}, got {self.compression!r}")
        if problems:
            raise ValueError(
                f"QSA model does not match the per-rank operator contract at tensor parallel "
                f"size {tp_size} (3 query heads, 1 KV head of dim 256, 4 indexer heads of dim "
                f"128 per rank): " + "; ".join(problems)
            )
