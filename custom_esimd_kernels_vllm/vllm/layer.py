"""The QSA attention layer: cache writes, token selection and sparse attention per forward.

Per step and layer (``qsa_attention`` below), with the step's ``QSAMetadata``:

1. store the new tokens' K/V into the exact-packed cache at their vLLM slots;
2. refresh the compressed key of each new token's block from the cached keys;
3. ``qsa_ops.select_paged_tokens`` picks up to 2051 visible tokens per query row
   (query_positions = the tokens' positions, sequence_lengths = tokens stored per request);
4. ``qsa_ops.sparse_paged_attention`` attends over exactly those tokens.

Both operators go through the package's public API: CUDA kernels for CUDA tensors when they
are built, the PyTorch reference elsewhere (``QSA_BACKEND``).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.utils.torch_utils import direct_register_custom_op

from .. import qsa_ops
from ..qsa_ops.contract import (
    ATTN_HEADS,
    COMPRESS_RATIO,
    HEAD_DIM,
    INDEX_DIM,
    INDEX_HEADS,
    KV_PAGE,
    TOKEN_TOPK,
    WIDTH,
)
from . import paging
from .backend import QSABackend, QSAImpl, QSAMetadata
from .spec import QSACacheSpec, make_spec


class QSAAttention(nn.Module, AttentionLayerBase):
    """One rank's QSA attention over vLLM-managed caches (3 query heads, 1 KV head)."""

    def __init__(self, scale: float, prefix: str) -> None:
        super().__init__()
        self.layer_name = prefix
        self.num_heads = ATTN_HEADS
        self.scale = scale
        self.impl = QSAImpl()
        self.kv_cache = torch.tensor([])  # replaced by bind_kv_cache
        self.cache: paging.QSALayerCache | None = None
        static = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in static:
            raise ValueError(f"Duplicate layer name: {prefix}")
        static[prefix] = self

    # --- AttentionLayerBase -------------------------------------------------------------
    def get_attn_backend(self) -> type[QSABackend]:
        return QSABackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> QSACacheSpec:
        block_size = vllm_config.cache_config.block_size
        if block_size != KV_PAGE:
            raise ValueError(
                f"QSA layer {self.layer_name} needs --block-size {KV_PAGE} (one KV page of the "
                f"operator contract), got {block_size}"
            )
        return make_spec()

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        # vLLM hands a [num_blocks, 1, 512, 544] float16 view of this layer's pages; both QSA
        # regions need the layer's pages to be one dense run (a layer-outermost layout).
        self.kv_cache = kv_cache
        if kv_cache.numel() == 0:
            self.cache = None
            return
        num_pages = kv_cache.shape[0]
        if kv_cache.dtype != paging.CACHE_DTYPE or not kv_cache.is_contiguous():
            raise ValueError(
                f"QSA layer {self.layer_name}: vLLM allocated its cache as dtype {kv_cache.dtype}, "
                f"shape {tuple(kv_cache.shape)}, strides {kv_cache.stride()}; QSA needs one "
                f"dense float16 run of {paging.PAGE_BYTES} bytes per page, so use a "
                f"layer-outermost KV cache layout (e.g. VLLM_KV_CACHE_LAYOUT=LBHNC)"
            )
        self.cache = paging.carve(kv_cache.view(-1), num_pages)

    # --- forward ------------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,  # [T, 3 * 256] any float dtype
        k: torch.Tensor,  # [T, 256]
        v: torch.Tensor,  # [T, 256]
        index_q: torch.Tensor,  # [T, 4 * 128]
        positions: torch.Tensor,  # [T] int64
        index_wk: torch.Tensor,  # [128, 256], this rank's indexer key projection
    ) -> torch.Tensor:  # [T, 3 * 256] in q's dtype
        half = paging.CACHE_DTYPE
        tokens = q.shape[0]
        out = torch.empty(tokens, ATTN_HEADS, HEAD_DIM, dtype=half, device=q.device)
        torch.ops.vllm.qsa_attention(
            q.reshape(tokens, ATTN_HEADS, HEAD_DIM).to(half).contiguous(),
            k.reshape(tokens, HEAD_DIM).to(half).contiguous(),
            v.reshape(tokens, HEAD_DIM).to(half).contiguous(),
            index_q.reshape(tokens, INDEX_HEADS, INDEX_DIM).to(half).contiguous(),
            positions.reshape(tokens).to(torch.int64).contiguous(),
            index_wk,
            out,
            self.layer_name,
        )
        return out.view(tokens, ATTN_HEADS * HEAD_DIM).to(q.dtype)

    def run(
        self,
        md: QSAMetadata,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index_q: torch.Tensor,
        positions: torch.Tensor,
        index_wk: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        n = md.num_tokens
        cache = self.cache
        if cache is None:
            raise RuntimeError(f"QSA layer {self.layer_name} runs before vLLM bound its KV cache")
        paging.write_kv(cache, k[:n], v[:n], md.slot_mapping)
        paging.write_compressed_keys(cache, md.slot_mapping, index_wk)
        selected = torch.empty(n, WIDTH, dtype=torch.int32, device=q.device)
        qsa_ops.select_paged_tokens(
            index_q[:n],
            cache.ck_cache,
            md.block_table,
            md.token_to_req,
            positions[:n],
            md.seq_lens,
            TOKEN_TOPK,
            COMPRESS_RATIO,
            selected,
        )
        qsa_ops.sparse_paged_attention(
            q[:n],
            cache.k_cache,
            cache.v_cache,
            selected,
            md.block_table,
            md.token_to_req,
            KV_PAGE,
            out[:n],
            self.scale,
        )
        out[n:].zero_()


def _layer_metadata(layer_name: str) -> QSAMetadata | None:
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):  # speculative decoding: [0] is the target model's
        metadata = metadata[0]
    if isinstance(metadata, dict):
        return metadata.get(layer_name)
    return metadata


def qsa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index_q: torch.Tensor,
    positions: torch.Tensor,
    index_wk: torch.Tensor,
    out: torch.Tensor,
    layer_name: str,
) -> None:
    layer = get_forward_context().no_compile_layers[layer_name]
    md = _layer_metadata(layer_name)
    if md is None:  # memory profiling / dummy run: no cache traffic
        out.zero_()
        return
    layer.run(md, q, k, v, index_q, positions, index_wk, out)


def qsa_attention_fake(q, k, v, index_q, positions, index_wk, out, layer_name) -> None:
    return None


direct_register_custom_op(
    op_name="qsa_attention",
    op_func=qsa_attention,
    mutates_args=["out"],
    fake_impl=qsa_attention_fake,
)
