"""The result files: JSON (everything, every raw sample), a Markdown report, a PNG plot, and
the timing section of the GPU validation record (``--validation PATH``).

Results are committed, so nothing here writes a machine path (``strip_paths``). This module
reads only the results dictionary: it imports nothing else of the benchmark.
"""

from __future__ import annotations

import json
import math
import re
import traceback
from pathlib import Path

MODES = ("graph", "eager")
VALIDATION_SCHEMA = "qsa-bench-validation/1"


def strip_paths(text: str) -> str:
    """``/any/dir/file.py`` -> ``file.py``: results are committed and must not carry machine
    paths, and messages of torch or of the loader may."""
    return re.sub(r"(?<![\w.])/(?:[\w.+-]+/)+", "", text)


def format_error(exc: BaseException) -> str:
    """``Type: message`` and the innermost frames as ``file.py:line in function`` (file names
    only)."""
    frames = traceback.extract_tb(exc.__traceback__)[-4:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in reversed(frames))
    message = strip_paths(f"{type(exc).__name__}: {exc}")[:1500]
    return message + (f" (at {where})" if where else "")


def _us(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "–"
    us = seconds * 1e6
    return f"{us:.1f}" if us < 1000 else f"{us:,.0f}"


def _num(us: float | None) -> str:
    return _us(None if us is None else us * 1e-6)


def _pct(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "–"
    return f"{x:.0f} %" if x >= 10 else f"{x:.2g} %"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    if not rows:
        return []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False, default=str) + "\n")
    tmp.replace(path)


def _order(data: dict) -> list[str]:
    """Implementation names in candidate-preference order (the run's --impls, which the CLI
    writes in bench.impls.ALL order), then any other name measured."""
    order = list(data.get("config", {}).get("impls") or [])
    seen = [
        n for c in data["cases"] for m in c.get("modes", {}).values() for n in m.get("latency", {})
    ]
    return order + sorted(set(seen) - set(order))


def _impls_present(cases: list[dict], order: list[str]) -> list[str]:
    seen = {n for c in cases for m in c.get("modes", {}).values() for n in m.get("latency", {})}
    return [n for n in order if n in seen]


def _median(case: dict, mode: str, name: str) -> float | None:
    s = case.get("modes", {}).get(mode, {}).get("latency", {}).get(name)
    return s["median"] if s else None


def _best_mode(case: dict) -> str | None:
    return next((m for m in MODES if m in case.get("modes", {})), None)


def _ratio(num: float | None, den: float | None) -> str:
    return f" ({num / den:.1f}x)" if num and den else ""


def _latency_table(cases: list[dict], mode: str, order: list[str]) -> list[str]:
    names = _impls_present(cases, order)
    head = ["op", "case", "R", "floor µs"] + [f"{n} µs" for n in names] + ["candidate % of floor"]
    rows = []
    for c in cases:
        if mode not in c.get("modes", {}):
            continue
        m = c["modes"][mode]
        cells = [c["spec"]["op"], c["spec"]["name"], str(c["spec"]["rows"]),
                 _us(c["floor"]["seconds"])]  # fmt: skip
        for n in names:
            s = m["latency"].get(n)
            cells.append(f"{_us(s['median'])} [{_us(s['p10'])}–{_us(s['p90'])}]" if s else "–")
        cand = m["candidate"]
        cells.append(f"{_pct(m['pct_of_floor'].get(cand))} ({cand})")
        rows.append(cells)
    return _table(head, rows)


def _per_pairing(case: dict, mode: str, candidate: str) -> str:
    """The candidate's median in each B/C/B pairing, e.g. ``6.3 (upstream) / 6.2 (ref)``: its
    reading beside each baseline, of which the pooled median is one number."""
    comparisons = case.get("modes", {}).get(mode, {}).get("comparisons", [])
    cells = [
        f"{_us(c['candidate_latency']['median'])} ({c['baseline']})"
        for c in comparisons
        if c.get("candidate") == candidate and c.get("candidate_latency")
    ]
    return " / ".join(cells) or "–"


