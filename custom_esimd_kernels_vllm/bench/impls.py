"""The implementations compared on every case, in candidate-preference order.

``kernel``          the public ``qsa_ops`` operator on the compiled CUDA backend (validation,
                    custom-op dispatch and the kernel launch: what a caller pays)
``ref-compiled``    ``torch.compile(fullgraph=True, dynamic=False)`` of the PyTorch reference,
                    called on row chunks (see ``compiled_call``); one graph per chunk shape
``ref-vectorised``  the PyTorch reference, ``qsa_ops.reference`` (no host sync)
``ref-rowwise``     BASELINE ONLY: the row-by-row loop with host syncs (``bench.rowwise``);
                    eager only (it cannot be captured in a CUDA graph)

The candidate of a case is the first available in this order; every other available one is a
baseline it is compared with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import qsa_ops
from ..qsa_ops import ops, reference
from ..qsa_ops.contract import (
    ATTN_HEADS,
    CK_PAGE,
    COMPRESS_RATIO,
    HEAD_DIM,
    INDEX_DIM,
    INDEX_HEADS,
    KV_PAGE,
    TOKEN_TOPK,
    WIDTH,
)
from . import rowwise
from .cases import ATTENTION

KERNEL = "kernel"
REF_COMPILED = "ref-compiled"
REF_VECTORISED = "ref-vectorised"
REF_ROWWISE = "ref-rowwise"
ALL = (KERNEL, REF_COMPILED, REF_VECTORISED, REF_ROWWISE)

# NOTES: the row loop costs about one host round trip per row plus a dozen small launches;
# at R = 64 that is already ~100x the kernel time per call and would dominate the run time
# of the whole grid, so the rowwise baseline runs on cases with R <= 8 only.
ROWWISE_MAX_ROWS = 8

Args = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Impl:
    name: str
    call: Callable[[Args], object]
    graphable: bool  # may be captured in a CUDA graph


def _attention_args(a: Args) -> tuple[torch.Tensor, ...]:
    return (
        a["q"],
        a["k_cache"],
        a["v_cache"],
        a["logical_indices"],
        a["page_table"],
        a["token_to_req"],
    )


def _selection_args(a: Args) -> tuple[torch.Tensor, ...]:
    return (
        a["q"],
        a["compressed_key_cache"],
        a["page_table"],
        a["token_to_req"],
        a["query_positions"],
        a["sequence_lengths"],
    )


def kernel_status(device: torch.device) -> tuple[bool, str]:
    """(True, "") when the public ops run the compiled CUDA kernels on ``device``."""
    if device.type != "cuda":
        return False, "no CUDA device: the kernels run on CUDA tensors only"
    if ops.BACKEND != "cuda":
        return False, f"CUDA tensors run on the {ops.BACKEND} backend ({ops.LIBRARY_ERROR})"
    return True, ""


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
        per_row = ATTN_HEADS * WIDTH * HEAD_DIM
    else:
        per_row = INDEX_HEADS * INDEX_DIM * a["page_table"].shape[1] * CK_PAGE
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


def make(name: str, op: str) -> Impl:
    attention = op == ATTENTION
    pick = _attention_args if attention else _selection_args
    if name == KERNEL:
        if attention:

            def call(a: Args) -> object:
                return qsa_ops.sparse_paged_attention(*pick(a), KV_PAGE, a["out"])
        else:

            def call(a: Args) -> object:
                return qsa_ops.select_paged_tokens(*pick(a), TOKEN_TOPK, COMPRESS_RATIO, a["out"])

        return Impl(name, call, graphable=True)
    if name == REF_VECTORISED:
        fn = (
            reference.sparse_paged_attention_ref if attention else reference.select_paged_tokens_ref
        )
        return Impl(name, lambda a: fn(*pick(a), a["out"]), graphable=True)
    if name == REF_COMPILED:
        return Impl(name, compiled_call(op), graphable=True)
    if name == REF_ROWWISE:
        fn = (
            rowwise.sparse_paged_attention_rowwise
            if attention
            else rowwise.select_paged_tokens_rowwise
        )
        return Impl(name, lambda a: fn(*pick(a), a["out"]), graphable=False)
    raise ValueError(f"implementation must be one of {', '.join(ALL)}, got {name!r}")


def select(
    op: str,
    rows: int,
    device: torch.device,
    compile_skip: str | None,
    rowwise_max_rows: int = ROWWISE_MAX_ROWS,
    only: tuple[str, ...] = ALL,
) -> tuple[list[Impl], dict[str, str]]:
    """(implementations to run, {skipped name: reason}) for one case; ``compile_skip`` is
    the reason not to run the compiled reference here (None: run it)."""
    skipped: dict[str, str] = {}
    ok, reason = kernel_status(device)
    if not ok:
        skipped[KERNEL] = reason
    if compile_skip:
        skipped[REF_COMPILED] = compile_skip
    if rows > rowwise_max_rows:
        skipped[REF_ROWWISE] = f"row loop with host syncs: run only for R <= {rowwise_max_rows}"
    for name in ALL:
        if name not in only and name not in skipped:
            skipped[name] = "not requested (--impls)"
    return [make(n, op) for n in ALL if n not in skipped], skipped
