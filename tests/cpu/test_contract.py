"""Fail-closed validation: one test per refusal path (exception type, message, out untouched),
the validation order, the overlap rule and the compiled-macro agreement."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import contract, testing

ROOT = Path(__file__).resolve().parents[2]


def test_constants_are_the_contract():
    assert (contract.TOKEN_TOPK, contract.COMPRESS_RATIO, contract.BLOCK_TOPK) == (2048, 4, 512)
    assert (contract.TAIL, contract.WIDTH, contract.KV_PAGE, contract.CK_PAGE) == (
        3,
        2051,
        512,
        128,
    )
    assert (contract.ATTN_HEADS, contract.HEAD_DIM) == (3, 256)
    assert (contract.INDEX_HEADS, contract.INDEX_DIM) == (4, 128)
    assert contract.KV_STRIDES == (262144, 512, 256, 1)
    assert contract.DEFAULT_SOFTMAX_SCALE == 1 / 16


def header_macros() -> dict[str, int]:
    """The ``#define QSA_* N`` lines of csrc/qsa/contract.h (the C++ half of the contract)."""
    text = (ROOT / "csrc" / "qsa" / "contract.h").read_text()
    return {m[1]: int(m[2]) for m in re.finditer(r"^#define (QSA_\w+) (\d+)", text, re.M)}


def test_contract_header_agrees_with_constants():
    contract.check_macros(header_macros())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"QSA_WIDTH": 2048}, "QSA_WIDTH must be 2051, got 2048"),
        ({"QSA_EXTRA": 1}, "QSA_EXTRA is not a contract macro"),
        ({"QSA_KV_PAGE": None}, "QSA_KV_PAGE missing"),
    ],
)
def test_check_macros_refuses_drift(change, message):
    macros = header_macros()
    for key, value in change.items():
        if value is None:
            del macros[key]
        else:
            macros[key] = value
    with pytest.raises(ValueError, match=re.escape(message)):
        contract.check_macros(macros)


# ----------------------------------------------------------------------------------------
# refusal helpers: every refusal leaves `out` (and the inputs) untouched
# ----------------------------------------------------------------------------------------

SELECT_ARGS = (
    "q",
    "compressed_key_cache",
    "page_table",
    "token_to_req",
    "query_positions",
    "sequence_lengths",
    "token_topk",
    "compress_ratio",
    "out",
)
ATTN_ARGS = (
    "q",
    "k_cache",
    "v_cache",
    "logical_indices",
    "page_table",
    "token_to_req",
    "page_size",
    "out",
    "softmax_scale",
)


def _select_case(R=2):
    return testing.make_select_case("multi_request", R)  # B = 3: every tensor has >1 element


def _attention_case(R=2):
    return testing.make_attention_case("holes_dups_cross_page", R)


def _refused(fn, args, exc, message, watched):
    """Call fn(*args), expect ``exc`` matching ``message``; every tensor in ``watched``
    must be bit-identical afterwards (NaN == NaN)."""
    before = [_bits(t) for t in watched]
    with pytest.raises(exc, match=message):
        fn(*args)
    for t, b in zip(watched, before, strict=True):
        assert torch.equal(_bits(t), b), "a refused call wrote into a tensor"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def _refuse_select(case, exc, message, **replace):
    args = dict(zip(SELECT_ARGS, case.args(), strict=True)) | replace
    watched = [case.out, *case.inputs().values()]
    watched += [
        v for v in replace.values() if isinstance(v, torch.Tensor) and v.device.type != "meta"
    ]
    _refused(
        qsa_ops.select_paged_tokens, tuple(args[k] for k in SELECT_ARGS), exc, message, watched
    )


def _refuse_attention(case, exc, message, **replace):
    args = dict(zip(ATTN_ARGS, case.args(), strict=True)) | replace
    watched = [case.out, *case.inputs().values()]
    watched += [
        v for v in replace.values() if isinstance(v, torch.Tensor) and v.device.type != "meta"
    ]
    _refused(
        qsa_ops.sparse_paged_attention, tuple(args[k] for k in ATTN_ARGS), exc, message, watched
    )


