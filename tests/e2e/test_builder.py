"""The QSA metadata builder on a hand-made vLLM step (no server): padded rows, compressed
slots, and that every per-step tensor is a view of a buffer allocated at init."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="the E2E suite runs in a vLLM environment (nox -s e2e)")

from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402

from custom_esimd_kernels_vllm.vllm.backend import QSABackend, QSAMetadataBuilder  # noqa: E402
from custom_esimd_kernels_vllm.vllm.spec import make_ck_spec, make_kv_spec  # noqa: E402

MAX_TOKENS = 64


def _step():
    """Two requests: 5 new tokens at positions 6..10 (pages [3, 1]) and one decode token at
    position 515 (pages [2, 0]); 3 padded rows (slot -1), as vLLM pads a graph's batch."""
    query_start_loc = torch.tensor([0, 5, 6], dtype=torch.int32)
    seq_lens = torch.tensor([11, 516], dtype=torch.int32)
    block_table = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)
    slots = [3 * 512 + p for p in range(6, 11)] + [0 * 512 + 3] + [-1] * 3
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=seq_lens,
        num_reqs=2,
        num_actual_tokens=9,
        max_query_len=5,
        max_seq_len=516,
        block_table_tensor=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )


def _builder(spec):
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=MAX_TOKENS))
    return QSAMetadataBuilder(spec, ["layer"], config, torch.device("cpu"))


def test_kv_metadata_maps_padding_out_of_range():
    builder = _builder(make_kv_spec())
    md = builder.build(0, _step())
    assert md.token_to_req.tolist() == [0, 0, 0, 0, 0, 1, 2, 2, 2]  # padding -> B = 2
    assert md.token_to_req.data_ptr() == builder._token_to_req.data_ptr()
    assert md.slot_mapping.tolist()[-3:] == [-1, -1, -1]
    assert md.block_table.dtype == torch.int32 and md.block_table.is_contiguous()


def test_compressed_slots_only_on_block_completing_rows():
    builder = _builder(make_ck_spec())
    md = builder.build(0, _step())
    # position 7 (slot 3*512+7) completes block 1 of page 3; position 515 (slot 3) completes
    # block 128 = block 0 of its second page; padding and the rest: -1
    assert md.compressed_slot_mapping.tolist() == [-1, 3 * 128 + 1, -1, -1, -1, 0, -1, -1, -1]
    assert md.compressed_slot_mapping.data_ptr() == builder._ck_slots.data_ptr()


def test_backend_declares_graphs_and_layouts():
    assert QSAMetadataBuilder._cudagraph_support == AttentionCGSupport.UNIFORM_BATCH
    assert [layout.name for layout in QSABackend.supported_kv_cache_layouts()] == [
        "LBNHC",
        "LBHNC",
    ]
