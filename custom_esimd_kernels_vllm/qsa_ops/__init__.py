"""Public ABI of the QSA operators (positional order of the existing ``qsa_ops`` ABI).

Each function calls its ``torch.ops.qsa`` operator (``qsa_ops.ops``: one schema per operator,
the backend chosen once at import) and returns the caller's ``out``. The operator validates
every argument before anything runs (C++ for CUDA tensors, ``qsa_ops.contract`` otherwise);
a refusal is a TypeError/ValueError naming the argument, what was expected and what was given,
and nothing is written.
"""

from __future__ import annotations

import weakref

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
    "update_caches",
]

_select = torch.ops.qsa.select_paged_tokens.default
_attention = torch.ops.qsa.sparse_paged_attention.default
_update = torch.ops.qsa.update_caches.default


def _is_int(value: object) -> bool:
    return type(value) is int  # bool and other int look-alikes take contract.py's checks


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
    args = (q, k_cache, v_cache, logical_indices, page_table, token_to_req, page_size, out,
            softmax_scale)  # fmt: skip
    if torch.compiler.is_compiling():  # traced once: check what metadata shows, then the op
        contract.validate_attention_args(*args, check_storage=False)
        kv = contract.packed_kv_buffer(k_cache)
        _attention(q, kv, logical_indices, page_table, token_to_req, page_size, out, softmax_scale)
        return out
    if not (_is_int(page_size) and (softmax_scale is None or type(softmax_scale) is float)):
        contract.validate_attention_args(*args)  # types the schema would coerce
    kv = _packed_buffer(k_cache, v_cache)
    if kv is None:
        contract.validate_attention_args(*args)  # raises with the contract's ordered message
        kv = contract.packed_kv_buffer(k_cache)  # (only reached if it did not)
    try:
        _attention(q, kv, logical_indices, page_table, token_to_req, page_size, out, softmax_scale)
    except (RuntimeError, TypeError, ValueError) as exc:
        ops.raise_refusal(exc, "sparse_paged_attention", args)
    return out


def update_caches(
    key: torch.Tensor,  # [T, 256] float16
    value: torch.Tensor,  # [T, 256] float16
    slot_mapping: torch.Tensor,  # [T] int64: page * 512 + offset, -1 = padded row
    compressed_slot_mapping: torch.Tensor,  # [T] int64: page * 128 + j, -1 = none
    index_wk: torch.Tensor,  # [128, 256] float32
    kv_cache: torch.Tensor,  # [P, 512, 512] float16 exact-packed, written
    compressed_key_cache: torch.Tensor,  # [Q, 128, 1, 128] float16, written
) -> None:
    """Write the step's K/V at their slots, then refresh the compressed key of every row with
    a compressed slot from the 4 cached keys of its block (contract section "update_caches")."""
    args = (key, value, slot_mapping, compressed_slot_mapping, index_wk, kv_cache,
            compressed_key_cache)  # fmt: skip
    if torch.compiler.is_compiling():
        _update(*args)
        return
    try:
        _update(*args)
    except (RuntimeError, TypeError, ValueError) as exc:
        ops.raise_refusal(exc, "update_caches", args)


_KV_STRIDES = contract.KV_STRIDES
_KV_SHAPE = (KV_PAGE, 1, HEAD_DIM)
_V_BYTES = 2 * HEAD_DIM  # v_cache starts 256 float16 after k_cache
_PAIR = "_qsa_packed_pair"  # attribute of a checked k_cache: (weakref to its v_cache, buffer)


def _packed_buffer(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """The [P, 512, 512] buffer whose two views are (k, v), or None when they are not such a
    pair (contract.py then words the refusal; the operator checks the buffer itself).

    NOTES: a serving loop passes the same two view objects at every step, and checking them
    from Python costs about 9 us on the H200 host (measured), so a checked pair remembers its
    buffer on the k_cache object (its lifetime, no global cache); a later call re-checks only
    that v is the same object and that neither view moved (their data pointers)."""
    try:
        pair = k.__dict__.get(_PAIR)
        if pair is not None and pair[0]() is v and v.data_ptr() - k.data_ptr() == _V_BYTES:
            return pair[1]
        ok = (
            k.stride() == _KV_STRIDES
            and v.stride() == _KV_STRIDES
            and k.shape[1:] == _KV_SHAPE
            and v.shape == k.shape
            and k.dtype is torch.float16
            and v.dtype is torch.float16
            and v.device == k.device
            and v.storage_offset() == k.storage_offset() + HEAD_DIM
            and v.data_ptr() - k.data_ptr() == _V_BYTES
            and k.untyped_storage().nbytes()
            >= 2 * (k.storage_offset() + k.shape[0] * _KV_STRIDES[0])
        )
    except (AttributeError, IndexError, TypeError):
        return None
    if not ok:
        return None
    kv = contract.packed_kv_buffer(k)
    k.__dict__[_PAIR] = (weakref.ref(v), kv)
    return kv


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
