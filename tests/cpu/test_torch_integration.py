"""torch.library registration (opcheck), torch.compile(fullgraph=True) through the public
API, backend selection (QSA_BACKEND) and build_info."""

from __future__ import annotations

import warnings

import pytest
import torch

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import dispatch, testing


@pytest.mark.parametrize("name", ["multi_request", "empty"])
def test_opcheck_select(name):
    case = testing.make_select_case(name, 2)
    torch.library.opcheck(torch.ops.qsa.select_paged_tokens.default, case.args())


def test_opcheck_select_zero_rows():
    case = testing.random_select_case(0, 2, 2, 2, seed=1)
    torch.library.opcheck(torch.ops.qsa.select_paged_tokens.default, case.args())


@pytest.mark.parametrize("name", ["holes_dups_cross_page", "empty"])
def test_opcheck_attention(name):
    case = testing.make_attention_case(name, 2)
    torch.library.opcheck(torch.ops.qsa.sparse_paged_attention.default, case.op_args())


def test_opcheck_attention_explicit_scale():
    case = testing.make_attention_case("valid_width_32", 1)
    args = case.op_args()[:-1] + (0.1,)
    torch.library.opcheck(torch.ops.qsa.sparse_paged_attention.default, args)


def _qsa_layer(sel: testing.SelectCase, att: testing.AttentionCase, indices_out, attn_out):
    """What a model layer does: select, then attend over the selection."""
    qsa_ops.select_paged_tokens(*sel.args()[:-1], indices_out)
    qsa_ops.sparse_paged_attention(
        att.q, att.k_cache, att.v_cache, indices_out, att.page_table, att.token_to_req,
        qsa_ops.KV_PAGE, attn_out,
    )  # fmt: skip
    return attn_out * 2


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_through_public_api(backend):
    """The public functions trace without graph breaks (the custom ops are opaque, their
    fake kernels declare the mutation) and the compiled graph computes what eager does.
    inductor is the default torch.compile backend (it compiles a small C++ kernel here)."""
    torch._dynamo.reset()
    sel = testing.make_select_case("multi_request", 2, integer=False)
    att = testing.random_attention_case(2, 3, 5, 12, seed=4, bad_values=False)
    att.page_table.copy_(sel.page_table.clamp_min(0))
    att.token_to_req.copy_(sel.token_to_req)

    def fresh():
        return sel.new_out(), att.new_out()

    idx_eager, out_eager = fresh()
    want = _qsa_layer(sel, att, idx_eager, out_eager)
    compiled = torch.compile(_qsa_layer, fullgraph=True, backend=backend)
    idx, out = fresh()
    got = compiled(sel, att, idx, out)
    assert torch.equal(idx, idx_eager)
    assert torch.equal(out, out_eager) and torch.equal(got, want)


def test_compiled_graph_validates_when_it_runs():
    """Fake kernels do not validate; the op body does, when the compiled graph runs."""
    torch._dynamo.reset()
    case = testing.make_select_case("short_tail", 1)

    def f(*args):
        torch.ops.qsa.select_paged_tokens(*args)
        return args[-1]

    args = list(case.args())
    args[7] = 8  # compress_ratio
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match="^compress_ratio must be 4, got 8$"):
        compiled(*args)


def test_compiled_graph_with_overlapping_out_reads_inputs_first():
    """Under torch.compile the op is functionalized: it writes a fresh buffer that is then
    copied into `out`, so an `out` overlapping an input cannot race with the kernel's
    reads (the eager path refuses it)."""
    torch._dynamo.reset()
    att = testing.make_attention_case("valid_width_32", 1)
    want = att.new_out()
    qsa_ops.sparse_paged_attention(*att.args()[:7], want)

    def f(q, k, v, idx, pt, ttr, out):
        return qsa_ops.sparse_paged_attention(q, k, v, idx, pt, ttr, 512, out)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    # `out` takes the last 768 elements of the buffer: V of slot 510 and K/V of slot 511 of
    # the last physical page, which this case does not read
    logical_page = att.page_table[0].tolist().index(att.k_cache.shape[0] - 1)
    assert not (
        (att.logical_indices // 512 == logical_page) & (att.logical_indices % 512 >= 510)
    ).any()
    out = att.kv[-att.out.numel() :].view(att.out.shape)
    args = (att.q, att.k_cache, att.v_cache, att.logical_indices, att.page_table, att.token_to_req)
    with pytest.raises(ValueError, match="out must not overlap any input"):
        f(*args, out)  # eager: refused
    compiled(*args, out)
    assert torch.equal(out, want)


# ----------------------------------------------------------------------------------------
# backend selection
# ----------------------------------------------------------------------------------------


def test_backends_on_cpu(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.available_backends("cpu") == ["reference"]
    assert dispatch.requested_backend() == "auto"
    assert dispatch.resolve_backend(torch.device("cpu")) == "reference"


@pytest.mark.parametrize("value", ["triton", "CUDA2", "ref"])
def test_bad_backend_value(monkeypatch, value):
    monkeypatch.setenv(dispatch.ENV_VAR, value)
    case = testing.make_select_case("short_tail", 1)
    with pytest.raises(
        ValueError, match=f"^QSA_BACKEND must be one of auto, reference, cuda, got '{value}'$"
    ):
        qsa_ops.select_paged_tokens(*case.args())


def test_forced_cuda_on_cpu_tensors(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    case = testing.make_attention_case("valid_width_32", 1)
    with pytest.raises(
        RuntimeError, match="^QSA_BACKEND=cuda needs CUDA tensors, got tensors on cpu$"
    ):
        qsa_ops.sparse_paged_attention(*case.args())


def test_forced_cuda_without_kernels(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    monkeypatch.setattr(dispatch, "cuda_status", lambda: (False, "not built"))
    with pytest.raises(
        RuntimeError, match="^QSA_BACKEND=cuda but the CUDA kernels cannot run: not built$"
    ):
        dispatch.resolve_backend(torch.device("cuda", 0))


def test_auto_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "auto")
    monkeypatch.setattr(dispatch, "cuda_status", lambda: (False, "not built"))
    dispatch._warn_fallback_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert dispatch.resolve_backend(torch.device("cuda", 0)) == "reference"
        assert dispatch.resolve_backend(torch.device("cuda", 0)) == "reference"
        assert dispatch.resolve_backend(torch.device("cpu")) == "reference"
    messages = [str(w.message) for w in caught]
    assert messages == [f"{dispatch.FALLBACK_WARNING} (not built)"]


def test_reference_forced(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    assert dispatch.resolve_backend(torch.device("cuda", 0)) == "reference"


def test_build_info():
    info = qsa_ops.build_info()
    assert info["contract"]["WIDTH"] == 2051
    assert info["backend_env"] in dispatch.CHOICES
    assert set(info) >= {"version", "torch", "cuda_available", "cuda_reason", "cuda_build"}
