"""``python -m custom_esimd_kernels_vllm.bench``: run the grid (and the host-overhead, decode-step
and optional split-sweep sections), write results/bench-<device>.{json,md,png} and, with
``--validation PATH``, the timing section of the GPU validation record."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..qsa_ops.provenance import git_state
from . import cases, impls, report, run, upstream

SCHEMA = "qsa-bench/2"
GPU_COPY_BYTES = 1 << 30  # 1 GiB each way: far beyond L2, long enough to time well
CPU_COPY_BYTES = 64 << 20
QUICK_CPU_CACHE_BYTES = 4 << 20  # --quick: small stand-in cache, so that rotation still runs
DEFAULT_L2_BYTES = 60 * 1024 * 1024  # H200 (used when the device does not report its L2)
TIME_BUDGET_S = 450.0  # about 6 minutes expected with the dtype cases (docs/bench.md, Time)
VALIDATION_TIME_BUDGET_S = 120.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m custom_esimd_kernels_vllm.bench",
        description="B/C/B latency, % of the memory floor, upstream baselines, host overhead, "
        "the decode step and profiler counts of the QSA operators.",
    )
    add = p.add_argument
    add(
        "--quick",
        action="store_true",
        help="tiny grid on the CPU reference implementations (CI: proves the harness, < 60 s)",
    )
    add(
        "--grid",
        choices=sorted(cases.GRIDS),
        default=None,
        help="case grid (default: 'default' = seed + scale + dtype; 'targets' with "
        "--validation; 'quick' with --quick)",
    )
    add("--ops", default=",".join(cases.OPS), help="comma-separated: attention,selection")
    add("--cases", default="", help="run only the cases whose name contains this text")
    add(
        "--impls",
        default=",".join(impls.ALL),
        help=f"comma-separated subset of {','.join(impls.ALL)}",
    )
    add(
        "--upstream",
        default=None,
        metavar="PATH",
        help=f"vLLM's kernels from a wheel/zip or an extracted tree (default: ${upstream.ENV}, "
        "else the installed vllm)",
    )
    add(
        "--pairs",
        type=int,
        default=None,
        help="B/C/B pairs per comparison (default 10; 3 with --quick)",
    )
    add(
        "--warmup-units",
        type=int,
        default=None,
        help="excluded warm-up units (default 3; 1 with --quick)",
    )
    add("--unit-ms", type=float, default=2.0, help="aimed duration of one measurement unit")
    add(
        "--graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time CUDA-graph replay (CUDA only)",
    )
    add(
        "--compile",
        choices=("targets", "all", "none"),
        default=None,
        help="where torch.compile'd reference runs: the performance-table cases (default), "
        "every case, or none (default with --quick)",
    )
    add(
        "--compile-budget-s",
        type=float,
        default=120.0,
        help="stop compiling new shapes once this much compile time is spent",
    )
    add(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="profiler capture on the cases marked for it",
    )
    add(
        "--host-overhead",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="host time per eager call of the public ops vs Tensor.add_",
    )
    add(
        "--decode-step",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the 8-layer decode step (select + attention), eager and graph",
    )
    add("--splits-sweep", action="store_true", help="attention graph time per forced split count")
    add(
        "--time-budget-s",
        type=float,
        default=None,
        help="stop starting new cases past this many seconds (default 450; 120 with --validation; "
        "none with --quick)",
    )
    add(
        "--device",
        default=None,
        help="cuda or cpu (default: cuda when available; cpu with --quick)",
    )
    add("--out-dir", type=Path, default=Path("results"))
    add(
        "--name",
        default=None,
        help="file stem (default bench-<device name>; bench-<grid>-<device name> for the "
        f"{', '.join(cases.PARTS)} grids)",
    )
    add(
        "--validation",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write the timing section of the GPU validation record (JSON) to PATH",
    )
    add("--commit", default=None, help="commit to record (default: git of the checkout)")
    add(
        "--max-copies",
        type=int,
        default=None,
        help="rotated input copies at most (default 256; 2 with --quick)",
    )
    add("--seed", type=int, default=0)
    add(
        "--from-json",
        type=Path,
        default=None,
        help="run nothing: re-render the Markdown report and the plot of a results JSON",
    )
    add("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)  # fmt: skip


def _split(value: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in value.split(",") if x.strip())


# ----------------------------------------------------------------------------------------
# what ran: device, versions, commit, the compiled module's identity
# ----------------------------------------------------------------------------------------


def device_slug(device: torch.device) -> str:
    """File-name stem of the device: e.g. ``nvidia-h200`` or ``cpu``."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "cuda"


