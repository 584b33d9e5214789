"""The ``torch.ops.qsa`` operators: schemas (defined once, here), their CPU and fake kernels,
the compiled CUDA kernels, and the one choice of backend.

* ``SCHEMAS`` holds each operator's signature. It is defined in two namespaces: ``qsa`` (the
  operators) and ``qsa_check`` (validation only, for the parity test of the C++ checks).
* CPU tensors: ``contract.py`` validates, ``reference.py`` computes (the executable spec).
* Meta/fake tensors (``torch.compile``): ``contract.py`` checks what metadata can show
  (everything but storage offsets and overlap) and nothing is computed.
* CUDA tensors: the compiled library ``custom_esimd_kernels_vllm/_C.so`` (LibTorch stable ABI,
  ``csrc/torch_ops.cpp``) validates everything in C++, with contract.py's exception classes
  and messages, then launches the kernels.

The backend for CUDA tensors is chosen once, at import, from ``QSA_BACKEND``:

* ``auto`` (default): the compiled library when it loads, else the PyTorch reference with a
  one-time warning on the first CUDA call;
* ``reference``: the PyTorch reference for CUDA tensors too (the library is not loaded);
* ``cuda``: the compiled library; a call on CPU tensors, or any call when the library cannot
  load, raises RuntimeError with the reason.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import warnings
from pathlib import Path

import torch

from . import contract, reference

ENV_VAR = "QSA_BACKEND"
CHOICES = ("auto", "reference", "cuda")
LIBRARY_NAME = "_C.so"
LIBRARY_PATH = Path(__file__).resolve().parent.parent / LIBRARY_NAME
FALLBACK_WARNING = "custom_esimd_kernels_vllm: CUDA kernels not built; using the PyTorch reference"

# NOTES: the signatures of the public functions in qsa_ops/__init__.py and of the C++ kernels in
# csrc/torch_ops.cpp follow these; tests/cpu/test_ops.py checks both against this table.
SCHEMAS: dict[str, str] = {
    "select_paged_tokens": (
        "(Tensor q, Tensor compressed_key_cache, Tensor page_table, Tensor token_to_req, "
        "Tensor query_positions, Tensor sequence_lengths, int token_topk, int compress_ratio, "
        "Tensor(a!) out) -> ()"
    ),
    # NOTES: k_cache and v_cache are two arguments (contract v2: one storage or two, any
    # strides); the K/V scales and the gate are keyword-only, so the seed's positional ABI
    # holds.
    "sparse_paged_attention": (
        "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor logical_indices, Tensor page_table, "
        "Tensor token_to_req, int page_size, Tensor(a!) out, float? softmax_scale=None, *, "
        "float? k_scale=None, float? v_scale=None, Tensor? gate=None) -> ()"
    ),
}
NAMESPACE = "qsa"
CHECK_NAMESPACE = "qsa_check"


def schema_arguments(op: str) -> list[tuple[str, str]]:
    """``(type, name)`` of each argument of ``SCHEMAS[op]``, in order (``*`` omitted)."""
    inner = SCHEMAS[op][1 : SCHEMAS[op].index(") ->")]
    pairs = []
    for item in inner.split(", "):
        if item == "*":
            continue
        declaration = item.split("=")[0].strip()
        type_, name = declaration.rsplit(" ", 1)
        pairs.append((type_, name))
    return pairs


def keyword_only(op: str) -> tuple[str, ...]:
    """Names of the schema's keyword-only arguments (after ``*``)."""
    inner = SCHEMAS[op][1 : SCHEMAS[op].index(") ->")]
    if ", *, " not in inner:
        return ()
    tail = inner.split(", *, ", 1)[1].split(", ")
    return tuple(item.split("=")[0].strip().rsplit(" ", 1)[1] for item in tail)


def public_arguments(op: str) -> tuple[str, ...]:
    """Names of the public function's arguments (the schema's), keyword-only ones last."""
    return tuple(name for _, name in schema_arguments(op))