def _target_table(cases: list[dict]) -> list[str]:
    """The kernels' performance-table cases: the kernel's median against its target (pooled,
    and beside each baseline), upstream and the references of the same run (CUDA-graph replay
    where measured, else eager)."""
    head = ["op", "case", "mode", "target µs", "kernel µs", "met", "kernel µs per pairing",
            "upstream µs", "ref-compiled µs", "ref-vectorised µs", "kernel % of floor"]  # fmt: skip
    rows = []
    for c in cases:
        target, mode = c["spec"].get("target_us"), _best_mode(c)
        if target is None or mode is None:
            continue
        kernel = _median(c, mode, "kernel")
        met = "–" if kernel is None else ("yes" if kernel * 1e6 <= target else "no")
        cells = [c["spec"]["op"], c["spec"]["name"], mode, f"{target:g}", _us(kernel), met,
                 _per_pairing(c, mode, "kernel")]  # fmt: skip
        for n in ("upstream", "ref-compiled", "ref-vectorised"):
            cells.append(_us(_median(c, mode, n)) + _ratio(_median(c, mode, n), kernel))
        cells.append(_pct(c["modes"][mode]["pct_of_floor"].get("kernel")))
        rows.append(cells)
    return _table(head, rows)


def _quoted_topk(c: dict, data: dict) -> float | None:
    """The quoted compiled top-k of a selection case timed with the stand-in top-k, in µs
    (None for attention, when the compiled top-k ran, or when no figure is quoted)."""
    up = data.get("upstream", {})
    if up.get("compiled_topk", False) or c["spec"]["op"] != "selection":
        return None
    q = up.get("quoted_topk_us", {})
    blocks = c.get("floor", {}).get("counts", {}).get("usable_blocks", 0) // max(
        1, c["spec"]["rows"]
    )
    return q.get(f"{c['spec']['rows']}x{blocks}")


def _upstream_estimate(c: dict, mode: str, data: dict) -> float | None:
    """Upstream's measured scoring + the quoted compiled top-k, in µs, where one is quoted."""
    score, quoted = _median(c, mode, "upstream-score"), _quoted_topk(c, data)
    return score * 1e6 + quoted if score is not None and quoted is not None else None


def _upstream_table(cases: list[dict], data: dict) -> list[str]:
    """Ours against vLLM's kernels, case by case (graph replay where measured)."""
    head = ["op", "case", "mode", "kernel µs", "upstream µs", "upstream / kernel"]
    head += ["upstream-score µs", "quoted compiled top-k µs", "score + quoted top-k µs"]
    rows = []
    for c in cases:
        mode = _best_mode(c)
        if mode is None:
            continue
        kernel, upstream = _median(c, mode, "kernel"), _median(c, mode, "upstream")
        if upstream is None:
            continue
        score = _median(c, mode, "upstream-score")
        quoted, est = _quoted_topk(c, data), _upstream_estimate(c, mode, data)
        ratio = f"{upstream / kernel:.2f}x" if kernel else "–"
        est_ratio = f" ({est / (kernel * 1e6):.2f}x)" if est and kernel else ""
        rows.append([c["spec"]["op"], c["spec"]["name"], mode, _us(kernel), _us(upstream), ratio,
                     _us(score), _num(quoted), _num(est) + est_ratio])  # fmt: skip
    return _table(head, rows)


# ----------------------------------------------------------------------------------------
# dtypes and layouts (ours and upstream in the same dtype, on the same tensors)
# ----------------------------------------------------------------------------------------

SEED_LAYOUT = "seed"
VLLM_BF16, PACKED_BF16 = "vllm_bf16_784", "bf16_packed_512"  # the pages comparison
PAGES_WITHIN = 0.05  # vLLM's pages within 5 % of packed ones (the bound)


def _layout(c: dict) -> str:
    return c["spec"].get("layout", SEED_LAYOUT)


def _layout_label(c: dict) -> str:
    return c["spec"].get("layout_label") or _layout(c)


def dtype_rows(cases: list[dict]) -> list[dict]:
    """The cases of the dtype comparison: every measured ``dtype`` case, and beside it the
    seed-layout (float16) scale case of the same operator, R and context; ordered by
    operator, R, then layout as the grid lists them."""
    variants = [c for c in cases if c["spec"]["group"] == "dtype" and _best_mode(c)]
    keys = {(c["spec"]["op"], c["spec"]["rows"], c["spec"]["context"]) for c in variants}
    seeds = [c for c in cases if c["spec"]["group"] == "scale" and _layout(c) == SEED_LAYOUT
             and (c["spec"]["op"], c["spec"]["rows"], c["spec"]["context"]) in keys
             and _best_mode(c)]  # fmt: skip
    layouts = [SEED_LAYOUT] + list(dict.fromkeys(_layout(c) for c in variants))
    return sorted(seeds + variants, key=lambda c: (c["spec"]["op"], c["spec"]["rows"],
                                                   layouts.index(_layout(c))))  # fmt: skip


