"""The library facts that need a GPU refuse clearly without one (run where torch sees no
CUDA device)."""

from __future__ import annotations

import pytest
import torch

from custom_esimd_kernels_vllm.qsa_ops import ops


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
@pytest.mark.parametrize("device", [None, 0])
def test_attention_splits_without_cuda(device):
    with pytest.raises(RuntimeError, match="CUDA device"):
        ops.attention_splits(4, device)
