"""Constants and argument validators of the two QSA operators, shared by every backend.

The contract is fixed (one rank of a TP8 Qwen3.8-style model); see docs/contract.md.
Every public call is validated here *before* any backend runs, in one fixed order:

1. argument types   (tensor / int / float; TypeError)
2. device           (all tensors on the device of ``q``)
3. dtype            (TypeError)
4. layout           (contiguity; K/V: exact strides (262144, 512, 256, 1))
5. shape            (rank and fixed sizes of each tensor)
6. consistency      (R, B, M and P agree across tensors; token_topk / compress_ratio /
                     page_size / softmax_scale values)
7. storage          (V starts 256 elements after K in the same storage, which holds every
                     page; ``out`` shares no byte with any input)

All other failures raise ValueError. Each message names the argument, what was expected
and what was given. Nothing is written when a call is refused.
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


def _check_tensor_types(names: Sequence[str], tensors: Sequence[object]) -> None:
    for name, t in zip(names, tensors, strict=True):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def _check_int_value(name: str, value: int, expected: int) -> None:
    if value != expected:
        raise ValueError(f"{name} must be {expected}, got {value}")


def _check_scale_type(softmax_scale: object) -> None:
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
    ):
        raise TypeError(
            f"softmax_scale must be a float, an int or None, got {type(softmax_scale).__name__}"
        )


def resolve_softmax_scale(softmax_scale: object) -> float:
    """None -> 1/sqrt(256); otherwise a finite positive Python float or int (not bool)."""
    _check_scale_type(softmax_scale)
    if softmax_scale is None:
        return DEFAULT_SOFTMAX_SCALE
    value = float(softmax_scale)
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale!r}")
    return value


def _check_devices(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    device = tensors[0].device
    for name, t in zip(names[1:], tensors[1:], strict=True):
        if t.device != device:
            raise ValueError(
                f"{name} must be on the same device as {names[0]} ({device}), got {t.device}"
            )


def _check_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")


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


def _check_kv_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if tuple(t.stride()) != KV_STRIDES:
            raise ValueError(
                f"{name} must have strides {KV_STRIDES} (exact-packed K/V), got {tuple(t.stride())}"
            )


def _check_kv_storage(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """V starts 256 elements after K in the same storage, which holds all P pages."""
    k_off, v_off = k_cache.storage_offset(), v_cache.storage_offset()
    if v_off != k_off + V_OFFSET:
        raise ValueError(
            f"v_cache must have storage offset k_cache.storage_offset() + {V_OFFSET} = "
            f"{k_off + V_OFFSET} (exact-packed K/V), got {v_off}"
        )
    k_storage, v_storage = k_cache.untyped_storage(), v_cache.untyped_storage()
    if k_storage.data_ptr() != v_storage.data_ptr():
        raise ValueError(
            "v_cache must share k_cache's storage (exact-packed K/V), got storage at "
            f"{v_storage.data_ptr():#x} vs {k_storage.data_ptr():#x}"
        )
    if k_cache.numel() > 0:
        # both views together cover elements [k_off, k_off + P * 262144) of the storage
        needed = (k_off + k_cache.shape[0] * KV_STRIDES[0]) * k_cache.element_size()
        if k_storage.nbytes() < needed:
            raise ValueError(
                f"k_cache/v_cache storage must hold at least {needed} bytes for "
                f"{k_cache.shape[0]} exact-packed pages, got {k_storage.nbytes()}"
            )


# ----------------------------------------------------------------------------------------
# the packed KV buffer: what the attention custom op receives
# ----------------------------------------------------------------------------------------

PACKED_KV_STRIDES = (KV_STRIDES[0], PACKED_TOKEN_STRIDE, 1)  # (262144, 512, 1)


def packed_kv_buffer(k_cache: torch.Tensor) -> torch.Tensor:
    """The [P, 512, 512] exact-packed buffer that a validated k_cache views (same storage
    offset). NOTES: the operator's schema takes this one tensor instead of the two aliasing
    views, because a schema cannot state that two arguments alias: opcheck clones every input
    on its own (measured: the clone of v_cache then has storage offset 0) and so would any
    tool that copies arguments apart."""
    return k_cache.as_strided((k_cache.shape[0], KV_PAGE, PACKED_TOKEN_STRIDE), PACKED_KV_STRIDES)


def kv_views(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache): the two [P, 512, 1, 256] views, strides (262144, 512, 256, 1)."""
    return kv[:, :, :HEAD_DIM].unsqueeze(2), kv[:, :, HEAD_DIM:].unsqueeze(2)


