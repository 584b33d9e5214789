"""Implementation wiring: the compiled reference's row chunks, the run order, the checks."""

from __future__ import annotations

import pytest
import torch

from custom_esimd_kernels_vllm.bench import cases, cli, impls
from custom_esimd_kernels_vllm.bench.report import format_error, strip_paths
from custom_esimd_kernels_vllm.bench.run import check as _check
from custom_esimd_kernels_vllm.qsa_ops import reference


def test_rows_per_chunk_is_a_power_of_two_within_budget():
    att = {"page_table": torch.zeros(1, 1)}
    assert impls.rows_per_chunk("attention", att) == 8  # 2**24 / (3 * 2051 * 256) = 10.6
    sel_32k = {"page_table": torch.zeros(1, 64)}
    assert impls.rows_per_chunk("selection", sel_32k) == 4  # 2**24 / (4 * 128 * 8192)
    sel_128k = {"page_table": torch.zeros(1, 256)}
    assert impls.rows_per_chunk("selection", sel_128k) == 1


@pytest.mark.parametrize("op", ["attention", "selection"])
def test_compiled_call_row_chunks_equal_whole_call(op, monkeypatch):
    # the chunking wrapper, with the eager reference standing in for the compiled one
    fn = (
        reference.sparse_paged_attention_ref
        if op == "attention"
        else reference.select_paged_tokens_ref
    )
    monkeypatch.setitem(impls._COMPILED, op, fn)
    monkeypatch.setattr(impls, "CHUNK_ELEMENTS", 1)  # one row per chunk
    t = cases.build(cases.CaseSpec(op, "quick", "x", 5, 4096), "cpu").tensors
    whole = dict(t, out=torch.empty_like(t["out"]))
    impls.make("ref-vectorised", op).call(whole)
    chunked = dict(t, out=torch.full_like(t["out"], -7))
    impls.make("ref-compiled", op).call(chunked)
    assert torch.equal(chunked["out"], whole["out"])


def test_execution_order_seeds_validation_dtypes_rest():
    grid = cases.grid("default")
    order = cli.execution_order(grid)
    rank = [cli.execution_rank(c) for c in order]
    assert rank == sorted(rank)
    assert all(c.group == "seed" for c in order[:5])
    n_valid = sum(c.in_validation for c in grid if c.group != "seed")
    valid = order[5 : 5 + n_valid]
    assert all(c.in_validation for c in valid)
    assert [c.group for c in valid] == ["scale"] * 7 + ["dtype"] * 5  # float16 targets first
    rest = order[5 + n_valid :]
    n_dtype = sum(c.group == "dtype" for c in rest)
    assert all(c.group == "dtype" for c in rest[:n_dtype])
    assert all(c.group == "scale" for c in rest[n_dtype:])
    assert sorted(c.key for c in order) == sorted(c.key for c in grid)


def test_checks():
    ref = torch.tensor([[4, 5, 6, 7, 0, 1, 2, 3, -1]], dtype=torch.int32)
    swapped = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, -1]], dtype=torch.int32)
    c = _check("selection", swapped, ref)
    assert c["ok"] and c["same_set_rows"] == 1.0 and c["equal_fraction"] == pytest.approx(1 / 9)
    assert not _check("selection", swapped.clamp_max(6), ref)["ok"]
    x = torch.ones(2, 3, 256, dtype=torch.float16)
    assert _check("attention", x, x)["ok"]
    assert not _check("attention", torch.full_like(x, float("nan")), x)["ok"]


def test_errors_carry_no_machine_paths():
    assert strip_paths("OSError: /opt/x/lib/_qsa_cuda.so: bad ELF; 1/2") == (
        "OSError: _qsa_cuda.so: bad ELF; 1/2"
    )
    try:
        raise RuntimeError("cannot open /home/someone/cache/kernel.cubin")
    except RuntimeError as exc:
        text = format_error(exc)
    assert text.startswith("RuntimeError: cannot open kernel.cubin (at test_bench_impls.py:")
    assert "/" not in text.split(" (at ")[1]
