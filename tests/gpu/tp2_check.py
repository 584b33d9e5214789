"""TP=2 check of one QSA attention block (NCCL on GPUs, gloo on CPUs).

    torchrun --standalone --nproc-per-node 2 tests/gpu/tp2_check.py --device cuda --json OUT

or ``spawn(...)`` below (what the tests use): two processes on 127.0.0.1 with the rendezvous in
the environment, which needs no host name resolution (offline containers have none).

The block of a 2-rank model: 6 query heads, 2 KV heads, 8 indexer heads (head dims 256 / 128),
sharded by heads so that each rank is exactly the per-rank contract (3 query heads, 1 KV head,
4 indexer heads). Each rank fills its shard's caches for a 2,600-token context (so that the
top-512 selection really chooses), runs select_paged_tokens and sparse_paged_attention for 4
decode rows and its slice of the output projection; an all-reduce sums the slices. Rank 0 also
runs both shards one after the other on its own device with the same weights and compares:
relative error within the contract's 2e-3, and whether the two agree bit for bit (the
all-reduce of two float32 partial sums adds them in the same order). Writes a JSON record
(commit, library SHA256, devices, result) and exits 1 when the check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import contract, provenance, testing

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = 64
CONTEXT = 2600
ROWS = 4
WORLD = 2
Q_DIM = contract.ATTN_HEADS * contract.HEAD_DIM  # 768 per rank


def weights(seed: int) -> dict[str, torch.Tensor]:
    """The whole block's weights (every rank draws the same), float32 on the CPU."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    return {
        "wq": w(WORLD * Q_DIM, HIDDEN),
        "wk": w(WORLD * contract.HEAD_DIM, HIDDEN),
        "wv": w(WORLD * contract.HEAD_DIM, HIDDEN),
        "wiq": w(WORLD * contract.INDEX_HEADS * contract.INDEX_DIM, HIDDEN),
        "wik": w(WORLD, contract.INDEX_DIM, contract.HEAD_DIM),
        "wo": w(HIDDEN, WORLD * Q_DIM),
        "hidden": torch.randn(CONTEXT, HIDDEN, generator=g),
    }