# ----------------------------------------------------------------------------------------
# selection refusals
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", [n for n in SELECT_ARGS if n not in ("token_topk", "compress_ratio")]
)
def test_select_refuses_non_tensor(name):
    case = _select_case()
    _refuse_select(case, TypeError, f"^{name} must be a torch.Tensor, got list$", **{name: [1, 2]})


@pytest.mark.parametrize("name", ["token_topk", "compress_ratio"])
@pytest.mark.parametrize("value", [2048.0, True, None])
def test_select_refuses_non_int(name, value):
    _refuse_select(
        _select_case(),
        TypeError,
        f"^{name} must be an int, got {type(value).__name__}$",
        **{name: value},
    )


@pytest.mark.parametrize("name, value", [("token_topk", 1024), ("compress_ratio", 8)])
def test_select_refuses_other_constants(name, value):
    expected = {"token_topk": 2048, "compress_ratio": 4}[name]
    _refuse_select(
        _select_case(), ValueError, f"^{name} must be {expected}, got {value}$", **{name: value}
    )


@pytest.mark.parametrize("name", SELECT_ARGS[1:6] + ("out",))
def test_select_refuses_other_device(name):
    case = _select_case()
    meta = dict(zip(SELECT_ARGS, case.args(), strict=True))[name].to("meta")
    _refuse_select(
        case,
        ValueError,
        re.escape(f"{name} must be on the same device as q (cpu), got meta"),
        **{name: meta},
    )


@pytest.mark.parametrize(
    "name, wrong",
    [
        ("q", torch.float32),
        ("compressed_key_cache", torch.bfloat16),
        ("page_table", torch.int64),
        ("token_to_req", torch.int64),
        ("query_positions", torch.int32),
        ("sequence_lengths", torch.int64),
        ("out", torch.int64),
    ],
)
def test_select_refuses_dtype(name, wrong):
    case = _select_case()
    t = dict(zip(SELECT_ARGS, case.args(), strict=True))[name].to(wrong)
    _refuse_select(
        case,
        TypeError,
        re.escape(f"{name} must have dtype ") + r"torch\.\w+, got " + re.escape(str(wrong)),
        **{name: t},
    )


def _non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Same shape and values, last dimension strided by 2 (or a transposed 2-D view)."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    view = wide[..., ::2]
    view.copy_(t)
    return view


@pytest.mark.parametrize(
    "name", [n for n in SELECT_ARGS if n not in ("token_topk", "compress_ratio")]
)
def test_select_refuses_non_contiguous(name):
    case = _select_case()
    t = _non_contiguous(dict(zip(SELECT_ARGS, case.args(), strict=True))[name])
    _refuse_select(case, ValueError, f"^{name} must be contiguous, got strides", **{name: t})


@pytest.mark.parametrize(
    "name, shape, pattern",
    [
        ("q", (2, 3, 128), "(R, 4, 128)"),
        ("q", (2, 4, 128, 1), "(R, 4, 128)"),
        ("compressed_key_cache", (4, 128, 128), "(P, 128, 1, 128)"),
        ("compressed_key_cache", (4, 64, 1, 128), "(P, 128, 1, 128)"),
        ("page_table", (2,), "(B, M)"),
        ("token_to_req", (2, 1), "(R,)"),
        ("query_positions", (), "(R,)"),
        ("sequence_lengths", (1, 1), "(B,)"),
        ("out", (2, 2048), "(R, 2051)"),
    ],
)
def test_select_refuses_shape(name, shape, pattern):
    case = _select_case()
    dtype = dict(zip(SELECT_ARGS, case.args(), strict=True))[name].dtype
    t = torch.zeros(shape, dtype=dtype)
    _refuse_select(
        case, ValueError, re.escape(f"{name} must have shape {pattern}, got {shape}"), **{name: t}
    )


