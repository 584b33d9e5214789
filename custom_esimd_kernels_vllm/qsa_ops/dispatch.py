"""torch.library custom ops ``qsa::select_paged_tokens`` / ``qsa::sparse_paged_attention``
and the one place where a backend is chosen.

Backends (``BACKENDS``): ``reference`` (qsa_ops.reference; any device) and ``cuda`` (the
compiled kernels behind qsa_ops._cuda; CUDA tensors only). The environment variable
``QSA_BACKEND`` picks one per call:

* ``auto`` (default): ``cuda`` for CUDA tensors when the compiled module loads, else
  ``reference`` (a CUDA tensor falling back warns once);
* ``reference``: always the PyTorch reference;
* ``cuda``: the compiled kernels, RuntimeError when they cannot run.

The ops mutate ``out`` and return nothing; their fake kernels only declare that, so
``torch.compile(fullgraph=True)`` traces callers without running a kernel. The op bodies
validate unless the public function has just done so (``validated_call``): they can be
reached directly (``torch.ops.qsa.*``) or from a compiled graph, whose trace could not run
the storage checks.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Callable
from types import ModuleType

import torch

from . import contract, reference

ENV_VAR = "QSA_BACKEND"
BACKENDS = ("reference", "cuda")
CHOICES = ("auto", *BACKENDS)
FALLBACK_WARNING = "custom_esimd_kernels_vllm: CUDA kernels not built; using the PyTorch reference"


def requested_backend() -> str:
    """The value of QSA_BACKEND (default ``auto``); ValueError for anything else."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(
            f"{ENV_VAR} must be one of {', '.join(CHOICES)}, got {os.environ.get(ENV_VAR)!r}"
        )
    return value


@functools.cache
def _cuda_backend() -> tuple[ModuleType | None, str]:
    """(module, "") when the compiled CUDA backend can run, else (None, reason)."""
    try:
        from . import _cuda
    except ImportError as exc:  # not built, or the adapter is missing
        return None, f"cannot import qsa_ops._cuda: {exc}"
    ok, reason = _cuda.available()
    return (_cuda, "") if ok else (None, reason)


def cuda_status() -> tuple[bool, str]:
    """(available, reason) of the compiled CUDA backend."""
    module, reason = _cuda_backend()
    return module is not None, reason


def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run on ``device``; tests parametrize over this list."""
    device = torch.device(device)
    names = ["reference"]
    if device.type == "cuda" and cuda_status()[0]:
        names.append("cuda")
    return names


@functools.cache
def _warn_fallback_once(reason: str) -> None:
    warnings.warn(f"{FALLBACK_WARNING} ({reason})", RuntimeWarning, stacklevel=4)


def resolve_backend(device: torch.device) -> str:
    """The backend that runs a call on ``device`` under the current QSA_BACKEND."""
    requested = requested_backend()
    if requested == "reference":
        return "reference"
    if device.type != "cuda":
        if requested == "cuda":
            raise RuntimeError(f"{ENV_VAR}=cuda needs CUDA tensors, got tensors on {device}")
        return "reference"
    ok, reason = cuda_status()
    if ok:
        return "cuda"
    if requested == "cuda":
        raise RuntimeError(f"{ENV_VAR}=cuda but the CUDA kernels cannot run: {reason}")
    _warn_fallback_once(reason)
    return "reference"


_state = threading.local()


def validated_call(op: Callable[..., None], *args) -> None:
    """Run ``op(*args)`` telling its body that the arguments were validated just now."""
    _state.validated = True
    try:
        op(*args)
    finally:
        _state.validated = False


def _take_validated() -> bool:
    validated = getattr(_state, "validated", False)
    _state.validated = False  # one op call per validation
    return validated


# ----------------------------------------------------------------------------------------
# custom ops
# ----------------------------------------------------------------------------------------


@torch.library.custom_op("qsa::select_paged_tokens", mutates_args=("out",))
def select_paged_tokens_op(
    q: torch.Tensor,
    compressed_key_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_to_req: torch.Tensor,
    query_positions: torch.Tensor,
    sequence_lengths: torch.Tensor,
    token_topk: int,
    compress_ratio: int,
    out: torch.Tensor,
) -> None:
    if not _take_validated():
        contract.validate_select_args(
            q,
            compressed_key_cache,
            page_table,
            token_to_req,
            query_positions,
            sequence_lengths,
            token_topk,
            compress_ratio,
            out,
        )
    args = (
        q,
        compressed_key_cache,
        page_table,
        token_to_req,
        query_positions,
        sequence_lengths,
        out,
    )
    if resolve_backend(q.device) == "cuda":
        _cuda_backend()[0].select_paged_tokens(*args)
    else:
        reference.select_paged_tokens_ref(*args)


@select_paged_tokens_op.register_fake
def _(q, compressed_key_cache, page_table, token_to_req, query_positions, sequence_lengths,
      token_topk, compress_ratio, out) -> None:  # fmt: skip
    return None


@torch.library.custom_op("qsa::sparse_paged_attention", mutates_args=("out",))
def sparse_paged_attention_op(
    q: torch.Tensor,
    kv: torch.Tensor,
    logical_indices: torch.Tensor,
    page_table: torch.Tensor,
    token_to_req: torch.Tensor,
    page_size: int,
    out: torch.Tensor,
    softmax_scale: float | None = None,
) -> None:
    """``kv`` is the [P, 512, 512] exact-packed buffer (contract.packed_kv_buffer); the
    public function takes the k_cache/v_cache views and passes their buffer."""
    if _take_validated():
        k_cache, v_cache = contract.kv_views(kv)
        scale = contract.resolve_softmax_scale(softmax_scale)
    else:
        contract.validate_packed_kv(kv)
        k_cache, v_cache = contract.kv_views(kv)
        scale = contract.validate_attention_args(
            q, k_cache, v_cache, logical_indices, page_table, token_to_req, page_size, out,
            softmax_scale,
        )  # fmt: skip
    args = (q, k_cache, v_cache, logical_indices, page_table, token_to_req, out, scale)
    if resolve_backend(q.device) == "cuda":
        _cuda_backend()[0].sparse_paged_attention(*args)
    else:
        reference.sparse_paged_attention_ref(*args)


@sparse_paged_attention_op.register_fake
def _(q, kv, logical_indices, page_table, token_to_req, page_size, out, softmax_scale=None) -> None:
    return None