def default_stem(grid: str, device: torch.device) -> str:
    """File stem of a run: ``bench-<device>``; ``bench-<grid>-<device>`` for a part of the
    default grid (``cases.PARTS``), so that such a run never overwrites the device's full
    benchmark (or the validation's, which the GPU record names)."""
    part = f"{grid}-" if grid in cases.PARTS else ""
    return f"bench-{part}{device_slug(device)}"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0)) or DEFAULT_L2_BYTES


def _nvidia_smi_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
        return out.strip().splitlines()[0] if out.strip() else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _build_identity() -> dict[str, object]:
    """qsa_ops.build_info() and the loaded DSO's SHA256 (never raises)."""
    out: dict[str, object] = {}
    try:
        from ..qsa_ops import build_info

        out["build_info"] = json.loads(report.strip_paths(json.dumps(build_info(), default=str)))
    except Exception as exc:  # recorded; the benchmark still runs
        out["build_info_error"] = report.strip_paths(f"{type(exc).__name__}: {exc}")
    try:
        from ..qsa_ops import provenance

        dso = provenance.loaded_dso()
        out["dso"] = {"file": Path(dso["path"]).name, "sha256": dso["sha256"]}
    except Exception as exc:  # no DSO on a CPU-only install
        out["dso"] = None
        out["dso_error"] = report.strip_paths(f"{type(exc).__name__}: {exc}")
    return out


def environment(device: torch.device, commit: str | None = None) -> dict[str, object]:
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():  # an installed package: the caller's checkout
        root = Path.cwd()
    git = {"commit": commit, "dirty": None, "source": "--commit"} if commit else git_state(root)
    info: dict[str, object] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
        "git": json.loads(report.strip_paths(json.dumps(git))),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(sm_count=props.multi_processor_count, memory_bytes=props.total_memory,
                    l2_bytes=l2_bytes(device), capability=f"{props.major}.{props.minor}",
                    driver=_nvidia_smi_driver())  # fmt: skip
    info.update(_build_identity())
    return info


# ----------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------