@pytest.mark.parametrize(
    "name, shape, message",
    [
        ("token_to_req", (3,), "token_to_req must have shape (R,) = (2,) (R = 2 from q), got (3,)"),
        (
            "query_positions",
            (1,),
            "query_positions must have shape (R,) = (2,) (R = 2 from q), got (1,)",
        ),
        (
            "sequence_lengths",
            (2,),
            "sequence_lengths must have shape (B,) = (3,) (B = 3 from page_table), got (2,)",
        ),
        (
            "out",
            (3, 2051),
            "out must have shape (R, 2051) = (2, 2051) (R = 2 from q), got (3, 2051)",
        ),
    ],
)
def test_select_refuses_inconsistent_sizes(name, shape, message):
    case = _select_case()
    dtype = dict(zip(SELECT_ARGS, case.args(), strict=True))[name].dtype
    _refuse_select(case, ValueError, re.escape(message), **{name: torch.zeros(shape, dtype=dtype)})


@pytest.mark.parametrize("name", ["page_table", "token_to_req", "sequence_lengths"])
def test_select_refuses_out_overlapping_input(name):
    case = _select_case()
    src = dict(zip(SELECT_ARGS, case.args(), strict=True))[name]
    # one int32 buffer holding the input and, overlapping its last element, `out`
    buffer = torch.full((src.numel() + case.out.numel(),), testing.POISON_INT32, dtype=torch.int32)
    buffer[: src.numel()] = src.reshape(-1)
    alias_in = buffer[: src.numel()].view(src.shape)
    alias_out = buffer[src.numel() - 1 : src.numel() - 1 + case.out.numel()].view(case.out.shape)
    _refuse_select(
        case,
        ValueError,
        f"^out must not overlap any input, got overlap with {name}",
        **{name: alias_in, "out": alias_out},
    )


def test_select_accepts_empty_out_sharing_storage():
    """R = 0: empty tensors address no byte, so an empty `out` never overlaps."""
    case = testing.random_select_case(0, 2, 2, 3, seed=1)
    buffer = torch.zeros(16, dtype=torch.int32)
    out = buffer[:0].view(0, contract.WIDTH)
    token_to_req = buffer[:0]
    args = list(case.args())
    args[3], args[8] = token_to_req, out
    assert qsa_ops.select_paged_tokens(*args) is out


# ----------------------------------------------------------------------------------------
# attention refusals
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in ATTN_ARGS if n not in ("page_size", "softmax_scale")])
def test_attention_refuses_non_tensor(name):
    _refuse_attention(
        _attention_case(), TypeError, f"^{name} must be a torch.Tensor, got int$", **{name: 3}
    )


@pytest.mark.parametrize("value", [512.0, False, "512"])
def test_attention_refuses_non_int_page_size(value):
    _refuse_attention(
        _attention_case(),
        TypeError,
        f"^page_size must be an int, got {type(value).__name__}$",
        page_size=value,
    )


def test_attention_refuses_other_page_size():
    _refuse_attention(
        _attention_case(), ValueError, "^page_size must be 512, got 256$", page_size=256
    )


@pytest.mark.parametrize("value", ["0.1", torch.tensor(0.1), True])
def test_attention_refuses_softmax_scale_type(value):
    _refuse_attention(
        _attention_case(),
        TypeError,
        "^softmax_scale must be a float, an int or None, got",
        softmax_scale=value,
    )


@pytest.mark.parametrize("value", [0.0, -0.5, math.nan, math.inf, -math.inf, 0])
def test_attention_refuses_softmax_scale_value(value):
    _refuse_attention(
        _attention_case(),
        ValueError,
        "^softmax_scale must be finite and > 0, got",
        softmax_scale=value,
    )


