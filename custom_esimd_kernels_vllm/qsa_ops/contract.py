"""Constants and argument validators of the QSA operators, shared by every backend.

Contract v2 (docs/contract.md): the seed's fixed case (float16, 512-token exact-packed pages)
is one point of it; bfloat16, float8-e4m3 K/V caches with per-tensor scales and an fp8
indexer, vLLM's page sizes and strides, strided index rows and an output gate are the rest.
Every public call is validated here *before* any backend runs, in one fixed order:

1. argument types   (tensor / int / float / None; TypeError)
2. device           (all tensors on the device of the first)
3. dtype            (TypeError; some follow another argument's dtype)
4. layout           (contiguity, or last stride 1 with strided rows; caches: strides in
                     multiples of 16 bytes)
5. shape            (rank and fixed sizes of each tensor)
6. consistency      (R, B, M, P, C, page_size agree across tensors; row strides; then the
                     values of token_topk / compress_ratio / page_size and the scales)
7. storage          (cache data 16-byte aligned; ``out`` shares no byte with any input)

All other failures raise ValueError. Each message names the argument, what was expected
and what was given. Nothing is written when a call is refused. csrc/torch_ops.cpp repeats
these checks word for word for CUDA tensors (tests/cpu/test_ops.py holds them together).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

# --- the validated contract: the Python half of its one definition per language (the C++ half
# is csrc/qsa/contract.h; tests/cpu/test_contract.py compares them, check_macros the library) ---
TOKEN_TOPK = 2048  # tokens chosen by the indexer
COMPRESS_RATIO = 4  # tokens per compressed key ("block")
BLOCK_TOPK = TOKEN_TOPK // COMPRESS_RATIO  # 512 blocks chosen
TAIL = COMPRESS_RATIO - 1  # 3: trailing tokens not yet compressed
WIDTH = TOKEN_TOPK + TAIL  # 2051: row width of the index tensor
KV_PAGE = 512  # tokens per KV-cache page
CK_PAGE = KV_PAGE // COMPRESS_RATIO  # 128 compressed keys per compressed-key page
ATTN_HEADS = 3  # query heads of attention (one KV head)
HEAD_DIM = 256  # attention head dimension
INDEX_HEADS = 4  # indexer heads
INDEX_DIM = 128  # indexer head dimension

# Exact-packed KV layout: one [P, 512, 512] buffer; per token 256 K values then 256 V values.
PACKED_TOKEN_STRIDE = 2 * HEAD_DIM  # 512 elements per token
KV_STRIDES = (
    KV_PAGE * PACKED_TOKEN_STRIDE,
    PACKED_TOKEN_STRIDE,
    HEAD_DIM,
    1,
)  # (262144, 512, 256, 1)
V_OFFSET = HEAD_DIM  # v_cache.storage_offset() == k_cache.storage_offset() + 256

DEFAULT_SOFTMAX_SCALE = 1.0 / math.sqrt(HEAD_DIM)  # 0.0625, exact
# NOTES: the selection score is (sum over heads of relu(q.k)) * SCORE_SCALE in float32. The
# scale is multiplied (not divided) as the float32 constant below, so that every backend
# rounds the same way and exact ties stay exact ties.
SCORE_SCALE = 1.0 / math.sqrt(INDEX_DIM)  # used as float32: 0.088388346...

CONSTANTS: dict[str, int] = {
    "TOKEN_TOPK": TOKEN_TOPK,
    "COMPRESS_RATIO": COMPRESS_RATIO,
    "BLOCK_TOPK": BLOCK_TOPK,
    "TAIL": TAIL,
    "WIDTH": WIDTH,
    "KV_PAGE": KV_PAGE,
    "CK_PAGE": CK_PAGE,
    "ATTN_HEADS": ATTN_HEADS,
    "HEAD_DIM": HEAD_DIM,
    "INDEX_HEADS": INDEX_HEADS,
    "INDEX_DIM": INDEX_DIM,
}
MACRO_PREFIX = "QSA_"


def check_macros(macros: Mapping[str, int]) -> None:
    """Raise ValueError unless ``macros`` (csrc/qsa/contract.h's ``QSA_*`` values, or the
    compiled library's report of them) equals the Python constants exactly."""
    expected = {MACRO_PREFIX + k: v for k, v in CONSTANTS.items()}
    given = {str(k): v for k, v in macros.items()}
    problems = []
    for name in sorted(expected.keys() | given.keys()):
        if name not in given:
            problems.append(f"{name} missing (expected {expected[name]})")
        elif name not in expected:
            problems.append(f"{name} is not a contract macro (given {given[name]})")
        elif int(given[name]) != expected[name]:
            problems.append(f"{name} must be {expected[name]}, got {given[name]}")
    if problems:
        raise ValueError(
            "compiled contract macros disagree with qsa_ops.contract: " + "; ".join(problems)
        )


# ----------------------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------------------


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def _check_int_value(name: str, value: int, expected: int) -> None:
    if value != expected:
        raise ValueError(f"{name} must be {expected}, got {value}")


def _check_scale_type(name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise TypeError(f"{name} must be a float, an int or None, got {type(value).__name__}")


def resolve_softmax_scale(softmax_scale: object) -> float:
    """None -> 1/sqrt(256); otherwise a finite positive Python float or int (not bool)."""
    _check_scale_type("softmax_scale", softmax_scale)
    if softmax_scale is None:
        return DEFAULT_SOFTMAX_SCALE
    return _check_scale_value("softmax_scale", softmax_scale)


def _check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous, got strides {tuple(t.stride())} for shape {tuple(t.shape)}"
        )


def _fmt_pattern(pattern: Sequence[int | str]) -> str:
    return "(" + ", ".join(str(p) for p in pattern) + ("," if len(pattern) == 1 else "") + ")"


def _check_shape(name: str, t: torch.Tensor, pattern: Sequence[int | str]) -> None:
    """Rank and fixed sizes; symbolic sizes (strings) are checked by _check_size."""
    shape = tuple(t.shape)
    ok = len(shape) == len(pattern) and all(
        isinstance(p, str) or s == p for s, p in zip(shape, pattern, strict=True)
    )
    if not ok:
        raise ValueError(f"{name} must have shape {_fmt_pattern(pattern)}, got {shape}")


def _check_size(
    name: str, t: torch.Tensor, pattern: Sequence[int | str], sizes: Mapping[str, tuple[int, str]]
) -> None:
    """Cross-tensor consistency: each symbol in ``pattern`` must equal ``sizes[sym][0]``,
    which was taken from the argument ``sizes[sym][1]``."""
    shape = tuple(t.shape)
    for dim, p in enumerate(pattern):
        if isinstance(p, str) and shape[dim] != sizes[p][0]:
            value, source = sizes[p]
            expected = tuple(sizes[x][0] if isinstance(x, str) else x for x in pattern)
            raise ValueError(
                f"{name} must have shape {_fmt_pattern(pattern)} = {_fmt_pattern(expected)} "
                f"({p} = {value} from {source}), got {shape}"
            )


def _byte_range(t: torch.Tensor) -> tuple[int, int] | None:
    """[start, end) of the bytes ``t`` can address; None for an empty tensor."""
    if t.numel() == 0:
        return None
    start = t.data_ptr()
    if t.is_contiguous():
        return start, start + t.numel() * t.element_size()
    span = 1 + sum(
        (size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True)
    )
    # negative strides cannot be created in torch; abs() keeps this conservative anyway
    return start, start + span * t.element_size()


def _check_no_overlap(
    out_name: str, out: torch.Tensor, names: Sequence[str], tensors: Sequence[torch.Tensor]
) -> None:
    out_range = _byte_range(out)
    if out_range is None:
        return
    for name, t in zip(names, tensors, strict=True):
        r = _byte_range(t)
        if r is not None and r[0] < out_range[1] and out_range[0] < r[1]:
            raise ValueError(
                f"{out_name} must not overlap any input, got overlap with {name} "
                f"(bytes [{out_range[0]:#x}, {out_range[1]:#x}) and [{r[0]:#x}, {r[1]:#x}))"
            )


# ----------------------------------------------------------------------------------------
# the seed's exact-packed K/V layout (the default of the
# test cases; contract v2 accepts it as one layout among others)
# ----------------------------------------------------------------------------------------

PACKED_KV_STRIDES = (KV_STRIDES[0], PACKED_TOKEN_STRIDE, 1)  # (262144, 512, 1)


def kv_views(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache) of an exact-packed [P, page, 512] buffer: the two [P, page, 1, 256]
    views (strides (page * 512, 512, 256, 1) for a contiguous buffer)."""
    return kv[:, :, :HEAD_DIM].unsqueeze(2), kv[:, :, HEAD_DIM:].unsqueeze(2)


# ----------------------------------------------------------------------------------------
# contract v2: dtypes, layouts and the ordered checks of the two operators
# ----------------------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn
ATTENTION_DTYPES = (torch.float16, torch.bfloat16)  # q / out (and gate, and non-fp8 caches)
SELECT_DTYPES = (torch.float16, torch.bfloat16, FP8)  # q and compressed_key_cache alike
CACHE_ALIGN = 16  # bytes: cache data pointers and every stride but the last (vector loads)
PAGE_MULTIPLE = COMPRESS_RATIO  # page_size must be a positive multiple of 4 (a block never
# straddles a page)

# layouts
CONTIGUOUS = "contiguous"
ROWS = "rows"  # last stride 1, rows may be strided
PAGED = "paged"  # last stride 1, other strides (of dims of size > 1) multiples of 16 bytes


def _fmt_dtypes(dtypes: Sequence[torch.dtype]) -> str:
    names = [str(d) for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


@dataclass(frozen=True)
class _Arg:
    """One tensor argument: its dtype rule, layout rule and shape pattern."""

    name: str
    dtypes: tuple[torch.dtype, ...] = ()  # fixed alternatives
    like: str | None = None  # ... or the dtype of this earlier argument (named first)
    layout: str = CONTIGUOUS
    shape: tuple[int | str, ...] = ()
    optional: bool = False  # may be None (then nothing is checked)

    def allowed(self, dtype_of: Mapping[str, torch.dtype]) -> tuple[torch.dtype, ...]:
        return ((dtype_of[self.like],) if self.like else ()) + self.dtypes

    def dtype_message(self, dtype_of: Mapping[str, torch.dtype], given: torch.dtype) -> str:
        if self.like:
            want = f"{dtype_of[self.like]} ({self.like}'s)"
            if self.dtypes:
                want += " or " + _fmt_dtypes(self.dtypes)
        else:
            want = _fmt_dtypes(self.dtypes)
        return f"{self.name} must have dtype {want}, got {given}"


@dataclass(frozen=True)
class _OpSpec:
    """The tensor arguments of one operator, in validation order (``out`` last)."""

    args: tuple[_Arg, ...]
    sizes: dict[str, tuple[int, int]]  # symbol -> (argument index, dim) it is taken from

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args)

    def resolve(self, tensors: Sequence[torch.Tensor]) -> dict[str, tuple[int, str]]:
        return {sym: (tensors[i].shape[dim], self.names[i]) for sym, (i, dim) in self.sizes.items()}


def _check_layout(arg: _Arg, t: torch.Tensor) -> None:
    if arg.layout == CONTIGUOUS:
        _check_contiguous(arg.name, t)
        return
    strides = tuple(t.stride())
    if strides and strides[-1] != 1:
        raise ValueError(f"{arg.name} must have last stride 1, got strides {strides}")
    if arg.layout == PAGED:
        step = CACHE_ALIGN // t.element_size()
        if any(s % step for s, n in zip(strides[:-1], t.shape[:-1], strict=True) if n > 1):
            raise ValueError(
                f"{arg.name} must have strides in multiples of {CACHE_ALIGN} bytes ({step} "
                f"elements of {t.dtype}) in every dimension of size > 1 but the last, got "
                f"strides {strides} for shape {tuple(t.shape)}"
            )


def _check_aligned(name: str, t: torch.Tensor) -> None:
    if t.numel() > 0 and t.data_ptr() % CACHE_ALIGN:
        raise ValueError(
            f"{name} must start at a {CACHE_ALIGN}-byte aligned address, got {t.data_ptr():#x}"
        )


def _full_check(spec: _OpSpec, tensors: Sequence, ints: Sequence[tuple]) -> None:
    """The ordered checks of types, devices, dtypes, layouts, shapes and sizes (see the
    module docstring); raises on the first failure. ``None`` stands for an absent optional
    tensor; ``ints`` are (name, value) pairs checked for type here."""
    for arg, t in zip(spec.args, tensors, strict=True):
        if arg.optional and t is None:
            continue
        if not isinstance(t, torch.Tensor):
            extra = " or None" if arg.optional else ""
            raise TypeError(f"{arg.name} must be a torch.Tensor{extra}, got {type(t).__name__}")
    for name, value in ints:
        _check_int(name, value)
    present = [(a, t) for a, t in zip(spec.args, tensors, strict=True) if t is not None]
    first_arg, first = present[0]
    for arg, t in present[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{arg.name} must be on the same device as {first_arg.name} ({first.device}), "
                f"got {t.device}"
            )
    dtype_of: dict[str, torch.dtype] = {}
    for arg, t in present:
        if t.dtype not in arg.allowed(dtype_of):
            raise TypeError(arg.dtype_message(dtype_of, t.dtype))
        dtype_of[arg.name] = t.dtype
    for arg, t in present:
        _check_layout(arg, t)
    for arg, t in present:
        _check_shape(arg.name, t, arg.shape)
    sizes = spec.resolve(tensors)
    for arg, t in present:
        _check_size(arg.name, t, arg.shape, sizes)


def _fast_ok(spec: _OpSpec, tensors: Sequence, ints: Sequence[tuple]) -> bool:
    """True when every check of _full_check passes; a cheap path for the common case. Anything
    unusual returns False and the ordered checks then decide and word the error."""
    try:
        for _, value in ints:
            if type(value) is not int:
                return False
        sizes = {sym: tensors[i].shape[dim] for sym, (i, dim) in spec.sizes.items()}
        device = tensors[0].device
        dtype_of: dict[str, torch.dtype] = {}
        for arg, t in zip(spec.args, tensors, strict=True):
            if t is None:
                if not arg.optional:
                    return False
                continue
            if t.device != device or t.dtype not in arg.allowed(dtype_of):
                return False
            dtype_of[arg.name] = t.dtype
            if t.shape != tuple(sizes[p] if isinstance(p, str) else p for p in arg.shape):
                return False
            if arg.layout == CONTIGUOUS:
                if not t.is_contiguous():
                    return False
            elif t.stride()[-1] != 1 or (
                arg.layout == PAGED
                and any(s % (CACHE_ALIGN // t.element_size()) for s in t.stride()[:2])
            ):
                return False
        return True
    except (AttributeError, IndexError, TypeError, KeyError):
        return False


def _check_tensors(spec: _OpSpec, tensors: Sequence, ints: Sequence[tuple] = ()) -> None:
    if not _fast_ok(spec, tensors, ints):
        _full_check(spec, tensors, ints)


def _check_storage(spec: _OpSpec, tensors: Sequence) -> None:
    """Alignment of the paged tensors, then ``out`` (last) against every input."""
    for arg, t in zip(spec.args, tensors, strict=True):
        if arg.layout == PAGED:
            _check_aligned(arg.name, t)
    inputs = [
        (a.name, t) for a, t in zip(spec.args[:-1], tensors[:-1], strict=True) if t is not None
    ]
    _check_no_overlap(spec.names[-1], tensors[-1], *zip(*inputs, strict=True))


def _check_scale_value(name: str, value: object) -> float:
    v = float(value)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return v


# ----------------------------------------------------------------------------------------
# select_paged_tokens
# ----------------------------------------------------------------------------------------

_SELECT = _OpSpec(
    args=(
        _Arg("q", SELECT_DTYPES, shape=("R", INDEX_HEADS, INDEX_DIM)),
        _Arg("compressed_key_cache", like="q", layout=PAGED, shape=("P", "C", 1, INDEX_DIM)),
        _Arg("page_table", (torch.int32,), layout=ROWS, shape=("B", "M")),
        _Arg("token_to_req", (torch.int32,), shape=("R",)),
        _Arg("query_positions", (torch.int64,), shape=("R",)),
        _Arg("sequence_lengths", (torch.int32,), shape=("B",)),
        _Arg("out", (torch.int32,), layout=ROWS, shape=("R", WIDTH)),
    ),
    sizes={"R": (0, 0), "P": (1, 0), "C": (1, 1), "B": (2, 0), "M": (2, 1)},
)


def validate_select_args(
    q: torch.Tensor,
    compressed_key_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_to_req: torch.Tensor,
    query_positions: torch.Tensor,
    sequence_lengths: torch.Tensor,
    token_topk: int,
    compress_ratio: int,
    out: torch.Tensor,
    *,
    check_storage: bool = True,
) -> None:
    """Refuse (TypeError/ValueError) any call of ``select_paged_tokens`` outside the contract.

    ``check_storage=False`` skips the checks that need real storage (data pointers, ``out``
    overlap), which ``torch.compile`` cannot trace; it is used only while tracing, and the
    custom op repeats the storage checks when the compiled graph runs.
    """
    tensors = (q, compressed_key_cache, page_table, token_to_req, query_positions,
               sequence_lengths, out)  # fmt: skip
    _check_tensors(
        _SELECT, tensors, (("token_topk", token_topk), ("compress_ratio", compress_ratio))
    )
    if compressed_key_cache.shape[1] < 1:
        raise ValueError(
            "compressed_key_cache must hold C >= 1 keys per page, got shape "
            f"{tuple(compressed_key_cache.shape)}"
        )
    if out.shape[0] > 1 and out.stride(0) < WIDTH:
        raise ValueError(
            f"out must have row stride >= {WIDTH} (rows must not overlap), got strides "
            f"{tuple(out.stride())}"
        )
    _check_int_value("token_topk", token_topk, TOKEN_TOPK)
    _check_int_value("compress_ratio", compress_ratio, COMPRESS_RATIO)
    if check_storage:
        _check_storage(_SELECT, tensors)


# ----------------------------------------------------------------------------------------
# sparse_paged_attention
# ----------------------------------------------------------------------------------------

_ATTENTION = _OpSpec(
    args=(
        _Arg("q", ATTENTION_DTYPES, shape=("R", ATTN_HEADS, HEAD_DIM)),
        _Arg("k_cache", (FP8,), like="q", layout=PAGED, shape=("P", "page_size", 1, HEAD_DIM)),
        _Arg("v_cache", like="k_cache", layout=PAGED, shape=("P", "page_size", 1, HEAD_DIM)),
        _Arg("logical_indices", (torch.int32,), layout=ROWS, shape=("R", WIDTH)),
        _Arg("page_table", (torch.int32,), layout=ROWS, shape=("B", "M")),
        _Arg("token_to_req", (torch.int32,), shape=("R",)),
        _Arg("gate", like="q", shape=("R", ATTN_HEADS, HEAD_DIM), optional=True),
        _Arg("out", like="q", shape=("R", ATTN_HEADS, HEAD_DIM)),
    ),
    sizes={"R": (0, 0), "P": (1, 0), "page_size": (1, 1), "B": (4, 0), "M": (4, 1)},
)
ATTENTION_SCALES = ("softmax_scale", "k_scale", "v_scale")  # float, int or None each


def validate_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    logical_indices: torch.Tensor,
    page_table: torch.Tensor,
    token_to_req: torch.Tensor,
    page_size: int,
    out: torch.Tensor,
    softmax_scale: float | None = None,
    *,
    k_scale: float | None = None,
    v_scale: float | None = None,
    gate: torch.Tensor | None = None,
    check_storage: bool = True,
) -> tuple[float, float, float]:
    """Refuse (TypeError/ValueError) any call of ``sparse_paged_attention`` outside the
    contract; return the resolved (softmax_scale, k_scale, v_scale) (1.0 for the K/V scales of
    a cache that is not float8). ``check_storage`` as in validate_select_args."""
    for name, value in zip(ATTENTION_SCALES, (softmax_scale, k_scale, v_scale), strict=True):
        _check_scale_type(name, value)
    tensors = (q, k_cache, v_cache, logical_indices, page_table, token_to_req, gate, out)
    _check_tensors(_ATTENTION, tensors, (("page_size", page_size),))
    if page_size <= 0 or page_size % PAGE_MULTIPLE:
        raise ValueError(
            f"page_size must be a positive multiple of {PAGE_MULTIPLE}, got {page_size}"
        )
    if page_size != k_cache.shape[1]:
        raise ValueError(
            f"page_size must be k_cache.shape[1] = {k_cache.shape[1]}, got {page_size}"
        )
    scale = resolve_softmax_scale(softmax_scale)
    kv_scales = []
    for name, value, cache in (("k_scale", k_scale, "k_cache"), ("v_scale", v_scale, "v_cache")):
        if k_cache.dtype == FP8:
            if value is None:
                raise ValueError(f"{name} must be a float > 0 when {cache} is {FP8}, got None")
            kv_scales.append(_check_scale_value(name, value))
        else:
            if value is not None:
                raise ValueError(
                    f"{name} must be None when {cache} is {k_cache.dtype} (only {FP8} caches "
                    f"are scaled), got {value!r}"
                )
            kv_scales.append(1.0)
    if check_storage:
        _check_storage(_ATTENTION, tensors)
    return scale, kv_scales[0], kv_scales[1]
