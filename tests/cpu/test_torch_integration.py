"""torch.library registration (opcheck), torch.compile(fullgraph=True) through the public
API, backend selection (QSA_BACKEND) and build_info."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import contract, ops, testing


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
    torch.library.opcheck(torch.ops.qsa.sparse_paged_attention.default, case.args())


def test_opcheck_attention_explicit_scale():
    case = testing.make_attention_case("valid_width_32", 1)
    args = case.args()[:-1] + (0.1,)
    torch.library.opcheck(torch.ops.qsa.sparse_paged_attention.default, args)


@pytest.mark.parametrize("layout", ["vllm_bf16_784", "vllm_fp8_784", "vllm_fp8_800_separate"])
def test_opcheck_v2_layouts(layout):
    """The keyword arguments (float8 scales, gate) and vLLM's layouts through opcheck."""
    lay = testing.LAYOUTS[layout]
    # NOTES: opcheck's schema test compares inputs before and after with arithmetic that CPU
    # torch lacks for float8 ("mul_cpu_reduced_float"); float8 cases run the other tests (the
    # bfloat16 layout runs all of them).
    utils = [u for u in torch.library._OPCHECK_DEFAULT_UTILS if lay.cache_dtype is not contract.FP8 or u != "test_schema"]  # fmt: skip
    att = testing.make_attention_case("holes_dups_cross_page", 2, layout=lay)
    torch.library.opcheck(
        torch.ops.qsa.sparse_paged_attention.default, att.args(), att.kwargs(), test_utils=utils
    )
    utils = [u for u in torch.library._OPCHECK_DEFAULT_UTILS if lay.select_dtype is not contract.FP8 or u != "test_schema"]  # fmt: skip
    sel = testing.make_select_case("multi_request", 2, layout=lay)
    torch.library.opcheck(torch.ops.qsa.select_paged_tokens.default, sel.args(), test_utils=utils)


def test_compile_fullgraph_v2_keywords():
    """The keyword arguments trace too (gate, float8 scales), and compute what eager does."""
    torch._dynamo.reset()
    att = testing.make_attention_case("valid_width_32", 2, layout=testing.LAYOUTS["vllm_fp8_784"])
    want = att.new_out()
    qsa_ops.sparse_paged_attention(*att.args()[:7], want, **att.kwargs())

    def f(q, k, v, idx, pt, ttr, out, gate):
        return qsa_ops.sparse_paged_attention(
            q, k, v, idx, pt, ttr, 784, out, k_scale=0.5, v_scale=2.0, gate=gate
        )

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = att.new_out()
    compiled(*att.args()[:6], out, att.gate)
    assert torch.equal(out, want)


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


def test_fake_kernel_refuses_while_tracing():
    """Under torch.compile the fake kernel checks what metadata shows (here a fixed value), so a
    bad call fails at trace time with the contract's message, before any graph runs."""
    torch._dynamo.reset()
    case = testing.make_select_case("short_tail", 1)

    def f(*args):
        torch.ops.qsa.select_paged_tokens(*args)
        return args[-1]

    args = list(case.args())
    args[7] = 8  # compress_ratio
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=re.escape("ValueError('compress_ratio must be 4, got 8')")):
        compiled(*args)
    assert (case.out == testing.POISON_INT32).all()


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
# backend selection: once, at import (each case in a fresh interpreter)
# ----------------------------------------------------------------------------------------


def _run_fresh(code: str, backend: str | None, cwd: Path | None = None) -> str:
    """Run ``code`` in a new interpreter with QSA_BACKEND=backend, importing the package from
    ``cwd`` (default: this checkout); its output (RuntimeError with the last line on failure)."""
    env = {k: v for k, v in os.environ.items() if k not in (ops.ENV_VAR, "PYTHONPATH")}
    if backend is not None:
        env[ops.ENV_VAR] = backend
    env["PYTHONPATH"] = str(cwd or REPO)
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True,
        cwd=str(cwd or REPO), timeout=120,
    )  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(res.stderr.strip().splitlines()[-1])
    return res.stdout + res.stderr


REPO = str(Path(__file__).resolve().parents[2])
CHECK_CPU = """
from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import contract, ops, testing
case = testing.make_attention_case("valid_width_32", 1)
print("backend", ops.BACKEND)
try:
    qsa_ops.sparse_paged_attention(*case.args())
    print("ran", bool(case.out.isfinite().all()))
except RuntimeError as exc:
    print("refused", exc)
"""


def test_default_backend_runs_cpu_tensors_on_the_reference():
    out = _run_fresh(CHECK_CPU, None)
    assert "ran True" in out


@pytest.mark.parametrize("value", ["triton", "CUDA2", "ref"])
def test_bad_backend_value(value):
    with pytest.raises(
        RuntimeError, match=f"QSA_BACKEND must be one of auto, reference, cuda, got '{value}'$"
    ):
        _run_fresh("import custom_esimd_kernels_vllm.qsa_ops", value)


def test_forced_cuda_on_cpu_tensors():
    out = _run_fresh(CHECK_CPU, "cuda")
    assert "refused QSA_BACKEND=cuda needs CUDA tensors, got tensors on cpu" in out


def test_reference_forced_does_not_load_the_library():
    out = _run_fresh(CHECK_CPU, "reference")
    assert "backend reference" in out and "ran True" in out


CHECK_CUDA_KEY = """
import warnings
from custom_esimd_kernels_vllm.qsa_ops import contract, ops, testing
print("backend", ops.BACKEND, "|", ops.LIBRARY_ERROR)
case = testing.make_attention_case("valid_width_32", 1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        for _ in range(2):  # the CUDA key's kernel, called directly (no GPU here)
            ops.CUDA_KERNELS["sparse_paged_attention"](*case.args())
        print("ran", bool(case.out.isfinite().all()))
    except RuntimeError as exc:
        print("refused", exc)
print("warnings", [str(w.message) for w in caught])
"""


def _without_library(tmp_path: Path) -> Path:
    """A copy of the package without the compiled library."""
    pkg = Path(REPO) / "custom_esimd_kernels_vllm"
    shutil.copytree(pkg, tmp_path / pkg.name, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    return tmp_path


def test_missing_library_auto_warns_once_and_runs_the_reference(tmp_path):
    out = _run_fresh(CHECK_CUDA_KEY, "auto", cwd=_without_library(tmp_path))
    assert "backend reference | _C.so not built" in out and "ran True" in out
    warned = [ln for ln in out.splitlines() if ln.startswith("warnings")]
    assert warned == [
        f"warnings ['{ops.FALLBACK_WARNING} (_C.so not built (no _C.so next to the package))']"
    ]


def test_missing_library_forced_cuda_refuses(tmp_path):
    out = _run_fresh(CHECK_CUDA_KEY, "cuda", cwd=_without_library(tmp_path))
    assert "backend none" in out
    assert "refused QSA_BACKEND=cuda but the CUDA kernels cannot run: _C.so not built" in out


def test_build_info():
    info = qsa_ops.build_info()
    assert info["contract"]["WIDTH"] == 2051
    assert info["backend_env"] in ops.CHOICES
    assert set(info) >= {"version", "torch", "cuda_backend", "library_error", "library"}
    text = qsa_ops.summary()
    assert "CPU tensors:  PyTorch reference" in text and "CUDA tensors:" in text
