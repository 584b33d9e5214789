"""The read floor of the attention's access pattern (development measurement, GPU host).

The benchmark's memory floor is the case's bytes over the bandwidth of a large contiguous copy.
The attention cases read their K/V as one row per listed token (512 B in float8, 1 KiB in
bfloat16) at random places of the pool, a pattern DRAM serves slower than a stream. This
script times, on the benchmark's own rotated copies of each attention case of a grid (graph
replay, B/C/B against the operator), a read-only gather of exactly those token rows written
in Triton (each program folds the 32-bit words of BT tokens by XOR, the fold of a row checked
against torch's; several shapes, the fastest kept): the fastest this host reads those bytes
in that pattern, the floor the kernel's "% of floor" cannot reach.

    python3 scripts/gather_floor.py [--grid dtype] [--rows 64,256] [--out FILE.json]

Needs the package (with its compiled library), torch with CUDA and Triton; without either it
says so and exits 0. NOTES-kernels.md, v48: what it measured.
"""

from __future__ import annotations

import argparse
import json

import torch
from floor_probes import xor_fold  # scripts/ is the script's own path entry

from custom_esimd_kernels_vllm.qsa_ops import contract

try:
    import triton
    import triton.language as tl
except ImportError:  # main() says so
    triton = None


def _gather_read(words, base, idx, idx_stride, table, table_stride, t2r, out,
                 page_stride, tok_stride, page_size, W: tl.constexpr, BT: tl.constexpr,
                 WORDS: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)
    c = tl.program_id(1)
    t = c * BT + tl.arange(0, BT)
    tok = tl.load(idx + r * idx_stride + t, mask=t < W, other=-1)
    req = tl.load(t2r + r)
    ok = tok >= 0
    page = tl.where(ok, tok // page_size, 0)
    phys = tl.load(table + req * table_stride + page, mask=ok, other=0)
    row = base + phys.to(tl.int64) * page_stride + (tok % page_size).to(tl.int64) * tok_stride
    w = tl.arange(0, WORDS)
    v = tl.load(words + row[:, None] + w[None, :], mask=ok[:, None], other=0)
    tl.store(out + r * tl.num_programs(1) + c, tl.xor_sum(tl.xor_sum(v, 1), 0))


if triton is not None:
    _gather_read = triton.jit(_gather_read)


def gather_call(bt: int, warps: int):
    """A call reading every listed token's K and V row of ``a`` (the packed layout: K and V
    of a token adjacent), as 32-bit words."""

    def call(a):
        k, pool = a["k_cache"], a["kv"]
        es = k.element_size()
        words = pool.view(-1).view(torch.int32)
        base = (k.data_ptr() - pool.data_ptr()) // 4
        n_words = 2 * contract.HEAD_DIM * es // 4
        idx, table, t2r = a["logical_indices"], a["page_table"], a["token_to_req"]
        rows = idx.shape[0]
        grid = (rows, triton.cdiv(contract.WIDTH, bt))
        out = a.setdefault("_gather_out", torch.empty(grid, dtype=torch.int32, device=k.device))
        _gather_read[grid](
            words, base, idx, idx.stride(0), table, table.stride(0), t2r, out,
            k.stride(0) * es // 4, k.stride(1) * es // 4, k.shape[1],
            W=contract.WIDTH, BT=bt, WORDS=n_words, num_warps=warps,
        )  # fmt: skip

    return call


SHAPES = ((8, 4), (16, 4), (32, 8))  # (tokens per program, warps)


def expected_fold(a, row: int) -> int:
    """The XOR of the 32-bit words of every K/V row ``row`` lists (what the gather's programs
    of that row write, folded together)."""
    k, pool = a["k_cache"], a["kv"]
    tok = a["logical_indices"][row].long()
    tok = tok[tok >= 0]
    ps = k.shape[1]
    phys = a["page_table"][int(a["token_to_req"][row])].long()[tok // ps]
    return xor_fold(pool[:, -1][phys, tok % ps].contiguous().view(torch.int32))


def check_read(a, row: int = 0) -> None:
    got = xor_fold(a["_gather_out"][row])
    want = expected_fold(a, row)
    if got != want:
        raise SystemExit(f"[gather-floor] row {row}: the gather read {got:#x}, expected {want:#x}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", default="dtype")
    ap.add_argument("--rows", default="", help="comma list of R (default: all of the grid)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or triton is None:
        why = "no CUDA device" if not torch.cuda.is_available() else "no Triton"
        print(f"[gather-floor] skipped: {why} (it runs on the GPU host only)")
        return 0
    from custom_esimd_kernels_vllm.bench import cases, impls, run, timing
    from custom_esimd_kernels_vllm.bench.cli import GPU_COPY_BYTES, l2_bytes

    dev = torch.device("cuda")
    cfg = run.BenchConfig(device=dev, cache_bytes=l2_bytes(dev), pairs=5)
    bw = timing.measure_copy_bandwidth(dev, GPU_COPY_BYTES)["bandwidth_bytes_per_s"]
    keep = {int(x) for x in args.rows.split(",") if x}
    kernel = impls.make(impls.KERNEL, cases.ATTENTION)
    results = []
    for spec in cases.grid(args.grid, (cases.ATTENTION,)):
        if keep and spec.rows not in keep or spec.lay.kv != "packed":
            continue
        copies, fb, _ = run.rotated_copies(spec, cfg)
        est = timing.estimate_per_call(kernel.call, copies, dev)
        ku = run.graph_unit(kernel.call, copies, est, cfg)
        best = None
        for bt, warps in SHAPES:
            call = gather_call(bt, warps)
            gu = run.graph_unit(call, copies, timing.estimate_per_call(call, copies, dev), cfg)
            check_read(copies[0])
            comp = timing.compare(timing.run_pairs(ku, gu, cfg.pairs, cfg.warmup_units))
            g, k = comp.candidate_latency.median, comp.baseline_latency.median
            gu.close()
            if best is None or g < best[0]:
                best = (g, k, bt, warps)
        ku.close()
        g, k, bt, warps = best
        row = {
            "case": spec.to_dict(), "R": spec.rows, "kernel_us": k * 1e6, "gather_us": g * 1e6,
            "gather_shape": [bt, warps], "floor_bytes": fb.total,
            "kv_bytes": fb.read["kv_tokens"], "copy_floor_us": fb.seconds(bw) * 1e6,
            "copy_bandwidth_bytes_per_s": bw,
        }  # fmt: skip
        results.append(row)
        print(f"{spec.rows:4d} {spec.layout:28s} kernel {k * 1e6:7.1f} us  gather {g * 1e6:7.1f}"
              f" us (BT {bt}, {warps} warps)  kernel/gather {k / g:.3f}  copy floor {row['copy_floor_us']:.1f} us",
              flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
