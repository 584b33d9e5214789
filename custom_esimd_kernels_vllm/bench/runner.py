"""One case, end to end: build the inputs, count the floor bytes, rotate, check every
implementation against the reference, time eager and CUDA-graph B/C/B, profile."""

from __future__ import annotations

import gc
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from . import impls as impls_mod
from . import rotation
from .cases import ATTENTION, CaseSpec, build
from .env import strip_paths
from .floor import floor_bytes, percent_of_floor
from .impls import ALL, ROWWISE_MAX_ROWS, Args, Impl
from .profiling import capture
from .protocol import run_pairs, run_solo
from .stats import compare, summarize
from .timing import EagerUnit, GraphUnit, calls_per_unit, estimate_per_call, synchronize, time_block


@dataclass
class BenchConfig:
    device: torch.device
    pairs: int = 10  # B/C/B pairs per comparison
    warmup_units: int = 3  # excluded units of each implementation before the pairs
    unit_s: float = 2e-3  # aimed duration of one measurement unit
    max_unit_s: float = 50e-3  # a unit of a slow baseline stops growing here
    max_calls: int = 256  # calls per unit at most
    max_copies: int = 256  # rotated input copies at most
    cache_bytes: int = 0  # last-level cache to defeat (L2 on CUDA)
    rotation_factor: float = 2.0  # the copies together should touch this many x cache_bytes
    memory_budget: int = 8 << 30  # bytes for the tiled pool of the copies
    graph: bool = True
    compile: str = "targets"  # "targets" | "all" | "none"
    compile_budget_s: float = 120.0  # stop compiling new shapes past this (compile time)
    profile: bool = True
    rowwise_max_rows: int = ROWWISE_MAX_ROWS
    impls: tuple[str, ...] = ALL
    seed: int = 0