def requested_backend() -> str:
    """The value of QSA_BACKEND (default ``auto``); ValueError for anything else."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(
            f"{ENV_VAR} must be one of {', '.join(CHOICES)}, got {os.environ.get(ENV_VAR)!r}"
        )
    return value


# ----------------------------------------------------------------------------------------
# validation + reference: the Python kernels
# ----------------------------------------------------------------------------------------


def check_select(q, ck, page_table, token_to_req, positions, lengths, topk, ratio, out,
                 check_storage=True) -> None:  # fmt: skip
    """contract.py's checks of the operator's arguments (the Python twin of the C++ checks)."""
    contract.validate_select_args(
        q, ck, page_table, token_to_req, positions, lengths, topk, ratio, out,
        check_storage=check_storage,
    )  # fmt: skip


def check_attention(q, k_cache, v_cache, indices, page_table, token_to_req, page_size, out,
                    scale=None, *, k_scale=None, v_scale=None, gate=None,
                    check_storage=True) -> tuple[float, float, float]:  # fmt: skip
    """contract.py's checks of the operator's arguments; the resolved (softmax_scale, k_scale,
    v_scale)."""
    return contract.validate_attention_args(
        q, k_cache, v_cache, indices, page_table, token_to_req, page_size, out, scale,
        k_scale=k_scale, v_scale=v_scale, gate=gate, check_storage=check_storage,
    )  # fmt: skip


def _select_reference(q, ck, page_table, token_to_req, positions, lengths, topk, ratio, out):
    check_select(q, ck, page_table, token_to_req, positions, lengths, topk, ratio, out)
    reference.select_paged_tokens_ref(q, ck, page_table, token_to_req, positions, lengths, out)


def _attention_reference(q, k_cache, v_cache, indices, page_table, token_to_req, page_size,
                         out, scale=None, *, k_scale=None, v_scale=None, gate=None):  # fmt: skip
    scales = check_attention(q, k_cache, v_cache, indices, page_table, token_to_req, page_size,
                             out, scale, k_scale=k_scale, v_scale=v_scale, gate=gate)  # fmt: skip
    reference.sparse_paged_attention_ref(
        q, k_cache, v_cache, indices, page_table, token_to_req, out, scales[0],
        k_scale=scales[1], v_scale=scales[2], gate=gate,
    )  # fmt: skip


def _select_fake(*args) -> None:
    check_select(*args, check_storage=False)


def _attention_fake(*args, **kwargs) -> None:
    check_attention(*args, **kwargs, check_storage=False)


REFERENCE_KERNELS = {
    "select_paged_tokens": _select_reference,
    "sparse_paged_attention": _attention_reference,
}
FAKE_KERNELS = {
    "select_paged_tokens": _select_fake,
    "sparse_paged_attention": _attention_fake,
}
CHECKS = {
    "select_paged_tokens": check_select,
    "sparse_paged_attention": check_attention,
}
VALIDATORS = {  # the public functions' argument lists
    "select_paged_tokens": contract.validate_select_args,
    "sparse_paged_attention": contract.validate_attention_args,
}


# ----------------------------------------------------------------------------------------
# refusals raised in C++
# ----------------------------------------------------------------------------------------

_REFUSAL = re.compile(r"\[qsa:(TypeError|ValueError)\] ([^\n]*)")
_ERROR_CLASSES = {"TypeError": TypeError, "ValueError": ValueError}


def refusal_of(exc: BaseException) -> tuple[type[Exception], str] | None:
    """(exception class, message) of a refusal raised by the C++ validation, else None."""
    match = _REFUSAL.search(str(exc))
    return (_ERROR_CLASSES[match[1]], match[2]) if match else None


def raise_refusal(exc: BaseException, op: str, args: tuple, kwargs: dict | None = None) -> None:
    """Re-raise an error of a ``torch.ops.qsa`` call as the contract words it: a C++ refusal as
    its TypeError/ValueError; an argument the schema itself rejects (say, a list for a tensor)
    through contract.py's ordered checks; anything else unchanged."""
    refusal = refusal_of(exc)
    if refusal is not None:
        raise refusal[0](refusal[1]) from None
    VALIDATORS[op](*args, **(kwargs or {}))  # raises, as the contract words it, when outside it
    raise exc


# ----------------------------------------------------------------------------------------
# registration (import time, once)
# ----------------------------------------------------------------------------------------

_libraries: list[torch.library.Library] = []


def _define(namespace: str) -> torch.library.Library:
    lib = torch.library.Library(namespace, "DEF")
    for name, schema in SCHEMAS.items():
        lib.define(name + schema)
    _libraries.append(lib)
    return lib


def _load_library() -> str:
    """Load the compiled library; "" on success, else why not."""
    if not LIBRARY_PATH.is_file():
        return f"{LIBRARY_NAME} not built (no {LIBRARY_PATH.name} next to the package)"
    try:
        torch.ops.load_library(str(LIBRARY_PATH))
    except (OSError, RuntimeError) as exc:
        return f"{LIBRARY_NAME} does not load: {exc}"
    return ""


