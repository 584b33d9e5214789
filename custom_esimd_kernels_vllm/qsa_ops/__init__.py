"""Public ABI of the QSA operators (positional order of the existing ``qsa_ops`` ABI).

Both operators validate every argument first (``qsa_ops.contract``; TypeError/ValueError,
nothing written on refusal), then run the ``torch.ops.qsa`` custom op, which picks the
backend (``qsa_ops.dispatch``; env ``QSA_BACKEND``), and return the caller's ``out``.
"""

from __future__ import annotations

import torch

from . import contract, dispatch, reference
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
    "dispatch",
    "reference",
    "select_paged_tokens",
    "sparse_paged_attention",
]


def _validated_select(*args) -> None:
    dispatch.validated_call(torch.ops.qsa.select_paged_tokens, *args)


def _validated_attention(*args) -> None:
    dispatch.validated_call(torch.ops.qsa.sparse_paged_attention, *args)


def select_paged_tokens(
    q: torch.Tensor,  # [R, 4, 128] float16
    compressed_key_cache: torch.Tensor,  # [P, 128, 1, 128] float16
    page_table: torch.Tensor,  # [B, M] int32
    token_to_req: torch.Tensor,  # [R] int32
    query_positions: torch.Tensor,  # [R] int64
    sequence_lengths: torch.Tensor,  # [B] int32
    token_topk: int,  # must be 2048
    compress_ratio: int,  # must be 4
    out: torch.Tensor,  # [R, 2051] int32, fully overwritten
) -> torch.Tensor:
    """Select up to 2051 logical token positions per row (contract section 1); returns ``out``."""
    compiling = torch.compiler.is_compiling()
    contract.validate_select_args(
        q,
        compressed_key_cache,
        page_table,
        token_to_req,
        query_positions,
        sequence_lengths,
        token_topk,
        compress_ratio,
        out,
        check_storage=not compiling,
    )
    call = torch.ops.qsa.select_paged_tokens if compiling else _validated_select
    call(
        q,
        compressed_key_cache,
        page_table,
        token_to_req,
        query_positions,
        sequence_lengths,
        token_topk,
        compress_ratio,
        out,
    )
    return out


def sparse_paged_attention(
    q: torch.Tensor,  # [R, 3, 256] float16
    k_cache: torch.Tensor,  # [P, 512, 1, 256] float16, strides (262144, 512, 256, 1)
    v_cache: torch.Tensor,  # [P, 512, 1, 256] float16, storage offset of k_cache + 256
    logical_indices: torch.Tensor,  # [R, 2051] int32, -1 = hole
    page_table: torch.Tensor,  # [B, M] int32
    token_to_req: torch.Tensor,  # [R] int32
    page_size: int,  # must be 512
    out: torch.Tensor,  # [R, 3, 256] float16, fully overwritten
    softmax_scale: float | None = None,  # default 1/sqrt(256)
) -> torch.Tensor:
    """Sparse attention over the listed tokens (contract section 2); returns ``out``."""
    compiling = torch.compiler.is_compiling()
    scale = contract.validate_attention_args(
        q,
        k_cache,
        v_cache,
        logical_indices,
        page_table,
        token_to_req,
        page_size,
        out,
        softmax_scale,
        check_storage=not compiling,
    )
    call = torch.ops.qsa.sparse_paged_attention if compiling else _validated_attention
    kv = contract.packed_kv_buffer(k_cache)
    call(q, kv, logical_indices, page_table, token_to_req, page_size, out, scale)
    return out


def build_info() -> dict:
    """What runs: package version, backend choice, contract constants, the compiled
    module's own build_info() (arch, macros, version, source SHA256) when it loads, and the
    provenance summary (shipped manifest, loaded DSO SHA256, whether they match)."""
    from .. import __version__
    from . import provenance

    cuda_ok, cuda_reason = dispatch.cuda_status()
    info: dict = {
        "version": __version__,
        "torch": torch.__version__,
        "backend_env": dispatch.requested_backend(),
        "backends": list(dispatch.BACKENDS),
        "contract": dict(contract.CONSTANTS),
        "cuda_available": cuda_ok,
        "cuda_reason": cuda_reason,
        "cuda_build": None,
        "provenance": provenance.summary(),
    }
    if cuda_ok:
        from . import _cuda  # the only module that talks to the compiled _qsa_cuda

        info["cuda_build"] = _cuda.build_info()
    return info
