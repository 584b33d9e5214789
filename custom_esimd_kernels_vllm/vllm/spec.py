"""The KV-cache spec of a QSA layer: one vLLM-managed page holds both QSA caches.

A ``FullAttentionSpec`` subclass, so vLLM's own ``FullAttentionManager`` allocates, frees,
prefix-caches and block-tables it like any full-attention layer (no private side cache).
Its page is 512 tokens of ``TOKEN_BYTES`` = 1088 bytes (1024 bytes of packed K/V plus a
quarter of a 256-byte compressed key), i.e. ``paging.PAGE_BYTES`` = 557056 bytes; the layer
carves the two regions out of its buffer (``paging.carve``).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.kv_cache_interface import FullAttentionSpec

from ..qsa_ops.contract import HEAD_DIM, KV_PAGE
from .paging import CACHE_DTYPE, PAGE_BYTES, TOKEN_BYTES


@dataclass(frozen=True, kw_only=True)
class QSACacheSpec(FullAttentionSpec):
    """Full-attention paging with the QSA page size (one KV head of dim 256 plus keys)."""


def make_spec() -> QSACacheSpec:
    spec = QSACacheSpec(
        block_size=KV_PAGE,
        num_kv_heads=1,
        head_size=HEAD_DIM,
        dtype=CACHE_DTYPE,
        num_head_slots=1,
        state_content_bytes=TOKEN_BYTES,
    )
    assert spec.page_size_bytes == PAGE_BYTES, (spec.page_size_bytes, PAGE_BYTES)
    return spec