def shard_partial(w: dict[str, torch.Tensor], rank: int, device: torch.device) -> torch.Tensor:
    """Rank ``rank``'s slice of the block output for the last ROWS tokens: [ROWS, HIDDEN] f32."""
    h = w["hidden"].to(device)
    heads = slice(rank * Q_DIM, (rank + 1) * Q_DIM)
    kv_head = slice(rank * contract.HEAD_DIM, (rank + 1) * contract.HEAD_DIM)
    index = contract.INDEX_HEADS * contract.INDEX_DIM
    k = (h @ w["wk"][kv_head].to(device).T).half()  # [T, 256]
    v = (h @ w["wv"][kv_head].to(device).T).half()
    pages = -(-CONTEXT // contract.KV_PAGE)
    perm = torch.randperm(pages, generator=torch.Generator().manual_seed(100 + rank))
    page_table = perm.to(torch.int32).view(1, pages).to(device)
    buffer, k_cache, v_cache = testing.packed_kv(pages, device)
    kv = buffer.view(pages, contract.KV_PAGE, contract.PACKED_TOKEN_STRIDE)
    tokens = torch.arange(CONTEXT, device=device)
    slots = page_table[0, tokens // contract.KV_PAGE].long() * contract.KV_PAGE + (
        tokens % contract.KV_PAGE
    )
    kv.view(-1, contract.PACKED_TOKEN_STRIDE).index_copy_(0, slots, torch.cat([k, v], -1))
    blocks = CONTEXT // contract.COMPRESS_RATIO
    mean = k[: blocks * 4].float().view(blocks, 4, -1).sum(1) * 0.25  # [blocks, 256]
    keys = (mean @ w["wik"][rank].to(device).T).half()  # [blocks, 128]
    ck = torch.zeros(pages, contract.CK_PAGE, 1, contract.INDEX_DIM, dtype=torch.float16,
                     device=device)  # fmt: skip
    j = torch.arange(blocks, device=device)
    ck_slots = page_table[0, j // contract.CK_PAGE].long() * contract.CK_PAGE + j % contract.CK_PAGE
    ck.view(-1, contract.INDEX_DIM).index_copy_(0, ck_slots, keys)

    rows = h[-ROWS:]
    q = (rows @ w["wq"][heads].to(device).T).half().view(ROWS, contract.ATTN_HEADS, -1)
    iq_rows = slice(rank * index, (rank + 1) * index)
    iq = (rows @ w["wiq"][iq_rows].to(device).T).half().view(ROWS, contract.INDEX_HEADS, -1)
    token_to_req = torch.zeros(ROWS, dtype=torch.int32, device=device)
    positions = torch.arange(CONTEXT - ROWS, CONTEXT, device=device)
    lengths = torch.full((1,), CONTEXT, dtype=torch.int32, device=device)
    selected = torch.empty(ROWS, contract.WIDTH, dtype=torch.int32, device=device)
    qsa_ops.select_paged_tokens(iq, ck, page_table, token_to_req, positions, lengths,
                                contract.TOKEN_TOPK, contract.COMPRESS_RATIO, selected)  # fmt: skip
    out = torch.empty(ROWS, contract.ATTN_HEADS, contract.HEAD_DIM, dtype=torch.float16,
                      device=device)  # fmt: skip
    qsa_ops.sparse_paged_attention(q, k_cache, v_cache, selected, page_table, token_to_req,
                                   contract.KV_PAGE, out)  # fmt: skip
    return out.float().view(ROWS, Q_DIM) @ w["wo"][:, heads].to(device).T


def spawn(device: str, record: Path, timeout: float = 180) -> list[subprocess.CompletedProcess]:
    """Run this check as WORLD processes on this host (loopback rendezvous); their results."""
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(WORLD),
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, str(Path(__file__).resolve()), "--device", device, "--json", str(record)]
    procs = [
        subprocess.Popen(cmd, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(WORLD)
    ]  # fmt: skip
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.monotonic()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != WORLD:
        raise SystemExit(f"run with --nproc-per-node {WORLD}, got world size {world}")
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    w = weights(args.seed)
    sharded = shard_partial(w, rank, device)
    dist.all_reduce(sharded)
    passed = True
    if rank == 0:
        one = shard_partial(w, 0, device) + shard_partial(w, 1, device)
        rel = float((sharded - one).norm() / one.norm())
        identical = bool(torch.equal(sharded, one))
        finite = bool(sharded.isfinite().all())
        passed = finite and rel < testing.ATTENTION_TOLERANCE
        try:
            library = provenance.loaded_dso()["sha256"]
        except ImportError as exc:
            library = f"not loaded: {exc}"
        record = {
            "check": "tp2 QSA attention block",
            "passed": passed,
            "rel_error": rel,
            "bit_identical": identical,
            "tolerance": testing.ATTENTION_TOLERANCE,
            "world_size": world,
            "backend": "nccl" if args.device == "cuda" else "gloo",
            "devices": [torch.cuda.get_device_name(i) for i in range(world)]
            if args.device == "cuda"
            else ["cpu"] * world,  # fmt: skip
            "cuda_backend": qsa_ops.ops.BACKEND,
            "torch": torch.__version__,
            "git": provenance.git_state(ROOT),
            "library_sha256": library,
            "shape": {"hidden": HIDDEN, "context": CONTEXT, "rows": ROWS},
            "duration_s": round(time.monotonic() - start, 1),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps(record, indent=2))
    flag = torch.tensor([0 if passed else 1], device=device)
    dist.broadcast(flag, 0)
    dist.destroy_process_group()
    return int(flag.item())


if __name__ == "__main__":
    raise SystemExit(main())
