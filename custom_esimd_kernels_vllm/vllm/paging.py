"""Cache geometry of one QSA layer and the views the operators take (torch only).

Two caches per layer, each a vLLM-managed layer of its own (``spec.py``):

* K/V: vLLM's per-layer view ``[P, 1, 512, 512]`` float16 (block, head, token, K then V) is
  the exact-packed buffer ``[P, 512, 512]`` with strides (262144, 512, 1); ``k_cache`` and
  ``v_cache`` are its ``[P, 512, 1, 256]`` views with strides (262144, 512, 256, 1), V at
  storage offset +256. Page x is one contiguous 524,288-byte range.
* Compressed keys: vLLM's per-layer view ``[P', 1, 128, 128]`` float16 is the selection's
  ``[P', 128, 1, 128]`` cache (a view: the head axis has size 1). Page x is one contiguous
  32,768-byte range.

The views are checked once, when vLLM binds the caches (``kv_views`` / ``ck_view`` raise
with what vLLM allocated and which layout would work); the per-step path only uses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import qsa_ops
from ..qsa_ops import reference
from ..qsa_ops.contract import (
    CK_PAGE,
    COMPRESS_RATIO,
    INDEX_DIM,
    KV_PAGE,
    PACKED_KV_STRIDES,
    PACKED_TOKEN_STRIDE,
    TOKEN_TOPK,
)
from ..qsa_ops.contract import (
    kv_views as _kv_views,
)

CACHE_DTYPE = torch.float16
KV_PAGE_ELEMENTS = KV_PAGE * PACKED_TOKEN_STRIDE  # 262144
CK_PAGE_ELEMENTS = CK_PAGE * INDEX_DIM  # 16384
KV_PAGE_BYTES = KV_PAGE_ELEMENTS * 2  # 524288
CK_PAGE_BYTES = CK_PAGE_ELEMENTS * 2  # 32768
TOKEN_BYTES = (KV_PAGE_BYTES + CK_PAGE_BYTES) // KV_PAGE  # 1088: one token in one layer
LAYOUT_HINT = "use a layer-outermost KV cache layout (VLLM_KV_CACHE_LAYOUT=LBNHC or LBHNC)"


@dataclass(frozen=True)
class KVViews:
    packed: torch.Tensor  # [P, 512, 512] float16, strides (262144, 512, 1)
    k_cache: torch.Tensor  # [P, 512, 1, 256] view, strides (262144, 512, 256, 1)
    v_cache: torch.Tensor  # [P, 512, 1, 256] view, storage offset + 256


def _check_layer_cache(
    layer_cache: torch.Tensor, layer_name: str, what: str, inner: tuple[int, int], why: str = ""
) -> None:
    """vLLM's per-layer view ``[P, 1, *inner]`` float16 of one QSA cache layer, else ValueError."""
    if (
        layer_cache.dtype != CACHE_DTYPE
        or layer_cache.dim() != 4
        or layer_cache.shape[1] != 1
        or tuple(layer_cache.shape[2:]) != inner
    ):
        raise ValueError(
            f"{layer_name}: vLLM allocated the {what} as dtype {layer_cache.dtype}, shape "
            f"{tuple(layer_cache.shape)}; QSA needs float16 (P, 1, {inner[0]}, {inner[1]}){why}"
        )


def kv_views(layer_cache: torch.Tensor, layer_name: str = "QSA layer") -> KVViews:
    """The operators' views of vLLM's K/V layer cache ``[P, 1, 512, 512]`` (ValueError when
    vLLM allocated anything else, e.g. under a block-outermost layout)."""
    _check_layer_cache(
        layer_cache, layer_name, "K/V cache", (KV_PAGE, PACKED_TOKEN_STRIDE),
        " (one KV head of dim 256, K then V per token)",
    )  # fmt: skip
    packed = layer_cache[:, 0]
    if tuple(packed.stride()) != PACKED_KV_STRIDES:
        raise ValueError(
            f"{layer_name}: the K/V cache pages have strides {tuple(packed.stride())}, QSA "
            f"needs {PACKED_KV_STRIDES} (one dense 524288-byte run per page); {LAYOUT_HINT}"
        )
    k_cache, v_cache = _kv_views(packed)
    return KVViews(packed, k_cache, v_cache)


def ck_view(layer_cache: torch.Tensor, layer_name: str = "QSA layer") -> torch.Tensor:
    """The selection's ``[P', 128, 1, 128]`` view of vLLM's compressed-key layer cache
    ``[P', 1, 128, 128]`` (ValueError for anything else)."""
    _check_layer_cache(layer_cache, layer_name, "compressed-key cache", (CK_PAGE, INDEX_DIM))
    view = layer_cache.transpose(1, 2)
    if not view.is_contiguous():
        raise ValueError(
            f"{layer_name}: the compressed-key cache pages have strides "
            f"{tuple(layer_cache.stride())}, QSA needs one dense 32768-byte run per page; "
            f"{LAYOUT_HINT}"
        )
    return view


def allocate(num_pages: int, device: torch.device | str = "cpu") -> tuple[KVViews, torch.Tensor]:
    """Zeroed caches of ``num_pages`` pages as vLLM would bind them (tests, reference model)."""
    kv = torch.zeros(num_pages, 1, KV_PAGE, PACKED_TOKEN_STRIDE, dtype=CACHE_DTYPE, device=device)
    ck = torch.zeros(num_pages, 1, CK_PAGE, INDEX_DIM, dtype=CACHE_DTYPE, device=device)
    return kv_views(kv), ck_view(ck)


def compress_keys(keys: torch.Tensor, index_wk: torch.Tensor) -> torch.Tensor:
    """Compressed keys of whole blocks: keys [N, 4, 256] float16, index_wk [128, 256] ->
    [N, 128] float16, the operator contract's rule (``reference.compress_block_keys``)."""
    return reference.compress_block_keys(keys, index_wk)


def reserve_workspaces(
    q: torch.Tensor,  # [T, 3, 256] float16: the profiling run's queries
    index_q: torch.Tensor,  # [T, 4, 128] float16
    positions: torch.Tensor,  # [T] int64
    selected: torch.Tensor,  # [>= T, 2051] int32: the model's selection buffer
    out: torch.Tensor,  # [T, 3, 256] float16
    max_pages: int,  # the page-table width of every step: ceil(max_model_len / 512)
) -> None:
    """Run selection and attention once at the largest shapes a step can have, on caches of one
    empty page, so that the op layer's per-stream workspaces are allocated during vLLM's
    profiling run, which sizes the KV cache from the peak memory it sees. CUDA tensors only
    (the PyTorch reference keeps no workspace); ``out`` is written with zeros (no valid row)."""
    if not q.is_cuda:
        return
    rows, device = q.shape[0], q.device
    table = torch.full((1, max_pages), -1, dtype=torch.int32, device=device)
    to_req = torch.zeros(rows, dtype=torch.int32, device=device)
    lengths = torch.zeros(1, dtype=torch.int32, device=device)
    ck = torch.zeros(1, CK_PAGE, 1, INDEX_DIM, dtype=CACHE_DTYPE, device=device)
    kv = torch.zeros(1, KV_PAGE, PACKED_TOKEN_STRIDE, dtype=CACHE_DTYPE, device=device)
    k_cache, v_cache = _kv_views(kv)
    indices = selected[:rows]
    qsa_ops.select_paged_tokens(
        index_q, ck, table, to_req, positions, lengths, TOKEN_TOPK, COMPRESS_RATIO, indices
    )
    qsa_ops.sparse_paged_attention(q, k_cache, v_cache, indices, table, to_req, KV_PAGE, out)
