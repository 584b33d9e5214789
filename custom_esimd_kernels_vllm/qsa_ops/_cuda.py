"""CUDA backend adapter: hands validated tensors to the compiled, torch-free ``_qsa_cuda``.

``qsa_ops.dispatch`` calls these functions *after* ``qsa_ops.contract`` has validated every
argument. This module adds only what the kernels themselves need (device capability, pointer
alignment, index ranges), passes raw pointers, sizes, strides and the raw handle of
``torch.cuda.current_stream()``, and owns the kernels' workspace.

Workspace (see docs/kernels.md): one scratch buffer and one counter array per (device,
stream), allocated through torch's caching allocator the first time a call needs them and
grown geometrically. Replaced buffers are kept alive, never freed, because a CUDA graph
captured earlier may still point at them (growth is rare: a few times per process).
Inside CUDA-graph capture a buffer is never grown or created: a call that needs more than
the cache holds allocates a temporary from the graph's private pool instead (stream-ordered,
like any intermediate tensor of a captured region); warm up once before capture to avoid that.
"""

from __future__ import annotations

import os
import threading

import torch

from .contract import CK_PAGE, KV_PAGE, check_macros

try:  # the compiled module is optional: a CPU-only install runs the reference
    from .. import _qsa_cuda as _ext

    _IMPORT_ERROR = ""
except ImportError as exc:  # pragma: no cover - depends on the build
    _ext = None
    _IMPORT_ERROR = str(exc)

SPLITS_ENV = "QSA_ATTN_SPLITS"
REQUIRED_CAPABILITY = (9, 0)  # built for sm_90a only (build_targets.py: cuda-sm90)
_INT32_MAX = 2**31 - 1


def available() -> tuple[bool, str]:
    """(True, "") when the kernels can run on the current CUDA device, else (False, reason)."""
    if _ext is None:
        return (
            False,
            f"compiled module custom_esimd_kernels_vllm._qsa_cuda not built ({_IMPORT_ERROR})",
        )
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    try:
        check_macros(_ext.build_info()["macros"])
    except ValueError as exc:
        return False, str(exc)
    cap = torch.cuda.get_device_capability()
    if tuple(cap) != REQUIRED_CAPABILITY:
        return False, (
            f"kernels are built for sm_90a (compute capability 9.0), device "
            f"{torch.cuda.get_device_name()} has {cap[0]}.{cap[1]}"
        )
    return True, ""


def build_info() -> dict:
    """The compiled module's own build_info(): arch, macros, version, source SHA256."""
    if _ext is None:
        raise RuntimeError(available()[1])
    return dict(_ext.build_info())


# ----------------------------------------------------------------------------------------
# workspace
# ----------------------------------------------------------------------------------------


class _Workspace:
    """Scratch bytes and zeroed int32 counters of one (device, stream)."""

    def __init__(self) -> None:
        self.scratch: torch.Tensor | None = None
        self.counters: torch.Tensor | None = None
        self.retired: list[torch.Tensor] = []  # kept alive for graphs captured earlier


_workspaces: dict[tuple[int, int], _Workspace] = {}
_lock = threading.Lock()


def _workspace(device: torch.device, stream: int) -> _Workspace:
    key = (device.index, stream)
    with _lock:
        ws = _workspaces.get(key)
        if ws is None:
            ws = _workspaces[key] = _Workspace()
        return ws


def _scratch(ws: _Workspace, device: torch.device, nbytes: int) -> torch.Tensor | None:
    if nbytes == 0:
        return None
    if ws.scratch is not None and ws.scratch.numel() >= nbytes:
        return ws.scratch
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(nbytes, dtype=torch.uint8, device=device)  # graph pool, this call
    size = max(nbytes, 2 * ws.scratch.numel() if ws.scratch is not None else 1 << 20)
    if ws.scratch is not None:
        ws.retired.append(ws.scratch)
    ws.scratch = torch.empty(size, dtype=torch.uint8, device=device)
    return ws.scratch


def _counters(ws: _Workspace, device: torch.device, slots: int) -> torch.Tensor:
    if ws.counters is not None:
        return ws.counters
    if torch.cuda.is_current_stream_capturing():
        # the zero fill is captured too, so every replay starts from zeros
        return torch.zeros(slots, dtype=torch.int32, device=device)
    ws.counters = torch.zeros(slots, dtype=torch.int32, device=device)
    return ws.counters


def _requested_splits() -> int:
    """QSA_ATTN_SPLITS: CTAs per attention row (tuning knob; 0 or unset = heuristic)."""
    value = os.environ.get(SPLITS_ENV, "").strip()
    if not value:
        return 0
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(f"{SPLITS_ENV} must be a non-negative integer, got {value!r}") from None


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