@pytest.mark.parametrize(
    "name", ["k_cache", "v_cache", "logical_indices", "page_table", "token_to_req", "out"]
)
def test_attention_refuses_other_device(name):
    case = _attention_case()
    meta = dict(zip(ATTN_ARGS, case.args(), strict=True))[name].to("meta")
    _refuse_attention(
        case,
        ValueError,
        re.escape(f"{name} must be on the same device as q (cpu), got meta"),
        **{name: meta},
    )


@pytest.mark.parametrize(
    "name, wrong",
    [
        ("q", torch.bfloat16),
        ("logical_indices", torch.int64),
        ("page_table", torch.int64),
        ("token_to_req", torch.int16),
        ("out", torch.float32),
    ],
)
def test_attention_refuses_dtype(name, wrong):
    case = _attention_case()
    t = dict(zip(ATTN_ARGS, case.args(), strict=True))[name].to(wrong)
    _refuse_attention(
        case,
        TypeError,
        f"^{name} must have dtype torch.float16|int32, got " + re.escape(str(wrong)),
        **{name: t},
    )


def test_attention_refuses_kv_dtype():
    case = _attention_case()
    buffer = case.kv.to(torch.bfloat16)
    shape = case.k_cache.shape
    k = buffer.as_strided(shape, contract.KV_STRIDES, 0)
    v = buffer.as_strided(shape, contract.KV_STRIDES, 256)
    _refuse_attention(
        case,
        TypeError,
        r"^k_cache must have dtype torch.float16, got torch.bfloat16$",
        k_cache=k,
        v_cache=v,
    )


@pytest.mark.parametrize("name", ["q", "logical_indices", "page_table", "token_to_req", "out"])
def test_attention_refuses_non_contiguous(name):
    case = _attention_case()
    t = _non_contiguous(dict(zip(ATTN_ARGS, case.args(), strict=True))[name])
    _refuse_attention(case, ValueError, f"^{name} must be contiguous, got strides", **{name: t})


def test_attention_refuses_contiguous_k_cache():
    case = _attention_case()
    k = case.k_cache.contiguous()  # [P, 512, 1, 256] on its own: not exact-packed
    _refuse_attention(
        case,
        ValueError,
        re.escape(
            "k_cache must have strides (262144, 512, 256, 1) (exact-packed K/V), got (131072, 256, 256, 1)"
        ),
        k_cache=k,
    )


def test_attention_refuses_v_cache_strides():
    case = _attention_case()
    v = case.v_cache.contiguous()
    _refuse_attention(
        case, ValueError, re.escape("v_cache must have strides (262144, 512, 256, 1)"), v_cache=v
    )


@pytest.mark.parametrize("offset", [0, 128, 255])
def test_attention_refuses_v_offset(offset):
    case = _attention_case()
    v = case.kv.as_strided(case.k_cache.shape, contract.KV_STRIDES, offset)
    _refuse_attention(
        case,
        ValueError,
        re.escape(
            f"v_cache must have storage offset k_cache.storage_offset() + 256 = 256 (exact-packed K/V), got {offset}"
        ),
        v_cache=v,
    )


def test_attention_refuses_v_in_other_storage():
    case = _attention_case()
    other = case.kv.clone()
    v = other.as_strided(case.k_cache.shape, contract.KV_STRIDES, 256)
    _refuse_attention(case, ValueError, "^v_cache must share k_cache's storage", v_cache=v)


def test_attention_refuses_storage_too_small():
    case = _attention_case()
    # a storage that lost its last page after the views were made
    buffer = case.kv.clone()
    k = buffer.as_strided(case.k_cache.shape, contract.KV_STRIDES, 0)
    v = buffer.as_strided(case.k_cache.shape, contract.KV_STRIDES, 256)
    buffer.untyped_storage().resize_(buffer.untyped_storage().nbytes() - 2 * contract.KV_STRIDES[0])
    args = dict(zip(ATTN_ARGS, case.args(), strict=True)) | {"k_cache": k, "v_cache": v}
    _refused(
        qsa_ops.sparse_paged_attention,
        tuple(args[k] for k in ATTN_ARGS),
        ValueError,
        "^k_cache/v_cache storage must hold at least 2621440 bytes for 5 exact-packed pages, got 2097152$",
        [case.out],
    )


