"""``python -m custom_esimd_kernels_vllm.bench``: run the grid, write results/bench-<device>.*"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from . import cases, env, report
from .impls import ALL
from .runner import BenchConfig, CompileLedger, format_error, run_case
from .timing import measure_copy_bandwidth

SCHEMA = "qsa-bench/1"
GPU_COPY_BYTES = 1 << 30  # 1 GiB each way: far beyond L2, long enough to time well
CPU_COPY_BYTES = 64 << 20
QUICK_CPU_CACHE_BYTES = 4 << 20  # --quick: small stand-in cache, so that rotation still runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m custom_esimd_kernels_vllm.bench",
        description="B/C/B latency, %% of the memory floor and profiler counts of the QSA operators.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny grid on the CPU reference implementations (CI: proves the harness, < 60 s)",
    )
    p.add_argument(
        "--grid",
        choices=sorted(cases.GRIDS),
        default=None,
        help="case grid (default: 'default' = seed + scale; 'quick' with --quick)",
    )
    p.add_argument(
        "--ops", default=",".join(cases.OPS), help="comma-separated: attention,selection"
    )
    p.add_argument(
        "--impls", default=",".join(ALL), help=f"comma-separated subset of {','.join(ALL)}"
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=None,
        help="B/C/B pairs per comparison (default 10; 3 with --quick)",
    )
    p.add_argument(
        "--warmup-units",
        type=int,
        default=None,
        help="excluded warm-up units (default 3; 1 with --quick)",
    )
    p.add_argument(
        "--unit-ms", type=float, default=2.0, help="aimed duration of one measurement unit"
    )
    p.add_argument(
        "--graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time CUDA-graph replay (CUDA only)",
    )
    p.add_argument(
        "--compile",
        choices=("targets", "all", "none"),
        default=None,
        help="where torch.compile'd reference runs: the performance-table cases (default), "
        "every case, or none (default with --quick)",
    )
    p.add_argument(
        "--compile-budget-s",
        type=float,
        default=120.0,
        help="stop compiling new shapes once this much compile time is spent",
    )
    p.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="profiler capture on the cases marked for it",
    )
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="stop starting new cases past this many seconds (default 300; none with --quick)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="cuda or cpu (default: cuda when available; cpu with --quick)",
    )
    p.add_argument("--out-dir", type=Path, default=Path("results"))
    p.add_argument("--name", default=None, help="file stem (default bench-<device name>)")
    p.add_argument(
        "--commit", default=None, help=f"commit to record (default: ${env.COMMIT_ENV}, else git)"
    )
    p.add_argument(
        "--max-copies",
        type=int,
        default=None,
        help="rotated input copies at most (default 256; 2 with --quick)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="run nothing: re-render the Markdown table and the plot of an existing results JSON",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def _split(value: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in value.split(",") if x.strip())


def configure(args: argparse.Namespace) -> tuple[BenchConfig, list[cases.CaseSpec], float | None]:
    quick = args.quick
    device = torch.device(
        args.device or ("cpu" if quick or not torch.cuda.is_available() else "cuda")
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    impls = _split(args.impls)
    bad = [n for n in impls if n not in ALL]
    if bad:
        raise SystemExit(f"--impls must be among {', '.join(ALL)}, got {', '.join(bad)}")
    grid = cases.grid(args.grid or ("quick" if quick else "default"), _split(args.ops))
    cache = env.l2_bytes(device) if device.type == "cuda" else QUICK_CPU_CACHE_BYTES
    budget = (
        int(min(8 << 30, 0.1 * torch.cuda.get_device_properties(device).total_memory))
        if device.type == "cuda"
        else 256 << 20
    )
    cfg = BenchConfig(
        device=device,
        pairs=args.pairs or (3 if quick else 10),
        warmup_units=args.warmup_units if args.warmup_units is not None else (1 if quick else 3),
        unit_s=args.unit_ms * 1e-3,
        max_copies=args.max_copies or (2 if quick else 256),
        cache_bytes=cache,
        memory_budget=budget,
        graph=args.graph,
        compile=args.compile or ("none" if quick else "targets"),
        compile_budget_s=args.compile_budget_s,
        profile=args.profile,
        impls=impls,
        seed=args.seed,
    )
    time_budget = (
        args.time_budget_s if args.time_budget_s is not None else (None if quick else 300.0)
    )
    return cfg, grid, time_budget


def execution_order(grid: list[cases.CaseSpec]) -> list[cases.CaseSpec]:
    """Seeds first, then the performance-table cases, then the rest of the grid: when the
    time budget cuts the run, what is lost is the least asked for."""
    return sorted(grid, key=lambda c: (c.group != "seed", not c.target))


def _spec_of(result: dict, grid: list[cases.CaseSpec]) -> cases.CaseSpec:
    return next(c for c in grid if c.to_dict() == result["spec"])


def _progress(total: int, enabled: bool):
    if enabled:
        try:
            from tqdm import tqdm

            return tqdm(total=total, unit="case", dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            pass
    return None


def rerender(path: Path) -> int:
    data = json.loads(path.read_text())
    paths = report.write_all(data, path.parent, path.stem)
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        return rerender(args.from_json)
    cfg, grid, time_budget = configure(args)
    t_start, cpu_start = time.perf_counter(), time.process_time()
    stem = args.name or f"bench-{env.device_slug(cfg.device)}"
    data: dict = {
        "schema": SCHEMA,
        "environment": env.collect(cfg.device, args.commit),
        "config": {
            **{k: v for k, v in asdict(cfg).items() if k != "device"},
            "device": str(cfg.device),
            "grid": args.grid or ("quick" if args.quick else "default"),
            "quick": args.quick,
            "time_budget_s": time_budget,
            "argv": [env.strip_paths(a) for a in (sys.argv[1:] if argv is None else argv)],
        },
        "cases": [],
        "notes": [],
    }
    if args.quick:
        data["notes"].append(
            "--quick: a tiny grid on the CPU reference implementations"
            + (", torch.compile skipped for time" if cfg.compile == "none" else "")
            + ", no CUDA graphs; the numbers prove the harness, not the kernels"
        )
    copy_bytes = GPU_COPY_BYTES if cfg.device.type == "cuda" else CPU_COPY_BYTES
    data["copy_bandwidth"] = measure_copy_bandwidth(cfg.device, copy_bytes)
    bandwidth = data["copy_bandwidth"]["bandwidth_bytes_per_s"]
    ledger = CompileLedger()
    bar = _progress(len(grid), not args.no_progress)
    not_run = []
    order = execution_order(grid)
    for i, spec in enumerate(order):
        elapsed = time.perf_counter() - t_start
        if time_budget is not None and elapsed > time_budget:
            not_run = order[i:]
            break
        if bar is not None:
            bar.set_description(f"{spec.op} {spec.name}"[:48])

        def status(stage: str, spec=spec) -> None:
            if bar is not None:
                bar.set_postfix_str(stage)
            else:
                print(f"[bench] {spec.op} / {spec.name}: {stage}", file=sys.stderr, flush=True)

        try:
            result = run_case(spec, cfg, bandwidth, ledger, status)
        except Exception as exc:  # one broken case must not lose the rest of the run
            result = {"spec": spec.to_dict(), "errors": [format_error(exc)]}
            if cfg.device.type == "cuda":
                torch.cuda.empty_cache()
        data["cases"].append(result)
        data["cases"].sort(key=lambda c: grid.index(_spec_of(c, grid)))  # report in grid order
        report.write_all(data, args.out_dir, stem, with_plot=False)  # partial results survive
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if not_run:
        data["notes"].append(
            f"time budget of {time_budget:.0f} s exceeded: {len(not_run)} case(s) not run: "
            + "; ".join(f"{s.op} {s.name}" for s in not_run)
        )
    data["compile_seconds"] = ledger.seconds
    data["wall_seconds"] = time.perf_counter() - t_start
    data["cpu_seconds"] = time.process_time() - cpu_start  # this process, all threads
    for c in data["cases"]:
        for e in c.get("errors", []):
            data["notes"].append(f"case {c['spec']['op']} / {c['spec']['name']} failed: {e}")
    paths = report.write_all(data, args.out_dir, stem)
    print(f"wrote {', '.join(str(p) for p in paths.values())} in {data['wall_seconds']:.0f} s")
    return 0