def validate_packed_kv(kv: object) -> None:
    """Refuse a packed KV buffer that is not float16 [P, 512, 512] with strides (262144, 512, 1)."""
    _check_tensor_types(("kv",), (kv,))
    _check_dtype("kv", kv, torch.float16)
    if kv.dim() != 3 or tuple(kv.shape[1:]) != (KV_PAGE, PACKED_TOKEN_STRIDE):
        raise ValueError(
            f"kv must have shape (P, {KV_PAGE}, {PACKED_TOKEN_STRIDE}), got {tuple(kv.shape)}"
        )
    if tuple(kv.stride()) != PACKED_KV_STRIDES:
        raise ValueError(f"kv must have strides {PACKED_KV_STRIDES}, got {tuple(kv.stride())}")


# ----------------------------------------------------------------------------------------
# the two validators
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _OpSpec:
    """The tensor arguments of one operator, in validation order (``out`` last)."""

    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int | str, ...], ...]
    sizes: dict[str, tuple[int, int]]  # symbol -> (argument index, dim) it is taken from
    packed: tuple[int, int] | None = None  # indices of (k_cache, v_cache): exact-packed

    def resolve(self, tensors: Sequence[torch.Tensor]) -> dict[str, tuple[int, str]]:
        return {sym: (tensors[i].shape[dim], self.names[i]) for sym, (i, dim) in self.sizes.items()}


def _fast_ok(spec: _OpSpec, tensors: Sequence[torch.Tensor], ints: Sequence[tuple]) -> bool:
    """True when every check of _full_check passes; a cheap path for the common case (about
    10 us instead of 60 us for the ordered checks). Anything unusual returns False and the
    ordered checks then decide and word the error."""
    try:
        for _, value, expected in ints:
            if type(value) is not int or value != expected:
                return False
        sizes = {sym: tensors[i].shape[dim] for sym, (i, dim) in spec.sizes.items()}
        device = tensors[0].device
        for i, (t, dtype, pattern) in enumerate(
            zip(tensors, spec.dtypes, spec.shapes, strict=True)
        ):
            if t.device != device or t.dtype != dtype:
                return False
            if t.shape != tuple(sizes[p] if isinstance(p, str) else p for p in pattern):
                return False
            if spec.packed is None or i not in spec.packed:
                if not t.is_contiguous():
                    return False
        if spec.packed is not None:
            k, v = (tensors[i] for i in spec.packed)
            if k.stride() != KV_STRIDES or v.stride() != KV_STRIDES:
                return False
        return True
    except (AttributeError, IndexError, TypeError):
        return False


def _full_check(spec: _OpSpec, tensors: Sequence[torch.Tensor], ints: Sequence[tuple]) -> None:
    """The ordered checks (see the module docstring); raises on the first failure."""
    _check_tensor_types(spec.names, tensors)
    for name, value, _ in ints:
        _check_int(name, value)
    _check_devices(spec.names, tensors)
    for name, t, dtype in zip(spec.names, tensors, spec.dtypes, strict=True):
        _check_dtype(name, t, dtype)
    for i, (name, t) in enumerate(zip(spec.names, tensors, strict=True)):
        if spec.packed is None or i not in spec.packed:
            _check_contiguous(name, t)
    if spec.packed is not None:
        _check_kv_strides(*(tensors[i] for i in spec.packed))
    for name, t, pattern in zip(spec.names, tensors, spec.shapes, strict=True):
        _check_shape(name, t, pattern)
    sizes = spec.resolve(tensors)
    for name, t, pattern in zip(spec.names, tensors, spec.shapes, strict=True):
        _check_size(name, t, pattern, sizes)
    for name, value, expected in ints:
        _check_int_value(name, value, expected)


def _validate(
    spec: _OpSpec, tensors: Sequence[torch.Tensor], ints: Sequence[tuple], check_storage: bool
) -> None:
    if not _fast_ok(spec, tensors, ints):
        _full_check(spec, tensors, ints)
    if check_storage:
        if spec.packed is not None:
            _check_kv_storage(*(tensors[i] for i in spec.packed))
        _check_no_overlap(spec.names[-1], tensors[-1], spec.names[:-1], tensors[:-1])