@pytest.mark.parametrize(
    "name, shape, pattern",
    [
        ("q", (2, 4, 256), "(R, 3, 256)"),
        ("q", (2, 768), "(R, 3, 256)"),
        ("logical_indices", (2, 2048), "(R, 2051)"),
        ("page_table", (6,), "(B, M)"),
        ("token_to_req", (), "(R,)"),
        ("out", (2, 3, 128), "(R, 3, 256)"),
    ],
)
def test_attention_refuses_shape(name, shape, pattern):
    case = _attention_case()
    dtype = dict(zip(ATTN_ARGS, case.args(), strict=True))[name].dtype
    t = torch.zeros(shape, dtype=dtype)
    _refuse_attention(
        case, ValueError, re.escape(f"{name} must have shape {pattern}, got {shape}"), **{name: t}
    )


def test_attention_refuses_kv_shape():
    case = _attention_case()
    k = case.kv.as_strided((5, 256, 1, 256), contract.KV_STRIDES, 0)
    v = case.kv.as_strided((5, 256, 1, 256), contract.KV_STRIDES, 256)
    _refuse_attention(
        case,
        ValueError,
        re.escape("k_cache must have shape (P, 512, 1, 256), got (5, 256, 1, 256)"),
        k_cache=k,
        v_cache=v,
    )


@pytest.mark.parametrize(
    "name, shape, message",
    [
        (
            "logical_indices",
            (3, 2051),
            "logical_indices must have shape (R, 2051) = (2, 2051) (R = 2 from q), got (3, 2051)",
        ),
        ("token_to_req", (1,), "token_to_req must have shape (R,) = (2,) (R = 2 from q), got (1,)"),
        (
            "out",
            (1, 3, 256),
            "out must have shape (R, 3, 256) = (2, 3, 256) (R = 2 from q), got (1, 3, 256)",
        ),
    ],
)
def test_attention_refuses_inconsistent_sizes(name, shape, message):
    case = _attention_case()
    dtype = dict(zip(ATTN_ARGS, case.args(), strict=True))[name].dtype
    _refuse_attention(
        case, ValueError, re.escape(message), **{name: torch.zeros(shape, dtype=dtype)}
    )


def test_attention_refuses_kv_page_count_mismatch():
    case = _attention_case()
    v = case.kv.as_strided((4, 512, 1, 256), contract.KV_STRIDES, 256)
    _refuse_attention(
        case,
        ValueError,
        re.escape(
            "v_cache must have shape (P, 512, 1, 256) = (5, 512, 1, 256) (P = 5 from k_cache), got (4, 512, 1, 256)"
        ),
        v_cache=v,
    )


