"""The QSA attention layer: one custom op per layer and step, over two vLLM cache layers.

``QSAAttention`` (the K/V layer, a plain full-attention spec) owns a child
``QSACompressedKeyCache`` (the compressed-key layer, an MLA spec with 4 tokens per state).
Per step, ``torch.ops.vllm.qsa_attention`` (a splitting op of vLLM's piecewise graphs, and
captured whole in FULL graphs) runs, with the step's metadata of each layer:

1. ``update_caches``: the new K/V at their slots, then the compressed key of every block
   completed by a new token (from its 4 cached keys; K/V slots from the K/V layer's
   metadata, compressed slots from the compressed-key layer's);
2. ``select_paged_tokens`` over the compressed-key layer's pages and block table;
3. ``sparse_paged_attention`` over the K/V layer's pages and block table.

The cache views and their dtypes are checked once, when vLLM binds the caches. The op is
wrapped in vLLM's layer-wise KV transfer hook for both layers, so a KV connector waits for /
saves the K/V layer and the compressed-key layer like any attention layer.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.kv_cache_interface import KVCacheSpec

from .. import qsa_ops
from ..qsa_ops.contract import (
    ATTN_HEADS,
    COMPRESS_RATIO,
    HEAD_DIM,
    INDEX_DIM,
    INDEX_HEADS,
    KV_PAGE,
    TOKEN_TOPK,
)
from . import OP_NAME, paging
from .backend import QSABackend, QSACompressedKeyMetadata, QSAImpl, QSAMetadata
from .spec import make_ck_spec, make_kv_spec

HALF = paging.CACHE_DTYPE


def _check_block_size(vllm_config: VllmConfig, layer_name: str) -> None:
    block_size = vllm_config.cache_config.block_size
    if block_size != KV_PAGE:
        raise ValueError(
            f"QSA layer {layer_name} needs --block-size {KV_PAGE} (one KV page of the operator "
            f"contract), got {block_size}"
        )


def _register(layer: nn.Module, name: str) -> None:
    static = get_current_vllm_config().compilation_config.static_forward_context
    if name in static:
        raise ValueError(f"Duplicate layer name: {name}")
    static[name] = layer


class QSACompressedKeyCache(nn.Module, AttentionLayerBase):
    """The compressed-key cache layer of one QSA layer: [P', 128, 1, 128] float16."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.layer_name = prefix
        self.kv_cache = torch.tensor([])  # vLLM's per-layer view, replaced by bind_kv_cache
        self.ck_cache: torch.Tensor | None = None
        _register(self, prefix)

    def get_attn_backend(self) -> type[QSABackend]:
        return QSABackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        _check_block_size(vllm_config, self.layer_name)
        return make_ck_spec()

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self.ck_cache = None if kv_cache.numel() == 0 else paging.ck_view(kv_cache, self.layer_name)

    def forward(self) -> None:  # computed by the owning QSAAttention
        raise RuntimeError("QSACompressedKeyCache has no forward; QSAAttention runs it")


class QSAAttention(nn.Module, AttentionLayerBase):
    """One rank's QSA attention over vLLM-managed caches (3 query heads, 1 KV head)."""

    def __init__(self, scale: float, prefix: str) -> None:
        super().__init__()
        self.layer_name = prefix
        self.num_heads = ATTN_HEADS
        self.scale = scale
        self.impl = QSAImpl()
        self.kv_cache = torch.tensor([])  # vLLM's per-layer view, replaced by bind_kv_cache
        self.views: paging.KVViews | None = None
        self.compressed_keys = QSACompressedKeyCache(f"{prefix}.compressed_key_cache")
        self.index_wk: torch.Tensor | None = None  # float32 [128, 256], set after loading
        self.selected: torch.Tensor | None = None  # [max_tokens, 2051] int32, model-wide
        # the page-table width of every step (vLLM's blocks per request at 512 tokens a block);
        # 0 when no model config is current (then the profiling run reserves nothing)
        model_config = get_current_vllm_config().model_config
        self.max_pages = -(-model_config.max_model_len // KV_PAGE) if model_config else 0
        _register(self, prefix)

    # --- AttentionLayerBase -------------------------------------------------------------
    def get_attn_backend(self) -> type[QSABackend]:
        return QSABackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        _check_block_size(vllm_config, self.layer_name)
        return make_kv_spec()

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self.views = None if kv_cache.numel() == 0 else paging.kv_views(kv_cache, self.layer_name)

    # --- forward ------------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,  # [T, 3 * 256] served dtype
        k: torch.Tensor,  # [T, 256]
        v: torch.Tensor,  # [T, 256]
        index_q: torch.Tensor,  # [T, 4 * 128]
        positions: torch.Tensor,  # [T] int64
    ) -> torch.Tensor:  # [T, 3 * 256] in q's dtype
        tokens = q.shape[0]
        # NOTES: the casts are what the served dtype needs (no-ops for float16 but the
        # contiguity copy of q, a view of the fused qkv projection).
        out = torch.empty(tokens, ATTN_HEADS, HEAD_DIM, dtype=HALF, device=q.device)
        torch.ops.vllm.qsa_attention(
            q.reshape(tokens, ATTN_HEADS, HEAD_DIM).to(HALF).contiguous(),
            k.reshape(tokens, HEAD_DIM).to(HALF).contiguous(),
            v.reshape(tokens, HEAD_DIM).to(HALF).contiguous(),
            index_q.reshape(tokens, INDEX_HEADS, INDEX_DIM).to(HALF).contiguous(),
            positions.reshape(tokens),
            out,
            self.layer_name,
        )
        return out.view(tokens, ATTN_HEADS * HEAD_DIM).to(q.dtype)

    def run(
        self,
        md: QSAMetadata,
        ck_md: QSACompressedKeyMetadata,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index_q: torch.Tensor,
        positions: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        views, ck_cache = self.views, self.compressed_keys.ck_cache
        if views is None or ck_cache is None:
            raise RuntimeError(f"QSA layer {self.layer_name} runs before vLLM bound its caches")
        n = md.num_actual_tokens  # host int: rows past it are padding of a piecewise graph
        qsa_ops.update_caches(
            k[:n],
            v[:n],
            md.slot_mapping,
            ck_md.compressed_slot_mapping,
            self.index_wk,
            views.packed,
            ck_cache,
        )
        selected = self.selected[:n]
        qsa_ops.select_paged_tokens(
            index_q[:n],
            ck_cache,
            ck_md.block_table,
            md.token_to_req,
            positions[:n],
            md.seq_lens,
            TOKEN_TOPK,
            COMPRESS_RATIO,
            selected,
        )
        qsa_ops.sparse_paged_attention(
            q[:n],
            views.k_cache,
            views.v_cache,
            selected,
            md.block_table,
            md.token_to_req,
            KV_PAGE,
            out[:n],
            self.scale,
        )
        if n < out.shape[0]:
            out[n:].zero_()


def _layer_metadata(layer_name: str):
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):  # micro-batches / drafting: [0] is the target model's
        metadata = metadata[0]
    if isinstance(metadata, dict):
        return metadata.get(layer_name)
    return None


@maybe_transfer_kv_layer
def _transfer_compressed_keys(layer_name: str, run) -> None:
    run()


@maybe_transfer_kv_layer
def _transfer_kv(layer_name: str, run) -> None:
    run()


# NOTES: as upstream's QSA owner: a break point of vLLM's opt-in breakable CUDA graphs
# (VLLM_USE_BREAKABLE_CUDAGRAPH; a no-op otherwise), outermost, so that the KV transfer
# hooks run in the eager segment.
@eager_break_during_capture
def qsa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index_q: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
    layer_name: str,
) -> None:
    layer = get_forward_context().no_compile_layers[layer_name]
    ck_name = layer.compressed_keys.layer_name
    md, ck_md = _layer_metadata(layer_name), _layer_metadata(ck_name)
    if md is None or ck_md is None:  # memory profiling / dummy run: no cache traffic
        # the op layer's workspaces, at the largest step, while vLLM measures the peak
        if layer.max_pages and layer.selected is not None:
            paging.reserve_workspaces(q, index_q, positions, layer.selected, out, layer.max_pages)
        out.zero_()
        return

    def run() -> None:
        layer.run(md, ck_md, q, k, v, index_q, positions, out)

    _transfer_kv(layer_name, lambda: _transfer_compressed_keys(ck_name, run))


def qsa_attention_fake(q, k, v, index_q, positions, out, layer_name) -> None:
    return None


direct_register_custom_op(
    op_name=OP_NAME,
    op_func=qsa_attention,
    mutates_args=["out"],
    fake_impl=qsa_attention_fake,
)