_SELECT = _OpSpec(
    names=(
        "q",
        "compressed_key_cache",
        "page_table",
        "token_to_req",
        "query_positions",
        "sequence_lengths",
        "out",
    ),
    dtypes=(
        torch.float16,
        torch.float16,
        torch.int32,
        torch.int32,
        torch.int64,
        torch.int32,
        torch.int32,
    ),
    shapes=(
        ("R", INDEX_HEADS, INDEX_DIM),
        ("P", CK_PAGE, 1, INDEX_DIM),
        ("B", "M"),
        ("R",),
        ("R",),
        ("B",),
        ("R", WIDTH),
    ),
    sizes={"R": (0, 0), "P": (1, 0), "B": (2, 0), "M": (2, 1)},
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

    ``check_storage=False`` skips the checks that need real storage (storage offsets, shared
    storage, ``out`` overlap), which ``torch.compile`` cannot trace; it is used only while
    tracing, and the custom op repeats the storage checks when the compiled graph runs.
    """
    tensors = (
        q,
        compressed_key_cache,
        page_table,
        token_to_req,
        query_positions,
        sequence_lengths,
        out,
    )
    ints = (
        ("token_topk", token_topk, TOKEN_TOPK),
        ("compress_ratio", compress_ratio, COMPRESS_RATIO),
    )
    _validate(_SELECT, tensors, ints, check_storage)


_ATTENTION = _OpSpec(
    names=("q", "k_cache", "v_cache", "logical_indices", "page_table", "token_to_req", "out"),
    dtypes=(
        torch.float16,
        torch.float16,
        torch.float16,
        torch.int32,
        torch.int32,
        torch.int32,
        torch.float16,
    ),
    shapes=(
        ("R", ATTN_HEADS, HEAD_DIM),
        ("P", KV_PAGE, 1, HEAD_DIM),
        ("P", KV_PAGE, 1, HEAD_DIM),
        ("R", WIDTH),
        ("B", "M"),
        ("R",),
        ("R", ATTN_HEADS, HEAD_DIM),
    ),
    sizes={"R": (0, 0), "P": (1, 0), "B": (4, 0), "M": (4, 1)},
    packed=(1, 2),
)


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
    check_storage: bool = True,
) -> float:
    """Refuse (TypeError/ValueError) any call of ``sparse_paged_attention`` outside the
    contract; return the resolved softmax scale. ``check_storage`` as in validate_select_args
    (it also covers the same-storage half of the exact-packed check)."""
    tensors = (q, k_cache, v_cache, logical_indices, page_table, token_to_req, out)
    _check_scale_type(softmax_scale)
    _validate(_ATTENTION, tensors, (("page_size", page_size, KV_PAGE),), check_storage)
    return resolve_softmax_scale(softmax_scale)


# ----------------------------------------------------------------------------------------
# update_caches: the third operator (docs/contract.md, section "update_caches")
# ----------------------------------------------------------------------------------------

# NOTES: the compressed key of a block is a float32 rule that every backend evaluates in the
# same order (products, then halving folds), so that backends agree bit for bit.
MEAN_SCALE = 0.25  # 1 / COMPRESS_RATIO, exact in float32

_UPDATE = _OpSpec(
    names=(
        "key",
        "value",
        "slot_mapping",
        "compressed_slot_mapping",
        "index_wk",
        "kv_cache",
        "compressed_key_cache",
    ),
    dtypes=(
        torch.float16,
        torch.float16,
        torch.int64,
        torch.int64,
        torch.float32,
        torch.float16,
        torch.float16,
    ),
    shapes=(
        ("T", HEAD_DIM),
        ("T", HEAD_DIM),
        ("T",),
        ("T",),
        (INDEX_DIM, HEAD_DIM),
        ("P", KV_PAGE, PACKED_TOKEN_STRIDE),
        ("Q", CK_PAGE, 1, INDEX_DIM),
    ),
    sizes={"T": (0, 0), "P": (5, 0), "Q": (6, 0)},
)
UPDATE_ARG_NAMES = _UPDATE.names


def validate_update_args(
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    compressed_slot_mapping: torch.Tensor,
    index_wk: torch.Tensor,
    kv_cache: torch.Tensor,
    compressed_key_cache: torch.Tensor,
    *,
    check_storage: bool = True,
) -> None:
    """Refuse (TypeError/ValueError) any call of ``update_caches`` outside the contract.

    The same ordered checks as the two other operators; ``kv_cache`` (the exact-packed
    [P, 512, 512] buffer) and ``compressed_key_cache`` are the two outputs: neither may share
    a byte with an input or with the other. ``check_storage`` as in validate_select_args.
    """
    tensors = (
        key,
        value,
        slot_mapping,
        compressed_slot_mapping,
        index_wk,
        kv_cache,
        compressed_key_cache,
    )
    if not _fast_ok(_UPDATE, tensors, ()):
        _full_check(_UPDATE, tensors, ())
    if check_storage:
        inputs, input_names = tensors[:5], _UPDATE.names[:5]
        _check_no_overlap("kv_cache", kv_cache, input_names, inputs)
        _check_no_overlap("compressed_key_cache", compressed_key_cache, input_names, inputs)
        ck_range, kv_range = _byte_range(compressed_key_cache), _byte_range(kv_cache)
        if ck_range and kv_range and ck_range[0] < kv_range[1] and kv_range[0] < ck_range[1]:
            raise ValueError(
                "compressed_key_cache must not overlap kv_cache (the other output), got bytes "
                f"[{ck_range[0]:#x}, {ck_range[1]:#x}) and [{kv_range[0]:#x}, {kv_range[1]:#x})"
            )
