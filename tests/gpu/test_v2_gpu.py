"""Contract v2 on the CUDA kernels: every layout of testing.LAYOUTS (bfloat16, float8 K/V with
scales and the float8 indexer, vLLM's page sizes with page strides spanning other layers,
separate K and V, strided index and page-table rows, the output gate) through both ops, on
the paths the shapes pick (decode-size and cluster attention; pairs, last-CTA, streamed and
generic selection), against the float64 checkers; CUDA-graph replay, opcheck and
torch.compile on v2 layouts."""

from __future__ import annotations

import inspect

import pytest
import torch
from gpu_helpers import DEVICE, ODD_KEYS, assert_fully_written, row_subset

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import testing

pytestmark = pytest.mark.gpu

LAYOUT_NAMES = tuple(testing.LAYOUTS)


def _attention(case: testing.AttentionCase) -> torch.Tensor:
    before = testing.snapshot(case)
    assert case.out.isnan().all()
    result = qsa_ops.sparse_paged_attention(*case.args(), **case.kwargs())
    assert result is case.out
    assert_fully_written(case.out, repr(case))
    testing.assert_inputs_unchanged(case, before)
    return case.out


def _select(case: testing.SelectCase) -> torch.Tensor:
    before = testing.snapshot(case)
    result = qsa_ops.select_paged_tokens(*case.args())
    assert result is case.out
    assert_fully_written(case.out, repr(case))
    testing.assert_inputs_unchanged(case, before)
    if case.out_base is not None and case.out_base.shape[1] > case.out.shape[1]:
        pad = case.out_base[:, case.out.shape[1] :]
        assert (pad == testing.POISON_INT32).all(), f"{case!r}: columns past 2051 written"
    return case.out


def _check_rows(case: testing.AttentionCase, out: torch.Tensor, limit: int = 12) -> None:
    rows = case.q.shape[0]
    picked = sorted({int(i) for i in torch.linspace(0, rows - 1, min(rows, limit)).round()})
    sub = row_subset(case, picked)
    if sub.gate is not None:
        import dataclasses

        sub = dataclasses.replace(
            sub, gate=case.gate.index_select(0, torch.as_tensor(picked, device=DEVICE))
        )
    testing.check_attention(sub, out.index_select(0, torch.as_tensor(picked, device=DEVICE)))


# R = 1, 2: 65 CTAs per row; 5: 33 per row (decode-size kernel); 9: clusters of 8; 40: deep
# cluster kernel; 160: one CTA per row, two per SM.
@pytest.mark.parametrize("R", [1, 2, 5, 9, 40, 160])
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_attention_layouts(cuda_backend, layout, R):
    lay = testing.LAYOUTS[layout]
    for name in testing.ATTENTION_CASES:
        case = testing.make_attention_case(name, R, DEVICE, seed=R + 7, layout=lay)
        _check_rows(case, _attention(case))


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_attention_random_layouts(cuda_backend, layout):
    """Holes, duplicates, bad page-table entries and bad requests in every layout."""
    lay = testing.LAYOUTS[layout]
    for R, seed in ((3, 1), (20, 2)):
        case = testing.random_attention_case(R, 3, 6, 9, device=DEVICE, seed=seed, layout=lay)
        _check_rows(case, _attention(case))


@pytest.mark.parametrize("R", [1, 3, 64])
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_select_layouts(cuda_backend, layout, R):
    lay = testing.LAYOUTS[layout]
    for name in testing.SELECT_CASES:
        case = testing.make_select_case(name, R, DEVICE, seed=R, integer=True, layout=lay)
        testing.check_selection(case, _select(case), exact=True)


@pytest.mark.parametrize("R", [1, 3, 64, 300])
@pytest.mark.parametrize("layout", sorted(ODD_KEYS))
def test_select_odd_keys_per_page(cuda_backend, layout, R):
    for name in testing.SELECT_CASES:
        case = testing.make_select_case(
            name, R, DEVICE, seed=R, integer=True, layout=ODD_KEYS[layout]
        )
        testing.check_selection(case, _select(case), exact=True)
    torch.cuda.synchronize()