@pytest.mark.parametrize("name, kv_offset", [("q", 0), ("k_cache", 0), ("k_cache", 256)])
def test_attention_refuses_out_overlapping_input(name, kv_offset):
    """Overlap is judged on address ranges: an `out` placed in the V half of the packed
    buffer lies inside k_cache's range and is reported against k_cache."""
    case = _attention_case()
    if name == "q":
        buffer = torch.zeros(2 * case.q.numel(), dtype=torch.float16)
        q = buffer[: case.q.numel()].view(case.q.shape).copy_(case.q)
        out = buffer[case.q.numel() // 2 :][: case.out.numel()].view(case.out.shape)
        replace = {"q": q, "out": out}
    else:  # out inside the KV buffer
        out = case.kv[kv_offset : kv_offset + case.out.numel()].view(case.out.shape)
        replace = {"out": out}
    _refuse_attention(
        case, ValueError, "^out must not overlap any input, got overlap with " + name, **replace
    )


def test_attention_accepts_empty_out_sharing_storage():
    case = testing.random_attention_case(0, 1, 1, 1, seed=2)
    out = case.q.view(0, 3, 256)  # the same (empty) tensor: no byte in common
    args = list(case.args())
    args[7] = out
    assert qsa_ops.sparse_paged_attention(*args) is out


def test_attention_accepts_nonzero_k_offset():
    case = testing.random_attention_case(2, 2, 2, 3, seed=4, lead=1000)
    assert case.k_cache.storage_offset() == 1000
    qsa_ops.sparse_paged_attention(*case.args())
    testing.check_attention(case, case.out)


# ----------------------------------------------------------------------------------------
# order of checks: device, dtype, layout, shape, consistency, overlap
# ----------------------------------------------------------------------------------------


def test_order_device_before_dtype():
    case = _select_case()
    _refuse_select(
        case,
        ValueError,
        "^page_table must be on the same device",
        page_table=case.page_table.to("meta", torch.int64),
    )


def test_order_dtype_before_layout_and_shape():
    case = _select_case()
    _refuse_select(case, TypeError, "^q must have dtype", q=_non_contiguous(torch.zeros(2, 3, 128)))


def test_order_layout_before_shape():
    case = _select_case()
    _refuse_select(
        case,
        ValueError,
        "^out must be contiguous",
        out=_non_contiguous(torch.zeros(2, 7, dtype=torch.int32)),
    )


def test_order_shape_before_consistency():
    case = _select_case()
    _refuse_select(
        case,
        ValueError,
        r"^sequence_lengths must have shape \(B,\), got",
        token_to_req=torch.zeros(5, dtype=torch.int32),
        sequence_lengths=torch.zeros(1, 1, dtype=torch.int32),
    )


def test_order_consistency_before_constants():
    case = _select_case()
    _refuse_select(
        case,
        ValueError,
        "^token_to_req must have shape",
        token_topk=1,
        token_to_req=torch.zeros(5, dtype=torch.int32),
    )


def test_order_first_argument_first():
    case = _attention_case()
    _refuse_attention(case, TypeError, "^q must have dtype", q=case.q.float(), out=case.out.float())


def test_direct_op_call_is_validated_too():
    """torch.ops.qsa.* validates in its body (it may be reached without the public function)."""
    case = _select_case()
    args = list(case.args())
    args[6] = 1024
    with pytest.raises(ValueError, match="^token_topk must be 2048, got 1024$"):
        torch.ops.qsa.select_paged_tokens(*args)
    assert (case.out == testing.POISON_INT32).all()
    acase = _attention_case()
    args = list(acase.op_args())
    args[6] = acase.kv[: acase.out.numel()].view(acase.out.shape)
    with pytest.raises(ValueError, match="^out must not overlap any input"):
        torch.ops.qsa.sparse_paged_attention(*args)


@pytest.mark.parametrize(
    "kv, exc, message",
    [
        (
            torch.zeros(1, 512, 512),
            TypeError,
            "^kv must have dtype torch.float16, got torch.float32$",
        ),
        (
            torch.zeros(1, 512, 256, dtype=torch.float16),
            ValueError,
            re.escape("kv must have shape (P, 512, 512), got (1, 512, 256)"),
        ),
        (
            torch.zeros(2, 512, 1024, dtype=torch.float16)[:, :, :512],
            ValueError,
            re.escape("kv must have strides (262144, 512, 1), got (524288, 1024, 1)"),
        ),
    ],
)
def test_direct_attention_op_refuses_bad_kv(kv, exc, message):
    case = _attention_case()
    args = list(case.op_args())
    args[1] = kv
    with pytest.raises(exc, match=message):
        torch.ops.qsa.sparse_paged_attention(*args)
    assert case.out.isnan().all()
