"""What one run measures, section by section:

* ``run_case``: one case of the grid end to end: build the inputs, count the floor bytes,
  rotate, check every implementation against the reference, time eager and CUDA-graph B/C/B,
  profile;
* ``host_overhead``: host time per eager call of the public ops next to a plain ``add_``;
* ``decode_step``: the layer's QSA path on our operators (selection, then attention) for 8
  layers, eager and CUDA-graph, host and GPU time per layer, against the two ops alone;
* ``splits_sweep``: attention graph time against the CTAs per row (``QSA_ATTN_SPLITS``).
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from dataclasses import dataclass

import torch

from .. import qsa_ops
from ..qsa_ops import contract, testing
from . import cases, impls, timing
from .cases import ATTENTION, CaseSpec
from .report import format_error
from .timing import Args, EagerUnit, GraphUnit
from .upstream import Upstream


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
    rowwise_max_rows: int = impls.ROWWISE_MAX_ROWS
    impls: tuple[str, ...] = impls.ALL
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


def graph_supported(device: torch.device) -> bool:
    return device.type == "cuda"


# ----------------------------------------------------------------------------------------
# one case
# ----------------------------------------------------------------------------------------

# upstream's attention rounds its probabilities to bfloat16 (float16 for float8 V) before the
# value sum: a sanity bound only
BF16_TOLERANCE = 1e-2
BLOCK_OVERLAP_MIN = 0.9  # upstream's blocks vs ours: bfloat16 scores reorder near-ties


def fresh(args: Args) -> Args:
    """The same arguments with a new, poisoned ``out`` (NaN for floats, -7 for integers), in
    the same layout (a row view of a new ``out_base`` where there is one)."""
    a = dict(args)
    name = "out_base" if "out_base" in args else "out"
    old = args[name]
    a[name] = torch.full_like(old, -7 if not old.is_floating_point() else math.nan)
    return cases.row_views(a)


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, bool]:
    diff = torch.linalg.vector_norm((out.double() - ref.double()).flatten())
    norm = torch.linalg.vector_norm(ref.double().flatten())
    return (float(diff / norm) if float(norm) > 0 else float(diff)), bool(torch.isfinite(out).all())


def check(kind: str, out: torch.Tensor, ref: torch.Tensor) -> dict[str, object]:
    """An implementation's output against the vectorised reference's, by ``Impl.check``."""
    if kind in (ATTENTION, "attention-upstream"):
        rel, finite = _rel_error(out, ref)
        tol = testing.ATTENTION_TOLERANCE if kind == ATTENTION else BF16_TOLERANCE
        return {"rel_error": rel, "finite": finite, "tolerance": tol, "ok": finite and rel < tol}
    if kind == "none":
        return {"ok": True, "note": "scores only: not compared (upstream's blocks are)"}
    if kind == "blocks":  # upstream's [R, 512] blocks vs the blocks of our token rows
        ratio = contract.COMPRESS_RATIO
        ref_blocks = ref[:, : contract.TOKEN_TOPK].reshape(ref.shape[0], -1, ratio)[:, :, 0]
        overlaps = []
        for mine, theirs in zip(ref_blocks.tolist(), out.tolist(), strict=True):
            want = {t // ratio for t in mine if t >= 0}
            got = {b for b in theirs if b >= 0}
            overlaps.append(len(want & got) / len(want) if want else float(not got))
        overlap = statistics.mean(overlaps) if overlaps else 1.0
        return {"block_overlap": overlap, "minimum": BLOCK_OVERLAP_MIN,
                "ok": overlap >= BLOCK_OVERLAP_MIN}  # fmt: skip
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
        samples[cand] = timing.run_solo(units[cand], 2 * cfg.pairs, cfg.warmup_units)
    for base in names[1:]:
        try:
            pairs = timing.run_pairs(units[base], units[cand], cfg.pairs, cfg.warmup_units)
        except Exception as exc:  # a baseline failing must not lose the others
            errors[base] = format_error(exc)
            continue
        comp = timing.compare(pairs)
        comparisons.append(
            {"candidate": cand, "baseline": base, **comp.to_dict(),
             "units_s": [[p.baseline_before, p.candidate, p.baseline_after] for p in pairs]}
        )  # fmt: skip
        samples[cand] += [p.candidate for p in pairs]
        samples[base] += [x for p in pairs for x in (p.baseline_before, p.baseline_after)]
    return {
        "candidate": cand,
        "calls_per_unit": {n: units[n].calls for n in names},
        "latency": {n: timing.summarize(s).to_dict() for n, s in samples.items() if s},
        "comparisons": comparisons,
        "errors": errors,
        "samples_s": samples,
    }


def graph_unit(call, copies: list[Args], est: float, cfg: BenchConfig) -> GraphUnit:
    min_calls = min(len(copies), cfg.max_calls)
    calls = timing.calls_per_unit(est, cfg.unit_s, cfg.max_calls, cfg.max_unit_s, min_calls)
    unit = GraphUnit(call, copies, calls, cfg.device)
    per_call = min(unit() for _ in range(2))
    better = timing.calls_per_unit(per_call, cfg.unit_s, cfg.max_calls, cfg.max_unit_s, min_calls)
    if better > 2 * calls:  # replay is much faster than eager: recapture a longer unit
        unit.close()
        unit = GraphUnit(call, copies, better, cfg.device)
    return unit


def rotated_copies(
    spec: CaseSpec, cfg: BenchConfig
) -> tuple[list[Args], cases.FloorBytes, dict[str, object]]:
    """The case's inputs, rotated past the cache (timing.make_copies): (copies, the bytes of
    its memory floor, the rotation's record)."""
    inputs = cases.build(spec, cfg.device, cfg.seed)
    fb = cases.floor_bytes(spec.op, inputs.tensors)
    rotation = timing.plan(
        fb.total,
        timing.page_bytes(inputs),
        int(timing.used_pages(inputs).numel()),
        int(cfg.rotation_factor * cfg.cache_bytes),
        cfg.max_copies,
        cfg.memory_budget,
    )
    copies, pool_info = timing.make_copies(inputs, rotation, cfg.seed)
    return copies, fb, {**rotation.to_dict(), **pool_info}


