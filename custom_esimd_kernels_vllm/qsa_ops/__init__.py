"""Public ABI of the QSA operators (positional order of the existing ``qsa_ops`` ABI).

Each function calls its ``torch.ops.qsa`` operator (``qsa_ops.ops``: one schema per operator,
the backend chosen once at import) and returns the caller's ``out``. The operator validates
every argument before anything runs (C++ for CUDA tensors, ``qsa_ops.contract`` otherwise);
a refusal is a TypeError/ValueError naming the argument, what was expected and what was given,
and nothing is written.
"""

from __future__ import annotations

import torch

from . import contract, ops, reference
from .contract import (
    ATTN_HEADS,
    BLOCK_TOPK,
    CK_PAGE,
    COMPRESS_RATIO,
    HEAD_DIM,
    INDEX_DIM,
    INDEX_HEADS,
    KV_PAGE,
    TAIL,
    TOKEN_TOPK,
    WIDTH,
)

__all__ = [
    "ATTN_HEADS",
    "BLOCK_TOPK",
    "CK_PAGE",
    "COMPRESS_RATIO",
    "HEAD_DIM",
    "INDEX_DIM",
    "INDEX_HEADS",
    "KV_PAGE",
    "TAIL",
    "TOKEN_TOPK",
    "WIDTH",
    "build_info",
    "contract",
    "ops",
    "reference",
    "select_paged_tokens",
    "sparse_paged_attention",
    "summary",
]

_select = torch.ops.qsa.select_paged_tokens.default
_attention = torch.ops.qsa.sparse_paged_attention.default


def _is_int(value: object) -> bool:
    return type(value) is int  # bool and other int look-alikes take contract.py's checks


def _is_float(value: object) -> bool:
    return value is None or type(value) is float


def select_paged_tokens(
    q: torch.Tensor,  # [R, 4, 128] float16, bfloat16 or float8_e4m3fn
    compressed_key_cache: torch.Tensor,  # [P, C, 1, 128] q's dtype, last stride 1
    page_table: torch.Tensor,  # [B, M] int32 (rows may be strided)
    token_to_req: torch.Tensor,  # [R] int32
    query_positions: torch.Tensor,  # [R] int64
    sequence_lengths: torch.Tensor,  # [B] int32
    token_topk: int,  # must be 2048
    compress_ratio: int,  # must be 4
    out: torch.Tensor,  # [R, 2051] int32 (rows may be strided), fully overwritten
) -> torch.Tensor:
    """Select up to 2051 logical token positions per row (contract section 1); returns ``out``."""
    args = (q, compressed_key_cache, page_table, token_to_req, query_positions,
            sequence_lengths, token_topk, compress_ratio, out)  # fmt: skip
    if torch.compiler.is_compiling():
        _select(*args)
        return out
    if not (_is_int(token_topk) and _is_int(compress_ratio)):
        contract.validate_select_args(*args)  # types the schema would coerce (bool -> int)
    try:
        _select(*args)
    except (RuntimeError, TypeError, ValueError) as exc:
        ops.raise_refusal(exc, "select_paged_tokens", args)
    return out


def sparse_paged_attention(
    q: torch.Tensor,  # [R, 3, 256] float16 or bfloat16
    k_cache: torch.Tensor,  # [P, page_size, 1, 256] q's dtype or float8_e4m3fn, last stride 1
    v_cache: torch.Tensor,  # [P, page_size, 1, 256] k_cache's dtype (same or other storage)
    logical_indices: torch.Tensor,  # [R, 2051] int32 (rows may be strided), -1 = hole
    page_table: torch.Tensor,  # [B, M] int32 (rows may be strided)
    token_to_req: torch.Tensor,  # [R] int32
    page_size: int,  # k_cache.shape[1], a positive multiple of 4
    out: torch.Tensor,  # [R, 3, 256] q's dtype, fully overwritten
    softmax_scale: float | None = None,  # default 1/sqrt(256)
    *,
    k_scale: float | None = None,  # float8 caches only: K = value * k_scale
    v_scale: float | None = None,  # float8 caches only: V = value * v_scale
    gate: torch.Tensor | None = None,  # [R, 3, 256] q's dtype: out = attn * sigmoid(gate)
) -> torch.Tensor:
    """Sparse attention over the listed tokens (contract section 2); returns ``out``."""
    args = (q, k_cache, v_cache, logical_indices, page_table, token_to_req, page_size, out,
            softmax_scale)  # fmt: skip
    # NOTES: the seed's call (no scales, no gate) goes to the operator without keywords: its
    # host cost is the one measured before contract v2 (benchmark host_overhead).
    seed_call = k_scale is None and v_scale is None and gate is None
    kwargs = {} if seed_call else {"k_scale": k_scale, "v_scale": v_scale, "gate": gate}
    if torch.compiler.is_compiling():
        _attention(*args, **kwargs)
        return out
    if not (
        type(page_size) is int
        and (softmax_scale is None or type(softmax_scale) is float)
        and (seed_call or (_is_float(k_scale) and _is_float(v_scale)))
    ):
        contract.validate_attention_args(*args, **kwargs)  # types the schema would coerce
    try:
        _attention(*args, **kwargs)
    except (RuntimeError, TypeError, ValueError) as exc:
        ops.raise_refusal(exc, "sparse_paged_attention", args, kwargs)
    return out


def build_info() -> dict:
    """What runs: package version, torch, the backend chosen for CUDA tensors (and why), the
    contract constants, the compiled library's own build facts when it is loaded, and the
    provenance summary (shipped manifest, loaded library SHA256, whether they match)."""
    from .. import __version__
    from . import provenance

    return {
        "version": __version__,
        "torch": torch.__version__,
        "backend_env": ops.REQUESTED,
        "cuda_backend": ops.BACKEND,
        "library_error": ops.LIBRARY_ERROR,
        "contract": dict(contract.CONSTANTS),
        "library": ops.library_info() if ops.BACKEND == "cuda" else None,
        "provenance": provenance.summary(),
    }


def summary() -> str:
    """A few readable lines: which backend runs CUDA tensors, and the library's SHA256."""
    info = build_info()
    lines = [
        f"custom_esimd_kernels_vllm {info['version']} (torch {info['torch']})",
        "CPU tensors:  PyTorch reference (qsa_ops.reference)",
    ]
    if info["cuda_backend"] == "cuda":
        lib = info["library"]
        lines.append(f"CUDA tensors: compiled kernels for {lib['arch']} ({ops.LIBRARY_PATH.name})")
        lines.append(f"  source sha256  {lib['source_sha256']}")
    else:
        lines.append(f"CUDA tensors: {info['cuda_backend']} ({info['library_error']})")
    dso = info["provenance"].get("dso")
    if dso:
        lines.append(f"  library sha256 {dso['sha256']}")
    return "\n".join(lines)
