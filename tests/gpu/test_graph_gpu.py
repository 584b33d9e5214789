"""CUDA graphs, torch.compile and the launch profile of the CUDA kernels."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import DEVICE, reference_select
from torch.profiler import ProfilerActivity, profile

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import ops, testing

pytestmark = pytest.mark.gpu
REPLAYS = 100


def _select_case():
    return testing.make_select_case("p8192_saturated", 2, DEVICE, seed=21)


def _attention_case(R):
    return testing.random_attention_case(R, 3, 8, 16, device=DEVICE, seed=R, valid_fraction=0.8)


def _replay_identical(call, out, expected, stream=None):
    """Capture ``call`` (writing ``out``), replay REPLAYS times from a poisoned ``out``."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        call()
    for i in range(REPLAYS):
        testing.poison_(out)
        graph.replay()
        if i % 10 == 9 or i == 0:
            torch.cuda.synchronize()
            assert torch.equal(out, expected), f"replay {i} differs from the eager result"
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("warm", [True, False])
def test_graph_select(cuda_backend, warm):
    """warm=False captures on a fresh stream whose workspace does not exist yet (the
    capture-time allocation path)."""
    case = _select_case()
    expected = reference_select(case)
    stream = torch.cuda.Stream()
    if warm:
        with torch.cuda.stream(stream):
            qsa_ops.select_paged_tokens(*case.args())
        torch.cuda.synchronize()
        assert torch.equal(case.out, expected)
    _replay_identical(lambda: qsa_ops.select_paged_tokens(*case.args()), case.out, expected, stream)


@pytest.mark.parametrize("warm", [True, False])
@pytest.mark.parametrize("R", [1, 300])
def test_graph_attention(cuda_backend, R, warm):
    """R=1 runs split rows (last-CTA merge with counters), R=300 one CTA per row."""
    case = _attention_case(R)
    qsa_ops.sparse_paged_attention(*case.args())
    torch.cuda.synchronize()
    expected = case.out.clone()
    testing.check_attention(case, expected)
    stream = torch.cuda.Stream()
    if warm:
        with torch.cuda.stream(stream):
            qsa_ops.sparse_paged_attention(*case.args())
        torch.cuda.synchronize()
        assert torch.equal(case.out, expected)
    _replay_identical(
        lambda: qsa_ops.sparse_paged_attention(*case.args()), case.out, expected, stream
    )


def test_torch_compile_fullgraph(cuda_backend):
    sel = _select_case()
    att = _attention_case(2)

    def both(sel_args, att_args):
        qsa_ops.select_paged_tokens(*sel_args)
        qsa_ops.sparse_paged_attention(*att_args)
        return sel_args[-1], att_args[7]

    compiled = torch.compile(both, fullgraph=True)
    s_out, a_out = compiled(sel.args(), att.args())
    torch.cuda.synchronize()
    assert torch.equal(s_out, reference_select(sel))
    testing.check_attention(att, a_out)


def _kernel_events(fn):
    fn()  # warm-up: workspace allocation happens here, not under the profiler
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [
        e.name for e in events if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()
    ]
    copies = [
        e.name
        for e in prof.events()
        if "memcpy" in e.name.lower() and "dtoh" in e.name.lower().replace(" ", "")
    ]
    return kernels, copies


@pytest.mark.parametrize(
    "R, context", [(1, 9215), (1, 131072), (64, 32768), (2048, 8192), (600, 131072)]
)
def test_profile_select(cuda_backend, R, context):
    case = testing.scale_select_case(context, R, DEVICE, seed=1)
    kernels, copies = _kernel_events(lambda: qsa_ops.select_paged_tokens(*case.args()))
    expected = ops.launch_counts(R, case.page_table.shape[1])["select_paged_tokens"]
    assert len(kernels) == expected, f"{len(kernels)} kernels, stated {expected}: {kernels}"
    assert all("qsa" in k for k in kernels), kernels
    assert not copies, f"device-to-host copies: {copies}"


@pytest.mark.parametrize("R", [1, 64, 256])
def test_profile_attention(cuda_backend, R):
    case = _attention_case(R)
    kernels, copies = _kernel_events(lambda: qsa_ops.sparse_paged_attention(*case.args()))
    assert len(kernels) == ops.launch_counts(R, 8)["sparse_paged_attention"] == 1, kernels
    assert "qsa" in kernels[0] and "attention" in kernels[0], kernels
    assert not copies, f"device-to-host copies: {copies}"


@pytest.mark.parametrize("op", ["select", "attention"])
def test_graph_unwarmed_stream_one_fill(cuda_backend, op):
    """A capture on a stream that never ran the ops shares one set of temporaries among its
    calls: the graph replays one zero fill of the counters, not one per call."""
    calls = 4
    if op == "select":
        case = _select_case()
        expected = reference_select(case)

        def call():
            qsa_ops.select_paged_tokens(*case.args())
    else:
        case = _attention_case(1)
        qsa_ops.sparse_paged_attention(*case.args())
        torch.cuda.synchronize()
        expected = case.out.clone()

        def call():
            qsa_ops.sparse_paged_attention(*case.args())

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        for _ in range(calls):
            call()
    graph.replay()
    torch.cuda.synchronize()
    testing.poison_(case.out)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(case.out, expected)
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ours = [n for n in names if "qsa" in n]
    others = [n for n in names if "qsa" not in n]
    assert len(ours) == calls, names
    assert len(others) <= 1, f"more than one fill per replay: {others}"