def upstream_us(c: dict, mode: str, data: dict) -> tuple[float | None, str]:
    """Upstream's time in µs and how it was obtained: measured, or for selection where the
    compiled top-k could not run, its measured scoring + the quoted compiled top-k."""
    est = _upstream_estimate(c, mode, data)
    if est is not None:
        return est, "score + quoted top-k"
    up = _median(c, mode, "upstream")
    if up is None:
        return None, "skipped" if "upstream" in c.get("skipped", {}) else "not measured"
    stand_in = c["spec"]["op"] == "selection" and not data.get("upstream", {}).get(
        "compiled_topk", False
    )
    return up * 1e6, "measured, stand-in top-k" if stand_in else "measured"


def _pct_us(floor_s: float, us: float | None) -> str:
    return _pct(100.0 * floor_s * 1e6 / us) if us else "–"


def _dtype_table(cases: list[dict], data: dict, op: str) -> list[str]:
    head = ["R", "context", "dtype / layout", "floor µs", "kernel µs", "kernel % of floor",
            "upstream µs (same dtype)", "upstream % of floor", "upstream / kernel",
            "target µs"]  # fmt: skip
    rows = []
    for c in dtype_rows(cases):
        if c["spec"]["op"] != op:
            continue
        mode = _best_mode(c)
        kernel = _median(c, mode, "kernel")
        kernel_us = kernel * 1e6 if kernel else None
        up, how = upstream_us(c, mode, data)
        floor_s = c["floor"]["seconds"]
        up_cell = f"{_num(up)} ({how})" if up is not None else how
        target = c["spec"].get("target_us")
        met = "" if target is None or kernel_us is None else (
            " met" if kernel_us <= target else " missed")  # fmt: skip
        rows.append([str(c["spec"]["rows"]), _ctx(c["spec"]["context"]), _layout_label(c),
                     _us(floor_s), _num(kernel_us), _pct_us(floor_s, kernel_us), up_cell,
                     _pct_us(floor_s, up),
                     f"{up / kernel_us:.2f}x" if up and kernel_us else "–",
                     (f"{target:g}" + met) if target is not None else "–"])  # fmt: skip
    return _table(head, rows)


def _pages_table(cases: list[dict]) -> list[str]:
    """Ours on vLLM's bfloat16 layout (784-token pages spanning 4 layers) against the same
    layout on packed 512-token pages."""
    by = {(c["spec"]["op"], c["spec"]["rows"], _layout(c)): c for c in dtype_rows(cases)}
    head = ["op", "R", "bf16 vLLM p784 µs", "bf16 packed p512 µs", "p784 / p512",
            f"within {PAGES_WITHIN:.0%}"]  # fmt: skip
    rows = []
    for (op, r, lay), c in sorted(by.items()):
        other = by.get((op, r, PACKED_BF16))
        if lay != VLLM_BF16 or other is None:
            continue
        a, b = _median(c, _best_mode(c), "kernel"), _median(other, _best_mode(other), "kernel")
        if not a or not b:
            continue
        rows.append([op, str(r), _us(a), _us(b), f"{a / b:.3f}",
                     "yes" if a <= (1 + PAGES_WITHIN) * b else "no"])  # fmt: skip
    return _table(head, rows)


