"""The implementations compared on every case, in candidate-preference order.

``kernel``          the public ``qsa_ops`` operator on the compiled CUDA backend (validation,
                    dispatch and the kernel launch: what a caller pays)
``upstream``        vLLM 0.32.0's own kernels (``bench.upstream``), bfloat16 (same bytes as
                    our float16): attention = its Triton sparse attention; selection = its
                    Triton indexer scoring + its compiled top-k, or a stated stand-in
                    (torch.topk on the float32 scores) when vLLM's compiled ops are absent.
                    Its block-index expansion (a third launch) is not included.
``upstream-score``  selection only: upstream's Triton scoring alone (the half that always
                    runs the real upstream code)
``ref-compiled``    ``torch.compile(fullgraph=True, dynamic=False)`` of the PyTorch reference,
                    called on row chunks (see ``compiled_call``); one graph per chunk shape
``ref-vectorised``  the PyTorch reference, ``qsa_ops.reference`` (no host sync)
``ref-rowwise``     BASELINE ONLY: the row-by-row loop with host syncs of the original change
                    (below); eager only (it cannot be captured in a CUDA graph)

The candidate of a case is the first available in this order; every other available one is a
baseline it is compared with. An implementation that needs its own inputs (upstream: bfloat16
copies, packed indices, per-row page tables) has a ``prepare`` that derives them from the
rotated copies once, outside the timed region.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import qsa_ops
from ..qsa_ops import contract, ops, reference
from .cases import ATTENTION, packed_kv_views
from .upstream import Upstream

KERNEL = "kernel"
UPSTREAM = "upstream"
UPSTREAM_SCORE = "upstream-score"
REF_COMPILED = "ref-compiled"
REF_VECTORISED = "ref-vectorised"
REF_ROWWISE = "ref-rowwise"
ALL = (KERNEL, UPSTREAM, UPSTREAM_SCORE, REF_COMPILED, REF_VECTORISED, REF_ROWWISE)

# NOTES: the row loop costs about one host round trip per row plus a dozen small launches;
# at R = 64 that is already ~100x the kernel time per call and would dominate the run time
# of the whole grid, so the rowwise baseline runs on cases with R <= 8 only.
ROWWISE_MAX_ROWS = 8

# vLLM's compiled top-k (float32 scores, k = 512, L2-cold), measured separately on the H200
# and quoted here for when it cannot run: {(rows, visible blocks): µs}
QUOTED_TOPK_US = {(1, 2303): 3.7, (1, 32768): 9.3, (8, 32768): 9.9, (64, 8192): 5.9,
                  (256, 8192): 11.1}  # fmt: skip
QUOTED_TOPK_SOURCE = "vLLM 0.32.0 cooperative_topk/persistent_topk on the H200 (issue 12)"

Args = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Impl:
    name: str
    call: Callable[[Args], object]
    graphable: bool  # may be captured in a CUDA graph
    check: str  # how its output is compared with the reference: see run.check
    prepare: Callable[[list[Args]], list[Args]] | None = None  # its own inputs per copy


def _attention_args(a: Args) -> tuple[torch.Tensor, ...]:
    return (a["q"], a["k_cache"], a["v_cache"], a["logical_indices"], a["page_table"],
            a["token_to_req"])  # fmt: skip


def _selection_args(a: Args) -> tuple[torch.Tensor, ...]:
    return (a["q"], a["compressed_key_cache"], a["page_table"], a["token_to_req"],
            a["query_positions"], a["sequence_lengths"])  # fmt: skip


def kernel_status(device: torch.device) -> tuple[bool, str]:
    """(True, "") when the public ops run the compiled CUDA kernels on ``device``."""
    if device.type != "cuda":
        return False, "no CUDA device: the kernels run on CUDA tensors only"
    if ops.BACKEND != "cuda":
        return False, f"CUDA tensors run on the {ops.BACKEND} backend ({ops.LIBRARY_ERROR})"
    return True, ""


def attention_splits_control() -> tuple[str, Callable[[int], int]]:
    """(the env variable that forces attention's CTAs per row, rows -> the automatic count)."""
    return ops.SPLITS_ENV, ops.attention_splits


# ----------------------------------------------------------------------------------------
# the torch.compile'd reference
# ----------------------------------------------------------------------------------------

_COMPILED: dict[str, Callable] = {}


def _configure_dynamo() -> None:
    # NOTES: one compiled function serves every case of an operator; dynamo recompiles per
    # new shape and, past its default limit of 8, would silently fall back to eager.
    import torch._dynamo.config as cfg

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(64, getattr(cfg, name)))
            break


