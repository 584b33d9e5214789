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
ATTN_KWARGS = ("k_scale", "v_scale", "gate")


def _select_case(R=2):
    return testing.make_select_case("multi_request", R)  # B = 3: every tensor has >1 element


def _attention_case(R=2, layout="seed"):
    return testing.make_attention_case("holes_dups_cross_page", R, layout=testing.LAYOUTS[layout])


def _refused(fn, args, exc, message, watched, kwargs=None):
    """Call fn(*args, **kwargs), expect ``exc`` matching ``message``; every tensor in
    ``watched`` must be bit-identical afterwards (NaN == NaN)."""
    before = [_bits(t) for t in watched]
    with pytest.raises(exc, match=message):
        fn(*args, **(kwargs or {}))
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
    args = dict(zip(ATTN_ARGS, case.args(), strict=True)) | case.kwargs() | replace
    watched = [case.out, *case.inputs().values()]
    watched += [
        v for v in replace.values() if isinstance(v, torch.Tensor) and v.device.type != "meta"
    ]
    _refused(
        qsa_ops.sparse_paged_attention,
        tuple(args[k] for k in ATTN_ARGS),
        exc,
        message,
        watched,
        {k: args[k] for k in ATTN_KWARGS},
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
        re.escape(f"{name} must have dtype ") + ".+, got " + re.escape(str(wrong)),
        **{name: t},
    )


def _non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Same shape and values, last dimension strided by 2 (or a transposed 2-D view)."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    view = wide[..., ::2]
    view.copy_(t)
    return view


@pytest.mark.parametrize("name", ["q", "token_to_req", "query_positions", "sequence_lengths"])
def test_select_refuses_non_contiguous(name):
    case = _select_case()
    t = _non_contiguous(dict(zip(SELECT_ARGS, case.args(), strict=True))[name])
    _refuse_select(case, ValueError, f"^{name} must be contiguous, got strides", **{name: t})


@pytest.mark.parametrize("name", ["compressed_key_cache", "page_table", "out"])
def test_select_refuses_last_stride(name):
    """Rows (and cache pages) may be strided; the last dimension may not."""
    case = _select_case()
    t = _non_contiguous(dict(zip(SELECT_ARGS, case.args(), strict=True))[name])
    _refuse_select(case, ValueError, f"^{name} must have last stride 1, got strides", **{name: t})


def test_select_refuses_cache_strides_off_16_bytes():
    case = _select_case()
    ck = case.compressed_key_cache
    wide = torch.zeros(*ck.shape[:-1], 129, dtype=ck.dtype)[..., :128]
    _refuse_select(
        case,
        ValueError,
        re.escape(
            "compressed_key_cache must have strides in multiples of 16 bytes (8 elements of "
            f"torch.float16) in every dimension of size > 1 but the last, got strides "
            f"{tuple(wide.stride())} for shape {tuple(wide.shape)}"
        ),
        compressed_key_cache=wide,
    )


def test_select_refuses_cache_start_off_16_bytes():
    case = _select_case()
    ck = case.compressed_key_cache
    buf = torch.zeros(ck.numel() + 8, dtype=ck.dtype)
    moved = buf[1 : 1 + ck.numel()].view(ck.shape)
    _refuse_select(
        case,
        ValueError,
        f"^compressed_key_cache must start at a 16-byte aligned address, got {moved.data_ptr():#x}$",
        compressed_key_cache=moved,
    )


def test_select_refuses_no_keys_per_page():
    case = _select_case()
    ck = case.compressed_key_cache[:, :0]
    _refuse_select(
        case,
        ValueError,
        re.escape(
            f"compressed_key_cache must hold C >= 1 keys per page, got shape {tuple(ck.shape)}"
        ),
        compressed_key_cache=ck,
    )


def test_select_refuses_overlapping_out_rows():
    case = _select_case()
    out = case.out.as_strided(case.out.shape, (2050, 1))
    _refuse_select(
        case,
        ValueError,
        re.escape(
            "out must have row stride >= 2051 (rows must not overlap), got strides (2050, 1)"
        ),
        out=out,
    )


def test_select_refuses_cache_dtype_other_than_q():
    case = testing.make_select_case("multi_request", 2, layout=testing.LAYOUTS["vllm_fp8_784"])
    _refuse_select(
        case,
        TypeError,
        "^compressed_key_cache must have dtype torch.float8_e4m3fn \\(q's\\), got torch.bfloat16$",
        compressed_key_cache=case.compressed_key_cache.to(torch.bfloat16),
    )