@pytest.mark.parametrize("R", [5, 40])
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_select_generic_path(cuda_backend, layout, R, monkeypatch):
    """The generic (radix) select on every layout, in a short batch and in one of enough rows
    for a float8 batch to be split: the same bits as the fast paths."""
    lay = testing.LAYOUTS[layout]
    case = testing.make_select_case("exact_ties", R, DEVICE, seed=3, integer=True, layout=lay)
    fast = _select(case).clone()
    monkeypatch.setenv("QSA_SELECT_PATH", "generic")
    case.out = case.new_out()
    generic = _select(case)
    assert torch.equal(fast, generic), f"{case!r}: generic path differs"
    testing.check_selection(case, generic, exact=True)


def _replay_identical(call, out, times=20):
    call()
    torch.cuda.synchronize()
    want = out.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        call()
    for _ in range(times):
        out.fill_(float("nan") if out.is_floating_point() else testing.POISON_INT32)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(
            out.view(torch.int16) if out.is_floating_point() else out,
            want.view(torch.int16) if want.is_floating_point() else want,
        )


@pytest.mark.parametrize("R", [1, 8, 64])
@pytest.mark.parametrize("layout", ["vllm_fp8_784", "vllm_bf16_1568_separate"])
def test_graph_replay_layouts(cuda_backend, layout, R):
    lay = testing.LAYOUTS[layout]
    att = testing.make_attention_case("full_width_2051", R, DEVICE, seed=5, layout=lay)
    _replay_identical(lambda: qsa_ops.sparse_paged_attention(*att.args(), **att.kwargs()), att.out)
    sel = testing.make_select_case(
        testing.SELECT_CASES[0], R, DEVICE, seed=5, integer=True, layout=lay
    )
    _replay_identical(lambda: qsa_ops.select_paged_tokens(*sel.args()), sel.out)


# opcheck's default tests (torch's own list)
OPCHECK_UTILS = inspect.signature(torch.library.opcheck).parameters["test_utils"].default


@pytest.mark.parametrize("layout", ["bf16_gate", "vllm_fp8_784"])
def test_opcheck_layouts(cuda_backend, layout):
    lay = testing.LAYOUTS[layout]
    # opcheck's test_schema compares tensors with arithmetic that float8 lacks ("mul_cuda" not
    # implemented for Float8_e4m3fn): with float8 inputs the schema's promise (only `out` is
    # written) is checked by the inputs' snapshot instead, and opcheck runs its other tests.
    fp8 = testing.FP8 in (lay.cache_dtype, lay.select_dtype)
    utils = tuple(u for u in OPCHECK_UTILS if not (fp8 and u == "test_schema"))
    att = testing.make_attention_case("full_width_2051", 2, DEVICE, seed=1, layout=lay)
    sel = testing.make_select_case(
        testing.SELECT_CASES[0], 2, DEVICE, seed=1, integer=True, layout=lay
    )
    for op, case, kwargs in (
        (torch.ops.qsa.sparse_paged_attention.default, att, att.kwargs()),
        (torch.ops.qsa.select_paged_tokens.default, sel, {}),
    ):
        before = testing.snapshot(case)
        torch.library.opcheck(op, case.args(), kwargs, test_utils=utils)
        testing.assert_inputs_unchanged(case, before)


def test_compile_fullgraph_layout(cuda_backend):
    lay = testing.LAYOUTS["vllm_fp8_784"]
    att = testing.make_attention_case("full_width_2051", 3, DEVICE, seed=2, layout=lay)
    eager = _attention(att).clone()

    @torch.compile(fullgraph=True)
    def f(q, k, v, idx, table, t2r, out, gate):
        return qsa_ops.sparse_paged_attention(
            q,
            k,
            v,
            idx,
            table,
            t2r,
            att.page_size,
            out,
            None,
            k_scale=att.k_scale,
            v_scale=att.v_scale,
            gate=gate,
        )

    att.out.fill_(float("nan"))
    out = f(
        att.q,
        att.k_cache,
        att.v_cache,
        att.logical_indices,
        att.page_table,
        att.token_to_req,
        att.out,
        att.gate,
    )
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
