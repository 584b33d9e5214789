"""The op layer: each signature written once (SCHEMAS) and followed everywhere, and the C++
validation of the compiled library held to contract.py's exception classes and messages.

The parity tests call the library's ``qsa_check`` operators (the same C++ checks as the CUDA
kernels, without a launch) on CPU tensors, so they run wherever the library can be built: the
package's own ``_C.so`` when it is loaded, else a build of csrc/ into a temporary directory
(nvcc on the PATH is enough; no GPU). Without either they skip, saying so.
"""

from __future__ import annotations

import inspect
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import contract, ops, reference, testing

ROOT = Path(__file__).resolve().parents[2]
OPS = tuple(ops.SCHEMAS)


# ----------------------------------------------------------------------------------------
# one signature per operator
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
def test_public_function_follows_the_schema(op):
    params = inspect.signature(getattr(qsa_ops, op)).parameters
    assert tuple(params) == ops.public_arguments(op)
    kw_only = tuple(n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY)
    assert kw_only == ops.keyword_only(op)


@pytest.mark.parametrize("op", OPS)
def test_registered_schema_is_the_table(op):
    schema = str(getattr(torch.ops.qsa, op).default._schema)
    assert schema == f"qsa::{op}{ops.SCHEMAS[op]}"
    check = str(getattr(torch.ops.qsa_check, op).default._schema)
    assert check == f"qsa_check::{op}{ops.SCHEMAS[op]}"


_CPP_TYPES = {"Tensor": "Tensor", "Tensor(a!)": "Tensor", "Tensor(b!)": "Tensor", "int": "int64_t",
              "float?": "std::optional<double>", "Tensor?": "std::optional<Tensor>"}  # fmt: skip


@pytest.mark.parametrize("op", OPS)
def test_cpp_kernel_follows_the_schema(op):
    """csrc/torch_ops.cpp's kernel of ``op`` takes the schema's arguments, in order, with the
    stable-ABI type of each (TORCH_BOX unboxes by position)."""
    source = (ROOT / "csrc" / "torch_ops.cpp").read_text()
    match = re.search(rf"^void {op}\(([^)]*)\)", source, re.M)
    assert match, f"no kernel `void {op}(...)` in csrc/torch_ops.cpp"
    params = [" ".join(p.split()[:-1]) for p in match[1].replace("\n", " ").split(",")]
    assert params == [_CPP_TYPES[t] for t, _ in ops.schema_arguments(op)]


def test_contract_validators_name_the_schema_arguments():
    for op, spec in (("select_paged_tokens", contract._SELECT),
                     ("sparse_paged_attention", contract._ATTENTION)):  # fmt: skip
        assert set(spec.names) <= set(ops.public_arguments(op))
        params = tuple(inspect.signature(ops.VALIDATORS[op]).parameters)
        assert params == (*ops.public_arguments(op), "check_storage")


def test_reference_kernels_take_the_schema_arguments():
    for op in OPS:
        params = inspect.signature(ops.CHECKS[op]).parameters
        names = tuple(params)[:-1]
        assert len(names) == len(ops.schema_arguments(op))
        kw_only = tuple(n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY)
        assert kw_only[:-1] == ops.keyword_only(op)  # then check_storage
    assert "out" in inspect.signature(reference.select_paged_tokens_ref).parameters


# ----------------------------------------------------------------------------------------
# the compiled library's validation (qsa_check) vs contract.py
# ----------------------------------------------------------------------------------------