def configure(
    args: argparse.Namespace,
) -> tuple[run.BenchConfig, list[cases.CaseSpec], float | None]:
    quick = args.quick
    device = torch.device(
        args.device or ("cpu" if quick or not torch.cuda.is_available() else "cuda")
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    chosen = _split(args.impls)
    bad = [n for n in chosen if n not in impls.ALL]
    if bad:
        raise SystemExit(f"--impls must be among {', '.join(impls.ALL)}, got {', '.join(bad)}")
    grid = cases.grid(grid_name(args), _split(args.ops))
    grid = [c for c in grid if args.cases in c.name]
    cache = l2_bytes(device) if device.type == "cuda" else QUICK_CPU_CACHE_BYTES
    budget = (
        int(min(8 << 30, 0.1 * torch.cuda.get_device_properties(device).total_memory))
        if device.type == "cuda"
        else 256 << 20
    )
    cfg = run.BenchConfig(
        device=device,
        pairs=args.pairs or (3 if quick else 10),
        warmup_units=args.warmup_units if args.warmup_units is not None else (1 if quick else 3),
        unit_s=args.unit_ms * 1e-3,
        max_copies=args.max_copies or (2 if quick else 256),
        cache_bytes=cache,
        memory_budget=budget,
        graph=args.graph,
        compile=args.compile or ("none" if quick or args.validation else "targets"),
        compile_budget_s=args.compile_budget_s,
        profile=args.profile,
        impls=tuple(n for n in impls.ALL if n in chosen),
        seed=args.seed,
    )
    if args.time_budget_s is not None:
        time_budget = args.time_budget_s
    else:  # --validation runs inside scripts/gpu_session.sh's time limit
        time_budget = (
            None if quick else (VALIDATION_TIME_BUDGET_S if args.validation else TIME_BUDGET_S)
        )
    return cfg, grid, time_budget


def grid_name(args: argparse.Namespace) -> str:
    if args.grid:
        return args.grid
    return "quick" if args.quick else ("targets" if args.validation else "default")


def execution_order(grid: list[cases.CaseSpec]) -> list[cases.CaseSpec]:
    """Seeds first, then the validation subset (the float16 performance-table cases, then the
    dtype cases marked for it), then the other dtype cases, then the rest of the grid: when
    the time budget cuts the run, what is lost is the least asked for."""
    return sorted(grid, key=execution_rank)


def execution_rank(c: cases.CaseSpec) -> tuple[int, int]:
    if c.group == "seed":
        return (0, 0)
    if c.in_validation:
        return (1, int(c.group == "dtype"))
    return (2, int(c.group != "dtype"))


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


def write_validation(path: Path | None, data: dict) -> bool:
    """The validation record's timing section, rewritten as the run goes (a run stopped by
    gpu_session.sh's time limit still leaves what it measured)."""
    if path is None:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    report.write_json(path, report.validation_section(data))
    return True


def _section(data: dict, key: str, fn, status) -> None:
    status(key)
    try:
        data[key] = fn()
    except Exception as exc:  # a broken section must not lose the rest of the run
        data[key] = {"error": report.format_error(exc)}
        data["notes"].append(f"{key} failed: {data[key]['error']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        return rerender(args.from_json)
    cfg, grid, time_budget = configure(args)
    t_start, cpu_start = time.perf_counter(), time.process_time()
    stem = args.name or default_stem(grid_name(args), cfg.device)
    data: dict = {
        "schema": SCHEMA,
        "stem": stem,
        "environment": environment(cfg.device, args.commit),
        "config": {
            **{k: v for k, v in asdict(cfg).items() if k != "device"},
            "device": str(cfg.device),
            "grid": grid_name(args),
            "quick": args.quick,
            "time_budget_s": time_budget,
            "argv": [report.strip_paths(a) for a in (sys.argv[1:] if argv is None else argv)],
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
    wants_upstream = any(n in cfg.impls for n in (impls.UPSTREAM, impls.UPSTREAM_SCORE))
    up = (
        upstream.load(args.upstream)
        if wants_upstream
        else upstream.Upstream(skip="not requested (--impls)")
    )
    data["upstream"] = {
        **up.to_dict(),
        "compiled_topk": up.compiled_topk,
        "quoted_topk_us": {f"{r}x{b}": us for (r, b), us in impls.QUOTED_TOPK_US.items()},
        "quoted_topk_source": impls.QUOTED_TOPK_SOURCE,
    }
    copy_bytes = GPU_COPY_BYTES if cfg.device.type == "cuda" else CPU_COPY_BYTES
    data["copy_bandwidth"] = run.timing.measure_copy_bandwidth(cfg.device, copy_bytes)
    bandwidth = data["copy_bandwidth"]["bandwidth_bytes_per_s"]
    ledger = run.CompileLedger()
    bar = _progress(len(grid), not args.no_progress)
    not_run = []
    order = execution_order(grid)
    for i, spec in enumerate(order):
        if time_budget is not None and time.perf_counter() - t_start > time_budget:
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
            result = run.run_case(spec, cfg, bandwidth, ledger, status, up)
        except Exception as exc:  # one broken case must not lose the rest of the run
            result = {"spec": spec.to_dict(), "errors": [report.format_error(exc)]}
            run._release(cfg.device)
        data["cases"].append(result)
        keys = [c.to_dict() for c in grid]
        data["cases"].sort(key=lambda c: keys.index(c["spec"]))  # report in grid order
        report.write_all(data, args.out_dir, stem, with_plot=False)  # partial results survive
        write_validation(args.validation, data)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if not_run:
        data["notes"].append(
            f"time budget of {time_budget:.0f} s exceeded: {len(not_run)} case(s) not run: "
            + "; ".join(f"{s.op} {s.name}" for s in not_run)
        )

    def say(stage: str) -> None:
        print(f"[bench] {stage}", file=sys.stderr, flush=True)

    if args.host_overhead:
        _section(
            data, "host_overhead", lambda: run.host_overhead(cfg.device, args.quick, cfg.seed), say
        )
    if args.decode_step:
        small = {"rows": (1, 2), "context": 2048, "layers": 2, "reps": 3} if args.quick else {}
        _section(data, "decode_step", lambda: run.decode_step(
            cfg.device, graph=cfg.graph, seed=cfg.seed, **small), say)  # fmt: skip
        if "skipped" in data["decode_step"]:
            data["notes"].append(f"decode step skipped: {data['decode_step']['skipped']}")
    if args.splits_sweep:
        _section(data, "splits_sweep", lambda: run.splits_sweep(cfg), say)
    data["compile_seconds"] = ledger.seconds
    data["wall_seconds"] = time.perf_counter() - t_start
    data["cpu_seconds"] = time.process_time() - cpu_start  # this process, all threads
    for c in data["cases"]:
        for e in c.get("errors", []):
            data["notes"].append(f"case {c['spec']['op']} / {c['spec']['name']} failed: {e}")
    paths = report.write_all(data, args.out_dir, stem)
    if write_validation(args.validation, data):
        paths["validation"] = args.validation
    print(f"wrote {', '.join(str(p) for p in paths.values())} in {data['wall_seconds']:.0f} s")
    return 0
