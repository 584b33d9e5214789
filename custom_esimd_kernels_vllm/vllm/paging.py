"""Workspace reservation for vLLM's profiling run (torch only).

vLLM sizes the KV cache from the peak memory of its profiling forward. The op layer keeps
per-stream workspaces (the selection's per-row-group scores, the attention's split partials and
counters) that it allocates on first use; ``reserve_workspaces`` runs both operators once at
the largest shapes a step can have, so that those workspaces exist while vLLM measures.
``tests/gpu/test_reserve_gpu.py`` checks that a step of that size then allocates nothing more.
The Qwen4Exp routing calls it in vLLM's profiling forward (qwen4exp.py; docs/vllm.md, "Memory
the profile run sees").
"""

from __future__ import annotations

import torch

from .. import qsa_ops
from ..qsa_ops.contract import (
    COMPRESS_RATIO,
    INDEX_DIM,
    KV_PAGE,
    PACKED_TOKEN_STRIDE,
    TOKEN_TOPK,
)
from ..qsa_ops.contract import kv_views as _kv_views


def reserve_workspaces(
    q: torch.Tensor,  # [T, 3, 256] float16 / bfloat16: the profiling run's queries
    index_q: torch.Tensor,  # [T, 4, 128] float16 / bfloat16
    positions: torch.Tensor,  # [T] int64
    selected: torch.Tensor,  # [>= T, 2051] int32: the selection buffer
    out: torch.Tensor,  # [T, 3, 256] q's dtype
    max_pages: int,  # the page-table width of every step: ceil(max_model_len / page_size)
    page_size: int = KV_PAGE,  # tokens per page (the selection's: page_size / 4 keys)
) -> None:
    """Run selection and attention once at the largest shapes a step can have, on caches of one
    empty page of ``page_size`` tokens. CUDA tensors only (the PyTorch reference keeps no
    workspace); ``out`` is written with zeros (no valid row)."""
    if not q.is_cuda:
        return
    rows, device = q.shape[0], q.device
    table = torch.full((1, max_pages), -1, dtype=torch.int32, device=device)
    to_req = torch.zeros(rows, dtype=torch.int32, device=device)
    lengths = torch.zeros(1, dtype=torch.int32, device=device)
    keys_per_page = page_size // COMPRESS_RATIO
    ck = torch.zeros(1, keys_per_page, 1, INDEX_DIM, dtype=index_q.dtype, device=device)
    kv = torch.zeros(1, page_size, PACKED_TOKEN_STRIDE, dtype=q.dtype, device=device)
    k_cache, v_cache = _kv_views(kv)
    indices = selected[:rows]
    qsa_ops.select_paged_tokens(
        index_q, ck, table, to_req, positions, lengths, TOKEN_TOPK, COMPRESS_RATIO, indices
    )
    qsa_ops.sparse_paged_attention(q, k_cache, v_cache, indices, table, to_req, page_size, out)
