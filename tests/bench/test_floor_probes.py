"""The floor probes' host side (scripts/floor_probes.py) on the CPU: the XOR fold that checks
what a probe read, and the script's clean skip without a GPU. The probes themselves run on
the GPU host (NOTES-kernels.md, "Floor probes")."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch

from custom_esimd_kernels_vllm.qsa_ops import contract

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def probes():
    spec = importlib.util.spec_from_file_location("floor_probes", ROOT / "scripts/floor_probes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_xor_fold_matches_a_loop():
    g = torch.Generator().manual_seed(3)
    for n in (0, 1, 2, 7, 64, 1001):
        w = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int32)
        want = 0
        for v in w.tolist():
            want ^= v & 0xFFFFFFFF
        assert probes().xor_fold(w) == want


def test_expected_fold_reads_each_resolved_token_once_per_column():
    page = contract.KV_PAGE
    g = torch.Generator().manual_seed(5)
    pool = torch.randn(3, page, 2 * contract.HEAD_DIM, generator=g).to(torch.float16)
    table = torch.tensor([[2, 0], [1, -1]], dtype=torch.int32)
    # row 0: request 1; columns: a token of page 0 (physical 1), a hole, a token past the
    # table's valid entry (-1: nothing), the same token twice (cancels), another token
    idx = torch.full((1, contract.WIDTH), -1, dtype=torch.int32)
    idx[0, :6] = torch.tensor([5, -1, page + 3, 7, 7, 9])
    a = {"logical_indices": idx, "token_to_req": torch.tensor([1], dtype=torch.int32),
         "page_table": table, "kv": pool}  # fmt: skip
    words = pool.reshape(-1, pool.shape[-1]).view(torch.int32)
    want = 0
    for slot in (1 * page + 5, 1 * page + 9):
        for v in words[slot].tolist():
            want ^= v & 0xFFFFFFFF
    assert probes().expected_fold(a, 0) == want
    a["token_to_req"] = torch.tensor([5], dtype=torch.int32)  # no such request: nothing read
    assert probes().expected_fold(a, 0) == 0


def test_script_skips_without_a_gpu(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert probes().main(["--out-dir", str(tmp_path)]) == 0
    assert "skipped: no CUDA device" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())