# ----------------------------------------------------------------------------------------
# operators (arguments already validated by qsa_ops.contract)
# ----------------------------------------------------------------------------------------


def select_paged_tokens(
    q: torch.Tensor,  # [R, 4, 128] float16
    compressed_key_cache: torch.Tensor,  # [P, 128, 1, 128] float16
    page_table: torch.Tensor,  # [B, M] int32
    token_to_req: torch.Tensor,  # [R] int32
    query_positions: torch.Tensor,  # [R] int64
    sequence_lengths: torch.Tensor,  # [B] int32
    out: torch.Tensor,  # [R, 2051] int32
) -> None:
    rows = q.shape[0]
    requests, table_width = page_table.shape
    if table_width * CK_PAGE > _INT32_MAX:
        raise ValueError(
            f"page_table width M must be at most {_INT32_MAX // CK_PAGE} for the CUDA kernels "
            f"(M * {CK_PAGE} blocks index an int32), got {table_width}"
        )
    device = q.device
    stream = _stream(device)
    ws = _workspace(device, stream)
    scratch = _scratch(ws, device, _ext.select_workspace_bytes(rows, table_width))
    _ext.select_paged_tokens(
        device=device.index,
        q=q.data_ptr(),
        compressed_keys=compressed_key_cache.data_ptr(),
        page_table=page_table.data_ptr(),
        token_to_req=token_to_req.data_ptr(),
        query_positions=query_positions.data_ptr(),
        sequence_lengths=sequence_lengths.data_ptr(),
        out=out.data_ptr(),
        rows=rows,
        requests=requests,
        table_width=table_width,
        pages=compressed_key_cache.shape[0],
        page_table_stride=page_table.stride(0) if requests else table_width,
        out_stride=out.stride(0) if rows else out.shape[1],
        workspace=_ptr(scratch),
        workspace_bytes=0 if scratch is None else scratch.numel(),
        stream=stream,
    )


def sparse_paged_attention(
    q: torch.Tensor,  # [R, 3, 256] float16
    k_cache: torch.Tensor,  # [P, 512, 1, 256] float16, exact-packed with v_cache
    v_cache: torch.Tensor,  # k_cache's storage + 256 elements
    logical_indices: torch.Tensor,  # [R, 2051] int32
    page_table: torch.Tensor,  # [B, M] int32
    token_to_req: torch.Tensor,  # [R] int32
    out: torch.Tensor,  # [R, 3, 256] float16
    softmax_scale: float,
) -> None:
    del v_cache  # the kernel reads V at k_cache + 256 elements (exact-packed, validated)
    rows = q.shape[0]
    pages = k_cache.shape[0]
    requests, table_width = page_table.shape
    if pages * KV_PAGE > _INT32_MAX:
        raise ValueError(
            f"k_cache must have at most {_INT32_MAX // KV_PAGE} pages for the CUDA kernels "
            f"(cache slots index an int32), got {pages}"
        )
    device = q.device
    stream = _stream(device)
    ws = _workspace(device, stream)
    splits = _requested_splits()
    scratch = _scratch(ws, device, _ext.attention_workspace_bytes(rows, splits, device.index))
    counters = _counters(ws, device, _ext.attention_counter_slots())
    _ext.sparse_paged_attention(
        device=device.index,
        q=q.data_ptr(),
        kv=k_cache.data_ptr(),
        logical_indices=logical_indices.data_ptr(),
        page_table=page_table.data_ptr(),
        token_to_req=token_to_req.data_ptr(),
        out=out.data_ptr(),
        rows=rows,
        requests=requests,
        table_width=table_width,
        pages=pages,
        indices_stride=logical_indices.stride(0) if rows else logical_indices.shape[1],
        page_table_stride=page_table.stride(0) if requests else table_width,
        softmax_scale=float(softmax_scale),
        splits=splits,
        workspace=_ptr(scratch),
        workspace_bytes=0 if scratch is None else scratch.numel(),
        counters=counters.data_ptr(),
        stream=stream,
    )


def attention_splits(rows: int, device: torch.device | None = None) -> int:
    """CTAs that share one attention row for ``rows`` rows on ``device``."""
    index = torch.cuda.current_device() if device is None else torch.device(device).index
    return int(_ext.attention_splits(rows, _requested_splits(), index))


def launch_counts(rows: int, table_width: int) -> dict[str, int]:
    """Kernel launches one call makes: {"select_paged_tokens": n, "sparse_paged_attention": n}."""
    return {
        "select_paged_tokens": int(_ext.select_launch_count(rows, table_width)),
        "sparse_paged_attention": int(_ext.attention_launch_count(rows)),
    }