def _build_library(tmp: Path) -> str:
    """Build csrc/ into ``tmp`` (not the checkout) and load it; "" or why it could not."""
    if shutil.which("nvcc") is None:
        return "nvcc not on PATH: the C++ validation cannot be built here"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp / "lib"),
           "--build-temp", str(tmp / "tmp")]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    built = tmp / "lib" / "custom_esimd_kernels_vllm" / ops.LIBRARY_NAME
    if res.returncode != 0 or not built.is_file():
        pytest.fail(f"building the library failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    torch.ops.load_library(str(built))
    return ""


@pytest.fixture(scope="session")
def cpp_checks(tmp_path_factory):
    """The qsa_check operators have their C++ kernels (the package's library or a fresh build)."""
    if ops.BACKEND != "cuda":
        why = _build_library(tmp_path_factory.mktemp("qsa_library"))
        if why:
            pytest.skip(why)
    return torch.ops.qsa_check


def _call(fn, op: str, args):
    """``fn`` with every schema argument of ``op`` in order (keyword-only ones by name)."""
    kw = ops.keyword_only(op)
    n = len(args) - len(kw)
    return fn(*args[:n], **dict(zip(kw, args[n:], strict=True)))


def _outcome(fn, op: str, args):
    """(exception class name, message) of a refusal, or None when ``fn`` accepts the args."""
    try:
        _call(fn, op, args)
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    except RuntimeError as exc:
        refusal = ops.refusal_of(exc)
        if refusal is None:
            raise
        return refusal[0].__name__, refusal[1]
    return None


# the corpus' base calls: each operator in the seed's layout and in vLLM's (contract v2)
BASES = {
    "select_paged_tokens": ("seed", "vllm_bf16_784", "vllm_fp8_784"),
    "sparse_paged_attention": ("seed", "vllm_bf16_784", "vllm_fp8_784"),
}


def _base_args(op: str, layout: str = "seed") -> list:
    """Every schema argument of ``op`` in order (keyword-only ones last)."""
    lay = testing.LAYOUTS[layout]
    if op == "select_paged_tokens":
        return list(testing.make_select_case("multi_request", 2, seed=3, layout=lay).args())
    case = testing.make_attention_case("holes_dups_cross_page", 2, seed=3, layout=lay)
    return [*case.args(), *(case.kwargs()[k] for k in ops.keyword_only(op))]


def _shapes(op: str) -> dict[str, tuple]:
    spec = contract._SELECT if op == "select_paged_tokens" else contract._ATTENTION
    return {a.name: a.shape for a in spec.args}


def _op_names(op: str) -> list[str]:
    return [name for _, name in ops.schema_arguments(op)]


OUTPUTS = ("out",)  # what each operator writes


def _corpus(op: str, layout: str):
    args = _base_args(op, layout)
    names = _op_names(op)
    changes = testing.refusal_mutations(args, names, _shapes(op), OUTPUTS)
    changes += testing.contract_v2_mutations(args, names)
    ints = [(n, i) for i, (t, n) in enumerate(ops.schema_arguments(op)) if t == "int"]
    for name, i in ints:
        changes.append((f"{name}: wrong value", i, args[i] * 2))
        changes.append((f"{name}: negative", i, -1))
    if op == "sparse_paged_attention":
        i = names.index("softmax_scale")
        for value in (math.nan, math.inf, -math.inf, -1.0, 0.0, -0.0, -1e-300, 1e-5, 5e-324, 1e20):
            changes.append((f"softmax_scale {value!r}", i, value))
    return args, changes


CORPUS = {(op, layout): _corpus(op, layout) for op in OPS for layout in BASES[op]}


@pytest.mark.parametrize(
    "op, layout, label",
    [(op, layout, label) for (op, layout), (_, ch) in CORPUS.items() for label, _, _ in ch],
)
def test_cpp_refusal_matches_contract(cpp_checks, op, layout, label):
    args, changes = CORPUS[op, layout]
    ((_, index, value),) = [c for c in changes if c[0] == label]
    bad = testing.apply_mutation(args, index, value)
    want = _outcome(ops.CHECKS[op], op, bad)  # None where the change stays inside v2
    got = _outcome(getattr(cpp_checks, op), op, bad)
    assert got == want, f"{op} / {layout} / {label}"


@pytest.mark.parametrize("op, layout", list(CORPUS))
def test_cpp_accepts_valid_arguments(cpp_checks, op, layout):
    args = _base_args(op, layout)
    assert _outcome(ops.CHECKS[op], op, args) is None
    assert _outcome(getattr(cpp_checks, op), op, args) is None


@pytest.mark.parametrize("op, layout", list(CORPUS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_cpp_refusal_order_matches_contract(cpp_checks, op, layout, data):
    """Several arguments wrong at once: both validators name the same first problem."""
    args, changes = CORPUS[op, layout]
    picked = data.draw(st.lists(st.sampled_from(changes), min_size=2, max_size=4))
    bad = list(args)
    for _, index, value in picked:
        bad = testing.apply_mutation(bad, index, value)
    assert _outcome(getattr(cpp_checks, op), op, bad) == _outcome(ops.CHECKS[op], op, bad)


# ----------------------------------------------------------------------------------------
# the public functions: refusals keep the contract's class and message, out untouched
# ----------------------------------------------------------------------------------------


def test_public_refusal_is_the_contract_error_and_writes_nothing():
    case = testing.make_select_case("multi_request", 2, seed=5)
    args = list(case.args())
    args[0] = args[0].float()
    message = (
        "q must have dtype torch.float16, torch.bfloat16 or torch.float8_e4m3fn, got torch.float32"
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        qsa_ops.select_paged_tokens(*args)
    assert (case.out == testing.POISON_INT32).all()


@pytest.mark.parametrize(
    "value, exc, message",
    [
        ([1, 2], TypeError, "q must be a torch.Tensor, got list"),
        (None, TypeError, "q must be a torch.Tensor, got NoneType"),
    ],
)
def test_public_refusal_of_what_the_schema_rejects(value, exc, message):
    case = testing.make_attention_case("valid_width_32", 1)
    args = list(case.args())
    args[0] = value
    with pytest.raises(exc, match=f"^{re.escape(message)}$"):
        qsa_ops.sparse_paged_attention(*args)
    assert case.out.isnan().all()


@pytest.mark.parametrize("value", [True, 2048.0])
def test_public_refusal_of_coercible_ints(value):
    case = testing.make_select_case("short_tail", 1)
    args = list(case.args())
    args[6] = value
    with pytest.raises(TypeError, match=f"^token_topk must be an int, got {type(value).__name__}$"):
        qsa_ops.select_paged_tokens(*args)


def test_refusal_marker_round_trip():
    exc = RuntimeError("[qsa:ValueError] out must not overlap any input, got overlap with q")
    assert ops.refusal_of(exc) == (ValueError, "out must not overlap any input, got overlap with q")
    assert ops.refusal_of(RuntimeError("CUDA error: out of memory")) is None