@pytest.mark.parametrize(
    "name, shape, pattern",
    [
        ("q", (2, 3, 128), "(R, 4, 128)"),
        ("q", (2, 4, 128, 1), "(R, 4, 128)"),
        ("compressed_key_cache", (4, 128, 128), "(P, C, 1, 128)"),
        ("compressed_key_cache", (4, 64, 2, 128), "(P, C, 1, 128)"),
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


@pytest.mark.parametrize(
    "value, message",
    [
        (256, "page_size must be k_cache.shape[1] = 512, got 256"),
        (514, "page_size must be a positive multiple of 4, got 514"),
        (0, "page_size must be a positive multiple of 4, got 0"),
        (-512, "page_size must be a positive multiple of 4, got -512"),
    ],
)
def test_attention_refuses_other_page_size(value, message):
    _refuse_attention(_attention_case(), ValueError, f"^{re.escape(message)}$", page_size=value)


@pytest.mark.parametrize("name", ["softmax_scale", "k_scale", "v_scale"])
@pytest.mark.parametrize("value", ["0.1", torch.tensor(0.1), True])
def test_attention_refuses_scale_type(name, value):
    _refuse_attention(
        _attention_case(),
        TypeError,
        f"^{name} must be a float, an int or None, got",
        **{name: value},
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
    "name, wrong, message",
    [
        ("q", torch.float32, "q must have dtype torch.float16 or torch.bfloat16, got torch.float32"),
        ("q", torch.bfloat16, "k_cache must have dtype torch.bfloat16 (q's) or torch.float8_e4m3fn, got torch.float16"),
        ("k_cache", torch.float32, "k_cache must have dtype torch.float16 (q's) or torch.float8_e4m3fn, got torch.float32"),
        ("v_cache", torch.bfloat16, "v_cache must have dtype torch.float16 (k_cache's), got torch.bfloat16"),
        ("logical_indices", torch.int64, "logical_indices must have dtype torch.int32, got torch.int64"),
        ("page_table", torch.int64, "page_table must have dtype torch.int32, got torch.int64"),
        ("token_to_req", torch.int16, "token_to_req must have dtype torch.int32, got torch.int16"),
        ("out", torch.bfloat16, "out must have dtype torch.float16 (q's), got torch.bfloat16"),
    ],
)  # fmt: skip
def test_attention_refuses_dtype(name, wrong, message):
    case = _attention_case()
    t = dict(zip(ATTN_ARGS, case.args(), strict=True))[name].to(wrong)
    _refuse_attention(case, TypeError, f"^{re.escape(message)}$", **{name: t})


@pytest.mark.parametrize(
    "name, wrong, message",
    [
        ("gate", torch.float16, "gate must have dtype torch.bfloat16 (q's), got torch.float16"),
        ("gate", [1.0], "gate must be a torch.Tensor or None, got list"),
    ],
)
def test_attention_refuses_gate(name, wrong, message):
    case = _attention_case(layout="vllm_bf16_784")
    gate = case.gate.to(wrong) if isinstance(wrong, torch.dtype) else wrong
    exc = TypeError
    _refuse_attention(case, exc, f"^{re.escape(message)}$", gate=gate)


def test_attention_refuses_gate_shape_and_overlap():
    case = _attention_case(layout="vllm_bf16_784")
    _refuse_attention(
        case,
        ValueError,
        re.escape("gate must have shape (R, 3, 256) = (2, 3, 256) (R = 2 from q), got (1, 3, 256)"),
        gate=case.gate[:1],
    )
    _refuse_attention(case, ValueError, "^gate must be contiguous", gate=_non_contiguous(case.gate))
    _refuse_attention(
        case, ValueError, "^out must not overlap any input, got overlap with gate", out=case.gate
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"k_scale": None}, "k_scale must be a float > 0 when k_cache is torch.float8_e4m3fn, got None"),
        ({"v_scale": None}, "v_scale must be a float > 0 when v_cache is torch.float8_e4m3fn, got None"),
        ({"k_scale": -1.0}, "k_scale must be finite and > 0, got -1.0"),
        ({"v_scale": math.inf}, "v_scale must be finite and > 0, got inf"),
        ({"k_scale": math.nan}, "k_scale must be finite and > 0, got nan"),
    ],
)  # fmt: skip
def test_attention_refuses_fp8_scales(change, message):
    case = _attention_case(layout="vllm_fp8_784")
    _refuse_attention(case, ValueError, f"^{re.escape(message)}$", **change)


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_attention_refuses_scales_for_unscaled_caches(name):
    cache = "k_cache" if name == "k_scale" else "v_cache"
    _refuse_attention(
        _attention_case(),
        ValueError,
        re.escape(
            f"{name} must be None when {cache} is torch.float16 (only torch.float8_e4m3fn "
            "caches are scaled), got 0.5"
        ),
        **{name: 0.5},
    )


