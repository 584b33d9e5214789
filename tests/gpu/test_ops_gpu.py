"""The op layer on CUDA tensors: the C++ validation refuses exactly as contract.py does on CPU
tensors (class and message), writes nothing when it refuses, never crashes on generated bad
input, and the operators pass torch.library.opcheck."""

from __future__ import annotations

import re

import pytest
import torch
from gpu_helpers import DEVICE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import contract, ops, testing

pytestmark = pytest.mark.gpu
OPS = tuple(ops.SCHEMAS)
_ADDRESS = re.compile(r"0x[0-9a-f]+")


def _public_case(op: str, device: str):
    if op == "select_paged_tokens":
        return testing.make_select_case("multi_request", 2, device, seed=3)
    return testing.make_attention_case("holes_dups_cross_page", 2, device, seed=3)


def _shapes(op: str) -> dict[str, tuple]:
    spec = contract._SELECT if op == "select_paged_tokens" else contract._ATTENTION
    return {a.name: a.shape for a in spec.args}


OUTPUTS = ("out",)  # what each operator writes


def _written(op: str, args) -> list:
    names = ops.public_arguments(op)
    return [args[names.index(o)] for o in OUTPUTS]


def _snapshot(tensors) -> list:
    return [
        t.clone() if isinstance(t, torch.Tensor) and t.device.type != "meta" else None
        for t in tensors
    ]


def _unchanged(tensors, before) -> bool:
    return all(
        b is None or torch.equal(t.nan_to_num(7), b.nan_to_num(7))
        for t, b in zip(tensors, before, strict=True)
    )


def _outcome(op: str, args) -> tuple[str, str] | None:
    """(class, message with addresses and device names normalised) of a refusal, or None."""
    kw = ops.keyword_only(op)
    n = len(args) - len(kw)
    try:
        getattr(qsa_ops, op)(*args[:n], **dict(zip(kw, args[n:], strict=True)))
    except (TypeError, ValueError) as exc:
        message = _ADDRESS.sub("0x?", str(exc)).replace("cuda:0", "DEV").replace("cpu", "DEV")
        return type(exc).__name__, message
    return None


def _mutations(op: str, device: str):
    case = _public_case(op, device)
    args = list(case.args())
    if op == "sparse_paged_attention":
        args += [case.kwargs()[k] for k in ops.keyword_only(op)]
    names = ops.public_arguments(op)
    changes = testing.refusal_mutations(args, names, _shapes(op), OUTPUTS)
    changes += testing.contract_v2_mutations(args, names)
    if op == "sparse_paged_attention":
        k, v = names.index("k_cache"), names.index("v_cache")
        changes.append(("v_cache: offset 0", v, args[k]))
        changes.append(("v_cache: own storage", v, args[v].clone()))
        changes.append(("k_cache: contiguous copy", k, args[k].contiguous()))
        changes.append(("softmax_scale: nan", names.index("softmax_scale"), float("nan")))
        changes.append(("softmax_scale: 0", names.index("softmax_scale"), 0))
        changes.append(("page_size: 256", names.index("page_size"), 256))
    else:
        changes.append(("token_topk: 1024", names.index("token_topk"), 1024))
        changes.append(("compress_ratio: True", names.index("compress_ratio"), True))
    return case, args, changes


def _labels(op: str) -> list[str]:
    # labels only (built on the CPU at collection time; the tensors are rebuilt per test)
    return [label for label, _, _ in _mutations(op, "cpu")[2] if "meta" not in label]


@pytest.mark.parametrize("op, label", [(op, label) for op in OPS for label in _labels(op)])
def test_cuda_refusal_matches_cpu(cuda_backend, op, label):
    results = []
    for device in ("cpu", DEVICE):
        case, args, changes = _mutations(op, device)
        ((_, index, value),) = [c for c in changes if c[0] == label]
        bad = testing.apply_mutation(args, index, value)
        written = _written(op, bad)
        before = _snapshot(written)
        results.append(_outcome(op, bad))
        if results[-1] is not None:
            assert _unchanged(written, before), "out written on refusal"
    assert results[1] == results[0], f"{op} / {label}"  # both None: a free size, still valid


@pytest.mark.parametrize("op", OPS)
@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_generated_bad_input_is_refused_cleanly(cuda_backend, op, data):
    """Several arguments wrong at once (wrong device included): always a TypeError/ValueError,
    the same as on CPU tensors, and out untouched; never a crash or a CUDA error."""
    case, args, changes = _mutations(op, DEVICE)
    picked = data.draw(st.lists(st.sampled_from(changes), min_size=1, max_size=3))
    bad = list(args)
    for _, index, value in picked:
        bad = testing.apply_mutation(bad, index, value)
    written = _written(op, bad)
    before = _snapshot(written)
    result = _outcome(op, bad)
    if result is None:  # every picked change kept the call valid (e.g. a free size)
        return
    torch.cuda.synchronize()
    assert _unchanged(written, before), "out written on refusal"


def test_opcheck_select_cuda(cuda_backend):
    case = testing.make_select_case("multi_request", 2, DEVICE)
    torch.library.opcheck(torch.ops.qsa.select_paged_tokens.default, case.args())


@pytest.mark.parametrize("scale", [None, 0.1])
def test_opcheck_attention_cuda(cuda_backend, scale):
    case = testing.make_attention_case("holes_dups_cross_page", 2, DEVICE)
    args = case.args()[:-1] + (scale,)
    torch.library.opcheck(torch.ops.qsa.sparse_paged_attention.default, args, case.kwargs())


def test_library_reports_its_build(cuda_backend):
    info = ops.library_info()
    assert info["arch"] == "sm_90a" and info["torch_target_version"] == "0x20b000000000000"
    assert qsa_ops.build_info()["cuda_backend"] == "cuda"


@pytest.mark.parametrize("op", OPS)
def test_mixed_devices_refused_with_the_contract_message(cuda_backend, op):
    names = ops.public_arguments(op)
    first = names[0]
    for i, name in enumerate(names):
        case = _public_case(op, DEVICE)
        args = list(case.args())
        if i >= len(args) or not isinstance(args[i], torch.Tensor) or name in (first, "v_cache"):
            continue
        if name == "k_cache":  # the pair moves together (the buffer the operator takes)
            args[i], args[i + 1] = testing.packed_kv(args[i].shape[0], "cpu")[1:]
        else:
            args[i] = args[i].cpu()
        with pytest.raises(ValueError, match=f"^{name} must be on the same device as {first} "
                           r"\(cuda:0\), got cpu$"):  # fmt: skip
            getattr(qsa_ops, op)(*args)
