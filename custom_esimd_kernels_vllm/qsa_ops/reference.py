"""PyTorch reference of the two QSA operators: the executable specification.

Pure torch, CPU and GPU, and free of host synchronisation: no ``.item()``, ``.tolist()``,
``.nonzero()``, boolean-mask indexing, data-dependent shapes, Python branches on tensor
values, or ``torch.tensor(...)`` literals (a host-to-device copy on CUDA; constants are made
with ``torch.full``). Branches and loops below depend on shapes only, so the functions can be captured in
a CUDA graph and traced by ``torch.compile(fullgraph=True)``.

The functions do not validate their arguments (``qsa_ops`` does that before any backend runs)
but they never read out of bounds for any *values* of well-shaped arguments: indices are
clamped for the gather and the result is masked afterwards.

NOTES: dot products are computed as an elementwise float32 product followed by a sum, not
with ``matmul``: a float32 matmul may run in TF32 (CUDA, ``allow_tf32``) or bf16 (CPU,
``set_float32_matmul_precision``), which would break the bit-exact selection contract.
"""

from __future__ import annotations

import math

import torch

from .contract import (
    BLOCK_TOPK,
    COMPRESS_RATIO,
    HEAD_DIM,
    INDEX_DIM,
    INDEX_HEADS,
    SCORE_SCALE,
    TOKEN_TOPK,
    WIDTH,
    resolve_softmax_scale,
)

# NOTES: rows are processed in chunks so that the largest float32 temporary stays near
# 2**24 elements (64 MiB): selection over 32K visible tokens (8192 blocks) needs
# 4 * 8192 * 128 = 4M floats per row, attention 3 * 2051 * 256 = 1.6M floats per row.
_CHUNK_ELEMENTS = 1 << 24


