"""The vLLM layer's profiling-run reservation (paging.reserve_workspaces): after it, a step of
the same size allocates nothing more, so vLLM's memory profile already counted the op layer's
workspaces."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import DEVICE

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import testing
from custom_esimd_kernels_vllm.vllm import paging

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "rows, pages, layout",
    [(1, 256, "seed"), (64, 64, "seed"), (2048, 16, "seed"), (64, 42, "vllm_bf16_784")],
)
def test_reserve_covers_the_step(cuda_backend, rows, pages, layout):
    stream = torch.cuda.Stream()  # a fresh stream: its workspaces do not exist yet
    lay = testing.LAYOUTS[layout]
    sel = testing.random_select_case(rows, 2, pages, 9, device=DEVICE, seed=rows, layout=lay)
    att = testing.random_attention_case(rows, 2, pages, 9, device=DEVICE, seed=rows, layout=lay)
    selected = torch.empty(rows, qsa_ops.WIDTH, dtype=torch.int32, device=DEVICE)
    with torch.cuda.stream(stream):
        paging.reserve_workspaces(
            att.q, sel.q, sel.query_positions, selected, att.out, pages, lay.page_size
        )
        stream.synchronize()
        assert (att.out == 0).all() and (selected == -1).all()
        before = torch.cuda.memory_allocated()
        qsa_ops.select_paged_tokens(*sel.args())
        qsa_ops.sparse_paged_attention(*att.args(), **att.kwargs())
        stream.synchronize()
        assert torch.cuda.memory_allocated() == before, "the step allocated a workspace"
    testing.check_attention(att, att.out)
