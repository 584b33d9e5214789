"""Helpers of the GPU suite (imported by its test modules)."""

from __future__ import annotations

import dataclasses

import torch

from custom_esimd_kernels_vllm.qsa_ops import KV_PAGE, reference, testing

DEVICE = "cuda"

# Keys per page whose row of M * C candidate keys is not a multiple of 4 words (the
# selection's workspace rows are padded to 16 bytes; unpadded, C = 129 faulted with a
# misaligned load): valid v2 inputs for the suite and the sanitizer corpus.
ODD_KEYS = {
    "fp16_c129": testing.Layout(page_size=516, keys_per_page=129),
    "fp8_c130": testing.Layout(
        dtype=torch.bfloat16, index_dtype=testing.FP8, page_size=520, keys_per_page=130
    ),
}


def reference_select(case: testing.SelectCase) -> torch.Tensor:
    out = case.new_out()
    reference.select_paged_tokens_ref(*case.ref_args()[:-1], out)
    return out


def reference_attention(case: testing.AttentionCase) -> torch.Tensor:
    out = case.new_out()
    args = list(case.ref_args())
    args[6] = out
    reference.sparse_paged_attention_ref(*args)
    return out


def distributed_row_case(device: str = DEVICE) -> testing.SelectCase:
    """One row of 336 pages (43,008 blocks): on the whole device, every CTA of it selects (the
    distributed select, a cooperative grid)."""
    return testing.random_select_case(
        1, 1, 336, 340, device=device, seed=23, integer=True, bad_values=False,
        token_to_req=[0], query_positions=[336 * KV_PAGE - 1],
        sequence_lengths=[336 * KV_PAGE], name="distributed row",
    )  # fmt: skip


def row_subset(case, rows):
    """The same case restricted to ``rows`` (for the float64 checkers on large cases)."""
    index = torch.as_tensor(rows, device=case.q.device)
    per_row = {"q", "token_to_req", "query_positions", "logical_indices", "out"}
    changes = {
        f.name: getattr(case, f.name).index_select(0, index)
        for f in dataclasses.fields(case)
        if f.name in per_row
    }
    return dataclasses.replace(case, **changes)


def assert_fully_written(out: torch.Tensor, what: str) -> None:
    if out.is_floating_point():
        bad = out.isnan().nonzero()
    else:
        bad = (out == testing.POISON_INT32).nonzero()
    if len(bad):
        raise AssertionError(
            f"{what}: {len(bad)} poisoned elements left, first at {bad[0].tolist()}"
        )
