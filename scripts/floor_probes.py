"""Floor probes of the decode-size attention, timed beside the real kernel.

    PYTHONPATH=. python3 scripts/floor_probes.py [--rows 1,8] [--pairs 5] [--out-dir results]

Builds scripts/floor_probes.cu with nvcc (not part of the library), checks that each probe
read the row's bytes (the XOR of every K/V word it loaded against the same fold in torch), and
times every probe as the candidate of B/C/B pairs whose baseline is sparse_paged_attention
itself: the benchmark's graph units on the benchmark's rotated inputs of the same target case
(graph replay, L2-cold). Writes floor-probes-<device>.{json,md}. What each probe does and why
its time bounds any kernel of its structure: the .cu file's header and NOTES-kernels.md
("Floor probes").
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from custom_esimd_kernels_vllm.qsa_ops import contract

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "scripts" / "floor_probes.cu"
# name -> the structure it stands for (what each does: the .cu file's header)
PROBES = {
    "launch": "65 CTAs, empty",
    "loads-33": "33 CTAs x 8 warps x 8 tokens",
    "loads-65": "65 CTAs x 8 warps x 4 tokens",
    "loads-129": "129 CTAs x 8 warps x 2 tokens",
    "exchange-33": "33 CTAs + one hand-off",
    "exchange-65": "65 CTAs + one hand-off",
    "exchange-129": "129 CTAs + one hand-off",
    "loads-257": "257 CTAs x 8 warps x 1 token",
    "exchange-257": "257 CTAs + one hand-off",
    "wide-33": "33 CTAs + the kernel's hand-off",
    "wide-65": "65 CTAs + the kernel's hand-off",
    "wide-129": "129 CTAs + the kernel's hand-off",
    "wide-half-33": "33 CTAs + float16 partials",
    "wide-half-65": "65 CTAs + float16 partials",
    "wide-write-65": "65 CTAs, whole partials, 1 merging CTA",
    "wide-poll-65": "65 CTAs, 1-word partials, 24 merging CTAs",
    "wide-sums-65": "wide-65 without the maxima and sums read",
    "wide-aligned-65": "wide-65, partials 128-byte aligned",
    "wide-one-65": "wide-65, one partial read per warp",
    "tree-5x16": "5 clusters of 16 CTAs x 8 warps x 4 tokens",
    "tree-9x8": "9 clusters of 8 CTAs x 8 warps x 4 tokens",
    "tree-9x16": "9 clusters of 16 CTAs x 8 warps x 2 tokens",
    "tree-17x8": "17 clusters of 8 CTAs x 8 warps x 2 tokens",
    "cluster-8": "one cluster of 8 x 1024 threads",
    "cluster-16": "one cluster of 16 x 1024 threads",
    "single": "one CTA of 1024 threads",
}
OUT_PER_ROW = contract.ATTN_HEADS * contract.HEAD_DIM  # a wide probe's outputs per row
# the most CTAs of a probe per row x a wide probe's partial (the outputs, a maximum and a sum
# per head)
WORDS_PER_ROW = 129 * (OUT_PER_ROW + 2 * contract.ATTN_HEADS)
COUNTER_SPREAD = 32
COOPERATIVE_TOO_LARGE = 720  # cudaErrorCooperativeLaunchTooLarge


def source_sha256() -> dict[str, str]:
    files = [SOURCE, ROOT / "csrc/qsa/common.cuh", ROOT / "csrc/qsa/contract.h"]
    return {str(f.relative_to(ROOT)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def build(out: Path, device: torch.device) -> ctypes.CDLL:
    major, minor = torch.cuda.get_device_capability(device)
    arch = f"sm_{major}{minor}" + ("a" if major == 9 else "")
    so = out / "floor_probes.so"
    cmd = ["nvcc", "-O3", "-std=c++17", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC", "-diag-suppress", "128",
           "-o", str(so), str(SOURCE)]  # fmt: skip
    print(f"[floors] nvcc -arch={arch} {SOURCE.name} ...", flush=True)
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(so))
    f = lib.floor_probe
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    f.argtypes = [ctypes.c_char_p, i64, ptr, ptr, ptr, i64, ptr, i64, i64, ptr, i64, i64, ptr,
                  ptr, ptr, ptr]  # fmt: skip
    f.restype = ctypes.c_int
    return lib


def probe_call(lib: ctypes.CDLL, name: str, scratch: dict[str, torch.Tensor]):
    """A benchmark call (Args -> None) launching probe ``name`` on the current stream."""

    def call(a: dict[str, torch.Tensor]) -> None:
        idx, table = a["logical_indices"], a["page_table"]
        for arg in ("q", "kv"):  # the probes load 16 bytes at a time
            if a[arg].data_ptr() % 16:
                raise ValueError(f"probe {name}: {arg} must be 16-byte aligned")
        err = lib.floor_probe(
            name.encode(), idx.shape[0], a["q"].data_ptr(), a["kv"].data_ptr(), idx.data_ptr(),
            idx.stride(0), table.data_ptr(), table.stride(0), table.shape[1],
            a["token_to_req"].data_ptr(), table.shape[0], a["kv"].shape[0],
            scratch["words"].data_ptr(), scratch["counters"].data_ptr(),
            scratch["out"].data_ptr(), torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        if err == COOPERATIVE_TOO_LARGE:
            raise RuntimeError(f"probe {name}: the grid is not resident at once (error {err})")
        if err != 0:
            raise RuntimeError(f"probe {name}: launch failed (error {err})")

    return call


def xor_fold(words: torch.Tensor) -> int:
    """XOR of every element of an int32 tensor (as uint32)."""
    x = words.reshape(-1).to(torch.int64) & 0xFFFFFFFF
    while x.numel() > 1:
        if x.numel() % 2:
            x = torch.cat([x, x.new_zeros(1)])
        x = torch.bitwise_xor(x[0::2], x[1::2])
    return int(x[0]) if x.numel() else 0


def expected_fold(a: dict[str, torch.Tensor], row: int) -> int:
    """What the exchange and cluster probes write for ``row``: the XOR of the 32-bit words of
    every K/V token its index row resolves to (holes read nothing; q is loaded an even number
    of times there and cancels)."""
    page = contract.KV_PAGE
    li = a["logical_indices"][row].long()
    b = int(a["token_to_req"][row])
    table = a["page_table"]
    pool = a["kv"]
    if not 0 <= b < table.shape[0]:
        return 0
    ok = (li >= 0) & (li // page < table.shape[1])
    ph = torch.full_like(li, -1)
    ph[ok] = table[b, li[ok] // page].long()
    ok &= (ph >= 0) & (ph < pool.shape[0])
    slots = ph[ok] * page + li[ok] % page
    tokens = pool.reshape(-1, pool.shape[-1])[slots]
    return xor_fold(tokens.contiguous().view(torch.int32))


def markdown(data: dict) -> str:
    env = data["environment"]
    lines = [
        f"# Floor probes of the decode-size attention: {env.get('device_name')}",
        "",
        f"Commit {env.get('git', {}).get('commit')}; library "
        f"{(env.get('dso') or {}).get('sha256', 'unknown')[:12]}; probe sources "
        + ", ".join(f"{k} {v[:12]}" for k, v in data["sources_sha256"].items())
        + f". Graph replay, L2-cold (the benchmark's rotation), {data['pairs']} B/C/B pairs per "
        "probe against sparse_paged_attention (median per call, us).",
        "",
        "| rows | probe | structure | kernel us | probe us | probe / kernel | read check |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in data["cases"]:
        for name, r in case["probes"].items():
            if "error" in r:
                lines.append(f"| {case['rows']} | {name} | | | error: {r['error']} | | |")
                continue
            check = r.get("check", "")
            lines.append(
                f"| {case['rows']} | {name} | {PROBES[name]} | {r['kernel_us']:.2f} | "
                f"{r['probe_us']:.2f} | {r['probe_us'] / r['kernel_us']:.2f} | {check} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8", help="comma-separated R of the attention targets")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--probes", default=",".join(PROBES))
    p.add_argument("--out-dir", default="results")
    p.add_argument("--commit", default=None, help="the commit to record (default: git's state)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("[floors] skipped: no CUDA device (the probes run on the GPU only)")
        return 0
    from custom_esimd_kernels_vllm.bench import cases, cli, impls, run, timing

    names = [n for n in args.probes.split(",") if n]
    bad = [n for n in names if n not in PROBES]
    if bad:
        raise SystemExit(f"--probes must be among {', '.join(PROBES)}, got {', '.join(bad)}")
    rows = [int(r) for r in args.rows.split(",")]
    cfg, grid, _ = cli.configure(
        cli.parse_args(["--grid", "targets", "--ops", "attention", "--impls", "kernel",
                        "--pairs", str(args.pairs), "--compile", "none"])
    )  # fmt: skip
    device = cfg.device
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data: dict = {
        "environment": cli.environment(device, args.commit),
        "sources_sha256": source_sha256(),
        "pairs": cfg.pairs,
        "cases": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(tmp), device)
        for spec in [c for c in grid if c.rows in rows]:
            t0 = time.perf_counter()
            print(f"[floors] {spec.name}: building the rotated inputs", flush=True)
            copies, _, rotation = run.rotated_copies(spec, cfg)
            r = spec.rows
            scratch = {
                "words": torch.zeros(r * WORDS_PER_ROW, dtype=torch.int32, device=device),
                "counters": torch.zeros(r * COUNTER_SPREAD, dtype=torch.int32, device=device),
                "out": torch.zeros(r * OUT_PER_ROW, dtype=torch.int32, device=device),
            }
            kernel = impls.make(impls.KERNEL, cases.ATTENTION).call
            est = timing.estimate_per_call(kernel, copies, device)
            base = run.graph_unit(kernel, copies, est, cfg)
            case = {"name": spec.name, "rows": r, "rotation": rotation, "probes": {}}
            for name in names:
                res: dict[str, object] = {}
                case["probes"][name] = res
                try:
                    call = probe_call(lib, name, scratch)
                    scratch["out"].fill_(0x5A5A5A5A)  # poison
                    call(copies[0])
                    torch.cuda.synchronize(device)
                    if name.startswith("tree"):
                        spun = scratch["counters"].view(r, COUNTER_SPREAD)[:, 1]
                        res["check"] = "spin ran out (not resident)" if spun.any() else "finished"
                    if name.startswith(("exchange", "cluster")):
                        got = [int(x) & 0xFFFFFFFF for x in scratch["out"][:r].tolist()]
                        want = [expected_fold(copies[0], i) for i in range(r)]
                        res["check"] = "ok" if got == want else f"MISMATCH {got} != {want}"
                    unit = run.graph_unit(
                        call, copies, timing.estimate_per_call(call, copies, device), cfg
                    )
                    pairs = timing.run_pairs(base, unit, cfg.pairs, cfg.warmup_units)
                    unit.close()
                    comp = timing.compare(pairs)
                    res.update(
                        kernel_us=1e6 * timing.summarize([p.baseline for p in pairs]).median,
                        probe_us=1e6 * timing.summarize([p.candidate for p in pairs]).median,
                        comparison=comp.to_dict(),
                        units_s=[[p.baseline_before, p.candidate, p.baseline_after] for p in pairs],
                    )
                    print(
                        f"[floors] R={r} {name}: {res['probe_us']:.2f} us "
                        f"(kernel {res['kernel_us']:.2f}) {res.get('check', '')}",
                        flush=True,
                    )
                except Exception as exc:  # one probe failing must not lose the others
                    res["error"] = f"{type(exc).__name__}: {exc}"
                    print(f"[floors] R={r} {name}: {res['error']}", flush=True)
            base.close()
            case["seconds"] = time.perf_counter() - t0
            data["cases"].append(case)
            del copies
    slug = cli.device_slug(device)
    (out_dir / f"floor-probes-{slug}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out_dir / f"floor-probes-{slug}.md").write_text(markdown(data))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