@pytest.mark.parametrize("name", ["q", "token_to_req", "out"])
def test_attention_refuses_non_contiguous(name):
    case = _attention_case()
    t = _non_contiguous(dict(zip(ATTN_ARGS, case.args(), strict=True))[name])
    _refuse_attention(case, ValueError, f"^{name} must be contiguous, got strides", **{name: t})


@pytest.mark.parametrize("name", ["k_cache", "v_cache", "logical_indices", "page_table"])
def test_attention_refuses_last_stride(name):
    case = _attention_case()
    t = _non_contiguous(dict(zip(ATTN_ARGS, case.args(), strict=True))[name])
    _refuse_attention(
        case, ValueError, f"^{name} must have last stride 1, got strides", **{name: t}
    )


@pytest.mark.parametrize("name", ["k_cache", "v_cache"])
def test_attention_refuses_cache_strides_off_16_bytes(name):
    case = _attention_case()
    t = dict(zip(ATTN_ARGS, case.args(), strict=True))[name]
    wide = torch.zeros(*t.shape[:-1], 260, dtype=t.dtype)[..., :256]  # token stride 260
    _refuse_attention(
        case,
        ValueError,
        re.escape(
            f"{name} must have strides in multiples of 16 bytes (8 elements of torch.float16) "
            f"in every dimension of size > 1 but the last, got strides {tuple(wide.stride())} "
            f"for shape {tuple(wide.shape)}"
        ),
        **{name: wide},
    )


@pytest.mark.parametrize("name", ["k_cache", "v_cache"])
def test_attention_refuses_cache_start_off_16_bytes(name):
    case = _attention_case()
    t = dict(zip(ATTN_ARGS, case.args(), strict=True))[name]
    buf = torch.zeros(t.numel() + 8, dtype=t.dtype)
    moved = buf[4 : 4 + t.numel()].view(t.shape)  # 8 bytes past an aligned start
    _refuse_attention(
        case,
        ValueError,
        f"^{name} must start at a 16-byte aligned address, got {moved.data_ptr():#x}$",
        **{name: moved},
    )


def test_attention_refuses_fp8_caches_without_scales():
    case = _attention_case()
    _refuse_attention(
        case,
        ValueError,
        "^k_scale must be a float > 0 when k_cache is torch.float8_e4m3fn, got None$",
        k_cache=case.k_cache.to(contract.FP8),
        v_cache=case.v_cache.to(contract.FP8),
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
    k = case.k_cache[:, :, :, :128]
    _refuse_attention(
        case,
        ValueError,
        re.escape("k_cache must have shape (P, page_size, 1, 256), got (5, 512, 1, 128)"),
        k_cache=k,
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


@pytest.mark.parametrize(
    "shape, message",
    [
        ((4, 512), "v_cache must have shape (P, page_size, 1, 256) = (5, 512, 1, 256) (P = 5 from k_cache), got (4, 512, 1, 256)"),
        ((5, 256), "v_cache must have shape (P, page_size, 1, 256) = (5, 512, 1, 256) (page_size = 512 from k_cache), got (5, 256, 1, 256)"),
    ],
)  # fmt: skip
def test_attention_refuses_kv_size_mismatch(shape, message):
    case = _attention_case()
    v = case.v_cache[: shape[0], : shape[1]]
    _refuse_attention(case, ValueError, re.escape(message), v_cache=v)


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


@pytest.mark.parametrize("layout", sorted(testing.LAYOUTS))
def test_attention_accepts_every_v2_layout(layout):
    case = _attention_case(layout=layout)
    qsa_ops.sparse_paged_attention(*case.args(), **case.kwargs())
    testing.check_attention(case, case.out)


def test_attention_accepts_v_in_another_storage_and_order():
    """K and V may live apart, V even before K."""
    case = _attention_case()
    v = case.v_cache.clone()
    args = list(case.args())
    args[2] = v
    qsa_ops.sparse_paged_attention(*args)
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
        "^out must have last stride 1",
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
    args = list(acase.args())
    args[7] = acase.kv[: acase.out.numel()].view(acase.out.shape)
    with pytest.raises(ValueError, match="^out must not overlap any input"):
        torch.ops.qsa.sparse_paged_attention(*args)
