"""The implementations compared on every case, in candidate-preference order.

``kernel``          the public ``qsa_ops`` operator on the compiled CUDA backend (validation,
                    custom-op dispatch and the kernel launch: what a caller pays)
``ref-compiled``    ``torch.compile`` of the PyTorch reference (one compiled function per
                    operator; dynamo keeps one graph per shape guard, i.e. per case shape)
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
from ..qsa_ops import dispatch, reference
from ..qsa_ops.contract import COMPRESS_RATIO, KV_PAGE, TOKEN_TOPK
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
    try:
        backend = dispatch.resolve_backend(device)
    except (RuntimeError, ValueError) as exc:
        return False, str(exc)
    if backend != "cuda":
        ok, reason = dispatch.cuda_status()
        why = reason if not ok else f"{dispatch.ENV_VAR}={dispatch.requested_backend()}"
        return False, f"the public ops resolve to the {backend} backend ({why})"
    return True, ""


_COMPILED: dict[str, Callable] = {}


def _configure_dynamo() -> None:
    # NOTES: one compiled function serves every case of an operator; dynamo recompiles per
    # new shape guard and, past its default limit of 8, would silently fall back to eager.
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
        _COMPILED[op] = torch.compile(fn, fullgraph=True)
    return _COMPILED[op]


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
        fn = compiled_reference(op)
        return Impl(name, lambda a: fn(*pick(a), a["out"]), graphable=True)
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
    compile_reference: bool,
    rowwise_max_rows: int = ROWWISE_MAX_ROWS,
    only: tuple[str, ...] = ALL,
) -> tuple[list[Impl], dict[str, str]]:
    """(implementations to run, {skipped name: reason}) for one case."""
    skipped: dict[str, str] = {}
    ok, reason = kernel_status(device)
    if not ok:
        skipped[KERNEL] = reason
    if not compile_reference:
        skipped[REF_COMPILED] = "torch.compile disabled (--no-compile; --quick skips it for time)"
    if rows > rowwise_max_rows:
        skipped[REF_ROWWISE] = f"row loop with host syncs: run only for R <= {rowwise_max_rows}"
    for name in ALL:
        if name not in only and name not in skipped:
            skipped[name] = "not requested (--impls)"
    return [make(n, op) for n in ALL if n not in skipped], skipped