def _row_chunks(rows: int, elements_per_row: int) -> list[slice]:
    step = max(1, _CHUNK_ELEMENTS // max(1, elements_per_row))
    return [slice(start, min(rows, start + step)) for start in range(0, rows, step)]


# NOTES: each chunk's large temporaries (the gathered rows, their float copies, the products)
# go into buffers allocated once per call and sliced per chunk. Allocated afresh per chunk,
# every one of them was a new mapping from the C allocator, whose page faults cost ~10x the
# arithmetic: vLLM's CPU prefill spent ~5 s per layer in the attention reference at 1,020
# rows, 3.5x less with the buffers. Same operations on the same values: the results are
# unchanged to the bit.
def _gather_rows(table: torch.Tensor, index: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """``table[index]`` (table [N, D], index [C, K] int64) written into ``buffer``'s leading
    [C, K, D] (``buffer`` [C_max, K, D] of table's dtype); returns that slice."""
    rows = buffer[: index.shape[0]]
    torch.index_select(table, 0, index.reshape(-1), out=rows.view(-1, table.shape[1]))
    return rows


def token_rows(cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(table, page_step, slot_step) for a paged cache [P, S, 1, D] with last stride 1 and any
    other strides: ``table`` is a [N, D] view of the cache's storage whose row
    ``page * page_step + slot * slot_step`` is ``cache[page, slot, 0]``. Its row stride is the
    gcd of the page and slot strides, so that one view serves any layout: the seed's packed
    pages (row stride 512, exactly its [P * 512, 256] rows), vLLM's pages whose stride spans
    other layers, separate K and V tensors. Rows may overlap (never written)."""
    pages, slots, _, dim = cache.shape
    s0 = cache.stride(0) if pages > 1 else 0
    s1 = cache.stride(1) if slots > 1 else 0
    step = math.gcd(s0, s1) or 1
    rows = ((pages - 1) * s0 + (slots - 1) * s1) // step + 1
    table = cache.as_strided((rows, dim), (step, 1))  # cache's own storage offset
    return table, s0 // step, s1 // step


def _request_of_rows(
    token_to_req: torch.Tensor, num_requests: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid [R] bool, b [R] int64 clamped into [0, B)); requires num_requests > 0."""
    b = token_to_req.long()
    valid = (b >= 0) & (b < num_requests)
    return valid, b.clamp(0, num_requests - 1)


def visible_tokens(query_positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """n = clamp(min(position + 1, length), 0), computed as min(position, length - 1) + 1 so
    that position = INT64_MAX does not overflow (length is int32, so length - 1 fits)."""
    return (torch.minimum(query_positions, lengths.long() - 1) + 1).clamp_min(0)


def block_scores(
    q: torch.Tensor, keys: torch.Tensor, products: torch.Tensor | None = None
) -> torch.Tensor:
    """Selection scores of blocks, float32.

    q: [C, 4, 128] float16, bfloat16 or float8_e4m3fn; keys: [C, J, 128] of q's dtype or
    float32 -> [C, J] float32 with
    score = (((relu(d0) + relu(d1)) + relu(d2)) + relu(d3)) * float32(1/sqrt(128)) + 0.0,
    d_h = float32 sum over 128 float32 products of exactly converted values (summation order
    left to torch: float32
    sums in another order may differ in the last bit; with small-integer inputs every order is
    exact). ``+ 0.0`` turns -0.0 into +0.0, so that all zero scores tie. ``products``
    (optional, float32, at least [C, J, 128]) holds the products instead of a new tensor.
    """
    qf = q.float()
    kf = keys.float()
    total = None
    prod = None if products is None else products[: kf.shape[0], : kf.shape[1]]
    for h in range(INDEX_HEADS):
        dots = torch.mul(qf[:, h, None, :], kf, out=prod).sum(dim=-1)  # [C, J]
        term = torch.relu(dots)
        total = term if total is None else total + term
    scale = torch.full(
        (), SCORE_SCALE, dtype=torch.float32, device=q.device
    )  # float32(1/sqrt(128))
    return total * scale + 0.0


def select_paged_tokens_ref(
    q: torch.Tensor,  # [R, 4, 128] float16, bfloat16 or float8_e4m3fn
    compressed_key_cache: torch.Tensor,  # [P, C, 1, 128] q's dtype, last stride 1
    page_table: torch.Tensor,  # [B, M] int32, last stride 1
    token_to_req: torch.Tensor,  # [R] int32
    query_positions: torch.Tensor,  # [R] int64
    sequence_lengths: torch.Tensor,  # [B] int32
    out: torch.Tensor,  # [R, 2051] int32 (last stride 1), fully overwritten
) -> torch.Tensor:
    """Reference of ``select_paged_tokens`` (contract section 1); writes and returns ``out``.
    Block ``j`` of a request is row ``j % C`` of its logical page ``j // C``."""
    rows = q.shape[0]
    pages, per_page = compressed_key_cache.shape[:2]
    num_requests, max_pages = page_table.shape
    if rows == 0:
        return out
    if num_requests == 0:
        return out.fill_(-1)
    device = q.device

    valid_req, b = _request_of_rows(token_to_req, num_requests)
    n = torch.where(valid_req, visible_tokens(query_positions, sequence_lengths[b]), 0)
    nb = n // COMPRESS_RATIO  # visible blocks
    tail = n - COMPRESS_RATIO * nb  # 0..3 tail tokens

    num_blocks = max_pages * per_page  # candidate blocks j < M * C (others are unusable)
    chosen = torch.zeros(rows, BLOCK_TOPK, dtype=torch.long, device=device)
    kb = torch.zeros(rows, dtype=torch.long, device=device)
    if num_blocks > 0 and pages > 0:
        table, page_step, slot_step = token_rows(compressed_key_cache)
        j = torch.arange(num_blocks, device=device)
        in_page = torch.arange(per_page, device=device) * slot_step
        ninf = torch.full((), float("-inf"), device=device)
        chunks = _row_chunks(rows, INDEX_HEADS * INDEX_DIM * num_blocks)
        shape = (chunks[0].stop, num_blocks, INDEX_DIM)  # the first chunk is the largest
        gathered = torch.empty(shape, dtype=table.dtype, device=device)
        keys_f32 = torch.empty(shape, dtype=torch.float32, device=device)
        products = torch.empty(shape, dtype=torch.float32, device=device)
        for s in chunks:
            phys = page_table[b[s]].long()  # [C, M]
            page_ok = (phys >= 0) & (phys < pages)
            slot = (phys.clamp(0, pages - 1) * page_step)[:, :, None] + in_page  # [C, M, per]
            keys = _gather_rows(table, slot.reshape(-1, num_blocks), gathered)  # [C, J, 128]
            keys = keys_f32[: keys.shape[0]].copy_(keys)
            score = block_scores(q[s], keys, products)  # [C, J]
            usable = page_ok.repeat_interleave(per_page, dim=1) & (j < nb[s, None])
            # highest score first, equal scores lower j first: stable descending sort;
            # unusable blocks sort last (-inf) and are cut off by kb.
            order = torch.sort(
                torch.where(usable, score, ninf), dim=1, descending=True, stable=True
            )
            take = min(BLOCK_TOPK, num_blocks)
            chosen[s, :take] = order.indices[:, :take]
            kb[s] = usable.sum(dim=1).clamp_max(BLOCK_TOPK)

    # out[r] = chosen blocks expanded to 4 tokens, then the tail tokens, then -1
    cols = torch.arange(WIDTH, device=device)
    expanded = COMPRESS_RATIO * chosen[:, :, None] + torch.arange(COMPRESS_RATIO, device=device)
    expanded = torch.nn.functional.pad(expanded.reshape(rows, TOKEN_TOPK), (0, WIDTH - TOKEN_TOPK))
    n_sel = (COMPRESS_RATIO * kb)[:, None]
    tail_tokens = COMPRESS_RATIO * nb[:, None] + (cols - n_sel)
    minus_one = torch.full_like(expanded, -1)
    result = torch.where(
        cols < n_sel, expanded, torch.where(cols < n_sel + tail[:, None], tail_tokens, minus_one)
    )
    result = torch.where(valid_req[:, None], result, minus_one)
    return out.copy_(result)


def sparse_paged_attention_ref(
    q: torch.Tensor,  # [R, 3, 256] float16 or bfloat16
    k_cache: torch.Tensor,  # [P, page_size, 1, 256] q's dtype or float8_e4m3fn, last stride 1
    v_cache: torch.Tensor,  # [P, page_size, 1, 256] k_cache's dtype, last stride 1
    logical_indices: torch.Tensor,  # [R, 2051] int32, -1 (or any invalid value) = hole
    page_table: torch.Tensor,  # [B, M] int32
    token_to_req: torch.Tensor,  # [R] int32
    out: torch.Tensor,  # [R, 3, 256] q's dtype, fully overwritten
    softmax_scale: float | None = None,
    *,
    k_scale: float | None = None,  # K = float8 value * k_scale (None: 1)
    v_scale: float | None = None,  # V = float8 value * v_scale (None: 1)
    gate: torch.Tensor | None = None,  # [R, 3, 256] q's dtype
) -> torch.Tensor:
    """Reference of ``sparse_paged_attention`` (contract section 2); writes and returns ``out``.

    float32 math (the two matmuls accumulate in float64, rounded to float32), result in q's
    dtype; a row without any valid entry (or with an invalid request) is written as zeros,
    never NaN. With a gate: ``out = dtype(float32(dtype(attn)) * sigmoid(float32(gate)))``.
    """
    scale = resolve_softmax_scale(softmax_scale)
    rows = q.shape[0]
    pages, page_size = k_cache.shape[:2]
    num_requests, max_pages = page_table.shape
    if rows == 0:
        return out
    if num_requests == 0 or max_pages == 0 or pages == 0:
        return out.zero_()

    valid_req, b = _request_of_rows(token_to_req, num_requests)
    idx = logical_indices.long()  # [R, W]
    logical_page = torch.div(idx, page_size, rounding_mode="floor")
    valid = (idx >= 0) & (logical_page < max_pages) & valid_req[:, None]
    phys = page_table.long()[b[:, None], logical_page.clamp(0, max_pages - 1)]  # [R, W]
    valid &= (phys >= 0) & (phys < pages)
    phys = phys.clamp(0, pages - 1)
    slot = idx.clamp_min(0) % page_size

    heads = q.shape[1]
    ninf = torch.full((), float("-inf"), device=q.device)
    k_rows, k_page, k_slot = token_rows(k_cache)
    v_rows, v_page, v_slot = token_rows(v_cache)
    k_token = phys * k_page + slot * k_slot  # [R, W] rows of the two tables
    v_token = phys * v_page + slot * v_slot
    chunks = _row_chunks(rows, heads * WIDTH * HEAD_DIM)
    shape = (chunks[0].stop, idx.shape[1], HEAD_DIM)  # the first chunk is the largest
    gathered = torch.empty(shape, dtype=k_cache.dtype, device=q.device)
    keys_f64 = torch.empty(shape, dtype=torch.float64, device=q.device)
    values_f64 = torch.empty(shape, dtype=torch.float64, device=q.device)
    for s in chunks:
        keys = keys_f64[: s.stop - s.start].copy_(_gather_rows(k_rows, k_token[s], gathered))
        values = values_f64[: s.stop - s.start].copy_(_gather_rows(v_rows, v_token[s], gathered))
        if k_scale is not None:
            keys.mul_(k_scale)  # float8 dequantisation (exact in float64)
        if v_scale is not None:
            values.mul_(v_scale)
        # NOTES: batched matmuls (not elementwise products) here: attention is checked to a
        # tolerance, and the [C, 3, W, 256] temporaries of the elementwise form made the CPU
        # reference ~5x slower at R = 2300 (vLLM prefill on CPU). They accumulate in float64
        # and are rounded to float32: a BLAS may split a sum differently with the batch size
        # (MKL on 2 threads splits the 2051-term value sum of a single row, not of a batch),
        # and in float32 that made a row's result depend on the other rows of the call; in
        # float64 the difference almost never survives the rounding (float32, then float16).
        logits = torch.matmul(q[s].double(), keys.transpose(1, 2)).float() * scale  # [C, 3, W]
        logits = torch.where(valid[s, None, :], logits, ninf)
        row_max = logits.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        weights = torch.exp(logits - row_max)  # exp(-inf) = 0 for holes
        denom = weights.sum(dim=-1, keepdim=True)  # [C, 3, 1]
        numer = torch.matmul(weights.double(), values).float()  # [C, 3, 256]
        result = numer / torch.where(denom > 0, denom, torch.ones_like(denom))
        if gate is not None:  # vLLM's order: round the attention, then gate in float32
            result = result.to(out.dtype).float() * torch.sigmoid(gate[s].float())
        out[s].copy_(result)
    return out
