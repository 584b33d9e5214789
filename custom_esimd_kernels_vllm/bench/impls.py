"""The implementations compared on every case, in candidate-preference order.

``kernel``          the public ``qsa_ops`` operator on the compiled CUDA backend (validation,
                    dispatch and the kernel launch: what a caller pays)
``upstream``        vLLM 0.32.0's own kernels (``bench.upstream``) on the case's own tensors,
                    in the case's dtype: attention = its Triton sparse attention; selection =
                    its Triton indexer scoring + its compiled top-k, or a stated stand-in
                    (torch.topk on the float32 scores) when vLLM's compiled ops are absent.
                    Its block-index expansion (a third launch) is not included. Where it
                    cannot take a case (``upstream_skip``: float16 attention, no gate, 2051-wide
                    index rows), it is skipped with the reason, never fed a converted copy.
``upstream-score``  selection only: upstream's Triton scoring alone (the half that always
                    runs the real upstream code)
``ref-compiled``    ``torch.compile(fullgraph=True, dynamic=False)`` of the PyTorch reference,
                    called on row chunks (see ``compiled_call``); one graph per chunk shape
``ref-vectorised``  the PyTorch reference, ``qsa_ops.reference`` (no host sync)
``ref-rowwise``     BASELINE ONLY: the row-by-row loop with host syncs of the original change
                    (below); eager only (it cannot be captured in a CUDA graph)

The candidate of a case is the first available in this order; every other available one is a
baseline it is compared with. An implementation that needs its own inputs (upstream: its
output buffers, the visible block counts, a per-row page table where rows share a request)
has a ``prepare`` that derives them from the rotated copies once, outside the timed region;
the tensors both read are the same tensors. The references are timed on the seed layout (on
the other layouts they run once, for the check, unless no kernel runs here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import qsa_ops
from ..qsa_ops import contract, ops, reference
from .cases import ATTENTION, SEED_LAYOUT, layout_of
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


ATTENTION_KWARGS = ("k_scale", "v_scale", "gate")


def attention_kwargs(a: Args) -> dict[str, object]:
    """The keyword arguments of contract v2 present in ``a`` (float8 scales, the gate); {} for
    the seed's call, which then goes without keywords, as the seed's callers make it."""
    return {k: a[k] for k in ATTENTION_KWARGS if a.get(k) is not None}


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
    ATTENTION: ("q", "logical_indices", "token_to_req", "out", "gate"),
    "selection": ("q", "token_to_req", "query_positions", "out"),
}


def rows_per_chunk(op: str, a: Args) -> int:
    if op == ATTENTION:
        per_row = contract.ATTN_HEADS * contract.WIDTH * contract.HEAD_DIM
    else:
        per_row = contract.INDEX_HEADS * contract.INDEX_DIM * a["page_table"].shape[1]
        ck = a.get("compressed_key_cache")
        per_row *= contract.CK_PAGE if ck is None else ck.shape[1]
    limit = max(1, CHUNK_ELEMENTS // max(1, per_row))
    return 1 << (limit.bit_length() - 1)


def compiled_call(op: str) -> Callable[[Args], object]:
    fn = compiled_reference(op)
    pick = _attention_args if op == ATTENTION else _selection_args
    kwargs = attention_kwargs if op == ATTENTION else (lambda a: {})
    names = _ROW_NAMES[op]

    def call(a: Args) -> object:
        rows = a["q"].shape[0]
        step = rows_per_chunk(op, a)
        if step >= rows:
            return fn(*pick(a), a["out"], **kwargs(a))
        for start in range(0, rows, step):
            part = dict(a)
            for n in names:
                if a.get(n) is not None:
                    part[n] = a[n][start : start + step]
            fn(*pick(part), part["out"], **kwargs(part))
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
    ratio, ck_page = contract.COMPRESS_RATIO, compressed_key_cache.shape[1]
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
    kv_page = k_cache.shape[1]
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


def upstream_skip(op: str, layout: str) -> str | None:
    """Why vLLM's kernel cannot take a case in ``layout`` as it is (None: it can). The
    benchmark never converts a case for upstream: a skip says which of its input rules the
    case breaks (its asserts and its interface, vLLM 0.32.0)."""
    lay = layout_of(layout)
    if op == ATTENTION:
        if lay.dtype != BF16:
            return (f"vLLM's QSA attention takes bfloat16 queries only (it asserts q.dtype == "
                    f"torch.bfloat16); this case is {str(lay.dtype).replace('torch.', '')}: "
                    "compared with upstream in the bf16 and fp8 cases")  # fmt: skip
        if not lay.gate:
            return "vLLM's QSA attention always applies an output gate; this layout has none"
        if lay.index_stride <= contract.WIDTH:
            return ("vLLM's QSA attention reads its [T, 2052] index buffer (the valid count in "
                    "the last column); this layout's index rows are 2051 wide")  # fmt: skip
    return None


def _prepare_attention(copies: list[Args]) -> list[Args]:
    """Upstream reads the copy's own tensors (its index buffer is the [R, 2052] buffer whose
    first 2051 columns are ours); only its output is its own."""
    out = []
    for a in copies:
        out.append({
            "q": a["q"], "k_cache": a["k_cache"], "v_cache": a["v_cache"],
            "logical_indices": a["index_buffer"], "page_table": a["page_table"],
            "token_to_req": a["token_to_req"], "gate": a["gate"],
            "k_scale": a.get("k_scale"), "v_scale": a.get("v_scale"),
            "out": torch.empty_like(a["out"]),
        })  # fmt: skip
    return out


def _one_request_per_row(a: Args) -> bool:
    """Row r belongs to request r (host read, once per case, outside the timed region)."""
    t2r, table = a["token_to_req"], a["page_table"]
    rows = t2r.shape[0]
    return table.shape[0] == rows and torch.equal(t2r.long(), torch.arange(rows, device=t2r.device))


def _prepare_selection(copies: list[Args]) -> list[Args]:
    """Upstream reads the copy's q, cache and (one request per row, as in the scale cases)
    page table; it takes visible block counts instead of positions and lengths, writes its own
    [R, 512] blocks, and needs one page-table row per query row (the seed cases' rows share a
    request: their rows' tables are gathered once)."""
    out = []
    for a in copies:
        table = a["page_table"]
        b = a["token_to_req"].long().clamp(0, max(table.shape[0] - 1, 0))
        n = reference.visible_tokens(a["query_positions"], a["sequence_lengths"].long()[b])
        rows = a["q"].shape[0]
        out.append({
            "q": a["q"],
            "compressed_key_cache": a["compressed_key_cache"],
            "page_table": table if _one_request_per_row(a) else table[b].contiguous(),
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
        return fn(*_attention_args(a), False, a["out"], a["k_scale"], a["v_scale"],
                  output_gate=a["gate"])  # fmt: skip

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
                return qsa_ops.sparse_paged_attention(
                    *pick(a), a["k_cache"].shape[1], a["out"], **attention_kwargs(a)
                )
        else:

            def call(a: Args) -> object:
                return qsa_ops.select_paged_tokens(
                    *pick(a), contract.TOKEN_TOPK, contract.COMPRESS_RATIO, a["out"]
                )

        return Impl(name, call, True, check)
    if name == REF_VECTORISED:
        if attention:
            return Impl(name, lambda a: reference.sparse_paged_attention_ref(
                *pick(a), a["out"], **attention_kwargs(a)), True, check)  # fmt: skip
        fn = reference.select_paged_tokens_ref
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
            return Impl(name, _upstream_attention(up), True, "attention-upstream",
                        _prepare_attention)  # fmt: skip
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
    layout: str = SEED_LAYOUT,
) -> tuple[list[Impl], dict[str, str]]:
    """(implementations to run, {skipped name: reason}) for one case; ``compile_skip`` is
    the reason not to run the compiled reference here (None: run it)."""
    skipped: dict[str, str] = {}
    ok, reason = kernel_status(device)
    if not ok:
        skipped[KERNEL] = reason
    if up is None or not up.ok:
        skipped[UPSTREAM] = (up.skip if up else None) or "upstream not requested"
    elif upstream_skip(op, layout):
        skipped[UPSTREAM] = upstream_skip(op, layout)
    if op == ATTENTION:
        skipped[UPSTREAM_SCORE] = "a selection baseline only"
    elif UPSTREAM in skipped:
        skipped[UPSTREAM_SCORE] = skipped[UPSTREAM]
    if layout != SEED_LAYOUT:
        why = ("the references are timed on the seed layout only (here they run once, for "
               "the check)")  # fmt: skip
        skipped[REF_ROWWISE] = why
        if ok:  # without a kernel here, the references keep the case measured
            skipped[REF_COMPILED] = skipped[REF_VECTORISED] = why
    if compile_skip and REF_COMPILED not in skipped:
        skipped[REF_COMPILED] = compile_skip
    if rows > rowwise_max_rows and REF_ROWWISE not in skipped:
        skipped[REF_ROWWISE] = f"row loop with host syncs: run only for R <= {rowwise_max_rows}"
    for name in ALL:
        if name not in only and name not in skipped:
            skipped[name] = "not requested (--impls)"
    chosen = [make(n, op, up) for n in ALL if n not in skipped]
    if op == ATTENTION:
        skipped.pop(UPSTREAM_SCORE)  # not a skip: it does not exist for attention
    return chosen, skipped
