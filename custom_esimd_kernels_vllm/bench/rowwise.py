"""BASELINE ONLY — the row-by-row PyTorch style of the original change, kept to measure what
the fused kernels replace. It is *not* the specification (that is ``qsa_ops.reference``).

Each row is handled by a Python loop that reads device values on the host (``int(t)``,
boolean-mask indexing with data-dependent shapes): one or more device-to-host
synchronisations per row, so it cannot be captured in a CUDA graph. It follows the contract
(tie rule, holes, duplicates, bad values), and the bench's tests check it against the
reference.
"""

from __future__ import annotations

import torch

from ..qsa_ops.contract import (
    BLOCK_TOPK,
    CK_PAGE,
    COMPRESS_RATIO,
    KV_PAGE,
    resolve_softmax_scale,
)
from ..qsa_ops.reference import block_scores


def select_paged_tokens_rowwise(
    q, compressed_key_cache, page_table, token_to_req, query_positions, sequence_lengths, out
) -> torch.Tensor:
    rows = q.shape[0]
    pages = compressed_key_cache.shape[0]
    requests, max_pages = page_table.shape
    device = q.device
    out.fill_(-1)
    for r in range(rows):
        b = int(token_to_req[r])  # host sync
        if not 0 <= b < requests:
            continue
        n = max(min(int(query_positions[r]) + 1, int(sequence_lengths[b])), 0)  # host syncs
        nb, tail = divmod(n, COMPRESS_RATIO)
        j = torch.arange(min(nb, max_pages * CK_PAGE), device=device)
        phys = page_table[b, j // CK_PAGE].long()
        usable = (phys >= 0) & (phys < pages)
        j, phys = j[usable], phys[usable]  # data-dependent shape: host sync
        keys = compressed_key_cache[phys, j % CK_PAGE, 0]  # [U, 128]
        scores = block_scores(q[r : r + 1], keys[None])[0]  # [U] float32
        # highest score first; equal scores: lower j first (stable sort keeps j ascending)
        order = torch.sort(scores, descending=True, stable=True).indices[:BLOCK_TOPK]
        chosen = j[order]
        tokens = COMPRESS_RATIO * chosen[:, None] + torch.arange(COMPRESS_RATIO, device=device)
        row = torch.cat([tokens.reshape(-1), torch.arange(n - tail, n, device=device)])
        out[r, : row.numel()] = row.to(out.dtype)
    return out


def sparse_paged_attention_rowwise(
    q, k_cache, v_cache, logical_indices, page_table, token_to_req, out, softmax_scale=None
) -> torch.Tensor:
    scale = resolve_softmax_scale(softmax_scale)
    rows = q.shape[0]
    pages = k_cache.shape[0]
    requests, max_pages = page_table.shape
    for r in range(rows):
        b = int(token_to_req[r])  # host sync
        idx = logical_indices[r].long()
        idx = idx[(idx >= 0) & (idx // KV_PAGE < max_pages)]  # host sync
        if not 0 <= b < requests or idx.numel() == 0:
            out[r].zero_()
            continue
        phys = page_table[b, idx // KV_PAGE].long()
        ok = (phys >= 0) & (phys < pages)
        idx, phys = idx[ok], phys[ok]  # host sync
        if idx.numel() == 0:
            out[r].zero_()
            continue
        keys = k_cache[phys, idx % KV_PAGE, 0].float()  # [T, 256]
        values = v_cache[phys, idx % KV_PAGE, 0].float()
        logits = (q[r].float()[:, None, :] * keys[None]).sum(-1) * scale  # [3, T]
        out[r] = (torch.softmax(logits, dim=-1) @ values).to(out.dtype)
    return out
