"""CUDA graphs, torch.compile and the launch profile of the CUDA kernels."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch
from gpu_helpers import DEVICE, distributed_row_case, reference_select
from torch.profiler import ProfilerActivity, profile

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import ops, testing

pytestmark = pytest.mark.gpu
REPLAYS = 100


def _select_case(R):
    return testing.make_select_case("p8192_saturated", R, DEVICE, seed=21)


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
@pytest.mark.parametrize("R", [1, 2])
def test_graph_select(cuda_backend, R, warm):
    """R=1 takes the pairs select (its row counter an epoch counter), R=2 the last-CTA select.
    warm=False captures on a fresh stream whose workspace does not exist yet (the
    capture-time allocation path)."""
    case = _select_case(R)
    expected = reference_select(case)
    stream = torch.cuda.Stream()
    if warm:
        with torch.cuda.stream(stream):
            qsa_ops.select_paged_tokens(*case.args())
        torch.cuda.synchronize()
        assert torch.equal(case.out, expected)
    _replay_identical(lambda: qsa_ops.select_paged_tokens(*case.args()), case.out, expected, stream)


def test_graph_select_distributed(cuda_backend):
    """The distributed select (every CTA of one 336-page row selects, its row state in the
    workspace and the counters) replayed bit for bit."""
    case = distributed_row_case()
    expected = reference_select(case)
    _replay_identical(lambda: qsa_ops.select_paged_tokens(*case.args()), case.out, expected)


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
    sel = _select_case(2)
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


@pytest.mark.parametrize("R", [8, 64, 256])
@pytest.mark.parametrize("layout", ["vllm_bf16_784", "vllm_fp8_784", "fp8_kv"])
def test_profile_select_layouts(cuda_backend, layout, R):
    """The launches the library states for the case's dtype and page size (one per row
    group), none copying to the host."""
    lay = testing.LAYOUTS[layout]
    case = testing.make_select_case("p8192_saturated", R, DEVICE, seed=R, layout=lay)
    kernels, copies = _kernel_events(lambda: qsa_ops.select_paged_tokens(*case.args()))
    c, width = case.compressed_key_cache.shape[1], case.page_table.shape[1]
    expected = ops.launch_counts(R, width, c, lay.select_dtype)["select_paged_tokens"]
    assert len(kernels) == expected, f"{len(kernels)} kernels, stated {expected}: {kernels}"
    assert all("qsa" in k for k in kernels), kernels
    assert not copies, f"device-to-host copies: {copies}"
    testing.check_selection(case, case.out)


def test_launch_counts_refuse_other_dtypes(cuda_backend):
    with pytest.raises(ValueError, match="index_dtype must be .* got torch.float32"):
        ops.launch_counts(8, 16, 128, torch.float32)


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
        case = _select_case(2)
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


PDL_ENV = "QSA_PDL"  # programmatic dependent launch of the three ops' kernels: on unless "0"


def _layer_chain():
    """One layer's chain: a selection, an attention over its output (the same table and
    requests, a K/V pool of the selection's pages), and a second selection from other queries
    into the same index buffer."""
    sel = testing.random_select_case(
        8, 3, 16, 40, device=DEVICE, seed=31, integer=False, bad_values=False
    )
    gen = torch.Generator().manual_seed(32)
    q2 = torch.randn(sel.q.shape, generator=gen).to(torch.float16).to(DEVICE)
    q = torch.randn(8, 3, 256, generator=gen).to(torch.float16).to(DEVICE)
    pages = sel.compressed_key_cache.shape[0]
    buffer, k_cache, v_cache = testing.packed_kv(pages, DEVICE)
    buffer.copy_(torch.randn(buffer.numel(), generator=gen).to(torch.float16))
    att_out = testing.poison_(torch.empty(8, 3, 256, dtype=torch.float16, device=DEVICE))
    args = list(sel.args())

    def layer():
        qsa_ops.select_paged_tokens(*args)
        qsa_ops.sparse_paged_attention(
            q, k_cache, v_cache, sel.out, sel.page_table, sel.token_to_req, 512, att_out
        )
        qsa_ops.select_paged_tokens(q2, *args[1:])

    return layer, sel.out, att_out


def test_pdl_chain_in_a_graph(cuda_backend, monkeypatch):
    """With programmatic dependent launch (the default) a kernel may start before the one
    before it ends; it must still wait for it: the attention reads this replay's indices
    (poisoned before each replay), and the second selection does not overwrite them before
    the attention has read them. The results equal those of the same chain run eagerly
    without it, bit for bit."""
    layer, idx, att_out = _layer_chain()
    monkeypatch.setenv(PDL_ENV, "0")
    layer()
    torch.cuda.synchronize()
    expected_idx, expected_att = idx.clone(), att_out.clone()
    assert not (expected_idx == testing.POISON_INT32).any()
    assert not expected_att.isnan().any()
    monkeypatch.delenv(PDL_ENV)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        layer()  # warm: the stream's workspace
    torch.cuda.synchronize()
    assert torch.equal(idx, expected_idx) and torch.equal(att_out, expected_att)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        layer()
    for i in range(REPLAYS):
        testing.poison_(idx)
        testing.poison_(att_out)
        graph.replay()
        if i % 10 == 9 or i == 0:
            torch.cuda.synchronize()
            assert torch.equal(att_out, expected_att), f"replay {i}: attention differs"
            assert torch.equal(idx, expected_idx), f"replay {i}: selection differs"


# SASS opcodes that read or write global memory (directly, generic or bulk).
_GLOBAL_ACCESS = {"LDG", "STG", "ATOMG", "ATOM", "RED", "REDG", "LD", "ST", "LDGSTS", "UBLKCP",
                  "UBLKRED", "UTMALDG", "UTMASTG", "UTMAREDG"}  # fmt: skip
_SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)")


def test_pdl_wait_precedes_every_global_access():
    """Every kernel of the library executes griddepcontrol.wait (SASS: ACQBULK) before its
    first global load or store, in the compiled code and not only in the source: ptxas may
    move a read-only (ld.global.nc) load above the wait, and under programmatic dependent
    launch that load could read what the kernel before is still writing (the streamed
    select kernels loaded token_to_req ahead of it). Reads the library's SASS with cuobjdump
    (the CUDA toolkit's)."""
    tool = shutil.which("cuobjdump")
    if tool is None:
        pytest.skip("cuobjdump (CUDA toolkit) is not on PATH")
    sass = subprocess.run(
        [tool, "-sass", str(ops.LIBRARY_PATH)], check=True, capture_output=True, text=True
    ).stdout
    kernels: dict[str, list[tuple[str, str]]] = {}  # name -> [(opcode, instruction)]
    name = None
    for line in sass.splitlines():
        if "Function : " in line:
            name = line.split("Function : ", 1)[1].strip()
            kernels[name] = []
        elif name is not None and (m := _SASS_LINE.search(line)):
            kernels[name].append((m.group(1), line.split("*/", 1)[1].strip()))
    ours = {k: v for k, v in kernels.items() if k.startswith("_ZN3qsa")}
    assert len(ours) >= 3, f"found {len(ours)} qsa kernels in {ops.LIBRARY_PATH}"
    bad = {}
    for kernel, instructions in ours.items():
        opcodes = [op for op, _ in instructions]
        if "ACQBULK" not in opcodes:
            bad[kernel] = "no griddepcontrol.wait (ACQBULK)"
            continue
        wait = opcodes.index("ACQBULK")
        early = [text for op, text in instructions[:wait] if op in _GLOBAL_ACCESS]
        if early:
            bad[kernel] = f"global access before the wait: {early}"
    assert not bad, "\n".join(f"{k}: {v}" for k, v in bad.items())


def _pdl_case(op):
    """(call, case, outputs) of one op on a small case."""
    if op == "select":
        case = _select_case(2)
        return qsa_ops.select_paged_tokens, case, (case.out,)
    case = _attention_case(2)
    return qsa_ops.sparse_paged_attention, case, (case.out,)


@pytest.mark.parametrize("op", ["select", "attention"])
def test_pdl_knob_refuses_unknown_values(cuda_backend, monkeypatch, op):
    call, case, outputs = _pdl_case(op)
    before = [t.clone() for t in outputs]
    monkeypatch.setenv(PDL_ENV, "on")
    with pytest.raises(RuntimeError, match="QSA_PDL must be '0' or '1', got 'on'"):
        call(*case.args())
    torch.cuda.synchronize()
    for t, b in zip(outputs, before, strict=True):
        assert torch.equal(t.nan_to_num(7.0), b.nan_to_num(7.0)), "written before the refusal"


@pytest.mark.parametrize("op", ["select", "attention"])
def test_pdl_off_and_on_agree(cuda_backend, monkeypatch, op):
    """The same call with QSA_PDL=0 and with the default: the same bits."""
    call, case, outputs = _pdl_case(op)
    fresh = [t.clone() for t in outputs]
    monkeypatch.setenv(PDL_ENV, "0")
    call(*case.args())
    torch.cuda.synchronize()
    off = [t.clone() for t in outputs]
    for t, f in zip(outputs, fresh, strict=True):
        t.copy_(f)
    monkeypatch.delenv(PDL_ENV)
    call(*case.args())
    torch.cuda.synchronize()
    for t, o in zip(outputs, off, strict=True):
        assert torch.equal(t.nan_to_num(7.0), o.nan_to_num(7.0))
