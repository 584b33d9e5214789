"""Cache geometry of one QSA layer and the cache writes of one forward (torch only).

One KV-cache block (page) of 512 tokens holds, per layer, two regions of one raw float16
buffer of ``P`` pages, both addressed by the same physical page id:

* ``[0, P * 262144)``: the exact-packed K/V cache ``[P, 512, 512]`` (per token 256 K values
  then 256 V values), viewed as ``k_cache``/``v_cache`` ``[P, 512, 1, 256]`` with strides
  (262144, 512, 256, 1) and V at storage offset +256, as the attention operator requires;
* ``[P * 262144, P * 278528)``: the compressed-key cache ``[P, 128, 1, 128]``.

NOTES: the regions are carved from the layer's whole buffer, not interleaved per page: an
interleaved page (512 KiB K/V + 32 KiB keys) would make the K/V page stride 278528, and the
operator contract fixes it at 262144. Bytes per page: 512 * 1024 + 128 * 256 = 557056.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..qsa_ops.contract import (
    CK_PAGE,
    COMPRESS_RATIO,
    HEAD_DIM,
    INDEX_DIM,
    KV_PAGE,
    KV_STRIDES,
    PACKED_TOKEN_STRIDE,
    V_OFFSET,
)

CACHE_DTYPE = torch.float16
KV_PAGE_ELEMENTS = KV_PAGE * PACKED_TOKEN_STRIDE  # 262144
CK_PAGE_ELEMENTS = CK_PAGE * INDEX_DIM  # 16384
PAGE_ELEMENTS = KV_PAGE_ELEMENTS + CK_PAGE_ELEMENTS  # 278528
PAGE_BYTES = PAGE_ELEMENTS * 2  # 557056
TOKEN_BYTES = PAGE_BYTES // KV_PAGE  # 1088: what one token costs in one layer


@dataclass(frozen=True)
class QSALayerCache:
    kv_pages: torch.Tensor  # [P, 512, 512] float16, exact-packed K/V
    k_cache: torch.Tensor  # [P, 512, 1, 256] view of kv_pages
    v_cache: torch.Tensor  # [P, 512, 1, 256] view of kv_pages, storage offset +256
    ck_cache: torch.Tensor  # [P, 128, 1, 128] float16 compressed keys

    @property
    def num_pages(self) -> int:
        return self.kv_pages.shape[0]


def carve(flat: torch.Tensor, num_pages: int) -> QSALayerCache:
    """Split one layer's contiguous float16 buffer of ``num_pages`` pages into the caches."""
    if flat.dtype != CACHE_DTYPE or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(
            f"QSA layer cache must be a contiguous 1-D float16 buffer, got dtype {flat.dtype}, "
            f"shape {tuple(flat.shape)}, strides {flat.stride()}"
        )
    if flat.numel() != num_pages * PAGE_ELEMENTS:
        raise ValueError(
            f"QSA layer cache of {num_pages} pages must hold {num_pages * PAGE_ELEMENTS} "
            f"float16 elements ({PAGE_BYTES} bytes per page), got {flat.numel()}"
        )
    kv_pages = flat[: num_pages * KV_PAGE_ELEMENTS].view(num_pages, KV_PAGE, PACKED_TOKEN_STRIDE)
    ck_cache = flat[num_pages * KV_PAGE_ELEMENTS :].view(num_pages, CK_PAGE, 1, INDEX_DIM)
    shape = (num_pages, KV_PAGE, 1, HEAD_DIM)
    base = kv_pages.storage_offset()
    k_cache = kv_pages.as_strided(shape, KV_STRIDES, base)
    v_cache = kv_pages.as_strided(shape, KV_STRIDES, base + V_OFFSET)
    return QSALayerCache(kv_pages, k_cache, v_cache, ck_cache)


def allocate(num_pages: int, device: torch.device | str = "cpu") -> QSALayerCache:
    """A zeroed cache of ``num_pages`` pages (reference model and tests; vLLM allocates its own)."""
    return carve(
        torch.zeros(num_pages * PAGE_ELEMENTS, dtype=CACHE_DTYPE, device=device), num_pages
    )


def compress_keys(keys: torch.Tensor, index_wk: torch.Tensor) -> torch.Tensor:
    """Compressed keys from the cached keys of whole blocks.

    keys: [N, 4, 256] float16 (the block's 4 cached attention keys, in token order);
    index_wk: [128, 256] -> [N, 128] float16 = W_ik @ (((K0 + K1) + K2) + K3) / 4.

    NOTES: float32 math in a fixed order (explicit sum of the 4 rows, then an elementwise
    product and a sum over 256) rather than a matmul, whose blocking may change the last bit
    with the number of rows: the vLLM layer (any batch) and the reference model (one request)
    must produce bit-identical keys, because exact score ties decide the selection order.
    """
    k = keys.float()
    mean = (((k[:, 0] + k[:, 1]) + k[:, 2]) + k[:, 3]) * 0.25  # [N, 256]
    w = index_wk.float()
    return (mean[:, None, :] * w[None, :, :]).sum(dim=-1).to(CACHE_DTYPE)  # [N, 128]


def write_kv(cache: QSALayerCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store K/V of new tokens: k, v [T, 256] float16; slots [T] int64 = page * 512 + offset."""
    rows = cache.kv_pages.view(-1, PACKED_TOKEN_STRIDE)
    rows.index_copy_(0, slots, torch.cat([k, v], dim=-1))


def write_compressed_keys(
    cache: QSALayerCache, slots: torch.Tensor, index_wk: torch.Tensor
) -> None:
    """Refresh the compressed key of the block of every new token (call after write_kv).

    slots: [T] int64 physical slots of the new tokens. Each token rewrites its block's key from
    the 4 cached rows of that block (a block never straddles pages: 512 % 4 == 0). Tokens of one
    block compute the same value, so duplicate writes agree; a block whose last token is not
    written yet gets a provisional value that selection never reads (it only reads blocks of
    4 visible tokens) and that the block's last token overwrites.
    """
    page = torch.div(slots, KV_PAGE, rounding_mode="floor")
    first = page * KV_PAGE + (slots % KV_PAGE) // COMPRESS_RATIO * COMPRESS_RATIO  # [T]
    rows = first[:, None] + torch.arange(COMPRESS_RATIO, device=slots.device)  # [T, 4]
    keys = cache.kv_pages.view(-1, PACKED_TOKEN_STRIDE)[rows, :HEAD_DIM]  # [T, 4, 256]
    target = page * CK_PAGE + (slots % KV_PAGE) // COMPRESS_RATIO  # [T]
    cache.ck_cache.view(-1, INDEX_DIM).index_copy_(0, target, compress_keys(keys, index_wk))
