"""vLLM attention backend of the QSA layer: only the per-step metadata the two operators need.

The attention itself runs in ``layer.py`` (it needs the indexer query, which vLLM's
``AttentionImpl.forward`` signature does not carry); the backend exists so that vLLM builds
one metadata object per step for the layers of the QSA cache group.
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

from ..qsa_ops.contract import KV_PAGE


@dataclass
class QSAMetadata(AttentionMetadata):
    num_tokens: int  # real (unpadded) tokens of the step
    token_to_req: torch.Tensor  # [num_tokens] int32, request row of each token
    seq_lens: torch.Tensor  # [B] int32, tokens stored per request after this step
    block_table: torch.Tensor  # [B, M] int32, shared by both caches
    slot_mapping: torch.Tensor  # [num_tokens] int64, physical slot of each new token


class QSAMetadataBuilder(AttentionMetadataBuilder[QSAMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, **kwargs):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if kv_cache_spec.block_size != KV_PAGE:
            raise ValueError(
                f"QSA layers need KV-cache blocks of {KV_PAGE} tokens, got "
                f"{kv_cache_spec.block_size} (set --block-size {KV_PAGE})"
            )

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> QSAMetadata:
        cm = common_attn_metadata
        num_tokens = cm.num_actual_tokens
        num_reqs = cm.num_reqs
        query_start_loc = cm.query_start_loc[: num_reqs + 1]
        tokens = torch.arange(
            num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype
        )
        # request b owns tokens [query_start_loc[b], query_start_loc[b + 1]); padding -> B
        token_to_req = torch.searchsorted(query_start_loc[1:], tokens, right=True)
        return QSAMetadata(
            num_tokens=num_tokens,
            token_to_req=token_to_req.to(torch.int32).contiguous(),
            seq_lens=cm.seq_lens[:num_reqs].to(torch.int32).contiguous(),
            block_table=cm.block_table_tensor[:num_reqs].to(torch.int32).contiguous(),
            slot_mapping=cm.slot_mapping[:num_tokens].to(torch.int64).contiguous(),
        )


class QSAImpl(AttentionImplBase[QSAMetadata]):
    """Placeholder: vLLM asks every backend for an impl class; QSA computes in its layer."""

    def __init__(self, *args, **kwargs) -> None:
        pass


class QSABackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
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