def _register() -> tuple[str, str, str, dict]:
    """Define the schemas and register the kernels: (backend for CUDA tensors, why the library
    is not used, QSA_BACKEND, the Python kernels of the CUDA key (empty when C++ serves it))."""
    requested = requested_backend()
    qsa = _define(NAMESPACE)
    _define(CHECK_NAMESPACE)
    for name in SCHEMAS:
        torch.library.register_fake(f"{NAMESPACE}::{name}", FAKE_KERNELS[name], lib=qsa)
    if requested == "reference":
        library_error = "not loaded (QSA_BACKEND=reference)"
    else:
        library_error = _load_library()
    backend = "cuda" if not library_error else "reference" if requested != "cuda" else "none"
    cuda_kernels = {}
    for name, kernel in REFERENCE_KERNELS.items():
        qsa.impl(name, _refuse_cpu(name) if requested == "cuda" else kernel, "CPU")
        if backend == "reference":
            cuda_kernels[name] = _warn_once(kernel) if requested == "auto" else kernel
        elif backend == "none":
            cuda_kernels[name] = _refuse_cuda(name, library_error)
        if name in cuda_kernels:
            qsa.impl(name, cuda_kernels[name], "CUDA")
    return backend, library_error, requested, cuda_kernels


def _refuse_cpu(name: str):
    def kernel(q, *args, **kwargs):
        raise RuntimeError(f"{ENV_VAR}=cuda needs CUDA tensors, got tensors on {q.device}")

    kernel.__name__ = f"{name}_cpu_refused"
    return kernel


def _refuse_cuda(name: str, why: str):
    def kernel(*args, **kwargs):
        raise RuntimeError(f"{ENV_VAR}=cuda but the CUDA kernels cannot run: {why}")

    kernel.__name__ = f"{name}_cuda_refused"
    return kernel


def _warn_once(kernel):
    @functools.wraps(kernel)
    def wrapper(*args, **kwargs):
        _fallback_warning()
        kernel(*args, **kwargs)

    return wrapper


@functools.cache
def _fallback_warning() -> None:
    warnings.warn(f"{FALLBACK_WARNING} ({LIBRARY_ERROR})", RuntimeWarning, stacklevel=2)


BACKEND, LIBRARY_ERROR, REQUESTED, CUDA_KERNELS = _register()


# ----------------------------------------------------------------------------------------
# facts of the compiled library (plain C entry points, read with ctypes)
# ----------------------------------------------------------------------------------------


@functools.cache
def _clib() -> ctypes.CDLL:
    if BACKEND != "cuda":
        raise RuntimeError(f"the compiled library is not loaded: {LIBRARY_ERROR}")
    lib = ctypes.CDLL(str(LIBRARY_PATH))  # the same handle torch.ops.load_library opened
    lib.qsa_build_info_json.restype = ctypes.c_char_p
    lib.qsa_attention_splits.restype = ctypes.c_int
    lib.qsa_attention_splits.argtypes = (ctypes.c_int64, ctypes.c_int)
    lib.qsa_attention_splits_error.restype = ctypes.c_char_p
    lib.qsa_attention_splits_error.argtypes = ()
    lib.qsa_select_launch_count.restype = ctypes.c_int64
    lib.qsa_select_launch_count.argtypes = (
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_char_p,
    )
    lib.qsa_attention_launch_count.restype = ctypes.c_int64
    lib.qsa_attention_launch_count.argtypes = (ctypes.c_int64,)
    return lib


def library_info() -> dict:
    """The compiled library's own build facts (arch, macros, version, source SHA256, CUDA
    runtime, torch target version); RuntimeError when it is not loaded."""
    info = json.loads(_clib().qsa_build_info_json().decode())
    contract.check_macros(info["macros"])
    return info


SPLITS_ENV = "QSA_ATTN_SPLITS"  # read by the library at each call (tuning and tests only)


def attention_splits(rows: int, device: int | None = None) -> int:
    """CTAs that share one attention row for ``rows`` rows, as a call would take them now
    (the library reads QSA_ATTN_SPLITS, which overrides; ValueError when it is malformed).
    RuntimeError without a CUDA device or without the compiled library."""
    if not torch.cuda.is_available():
        raise RuntimeError("attention_splits needs a CUDA device; torch sees none")
    index = torch.cuda.current_device() if device is None else device
    lib = _clib()
    n = int(lib.qsa_attention_splits(rows, index))
    if n < 0:
        raise ValueError(lib.qsa_attention_splits_error().decode())  # the op's own refusal
    return n


def launch_counts(
    rows: int,
    table_width: int,
    keys_per_page: int = contract.CK_PAGE,
    index_dtype: torch.dtype = torch.float16,
) -> dict[str, int]:
    """Kernel launches one call makes: {"select_paged_tokens": n, "sparse_paged_attention": n}
    (selection: of q / compressed keys in ``index_dtype`` on pages of ``keys_per_page`` keys;
    ValueError for a dtype the selection does not take)."""
    lib = _clib()
    select = int(
        lib.qsa_select_launch_count(rows, table_width, keys_per_page, str(index_dtype).encode())
    )
    if select < 0:
        raise ValueError(
            f"index_dtype must be torch.float16, torch.bfloat16 or torch.float8_e4m3fn, "
            f"got {index_dtype}"
        )
    return {
        "select_paged_tokens": select,
        "sparse_paged_attention": int(lib.qsa_attention_launch_count(rows)),
    }