def run_case(
    spec: CaseSpec,
    cfg: BenchConfig,
    bandwidth: float,
    ledger: CompileLedger,
    status=None,
    up: Upstream | None = None,
) -> dict[str, object]:
    status = status or (lambda _msg: None)
    device = cfg.device
    t_case = time.perf_counter()
    result: dict[str, object] = {"spec": spec.to_dict(), "impls": {}, "modes": {}, "errors": []}

    status("build")
    copies, fb, result["rotation"] = rotated_copies(spec, cfg)
    floor_s = fb.seconds(bandwidth)
    result["floor"] = {**fb.to_dict(), "seconds": floor_s, "bandwidth_bytes_per_s": bandwidth}

    chosen, skipped = impls.select(
        spec.op, spec.rows, device, ledger.skip_reason(spec, cfg), cfg.rowwise_max_rows,
        cfg.impls, up, spec.layout,
    )  # fmt: skip
    result["skipped"] = skipped

    status("check")
    ref_args = fresh(copies[0])
    try:  # a reference that cannot run here loses the checks, not the case's timings
        impls.make(impls.REF_VECTORISED, spec.op).call(ref_args)
        timing.synchronize(device)
    except Exception as exc:
        result["reference_error"] = format_error(exc)
        ref_args = None
    live: list[tuple[impls.Impl, list[Args], float]] = []
    for impl in chosen:
        info: dict[str, object] = {}
        result["impls"][impl.name] = info
        try:
            own = impl.prepare(copies) if impl.prepare else copies
            args = fresh(own[0])
            t0 = time.perf_counter()
            timing.time_block(lambda a=args, f=impl.call: f(a), device)
            info["first_call_s"] = time.perf_counter() - t0
            if impl.name == impls.REF_COMPILED:
                ledger.seconds += info["first_call_s"]
            info["check"] = (
                check(impl.check, args["out"], ref_args["out"])
                if ref_args is not None
                else {"ok": None, "note": "not compared: the reference failed"}
            )
            est = timing.estimate_per_call(impl.call, own, device)
            info["eager_estimate_s"] = est
            live.append((impl, own, est))
        except Exception as exc:
            info["error"] = format_error(exc)
    del ref_args

    modes = ["eager"] + (["graph"] if cfg.graph and graph_supported(device) else [])
    for mode in modes:
        status(mode)
        units: dict[str, object] = {}
        for impl, own, est in live:
            if mode == "graph" and not impl.graphable:
                continue
            try:
                if mode == "eager":
                    calls = timing.calls_per_unit(est, cfg.unit_s, cfg.max_calls, cfg.max_unit_s)
                    units[impl.name] = EagerUnit(impl.call, own, calls, device)
                else:
                    units[impl.name] = graph_unit(impl.call, own, est, cfg)
            except Exception as exc:
                result["impls"][impl.name][f"{mode}_error"] = format_error(exc)
        if not units:
            continue
        try:
            measured = _measure(units, cfg)
            measured["pct_of_floor"] = {
                n: cases.percent_of_floor(floor_s, s["median"])
                for n, s in measured["latency"].items()
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
        for impl, own, _ in live:
            try:
                args = fresh(own[0])
                profiles[impl.name] = timing.profile_call(lambda f=impl.call, a=args: f(a), device)
            except Exception as exc:
                profiles[impl.name] = {"error": format_error(exc)}
        result["profile"] = profiles

    del copies, live
    _release(device)
    result["seconds"] = time.perf_counter() - t_case
    return result


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------
# host overhead of the public ops
# ----------------------------------------------------------------------------------------

HOST_TARGET_RATIO = 1.5
# the R = 1 seed cases whose eager host cost is recorded (the --quick grid has smaller ones)
HOST_CASES = {
    "default": ("seed R=1 width 2051", "seed P8192 saturated (2303 blocks / 2051 tokens)"),
    "quick": ("seed R=1 width 32", "seed cross-page tail (129 blocks / 519 tokens)"),
}


def _add_call(device: torch.device):
    """The host-cost reference of every host timing: one ``Tensor.add_`` on a device tensor."""
    x = torch.ones(1024, device=device)
    return lambda: x.add_(1.0)


def host_overhead(device: torch.device, quick: bool, seed: int = 0) -> dict[str, object]:
    """Median host time per eager call of ``Tensor.add_`` on a device tensor and of the public
    ``qsa_ops`` functions on the R = 1 seed cases, and their ratios."""
    calls, reps = (5, 5) if quick else (200, 25)
    names = HOST_CASES["quick" if quick else "default"]
    seeds = {c.name: c for c in cases.seed_cases()}
    fns = {"aten_add_us": _add_call(device)}
    out: dict[str, object] = {}
    for key, name in (("attention", names[0]), ("select", names[1])):
        spec = seeds[name]
        args = cases.build(spec, device, seed).tensors
        call = impls.make(impls.KERNEL, spec.op).call  # the public function, whatever backend
        fns[f"{key}_eager_us"] = lambda a=args, f=call: f(a)
        out[f"{key}_case"] = spec.key
    seconds = timing.host_seconds_interleaved(fns, calls, reps, device)
    out.update({name: 1e6 * s for name, s in seconds.items()})
    aten = out["aten_add_us"]
    out["select_ratio"] = out["select_eager_us"] / aten
    out["attention_ratio"] = out["attention_eager_us"] / aten
    out["target_ratio"] = HOST_TARGET_RATIO
    out["met"] = max(out["select_ratio"], out["attention_ratio"]) <= HOST_TARGET_RATIO
    out["backend"] = "cuda" if impls.kernel_status(device)[0] else "reference"
    out["method"] = (
        f"median over {reps} reps of the host time of {calls} back-to-back eager calls, per "
        "call, the reps of add_ and the two ops interleaved, device synchronised before and "
        "after each rep"
    )
    _release(device)
    return out


# ----------------------------------------------------------------------------------------
# the decode step
# ----------------------------------------------------------------------------------------

DECODE_GRAPH_TARGET = 1.15  # graph step <= 1.15 x (select + attention, graph each)
DECODE_EAGER_HOST_TARGET_US = 40.0  # eager host time per layer
DECODE_OPS = ("select", "attention")


def _decode_ops(step: dict) -> dict[str, object]:
    """Zero-argument callables over all layers: each op alone, and the whole step (per layer:
    select, then attention on its indices), with nothing but the op calls in the loops."""
    s = step["shared"]
    layers = step["layers"]
    table, t2r, idx = s["page_table"], s["token_to_req"], s["indices"]
    pos, lens = s["query_positions"], s["sequence_lengths"]
    topk, ratio, page = contract.TOKEN_TOPK, contract.COMPRESS_RATIO, contract.KV_PAGE
    select, attention = qsa_ops.select_paged_tokens, qsa_ops.sparse_paged_attention

    def sel() -> None:
        for L in layers:
            select(L["q_index"], L["compressed_key_cache"], table, t2r, pos, lens, topk, ratio,
                   idx)  # fmt: skip

    def att() -> None:
        for L in layers:
            attention(L["q"], L["k_cache"], L["v_cache"], idx, table, t2r, page, L["out"])

    def whole() -> None:
        for L in layers:
            select(L["q_index"], L["compressed_key_cache"], table, t2r, pos, lens, topk, ratio,
                   idx)  # fmt: skip
            attention(L["q"], L["k_cache"], L["v_cache"], idx, table, t2r, page, L["out"])

    return {"select": sel, "attention": att, "step": whole}


def _step_check(step: dict, context: int) -> dict[str, object]:
    """After a step: every row lists as many tokens as the contract selects at this context
    (512 blocks of 4, or all of them, then the tail) and the last layer's attention output
    is finite."""
    idx, out = step["shared"]["indices"], step["layers"][-1]["out"]
    blocks, tail = divmod(context, contract.COMPRESS_RATIO)
    want = contract.COMPRESS_RATIO * min(contract.BLOCK_TOPK, blocks) + tail
    full = bool(((idx >= 0).sum(dim=1) == want).all())
    finite = bool(torch.isfinite(out).all())
    return {"indices_listed": full, "out_finite": finite, "ok": full and finite}


def _eager_gpu_s(fn, device, reps: int) -> float:
    fn()
    timing.synchronize(device)
    return statistics.median(timing.time_block(fn, device) for _ in range(reps))


def _graph_s(fn, device, reps: int) -> tuple[float, float]:
    """(device s, host s of replay()) of one captured call of ``fn``."""
    unit = GraphUnit(lambda _a: fn(), [{}], 1, device)
    try:
        gpu = statistics.median(timing.run_solo(unit, reps, 2))
        return gpu, unit.host_seconds(reps)
    finally:
        unit.close()


def decode_step(
    device: torch.device,
    rows: tuple[int, ...] = cases.DECODE_ROWS,
    context: int = cases.DECODE_CONTEXT,
    layers: int = cases.DECODE_LAYERS,
    reps: int = 20,
    graph: bool = True,
    seed: int = 0,
) -> dict[str, object]:
    """Per R: eager and graph time of the whole step, host and GPU µs per layer, and the
    graph time of each op alone (all layers), with the two targets."""
    result: dict[str, object] = {
        "layers": layers,
        "context": context,
        "ops": list(DECODE_OPS),
        "targets": {
            "graph_step_over_kernel_sum": DECODE_GRAPH_TARGET,
            "eager_host_us_per_layer": DECODE_EAGER_HOST_TARGET_US,
        },
        "rows": [],
    }
    backend = "cuda" if impls.kernel_status(device)[0] else "reference"
    result["backend"] = backend
    use_graph = graph and graph_supported(device)
    for r in rows:
        entry: dict[str, object] = {"rows": r}
        result["rows"].append(entry)
        try:
            step = cases.build_decode(r, context, layers, device, seed)
            ops = _decode_ops(step)
            ops["step"]()
            timing.synchronize(device)
            entry["check"] = _step_check(step, context)
            per = 1e6 / layers
            # NOTES: the step's reps interleaved with add_'s (one add_ per layer): the host's
            # own speed drifts within a run, and the eager step's host time with it (not with
            # R); add_ beside it shows that drift (NOTES-kernels.md, the decode step's host).
            add = _add_call(device)
            host = timing.host_seconds_interleaved(
                {"step": ops["step"], "add_": lambda add=add: [add() for _ in range(layers)]},
                1, reps, device,
            )  # fmt: skip
            entry["eager"] = {
                "host_us_per_layer": host["step"] * per,
                "add_us": host["add_"] * per,
                "gpu_us_per_layer": _eager_gpu_s(ops["step"], device, reps) * per,
            }
            entry["eager"]["met"] = entry["eager"]["host_us_per_layer"] <= (
                DECODE_EAGER_HOST_TARGET_US
            )
            if use_graph:
                gpu, host = _graph_s(ops["step"], device, reps)
                alone = {k: _graph_s(ops[k], device, reps)[0] * per for k in DECODE_OPS}
                total = sum(alone.values())
                entry["graph"] = {
                    "gpu_us_per_layer": gpu * per,
                    "host_us_per_layer": host * per,
                    "ops_alone_us_per_layer": alone,
                    "kernel_sum_us_per_layer": total,
                    "ratio": gpu * per / total,
                    "met": gpu * per <= DECODE_GRAPH_TARGET * total,
                }
        except Exception as exc:  # one R failing keeps the others
            entry["error"] = format_error(exc)
        finally:
            step = ops = None
            _release(device)
    if not use_graph:
        result["notes"] = ["no CUDA graphs here: eager only"]
    return result


# ----------------------------------------------------------------------------------------
# the attention split sweep (a kernel tuning aid)
# ----------------------------------------------------------------------------------------

SWEEP_ROWS = (1, 2, 8, 64, 256)
SWEEP_SPLITS = (1, 2, 4, 8, 12, 16, 24, 32)
SWEEP_CONTEXT = 32 * 1024


def splits_sweep(cfg: BenchConfig) -> dict[str, object]:
    """Graph-replay time of the attention kernel per forced split count, L2-rotated."""
    if not (impls.kernel_status(cfg.device)[0] and graph_supported(cfg.device)):
        return {"skipped": "the split sweep times the CUDA kernels under graph replay: no CUDA"}
    try:
        env, auto_of = impls.attention_splits_control()
    except (ImportError, AttributeError) as exc:
        return {"skipped": f"this op layer exposes no split override ({format_error(exc)})"}
    kernel = impls.make(impls.KERNEL, ATTENTION)
    out: dict[str, object] = {"env": env, "context": SWEEP_CONTEXT, "rows": []}
    saved = os.environ.get(env)
    try:
        for r in SWEEP_ROWS:
            spec = CaseSpec(ATTENTION, "sweep", f"R={r} ctx=32K", r, SWEEP_CONTEXT)
            inputs = cases.build(spec, cfg.device, cfg.seed)
            fb = cases.floor_bytes(ATTENTION, inputs.tensors)
            rotation = timing.plan(
                fb.total, timing.page_bytes(inputs), int(timing.used_pages(inputs).numel()),
                int(cfg.rotation_factor * cfg.cache_bytes), cfg.max_copies, cfg.memory_budget,
            )  # fmt: skip
            copies, _ = timing.make_copies(inputs, rotation, cfg.seed)
            os.environ.pop(env, None)
            row: dict[str, object] = {"rows": r, "auto": int(auto_of(r)), "us": {}}
            for splits in SWEEP_SPLITS:
                os.environ[env] = str(splits)
                unit = GraphUnit(kernel.call, copies, len(copies), cfg.device)
                try:
                    samples = timing.run_solo(unit, cfg.pairs, cfg.warmup_units)
                    row["us"][str(splits)] = 1e6 * statistics.median(samples)
                finally:
                    unit.close()
            out["rows"].append(row)
            del inputs, copies
            _release(cfg.device)
    finally:
        if saved is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = saved
    return out