def _ctx(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def _comparison_table(cases: list[dict]) -> list[str]:
    head = ["op", "case", "mode", "candidate vs baseline", "speedup [p10–p90]", "wins",
            "baseline drift"]  # fmt: skip
    rows = []
    for c in cases:
        for mode in MODES:
            for comp in c.get("modes", {}).get(mode, {}).get("comparisons", []):
                rows.append([
                    c["spec"]["op"], c["spec"]["name"], mode,
                    f"{comp['candidate']} vs {comp['baseline']}",
                    f"{comp['speedup_median']:.2f}x [{comp['speedup_p10']:.2f}–"
                    f"{comp['speedup_p90']:.2f}]",
                    f"{comp['wins']}/{comp['pairs']}", f"{comp['drift_pct']:+.2f} %",
                ])  # fmt: skip
    return _table(head, rows)


def _profile_table(cases: list[dict]) -> list[str]:
    head = ["op", "case", "implementation", "device kernels", "memcpy DtoH", "host-sync ops",
            "CPU events", "kernels (launches, device µs)"]  # fmt: skip
    rows = []
    for c in cases:
        for name, p in c.get("profile", {}).items():
            if "error" in p:
                cells = ["error"] * 5
            else:
                cells = [str(p[k]) for k in ("device_kernels", "memcpy_dtoh", "host_sync_ops",
                                             "cpu_events")]  # fmt: skip
                top = p.get("top_kernels", [])[:3]
                cells.append("; ".join(f"`{t[0][:40]}` {t[1]}x {t[2]:.1f}" for t in top
                                       if len(t) > 2) or "–")  # fmt: skip
            rows.append([c["spec"]["op"], c["spec"]["name"], name, *cells])
    return _table(head, rows)


def _host_table(h: dict) -> list[str]:
    head = ["call", "host µs per call", "ratio to add_", "target"]
    rows = [["`Tensor.add_` (device tensor)", _num(h["aten_add_us"]), "1.0", ""]]
    for key, label in (("select", "select_paged_tokens"), ("attention", "sparse_paged_attention")):
        ratio = h[f"{key}_ratio"]
        met = "met" if ratio <= h["target_ratio"] else "missed"
        rows.append([f"`qsa_ops.{label}` ({h.get(f'{key}_case', '')})", _num(h[f"{key}_eager_us"]),
                     f"{ratio:.2f}", f"<= {h['target_ratio']:g}: {met}"])  # fmt: skip
    return _table(head, rows)


def _decode_ops(d: dict) -> list[str]:
    """The ops of the decode step (a results file records them; older ones: from the rows)."""
    if d.get("ops"):
        return list(d["ops"])
    for e in d.get("rows", []):
        if e.get("graph"):
            return list(e["graph"]["ops_alone_us_per_layer"])
    return ["select", "attention"]


def _decode_table(d: dict) -> list[str]:
    ops = _decode_ops(d)
    head = ["R", "eager host µs/layer", "`add_` µs (same reps)", "eager GPU µs/layer",
            "graph GPU µs/layer",
            "graph host µs/layer", f"{' + '.join(ops)} (graph, alone) µs/layer",
            "graph / kernel sum", "targets"]  # fmt: skip
    t = d["targets"]
    rows = []
    for e in d.get("rows", []):
        if "error" in e:
            rows.append([str(e["rows"]), f"error: {e['error'][:160]}"] + [""] * 7)
            continue
        eager, graph = e.get("eager", {}), e.get("graph")
        targets = [f"eager host <= {t['eager_host_us_per_layer']:g}: "
                   + ("met" if eager.get("met") else "missed")]  # fmt: skip
        if graph:
            alone = graph["ops_alone_us_per_layer"]
            parts = " + ".join(_num(alone.get(k)) for k in ops)
            sum_cell = f"{parts} = {_num(graph['kernel_sum_us_per_layer'])}"
            targets.append(f"graph <= {t['graph_step_over_kernel_sum']:g}x: "
                           + ("met" if graph["met"] else "missed"))  # fmt: skip
            cells = [_num(graph["gpu_us_per_layer"]), _num(graph["host_us_per_layer"]), sum_cell,
                     f"{graph['ratio']:.2f}x"]  # fmt: skip
        else:
            cells = ["–", "–", "–", "–"]
        rows.append([str(e["rows"]), _num(eager.get("host_us_per_layer")),
                     _num(eager.get("add_us")), _num(eager.get("gpu_us_per_layer")), *cells,
                     "; ".join(targets)])  # fmt: skip
    return _table(head, rows)


_DECODE_OP_NAMES = {"select": "select_paged_tokens", "attention": "sparse_paged_attention"}


def _sweep_table(s: dict) -> list[str]:
    splits = sorted({int(k) for r in s.get("rows", []) for k in r["us"]})
    head = ["R", "auto"] + [f"{k} µs" for k in splits]
    rows = [[str(r["rows"]), str(r["auto"])] + [_num(r["us"].get(str(k))) for k in splits]
            for r in s.get("rows", [])]  # fmt: skip
    return _table(head, rows)


def _checks(cases: list[dict]) -> list[str]:
    out = []
    for c in cases:
        if c.get("reference_error"):
            out.append(f"- {c['spec']['op']} / {c['spec']['name']}: the reference failed, "
                       f"nothing compared: `{c['reference_error'][:200]}`")  # fmt: skip
        for name, info in c.get("impls", {}).items():
            chk = info.get("check")
            where = f"{c['spec']['op']} / {c['spec']['name']} / {name}"
            if "error" in info:
                out.append(f"- {where}: **error** — `{info['error'].splitlines()[-1][:200]}`")
            elif chk and chk.get("ok") is False:
                out.append(f"- {where}: disagrees with the reference: {chk}")
    return out


def _upstream_line(data: dict) -> str:
    up = data.get("upstream")
    if not up:
        return ""
    if not up.get("available"):
        return f"Upstream (vLLM's own kernels): **skipped** — {up.get('skip')}."
    version = up.get("version") or "(version not recorded)"
    line = (f"Upstream: vLLM {version}'s Triton kernels from {up.get('source')}, on each "
            "case's own tensors in its own dtype (skipped, with the reason in the notes, where "
            f"it cannot take a case); top-k: {up.get('topk')}.")  # fmt: skip
    if not up.get("compiled_topk"):
        line += (f" Quoted compiled top-k figures: {up.get('quoted_topk_source')}: "
                 + ", ".join(f"{k} blocks {v} µs" for k, v in up.get("quoted_topk_us", {}).items())
                 + ".")  # fmt: skip
    return line


_DTYPE_INTRO = (
    "Each row: ours (the public op) and vLLM's kernel in the same dtype, on the same tensors "
    "(graph replay where measured); fp16 seed p512 = the scale case of the same R and context. "
    "% of floor = the floor's time over the measured time, the floor counting each input's "
    "bytes in its own dtype (float8 K/V and keys: 1 byte per element). Selection: upstream = "
    "its scoring + its top-k (see the top-k line above)."
)


def markdown(data: dict) -> str:
    env, cfg, cases = data["environment"], data["config"], data["cases"]
    bw = data.get("copy_bandwidth", {})
    git = env.get("git", {})
    dso = env.get("dso") or {}
    lines = [
        f"# QSA benchmark — {env.get('device_name')}",
        "",
        f"torch {env.get('torch')}, CUDA {env.get('cuda')}, commit `{git.get('commit')}`"
        + (" (dirty)" if git.get("dirty") else "")
        + f", DSO SHA256 `{dso.get('sha256', 'n/a')}`, {env.get('date_utc')}.",
        "",
        f"Protocol: {cfg['warmup_units']} excluded warm-up units, {cfg['pairs']} B/C/B pairs per "
        f"comparison, about {cfg['unit_s'] * 1e3:g} ms per unit (calls per unit in the JSON); "
        f"latency = median per call [p10–p90]; inputs rotated over copies touching "
        f"{cfg['rotation_factor']:g}x the {cfg['cache_bytes'] / 2**20:.0f} MiB cache where memory "
        f"allows. Floor = bytes moved / copy bandwidth "
        f"({bw.get('bandwidth_bytes_per_s', float('nan')) / 1e9:.0f} GB/s, read + written, "
        f"measured in this run).",
        "",
    ]
    if _upstream_line(data):
        lines += [_upstream_line(data), ""]
    order = _order(data)
    sections = [
        ("Performance-table cases", "Median per call; in brackets the baseline's time over the "
         "kernel's.", _target_table(cases)),
        ("Against upstream (vLLM 0.32.0)", "upstream / kernel > 1: ours is faster. Selection: "
         "upstream = its scoring + its top-k (see the top-k line above); the quoted compiled "
         "top-k is added to the measured scoring where the compiled op could not run.",
         _upstream_table(cases, data)),
        ("Attention by dtype and layout", _DTYPE_INTRO, _dtype_table(cases, data, "attention")),
        ("Selection by dtype and layout", _DTYPE_INTRO, _dtype_table(cases, data, "selection")),
        ("vLLM's pages against packed pages (ours, bfloat16)", "Same tensors but the page "
         "geometry: 784-token pages whose page stride spans 4 layers, against one layer of "
         "packed 512-token pages.", _pages_table(cases)),
        ("Latency — CUDA-graph replay", "", _latency_table(cases, "graph", order)),
        ("Latency — Eager (host overhead included)", "", _latency_table(cases, "eager", order)),
        ("B/C/B comparisons", "Speedup = baseline / candidate per pair (median [p10–p90]); a win "
         "= the candidate beat both baseline units of its pair; drift = second baseline vs first.",
         _comparison_table(cases)),
    ]  # fmt: skip
    host = data.get("host_overhead")
    if host and "aten_add_us" in host:
        sections.append(("Host overhead (eager, R = 1)", f"{host['method']}; backend "
                         f"{host['backend']}.", _host_table(host)))  # fmt: skip
    dec = data.get("decode_step")
    if dec:
        ops = " then ".join(f"qsa_ops.{_DECODE_OP_NAMES.get(o, o)}" for o in _decode_ops(dec))
        intro = (f"The layer's QSA path on our operators ({ops}) for {dec['layers']} layers, "
                 f"{dec['context']} tokens per request, one query per request; each layer has its "
                 "own caches.")  # fmt: skip
        body = _decode_table(dec) if "skipped" not in dec else [f"Skipped: {dec['skipped']}"]
        sections.append(("Decode step", intro, body))
    sweep = data.get("splits_sweep")
    if sweep:
        body = _sweep_table(sweep) if "skipped" not in sweep else [f"Skipped: {sweep['skipped']}"]
        sections.append(("Attention split sweep (graph, L2-rotated, 32K)",
                         f"CTAs per row forced with {sweep.get('env', '')}.", body))  # fmt: skip
    sections.append(("Profiler (one warm call)", "", _profile_table(cases)))
    for title, intro, table in sections:
        if table:
            lines += [f"## {title}", ""] + ([intro, ""] if intro else []) + [*table, ""]
    notes = list(data.get("notes", []))
    notes += _checks(cases)
    skipped = sorted({f"{n}: {r}" for c in cases for n, r in c.get("skipped", {}).items()})
    notes += [f"skipped {s}" for s in skipped]
    if notes:
        lines += ["## Notes", "", *[n if n.startswith("- ") else f"- {n}" for n in notes], ""]
    return "\n".join(lines)


def validation_section(data: dict) -> dict:
    """The ``timing`` section of the GPU validation record: per measured case the kernel's
    median (graph replay where measured), its target, upstream and the references, the floor;
    the host overhead and the decode step; ``bench_json`` names the full results file."""
    env, cases = data["environment"], data["cases"]
    rows = []
    for c in cases:
        mode = _best_mode(c)
        if mode is None:
            continue
        lat = c["modes"][mode]["latency"]
        kernel = _median(c, mode, "kernel")
        target = c["spec"].get("target_us")

        def us(name, lat=lat):
            return lat[name]["median"] * 1e6 if name in lat else None

        rows.append({
            "op": c["spec"]["op"], "case": c["spec"]["name"], "rows": c["spec"]["rows"],
            "context": c["spec"]["context"], "mode": mode, "target_us": target,
            "kernel_us": us("kernel"),
            "met": None if target is None or kernel is None else kernel * 1e6 <= target,
            "upstream_us": us("upstream"),
            "upstream_over_kernel": us("upstream") / us("kernel") if us("upstream") and kernel
            else None,
            "references_us": {n: us(n) for n in lat if n.startswith("ref-")},
            "floor_bytes": c["floor"]["total"], "floor_us": c["floor"]["seconds"] * 1e6,
            "kernel_pct_of_floor": c["modes"][mode]["pct_of_floor"].get("kernel"),
            "layout": _layout(c), "layout_label": _layout_label(c),
            "dtypes": c["spec"].get("dtypes"),
            "upstream_score_us": us("upstream-score"),
            "upstream_pct_of_floor": c["modes"][mode]["pct_of_floor"].get("upstream"),
            "upstream_skip": c.get("skipped", {}).get("upstream"),
        })  # fmt: skip
    bw = data.get("copy_bandwidth", {})
    return {
        "schema": VALIDATION_SCHEMA,
        "command": "python -m custom_esimd_kernels_vllm.bench "
        + " ".join(data["config"].get("argv", [])),
        "device": env.get("device_name"),
        "commit": env.get("git", {}).get("commit"),
        "copy_bandwidth_bytes_per_s": bw.get("bandwidth_bytes_per_s"),
        "copy_method": bw.get("method"),
        "upstream": {
            k: data.get("upstream", {}).get(k)
            for k in ("available", "skip", "source", "version", "topk")
        },  # fmt: skip
        "cases": rows,
        "host_overhead": data.get("host_overhead"),
        "decode_step": data.get("decode_step"),
        "splits_sweep": data.get("splits_sweep"),
        "notes": data.get("notes", []),
        "bench_json": data.get("stem", "") + ".json",
    }


# ----------------------------------------------------------------------------------------
# the plot
# ----------------------------------------------------------------------------------------


def _panel_latency(ax, sel: list[dict], order: list[str]) -> None:
    ctx = [c["spec"]["context"] for c in sel]
    for k, name in enumerate(order):
        for mode, style in (("graph", "-o"), ("eager", "--x")):
            pts = [(c["spec"]["context"], _median(c, mode, name) * 1e6) for c in sel
                   if _median(c, mode, name) is not None]  # fmt: skip
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, style, color=f"C{k}", label=f"{name} ({mode})", ms=4)
                break  # graph when measured, else eager
    ax.plot(ctx, [c["floor"]["seconds"] * 1e6 for c in sel], "k:", lw=2, label="memory floor")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ctx, [f"{x // 1024}K" if x % 1024 == 0 else str(x) for x in ctx])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.grid(True, which="both", alpha=0.3)


