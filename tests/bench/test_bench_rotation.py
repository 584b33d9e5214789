"""Input rotation: the plan's arithmetic, and copies that compute what the original does."""

from __future__ import annotations

import pytest
import torch

from custom_esimd_kernels_vllm.bench import timing as rotation
from custom_esimd_kernels_vllm.bench.cases import CaseSpec, build, floor_bytes
from custom_esimd_kernels_vllm.qsa_ops import contract, reference

MiB = 1 << 20


def test_plan_copies_to_exceed_target():
    p = rotation.plan(bytes_per_call=2 * MiB, page_bytes=512 * 1024, compact_pages=16,
                      target_bytes=120 * MiB, max_copies=256, memory_budget=8 << 30)  # fmt: skip
    assert p.copies == 60 and p.slabs == 60 and p.exact
    assert p.touched_bytes == 120 * MiB and p.beats_cache


def test_plan_caps_copies_and_memory():
    p = rotation.plan(32 * 1024, 512 * 1024, 16, 120 * MiB, max_copies=256, memory_budget=1 << 30)
    assert p.copies == 256  # would need 3840
    assert p.slabs == 128  # 1 GiB / 8 MiB per slab
    assert not p.exact and not p.beats_cache
    assert p.touched_bytes == 256 * 32 * 1024  # within the 1 GiB of slabs
    perm = rotation.plan(16 * MiB, 512 * 1024, 2048, 120 * MiB, 256, memory_budget=256 * MiB)
    assert (perm.copies, perm.slabs, perm.exact) == (8, 1, False)  # pages permuted per copy
    assert perm.touched_bytes == 8 * 16 * MiB and perm.beats_cache
    big = rotation.plan(600 * MiB, 512 * 1024, 4096, 120 * MiB, 256, 8 << 30)
    assert big.copies == 1 and big.slabs == 1 and big.exact
    with pytest.raises(ValueError, match="max_copies"):
        rotation.plan(1, 1, 1, 1, 0, 1)


def test_remap_keeps_invalid_entries_invalid():
    table = torch.tensor([[7, -1, 2, 10, 2]], dtype=torch.int32)  # P = 8: 10 is invalid
    ranks = torch.zeros(8, dtype=torch.long)
    ranks[torch.tensor([2, 7])] = torch.tensor([0, 1])
    out = rotation.remap_page_table(table, ranks, pages=8, slab=2, compact=2, slabs=3)
    assert out.tolist() == [[5, -1, 4, 10 - 8 + 6, 4]]  # new pool: 3 slabs x 2 pages = 6


def _call(op, args):
    out = torch.empty_like(args["out"])
    if op == "attention":
        names = ("q", "k_cache", "v_cache", "logical_indices", "page_table", "token_to_req")
        reference.sparse_paged_attention_ref(*(args[n] for n in names), out)
        contract.validate_attention_args(*(args[n] for n in names), 512, out)
    else:
        names = ("q", "compressed_key_cache", "page_table", "token_to_req", "query_positions",
                 "sequence_lengths")  # fmt: skip
        reference.select_paged_tokens_ref(*(args[n] for n in names), out)
        contract.validate_select_args(*(args[n] for n in names), 2048, 4, out)
    return out


@pytest.mark.parametrize(
    "spec",
    [
        CaseSpec("attention", "quick", "a", 2, 4096),
        CaseSpec("selection", "quick", "s", 2, 4096),
        CaseSpec(
            "selection", "seed", "p8192", 1, 9215, pool_pages=8192, testing_case="p8192_saturated"
        ),
    ],
    ids=lambda s: f"{s.op}-{s.name}",
)
@pytest.mark.parametrize("budget_slabs", [4, 2])
def test_copies_compute_the_original(spec, budget_slabs):
    inputs = build(spec, "cpu")
    expected = _call(spec.op, inputs.tensors)
    used = rotation.used_pages(inputs)
    slab = used.numel() * rotation.page_bytes(inputs)
    fb = floor_bytes(spec.op, inputs.tensors)
    plan = rotation.plan(fb.total, rotation.page_bytes(inputs), used.numel(),
                         target_bytes=4 * fb.total, max_copies=4,
                         memory_budget=budget_slabs * slab)  # fmt: skip
    assert plan.copies == 4 and plan.slabs == budget_slabs
    copies, info = rotation.make_copies(inputs, plan)
    assert info["pool_pages"] == budget_slabs * used.numel()
    pool = copies[0][inputs.pool_name]
    for k, args in enumerate(copies):
        assert args[inputs.pool_name] is pool  # one shared pool
        got = _call(spec.op, args)
        if k < plan.slabs:  # its own slab, same values: the same result
            assert torch.equal(got, expected), f"copy {k} differs"
        # the copy reads its own slab
        table = args["page_table"].long()
        valid = (table >= 0) & (table < pool.shape[0])
        slab_of = table[valid] // used.numel()
        assert bool((slab_of == k % plan.slabs).all())
