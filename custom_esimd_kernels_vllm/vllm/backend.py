"""vLLM attention backend of the QSA layers: the per-step metadata the three operators need.

The computation runs in ``layer.py`` (it needs the indexer query, which vLLM's
``AttentionImpl.forward`` signature does not carry). The backend serves both cache layers of
a QSA layer; vLLM makes one builder per (backend, spec), so the K/V layers get a
``QSAMetadata`` builder and the compressed-key layers a ``QSACompressedKeyMetadata`` one,
each from its own cache group's ``CommonAttentionMetadata`` (its own block table and slot
mapping, whether or not vLLM put the two layers in one group).

CUDA graphs (``UNIFORM_BATCH``, as upstream vLLM's QSA builder): every tensor the layer reads
is a slice of a buffer allocated once at init (or vLLM's own persistent buffers: seq_lens,
block table, slot mapping, positions), so a captured graph replays on the next step's
values. Padded tokens (vLLM pads the slot mapping with -1 and the token count to the graph
size) map to request B (out of range: selection rows of -1, attention rows of zeros) and
write no cache entry. Nothing here reads a device value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImplBase,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import MLAAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from ..qsa_ops.contract import CK_PAGE, COMPRESS_RATIO, KV_PAGE


@dataclass
class QSAMetadata(AttentionMetadata):
    """Metadata of the K/V layers (attention and selection rows)."""

    num_actual_tokens: int  # rows of the step (vLLM's count; padded in FULL graphs)
    token_to_req: torch.Tensor  # [T] int32, request row of each token (B for padding)
    seq_lens: torch.Tensor  # [B] int32, tokens stored per request after this step
    block_table: torch.Tensor  # [B, M] int32, K/V pages
    slot_mapping: torch.Tensor  # [T] int64, K/V slot of each new token (-1: padding)


@dataclass
class QSACompressedKeyMetadata(AttentionMetadata):
    """Metadata of the compressed-key layers."""

    num_actual_tokens: int
    block_table: torch.Tensor  # [B, M] int32, compressed-key pages
    compressed_slot_mapping: torch.Tensor  # [T] int64: block-completing tokens, else -1


class QSAMetadataBuilder(AttentionMetadataBuilder[AttentionMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, **kwargs):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if kv_cache_spec.block_size != KV_PAGE:
            raise ValueError(
                f"QSA layers need KV-cache blocks of {KV_PAGE} tokens, got "
                f"{kv_cache_spec.block_size} (set --block-size {KV_PAGE})"
            )
        self.compressed = isinstance(kv_cache_spec, MLAAttentionSpec)
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        # persistent buffers, sized once: the rows of any step are a prefix of them
        self._rows = torch.arange(max_tokens, dtype=torch.int32, device=device)
        self._token_to_req = torch.empty(max_tokens, dtype=torch.int32, device=device)
        self._ck_slots = torch.empty(max_tokens, dtype=torch.int64, device=device)
        self._scratch = torch.empty(max_tokens, dtype=torch.int64, device=device)
        self._skip = torch.empty(max_tokens, dtype=torch.bool, device=device)
        self._skip2 = torch.empty(max_tokens, dtype=torch.bool, device=device)

    def _block_table(self, cm: CommonAttentionMetadata) -> torch.Tensor:
        table = cm.block_table_tensor[: cm.num_reqs]
        if table.dtype != torch.int32 or not table.is_contiguous():  # host-side checks only
            table = table.to(torch.int32).contiguous()
        return table

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AttentionMetadata:
        cm = common_attn_metadata
        n = cm.num_actual_tokens
        slots = cm.slot_mapping[:n]
        if self.compressed:
            return QSACompressedKeyMetadata(
                num_actual_tokens=n,
                block_table=self._block_table(cm),
                compressed_slot_mapping=self._compressed_slots(slots, n),
            )
        token_to_req = self._token_to_req[:n]
        # request b owns rows [query_start_loc[b], query_start_loc[b + 1]); padding -> B
        torch.searchsorted(
            cm.query_start_loc[1 : cm.num_reqs + 1],
            self._rows[:n],
            right=True,
            out_int32=True,
            out=token_to_req,
        )
        return QSAMetadata(
            num_actual_tokens=n,
            token_to_req=token_to_req,
            seq_lens=cm.seq_lens[: cm.num_reqs],
            block_table=self._block_table(cm),
            slot_mapping=slots,
        )

    def _compressed_slots(self, slots: torch.Tensor, n: int) -> torch.Tensor:
        """Compressed-key slot of each token that completes its 4-token block (slot % 4 == 3,
        the token position's residue), from this group's K/V-granular slot mapping
        (page * 512 + offset): page * 128 + offset // 4; -1 elsewhere and on padding."""
        out, tmp = self._ck_slots[:n], self._scratch[:n]
        skip, negative = self._skip[:n], self._skip2[:n]
        torch.remainder(slots, KV_PAGE, out=out)
        out.floor_divide_(COMPRESS_RATIO)
        torch.floor_divide(slots, KV_PAGE, out=tmp)
        tmp.mul_(CK_PAGE)
        out.add_(tmp)
        torch.remainder(slots, COMPRESS_RATIO, out=tmp)
        torch.ne(tmp, COMPRESS_RATIO - 1, out=skip)
        torch.lt(slots, 0, out=negative)
        skip.logical_or_(negative)
        return out.masked_fill_(skip, -1)


class QSAImpl(AttentionImplBase[QSAMetadata]):
    """Placeholder: vLLM asks every backend for an impl class; QSA computes in its layer."""

    def __init__(self, *args, **kwargs) -> None:
        pass


class QSABackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16"]
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return [KV_PAGE]

    @staticmethod
    def get_name() -> str:
        return "QSA"

    @staticmethod
    def get_impl_cls() -> type[AttentionImplBase]:
        return QSAImpl

    @staticmethod
    def get_builder_cls() -> type[QSAMetadataBuilder]:
        return QSAMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Layer-outermost only: the operators need each layer's pages at a fixed stride of
        # one page (262144 elements for K/V); block-outermost layouts interleave layers.
        # With one head per page the two layouts are the same bytes.
        return (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC)