def _panel_ratio(ax, cases: list[dict], op: str, data: dict) -> bool:
    """upstream / kernel against context, one line per R; for selection with the stand-in
    top-k, (upstream's scoring + the quoted compiled top-k) / kernel, as in the table."""
    drew = estimated = False
    for k, rows in enumerate(sorted({c["spec"]["rows"] for c in cases if c["spec"]["op"] == op})):
        pts = []
        for c in sorted(cases, key=lambda c: c["spec"]["context"]):
            if c["spec"]["op"] != op or c["spec"]["rows"] != rows or not _best_mode(c):
                continue
            mode = _best_mode(c)
            kern, up = _median(c, mode, "kernel"), _median(c, mode, "upstream")
            est = _upstream_estimate(c, mode, data)
            if est is not None:
                up, estimated = est * 1e-6, True
            if kern and up:
                pts.append((c["spec"]["context"], up / kern))
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, "-o", color=f"C{k}", ms=4, label=f"R={rows}")
            drew = True
    ax.axhline(1.0, color="k", lw=1, ls=":")
    ax.set_xscale("log", base=2)
    ctx = sorted({c["spec"]["context"] for c in cases if c["spec"]["op"] == op})
    ax.set_xticks(ctx, [f"{x // 1024}K" if x % 1024 == 0 else str(x) for x in ctx])
    ax.minorticks_off()
    base = "(upstream score + quoted top-k)" if estimated else "upstream"
    ax.set_title(f"{op}: {base} / kernel\n(> 1: ours faster)", fontsize=9)
    ax.set_xlabel("context (tokens)")
    ax.grid(True, alpha=0.3)
    if drew:
        ax.legend(fontsize=7)
    return drew


