"""The two KV-cache specs of a QSA layer (vLLM's own spec classes, no subclass).

* K/V: a plain ``FullAttentionSpec`` of one KV head of dim 256, float16, 512-token blocks:
  page = 512 x (256 K + 256 V) x 2 B = 524,288 B, and vLLM's per-layer view ``[P, 1, 512,
  512]`` is exactly the operators' exact-packed buffer (``paging.kv_views``).
* Compressed keys: an ``MLAAttentionSpec`` with ``tokens_per_state = 4`` (as upstream vLLM's
  QSA compressed-key cache): 128 states of 128 float16 values per 512-token block = 32,768 B,
  per-layer view ``[P, 1, 128, 128]`` (``paging.ck_view``).

Both are FullAttentionSpec-based with the same block size, so vLLM's allocator puts them in
one ``UniformTypeKVCacheSpecs`` group (one block table, each layer its own tensor); the
layer nevertheless passes each operator its own layer's page table, so nothing depends on
that grouping.
"""

from __future__ import annotations

from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from ..qsa_ops.contract import COMPRESS_RATIO, HEAD_DIM, INDEX_DIM, KV_PAGE
from .paging import CACHE_DTYPE, CK_PAGE_BYTES, KV_PAGE_BYTES


def make_kv_spec() -> FullAttentionSpec:
    spec = FullAttentionSpec(
        block_size=KV_PAGE, num_kv_heads=1, head_size=HEAD_DIM, dtype=CACHE_DTYPE
    )
    assert spec.page_size_bytes == KV_PAGE_BYTES, (spec.page_size_bytes, KV_PAGE_BYTES)
    return spec


def make_ck_spec() -> MLAAttentionSpec:
    spec = MLAAttentionSpec(
        block_size=KV_PAGE,
        num_kv_heads=1,
        head_size=INDEX_DIM,
        dtype=CACHE_DTYPE,
        tokens_per_state=COMPRESS_RATIO,
    )
    assert spec.page_size_bytes == CK_PAGE_BYTES, (spec.page_size_bytes, CK_PAGE_BYTES)
    return spec