class CompileLedger:
    """Compile time spent so far (first calls of the compiled reference)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def skip_reason(self, spec: CaseSpec, cfg: BenchConfig) -> str | None:
        if cfg.compile == "none":
            return "torch.compile not requested (--compile none; --quick skips it for time)"
        if cfg.compile == "targets" and not spec.target:
            return "torch.compile runs on the performance-table cases only (--compile targets)"
        if self.seconds > cfg.compile_budget_s:
            return f"compile budget spent ({self.seconds:.0f} s > {cfg.compile_budget_s:.0f} s)"
        return None


def format_error(exc: BaseException) -> str:
    """``Type: message`` and the innermost frames as ``file.py:line in function`` (file names
    only: the results are committed and must not carry machine paths)."""
    frames = traceback.extract_tb(exc.__traceback__)[-4:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in reversed(frames))
    message = strip_paths(f"{type(exc).__name__}: {exc}")[:1500]
    return message + (f" (at {where})" if where else "")


def _fresh(args: Args, op: str) -> Args:
    """The same arguments with a new, poisoned ``out`` (NaN for attention, -7 for selection)."""
    a = dict(args)
    a["out"] = torch.full_like(args["out"], float("nan") if op == ATTENTION else -7)
    return a


def _check(op: str, out: torch.Tensor, ref: torch.Tensor) -> dict[str, object]:
    if op == ATTENTION:
        diff = torch.linalg.vector_norm((out.double() - ref.double()).flatten())
        norm = torch.linalg.vector_norm(ref.double().flatten())
        rel = float(diff / norm) if float(norm) > 0 else float(diff)
        finite = bool(torch.isfinite(out).all())
        return {"rel_error": rel, "finite": finite, "ok": finite and rel < 2e-3}
    # NOTES: float32 sums in another order may swap near-equal scores (contract section 4),
    # so a valid kernel can differ from the reference in order, or at the 512 cut; the GPU
    # test suite judges validity, this only reports the agreement.
    if out.numel() == 0:
        return {"equal_fraction": 1.0, "same_set_rows": 1.0, "ok": True}
    equal = float((out == ref).double().mean())
    same_set = float((out.sort(dim=1).values == ref.sort(dim=1).values).all(dim=1).double().mean())
    return {"equal_fraction": equal, "same_set_rows": same_set, "ok": same_set == 1.0}


def _measure(units: dict[str, object], cfg: BenchConfig) -> dict[str, object]:
    """B/C/B of the candidate (first unit) against every other unit."""
    names = list(units)
    cand = names[0]
    samples: dict[str, list[float]] = {n: [] for n in names}
    comparisons, errors = [], {}
    if len(names) == 1:
        samples[cand] = run_solo(units[cand], 2 * cfg.pairs, cfg.warmup_units)
    for base in names[1:]:
        try:
            pairs = run_pairs(units[base], units[cand], cfg.pairs, cfg.warmup_units)
        except Exception as exc:  # a baseline failing must not lose the others
            errors[base] = format_error(exc)
            continue
        comp = compare(pairs)
        comparisons.append(
            {"candidate": cand, "baseline": base, **comp.to_dict(),
             "units_s": [[p.baseline_before, p.candidate, p.baseline_after] for p in pairs]}
        )  # fmt: skip
        samples[cand] += [p.candidate for p in pairs]
        samples[base] += [x for p in pairs for x in (p.baseline_before, p.baseline_after)]
    return {
        "candidate": cand,
        "calls_per_unit": {n: units[n].calls for n in names},
        "latency": {n: summarize(s).to_dict() for n, s in samples.items() if s},
        "comparisons": comparisons,
        "errors": errors,
        "samples_s": samples,
    }


def graph_supported(device: torch.device) -> bool:
    return device.type == "cuda"


def _graph_unit(impl: Impl, copies: list[Args], est: float, cfg: BenchConfig) -> GraphUnit:
    min_calls = min(len(copies), cfg.max_calls)
    calls = calls_per_unit(est, cfg.unit_s, cfg.max_calls, cfg.max_unit_s, min_calls)
    unit = GraphUnit(impl, copies, calls, cfg.device)
    per_call = min(unit() for _ in range(2))
    better = calls_per_unit(per_call, cfg.unit_s, cfg.max_calls, cfg.max_unit_s, min_calls)
    if better > 2 * calls:  # replay is much faster than eager: recapture a longer unit
        unit.close()
        unit = GraphUnit(impl, copies, better, cfg.device)
    return unit


def run_case(
    spec: CaseSpec, cfg: BenchConfig, bandwidth: float, ledger: CompileLedger, status=None
) -> dict[str, object]:
    status = status or (lambda _msg: None)
    device = cfg.device
    t_case = time.perf_counter()
    result: dict[str, object] = {"spec": spec.to_dict(), "impls": {}, "modes": {}, "errors": []}

    status("build")
    inputs = build(spec, device, cfg.seed)
    fb = floor_bytes(spec.op, inputs.tensors)
    floor_s = fb.seconds(bandwidth)
    result["floor"] = {**fb.to_dict(), "seconds": floor_s, "bandwidth_bytes_per_s": bandwidth}
    plan = rotation.plan(
        fb.total,
        rotation.page_bytes(inputs),
        int(rotation.used_pages(inputs).numel()),
        int(cfg.rotation_factor * cfg.cache_bytes),
        cfg.max_copies,
        cfg.memory_budget,
    )
    copies, pool_info = rotation.make_copies(inputs, plan, cfg.seed)
    del inputs
    result["rotation"] = {**plan.to_dict(), **pool_info}

    chosen, skipped = impls_mod.select(
        spec.op, spec.rows, device, ledger.skip_reason(spec, cfg), cfg.rowwise_max_rows, cfg.impls
    )
    result["skipped"] = skipped

    status("check")
    ref = impls_mod.make(impls_mod.REF_VECTORISED, spec.op)
    ref_args = _fresh(copies[0], spec.op)
    ref.call(ref_args)
    synchronize(device)
    live: list[tuple[Impl, float]] = []
    for impl in chosen:
        info: dict[str, object] = {}
        result["impls"][impl.name] = info
        try:
            args = _fresh(copies[0], spec.op)
            t0 = time.perf_counter()
            time_block(lambda a=args, f=impl.call: f(a), device)
            info["first_call_s"] = time.perf_counter() - t0
            if impl.name == impls_mod.REF_COMPILED:
                ledger.seconds += info["first_call_s"]
            info["check"] = _check(spec.op, args["out"], ref_args["out"])
            est = estimate_per_call(impl, copies, device)
            info["eager_estimate_s"] = est
            live.append((impl, est))
        except Exception as exc:
            info["error"] = format_error(exc)
    del ref_args

    modes = ["eager"] + (["graph"] if cfg.graph and graph_supported(device) else [])
    for mode in modes:
        status(mode)
        units: dict[str, object] = {}
        for impl, est in live:
            if mode == "graph" and not impl.graphable:
                continue
            try:
                if mode == "eager":
                    calls = calls_per_unit(est, cfg.unit_s, cfg.max_calls, cfg.max_unit_s)
                    units[impl.name] = EagerUnit(impl, copies, calls, device)
                else:
                    units[impl.name] = _graph_unit(impl, copies, est, cfg)
            except Exception as exc:
                result["impls"][impl.name][f"{mode}_error"] = format_error(exc)
        if not units:
            continue
        try:
            measured = _measure(units, cfg)
            measured["pct_of_floor"] = {
                n: percent_of_floor(floor_s, s["median"]) for n, s in measured["latency"].items()
            }
            result["modes"][mode] = measured
        except Exception as exc:  # keep the other mode and the profile
            result["errors"].append(f"{mode} timing: {format_error(exc)}")
        finally:
            for u in units.values():
                u.close()
            del units

    if spec.profile and cfg.profile:
        status("profile")
        profiles = {}
        for impl, _ in live:
            try:
                profiles[impl.name] = capture(impl, _fresh(copies[0], spec.op), device)
            except Exception as exc:
                profiles[impl.name] = {"error": format_error(exc)}
        result["profile"] = profiles

    del copies
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result["seconds"] = time.perf_counter() - t_case
    return result