def _log_axes(ax, rows: list[int], title: str, xlabel: str) -> None:
    """Log-log axes over the rows R (one tick per R), the plots' common style."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(rows, [str(x) for x in rows])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.grid(True, which="both", alpha=0.3)


def _panel_decode(ax, dec: dict) -> bool:
    rows = [e for e in dec.get("rows", []) if "eager" in e]
    if not rows:
        return False
    r = [e["rows"] for e in rows]
    series = [("eager host", lambda e: e["eager"]["host_us_per_layer"]),
              ("eager GPU", lambda e: e["eager"]["gpu_us_per_layer"]),
              ("graph GPU", lambda e: e.get("graph", {}).get("gpu_us_per_layer")),
              ("kernel sum (graph)",
               lambda e: e.get("graph", {}).get("kernel_sum_us_per_layer"))]  # fmt: skip
    for k, (label, get) in enumerate(series):
        pts = [(x, get(e)) for x, e in zip(r, rows, strict=True) if get(e) is not None]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, "-o", ms=4, color=f"C{k}", label=label)
    ax.axhline(dec["targets"]["eager_host_us_per_layer"], color="C0", ls=":", lw=1)
    _log_axes(ax, r, f"decode step, {dec['layers']} layers (µs per layer)", "R (requests)")
    ax.legend(fontsize=7)
    return True


def plot(data: dict, path: Path) -> str | None:
    """Latency against context, one panel per (operator, rows), log scales, one line per
    implementation (CUDA-graph medians where measured, else eager), the floor dotted; a last
    row with upstream / kernel per operator and the decode step. Returns None, or why no plot
    was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: matplotlib missing ({exc})"
    cases = [c for c in data["cases"] if c["spec"]["group"] != "seed" and c.get("modes")
             and _layout(c) == SEED_LAYOUT and c["spec"]["group"] != "dtype"]  # fmt: skip
    panels = sorted({(c["spec"]["op"], c["spec"]["rows"]) for c in cases})
    if not panels:
        return "no plot: no measured scale case"
    ops = sorted({p[0] for p in panels})
    rows_by_op = {op: sorted(r for o, r in panels if o == op) for op in ops}
    dec = data.get("decode_step") or {}
    summary = any(_median(c, m, "upstream") for c in cases for m in MODES) or any(
        "eager" in e for e in dec.get("rows", [])
    )
    ncols = max(len(v) for v in rows_by_op.values())
    if summary:
        ncols = max(ncols, len(ops) + 1)
    nrows = len(ops) + summary
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 3.2 * nrows), squeeze=False)
    for i, op in enumerate(ops):
        for j in range(ncols):
            ax = axes[i][j]
            if j >= len(rows_by_op[op]):
                ax.set_visible(False)
                continue
            rows = rows_by_op[op][j]
            sel = sorted((c for c in cases if c["spec"]["op"] == op and c["spec"]["rows"] == rows),
                         key=lambda c: c["spec"]["context"])  # fmt: skip
            _panel_latency(ax, sel, _order(data))
            ax.set_title(f"{op}, R={rows}", fontsize=10)
            if j == 0:
                ax.set_ylabel("latency per call (µs)")
    if summary:
        last = axes[len(ops)]
        used = [_panel_ratio(last[j], cases, op, data) for j, op in enumerate(ops)]
        used.append(_panel_decode(last[len(ops)], dec))
        for j, ax in enumerate(last):
            if j >= len(used) or not used[j]:
                ax.set_visible(False)
    handles, labels = {}, []
    for ax in axes[: len(ops)].flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    fig.legend([handles[lab] for lab in labels], labels, loc="lower center",
               ncol=min(4, len(labels)), fontsize=8)  # fmt: skip
    env = data["environment"]
    fig.suptitle(f"QSA operators on {env.get('device_name')} (torch {env.get('torch')})",
                 fontsize=11)  # fmt: skip
    fig.tight_layout(rect=(0, 0.06 + 0.015 * (len(labels) > 4), 1, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def plot_dtypes(data: dict, path: Path) -> str | None:
    """Latency against R, one panel per (operator, dtype/layout): ours (the kernel), upstream in
    the same dtype (for selection where the compiled top-k could not run: its scoring + the
    quoted top-k, as in the table) and the memory floor; log scales. Returns None, or why no
    plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no dtype plot: matplotlib missing ({exc})"
    rows = dtype_rows(data["cases"])
    if not rows:
        return "no dtype plot: no measured dtype case"
    ops = sorted({c["spec"]["op"] for c in rows})
    layouts = list(dict.fromkeys(_layout(c) for c in rows))
    labels = {_layout(c): _layout_label(c) for c in rows}
    fig, axes = plt.subplots(len(ops), len(layouts), figsize=(3.6 * len(layouts), 3.2 * len(ops)),
                             squeeze=False, sharey="row")  # fmt: skip
    for i, op in enumerate(ops):
        for j, lay in enumerate(layouts):
            ax = axes[i][j]
            sel = sorted((c for c in rows if c["spec"]["op"] == op and _layout(c) == lay),
                         key=lambda c: c["spec"]["rows"])  # fmt: skip
            if not sel:
                ax.set_visible(False)
                continue
            series = {
                "ours (kernel)": [(c["spec"]["rows"], (_median(c, _best_mode(c), "kernel")
                                   or math.nan) * 1e6) for c in sel],
                "upstream (same dtype)": [(c["spec"]["rows"],
                                           upstream_us(c, _best_mode(c), data)[0] or math.nan)
                                          for c in sel],
                "memory floor": [(c["spec"]["rows"], c["floor"]["seconds"] * 1e6) for c in sel],
            }  # fmt: skip
            for k, (name, pts) in enumerate(series.items()):
                pts = [(x, y) for x, y in pts if math.isfinite(y)]
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    style = "k:" if name == "memory floor" else "-o"
                    kw = {} if name == "memory floor" else {"color": f"C{k}", "ms": 4}
                    ax.plot(xs, ys, style, label=name, **kw)
            r = [c["spec"]["rows"] for c in sel]
            _log_axes(ax, r, f"{op}, {labels[lay]}", "R (rows)")
            if j == 0:
                ax.set_ylabel("latency per call (µs)")
    handles, names = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in names:
                handles.append(h)
                names.append(lab)
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=8)
    env = data["environment"]
    fig.suptitle(f"QSA operators by dtype and layout on {env.get('device_name')}", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def write_all(data: dict, out_dir: Path, stem: str, with_plot: bool = True) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / f"{stem}.json",
        "md": out_dir / f"{stem}.md",
        "png": out_dir / f"{stem}.png",
        "png_dtypes": out_dir / f"{stem}-dtypes.png",
    }
    if not dtype_rows(data["cases"]):  # no dtype case in this grid: no such plot
        paths.pop("png_dtypes")
    if with_plot:
        for key, fn in (("png", plot), ("png_dtypes", plot_dtypes)):
            if key not in paths:
                continue
            why = fn(data, paths[key])
            if why:
                notes = data.setdefault("notes", [])
                if why not in notes:
                    notes.append(why)
                paths.pop(key)
    else:
        paths.pop("png")
        paths.pop("png_dtypes", None)
    write_json(paths["json"], data)
    paths["md"].write_text(markdown(data) + "\n")
    return paths