def compiled_reference(op: str) -> Callable:
    if op not in _COMPILED:
        _configure_dynamo()
        fn = (
            reference.sparse_paged_attention_ref
            if op == ATTENTION
            else reference.select_paged_tokens_ref
        )
        _COMPILED[op] = torch.compile(fn, fullgraph=True, dynamic=False)
    return _COMPILED[op]


# NOTES: the reference processes rows in chunks of about 2**24 float32 elements (64 MiB
# temporaries) with a Python loop; traced whole, dynamo unrolls that loop (26 chunk bodies at
# attention R=256), and Inductor's compile time grows with it. Rows are independent, so the
# compiled reference is called per row chunk of the same size instead, rounded down to a
# power of two so that it divides every R of the grid: one graph per case, not 26.
CHUNK_ELEMENTS = 1 << 24
_ROW_NAMES = {  # the row-indexed arguments (sliced per chunk); the others are shared
    ATTENTION: ("q", "logical_indices", "token_to_req", "out"),
    "selection": ("q", "token_to_req", "query_positions", "out"),
}


def rows_per_chunk(op: str, a: Args) -> int:
    if op == ATTENTION:
        per_row = contract.ATTN_HEADS * contract.WIDTH * contract.HEAD_DIM
    else:
        per_row = contract.INDEX_HEADS * contract.INDEX_DIM * a["page_table"].shape[1]
        per_row *= contract.CK_PAGE
    limit = max(1, CHUNK_ELEMENTS // max(1, per_row))
    return 1 << (limit.bit_length() - 1)


def compiled_call(op: str) -> Callable[[Args], object]:
    fn = compiled_reference(op)
    pick = _attention_args if op == ATTENTION else _selection_args
    names = _ROW_NAMES[op]

    def call(a: Args) -> object:
        rows = a["q"].shape[0]
        step = rows_per_chunk(op, a)
        if step >= rows:
            return fn(*pick(a), a["out"])
        for start in range(0, rows, step):
            part = dict(a)
            for n in names:
                part[n] = a[n][start : start + step]
            fn(*pick(part), part["out"])
        return a["out"]

    return call


# ----------------------------------------------------------------------------------------
# BASELINE ONLY: the row-by-row PyTorch style of the original change, kept to measure what
# the fused kernels replace. It is *not* the specification (that is qsa_ops.reference). Each
# row is handled by a Python loop that reads device values on the host (int(t), boolean-mask
# indexing with data-dependent shapes): one or more device-to-host synchronisations per row,
# so it cannot be captured in a CUDA graph. It follows the contract (tie rule, holes,
# duplicates, bad values), and the bench's tests check it against the reference.
# ----------------------------------------------------------------------------------------


def select_paged_tokens_rowwise(
    q, compressed_key_cache, page_table, token_to_req, query_positions, sequence_lengths, out
) -> torch.Tensor:
    rows = q.shape[0]
    pages = compressed_key_cache.shape[0]
    requests, max_pages = page_table.shape
    device = q.device
    ratio, ck_page = contract.COMPRESS_RATIO, contract.CK_PAGE
    out.fill_(-1)
    for r in range(rows):
        b = int(token_to_req[r])  # host sync
        if not 0 <= b < requests:
            continue
        n = max(min(int(query_positions[r]) + 1, int(sequence_lengths[b])), 0)  # host syncs
        nb, tail = divmod(n, ratio)
        j = torch.arange(min(nb, max_pages * ck_page), device=device)
        phys = page_table[b, j // ck_page].long()
        usable = (phys >= 0) & (phys < pages)
        j, phys = j[usable], phys[usable]  # data-dependent shape: host sync
        keys = compressed_key_cache[phys, j % ck_page, 0]  # [U, 128]
        scores = reference.block_scores(q[r : r + 1], keys[None])[0]  # [U] float32
        # highest score first; equal scores: lower j first (stable sort keeps j ascending)
        order = torch.sort(scores, descending=True, stable=True).indices[: contract.BLOCK_TOPK]
        chosen = j[order]
        tokens = ratio * chosen[:, None] + torch.arange(ratio, device=device)
        row = torch.cat([tokens.reshape(-1), torch.arange(n - tail, n, device=device)])
        out[r, : row.numel()] = row.to(out.dtype)
    return out


def sparse_paged_attention_rowwise(
    q, k_cache, v_cache, logical_indices, page_table, token_to_req, out, softmax_scale=None
) -> torch.Tensor:
    scale = contract.resolve_softmax_scale(softmax_scale)
    rows = q.shape[0]
    pages = k_cache.shape[0]
    requests, max_pages = page_table.shape
    kv_page = contract.KV_PAGE
    for r in range(rows):
        b = int(token_to_req[r])  # host sync
        idx = logical_indices[r].long()
        idx = idx[(idx >= 0) & (idx // kv_page < max_pages)]  # host sync
        if not 0 <= b < requests or idx.numel() == 0:
            out[r].zero_()
            continue
        phys = page_table[b, idx // kv_page].long()
        ok = (phys >= 0) & (phys < pages)
        idx, phys = idx[ok], phys[ok]  # host sync
        if idx.numel() == 0:
            out[r].zero_()
            continue
        keys = k_cache[phys, idx % kv_page, 0].float()  # [T, 256]
        values = v_cache[phys, idx % kv_page, 0].float()
        logits = (q[r].float()[:, None, :] * keys[None]).sum(-1) * scale  # [3, T]
        out[r] = (torch.softmax(logits, dim=-1) @ values).to(out.dtype)
    return out


# ----------------------------------------------------------------------------------------
# upstream (vLLM's kernels, loaded by bench.upstream)
# ----------------------------------------------------------------------------------------

BF16 = torch.bfloat16
GATE_OPEN = 30.0  # upstream multiplies by sigmoid(gate): sigmoid(30) is 1.0 in float32


def _bf16_pool(pool: torch.Tensor, seen: dict) -> torch.Tensor:
    """The bfloat16 twin of a shared pool (converted once per distinct pool)."""
    key = (pool.data_ptr(), tuple(pool.shape))
    if key not in seen:
        seen[key] = pool.to(BF16)
    return seen[key]


def packed_indices(idx: torch.Tensor) -> torch.Tensor:
    """Upstream's packed selection buffer [R, W + 1]: the valid entries first (in order), then
    holes, and the row's valid count in the last column."""
    valid = idx >= 0
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    front = torch.gather(idx, 1, order)
    count = valid.sum(dim=1, keepdim=True).to(idx.dtype)
    return torch.cat([front, count], dim=1).contiguous()


def _prepare_attention(copies: list[Args]) -> list[Args]:
    seen: dict = {}
    out = []
    for a in copies:
        k, v = packed_kv_views(_bf16_pool(a["kv"], seen))
        rows = a["q"].shape[0]
        out.append({
            "q": a["q"].to(BF16), "k_cache": k, "v_cache": v,
            "logical_indices": packed_indices(a["logical_indices"]),
            "page_table": a["page_table"], "token_to_req": a["token_to_req"],
            "gate": torch.full_like(a["q"], GATE_OPEN, dtype=BF16),
            "out": torch.empty(rows, *a["q"].shape[1:], dtype=BF16, device=a["q"].device),
        })  # fmt: skip
    return out


def _prepare_selection(copies: list[Args]) -> list[Args]:
    seen: dict = {}
    out = []
    for a in copies:
        table = a["page_table"]
        b = a["token_to_req"].long().clamp(0, max(table.shape[0] - 1, 0))
        n = reference.visible_tokens(a["query_positions"], a["sequence_lengths"].long()[b])
        rows = a["q"].shape[0]
        out.append({
            "q": a["q"].to(BF16),
            "compressed_key_cache": _bf16_pool(a["compressed_key_cache"], seen),
            "page_table": table[b].contiguous(),  # one request per row: a uniform decode batch
            "visible_blocks": (n // contract.COMPRESS_RATIO).to(torch.int32),
            "out": torch.empty(rows, contract.BLOCK_TOPK, dtype=torch.int32, device=table.device),
        })  # fmt: skip
    return out


def topk_stand_in(logits, visible_blocks, token_topk, compress_ratio, block_indices, workspace):
    """Upstream's ``_topk`` signature, done with torch.topk on the float32 scores: the
    ``block_indices.shape[1]`` best visible columns per row, -1 past the visible ones."""
    del token_topk, compress_ratio, workspace
    k = min(block_indices.shape[1], logits.shape[1])
    cols = torch.arange(logits.shape[1], device=logits.device)
    masked = logits.masked_fill(cols >= visible_blocks[:, None], float("-inf"))
    best = torch.topk(masked, k, dim=1, sorted=False)
    chosen = torch.where(best.values == float("-inf"), -1, best.indices)
    block_indices[:, :k] = chosen.to(block_indices.dtype)
    block_indices[:, k:] = -1


def _no_topk(*args) -> None:
    """Scores only: upstream's launcher runs its Triton scoring, then this in place of top-k."""


def _upstream_select(up: Upstream, topk: Callable | None) -> Callable[[Args], object]:
    """Upstream's own decode launcher (``qsa_select_paged_decode``) with its ``_topk`` kept
    (``topk=None``) or swapped for the call (stand-in, or nothing for scores only)."""
    mod = up.indexer

    def call(a: Args) -> object:
        saved = mod._topk
        if topk is not None:
            mod._topk = topk
        try:
            mod.qsa_select_paged_decode(
                a["q"], a["compressed_key_cache"], a["page_table"], a["visible_blocks"],
                contract.TOKEN_TOPK, contract.COMPRESS_RATIO, 1, a["out"],
            )  # fmt: skip
        finally:
            mod._topk = saved
        return a["out"]

    return call


def _upstream_attention(up: Upstream) -> Callable[[Args], object]:
    fn = up.attention.qsa_sparse_paged_attention

    def call(a: Args) -> object:
        return fn(*_attention_args(a), False, a["out"], output_gate=a["gate"])

    return call


# ----------------------------------------------------------------------------------------
# construction and choice
# ----------------------------------------------------------------------------------------


def make(name: str, op: str, up: Upstream | None = None) -> Impl:
    attention = op == ATTENTION
    pick = _attention_args if attention else _selection_args
    check = op
    if name == KERNEL:
        if attention:

            def call(a: Args) -> object:
                return qsa_ops.sparse_paged_attention(*pick(a), contract.KV_PAGE, a["out"])
        else:

            def call(a: Args) -> object:
                return qsa_ops.select_paged_tokens(
                    *pick(a), contract.TOKEN_TOPK, contract.COMPRESS_RATIO, a["out"]
                )

        return Impl(name, call, True, check)
    if name == REF_VECTORISED:
        fn = (
            reference.sparse_paged_attention_ref if attention else reference.select_paged_tokens_ref
        )
        return Impl(name, lambda a: fn(*pick(a), a["out"]), True, check)
    if name == REF_COMPILED:
        return Impl(name, compiled_call(op), True, check)
    if name == REF_ROWWISE:
        fn = sparse_paged_attention_rowwise if attention else select_paged_tokens_rowwise
        return Impl(name, lambda a: fn(*pick(a), a["out"]), False, check)
    if name in (UPSTREAM, UPSTREAM_SCORE):
        if up is None or not up.ok:
            raise ValueError(f"{name} needs a loaded upstream ({up.skip if up else 'none'})")
        if attention:
            if name == UPSTREAM_SCORE:
                raise ValueError("upstream-score is a selection baseline only")
            return Impl(name, _upstream_attention(up), True, "attention-bf16", _prepare_attention)
        if name == UPSTREAM_SCORE:
            return Impl(name, _upstream_select(up, _no_topk), True, "none", _prepare_selection)
        topk = None if up.compiled_topk else topk_stand_in
        return Impl(name, _upstream_select(up, topk), True, "blocks", _prepare_selection)
    raise ValueError(f"implementation must be one of {', '.join(ALL)}, got {name!r}")


def select(
    op: str,
    rows: int,
    device: torch.device,
    compile_skip: str | None,
    rowwise_max_rows: int = ROWWISE_MAX_ROWS,
    only: tuple[str, ...] = ALL,
    up: Upstream | None = None,
) -> tuple[list[Impl], dict[str, str]]:
    """(implementations to run, {skipped name: reason}) for one case; ``compile_skip`` is
    the reason not to run the compiled reference here (None: run it)."""
    skipped: dict[str, str] = {}
    ok, reason = kernel_status(device)
    if not ok:
        skipped[KERNEL] = reason
    if up is None or not up.ok:
        skipped[UPSTREAM] = (up.skip if up else None) or "upstream not requested"
    if op == ATTENTION:
        skipped[UPSTREAM_SCORE] = "a selection baseline only"
    elif UPSTREAM in skipped:
        skipped[UPSTREAM_SCORE] = skipped[UPSTREAM]
    if compile_skip:
        skipped[REF_COMPILED] = compile_skip
    if rows > rowwise_max_rows:
        skipped[REF_ROWWISE] = f"row loop with host syncs: run only for R <= {rowwise_max_rows}"
    for name in ALL:
        if name not in only and name not in skipped:
            skipped[name] = "not requested (--impls)"
    chosen = [make(n, op, up) for n in ALL if n not in skipped]
    if op == ATTENTION:
        skipped.pop(UPSTREAM_SCORE)  # not a skip: it does not exist for attention
    return chosen, skipped
