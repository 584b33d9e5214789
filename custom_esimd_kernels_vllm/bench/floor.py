"""The memory floor: the bytes one call must move, over the copy bandwidth of the device.

What is counted (each input read once, the output written once):

attention
    q (R x 3 x 256 x 2 B), the selected tokens' K and V (1 KiB per token: 256 + 256 float16),
    counted once per **distinct physical token** of the call (a token listed twice, or by two
    rows, is read once by an ideal kernel), the indices (R x 2051 x 4 B), the page table
    (B x M x 4 B, all of it), token_to_req (R x 4 B); written: out (R x 3 x 256 x 2 B).
selection
    q (R x 4 x 128 x 2 B), the usable compressed keys (256 B each), once per **distinct
    physical key** of the call (rows of one request share their keys), the page table
    (B x M x 4 B), token_to_req (R x 4 B), query_positions (R x 8 B), sequence_lengths
    (B x 4 B); written: out (R x 2051 x 4 B).

The floor time is ``bytes / bandwidth`` with the bandwidth of a large device-to-device copy
measured in the same run, counted as bytes read + bytes written. "% of floor" is
``floor time / measured time``: 100 % is a kernel that streams its bytes at copy speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..qsa_ops.contract import (
    ATTN_HEADS,
    CK_PAGE,
    COMPRESS_RATIO,
    HEAD_DIM,
    INDEX_DIM,
    INDEX_HEADS,
    KV_PAGE,
    WIDTH,
)
from ..qsa_ops.reference import visible_tokens
from .cases import ATTENTION

KV_TOKEN_BYTES = 2 * HEAD_DIM * 2  # K and V halves of one token, float16: 1 KiB
KEY_BYTES = INDEX_DIM * 2  # one compressed key, float16: 256 B


@dataclass(frozen=True)
class FloorBytes:
    read: dict[str, int]
    written: dict[str, int]
    counts: dict[str, int]  # the token/key counts behind the byte figures

    @property
    def total(self) -> int:
        return sum(self.read.values()) + sum(self.written.values())

    def seconds(self, bandwidth_bytes_per_s: float) -> float:
        return self.total / bandwidth_bytes_per_s

    def to_dict(self) -> dict[str, object]:
        return {
            "read": self.read,
            "written": self.written,
            "counts": self.counts,
            "total": self.total,
        }


def attention_bytes(rows: int, requests: int, max_pages: int, distinct_tokens: int) -> FloorBytes:
    return FloorBytes(
        read={
            "q": rows * ATTN_HEADS * HEAD_DIM * 2,
            "kv_tokens": distinct_tokens * KV_TOKEN_BYTES,
            "logical_indices": rows * WIDTH * 4,
            "page_table": requests * max_pages * 4,
            "token_to_req": rows * 4,
        },
        written={"out": rows * ATTN_HEADS * HEAD_DIM * 2},
        counts={"distinct_tokens": distinct_tokens},
    )


def selection_bytes(rows: int, requests: int, max_pages: int, distinct_keys: int) -> FloorBytes:
    return FloorBytes(
        read={
            "q": rows * INDEX_HEADS * INDEX_DIM * 2,
            "compressed_keys": distinct_keys * KEY_BYTES,
            "page_table": requests * max_pages * 4,
            "token_to_req": rows * 4,
            "query_positions": rows * 8,
            "sequence_lengths": requests * 4,
        },
        written={"out": rows * WIDTH * 4},
        counts={"distinct_keys": distinct_keys},
    )


def _request_of_rows(
    token_to_req: torch.Tensor, requests: int
) -> tuple[torch.Tensor, torch.Tensor]:
    b = token_to_req.long()
    return (b >= 0) & (b < requests), b.clamp(0, max(requests - 1, 0))


def count_attention_tokens(t: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(distinct physical tokens, valid entries counted per occurrence) of one call."""
    table = t["page_table"].long()
    requests, max_pages = table.shape
    pages = t["k_cache"].shape[0]
    if requests == 0 or max_pages == 0:
        return 0, 0
    ok_req, b = _request_of_rows(t["token_to_req"], requests)
    idx = t["logical_indices"].long()
    page = torch.div(idx, KV_PAGE, rounding_mode="floor")
    valid = (idx >= 0) & (page < max_pages) & ok_req[:, None]
    phys = table[b[:, None], page.clamp(0, max_pages - 1)]
    valid &= (phys >= 0) & (phys < pages)
    token_id = phys * KV_PAGE + idx.clamp_min(0) % KV_PAGE
    return int(torch.unique(token_id[valid]).numel()), int(valid.sum())


def count_selection_keys(
    t: dict[str, torch.Tensor], chunk_elements: int = 1 << 24
) -> tuple[int, int]:
    """(distinct physical keys, usable blocks summed over rows) of one call."""
    table = t["page_table"].long()
    requests, max_pages = table.shape
    pages = t["compressed_key_cache"].shape[0]
    rows = t["q"].shape[0]
    if requests == 0 or max_pages == 0 or rows == 0:
        return 0, 0
    ok_req, b = _request_of_rows(t["token_to_req"], requests)
    n = visible_tokens(t["query_positions"], t["sequence_lengths"].long()[b])
    nb = torch.where(ok_req, n // COMPRESS_RATIO, 0)
    blocks = max_pages * CK_PAGE
    j = torch.arange(blocks, device=table.device)
    ids, usable_total = [], 0
    step = max(1, chunk_elements // blocks)
    for start in range(0, rows, step):
        s = slice(start, min(rows, start + step))
        phys = table[b[s]].repeat_interleave(CK_PAGE, dim=1)  # [C, M * 128]
        usable = (j < nb[s, None]) & (phys >= 0) & (phys < pages)
        key_id = phys * CK_PAGE + j % CK_PAGE
        ids.append(torch.unique(key_id[usable]))
        usable_total += int(usable.sum())
    distinct = int(torch.unique(torch.cat(ids)).numel()) if ids else 0
    return distinct, usable_total


def floor_bytes(op: str, t: dict[str, torch.Tensor]) -> FloorBytes:
    rows = t["q"].shape[0]
    requests, max_pages = t["page_table"].shape
    if op == ATTENTION:
        distinct, occurrences = count_attention_tokens(t)
        fb = attention_bytes(rows, requests, max_pages, distinct)
        fb.counts["valid_entries"] = occurrences
    else:
        distinct, usable = count_selection_keys(t)
        fb = selection_bytes(rows, requests, max_pages, distinct)
        fb.counts["usable_blocks"] = usable
    return fb


def percent_of_floor(floor_seconds: float, measured_seconds: float) -> float:
    """floor / measured, in percent (100 % = at copy bandwidth)."""
    return 100.0 * floor_seconds / measured_seconds if measured_seconds > 0 else float("nan")
