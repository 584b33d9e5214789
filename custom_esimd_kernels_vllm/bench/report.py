"""The three result files: JSON (everything, every raw sample), a Markdown table, a PNG plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .impls import ALL

MODES = ("graph", "eager")


def _us(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "–"
    us = seconds * 1e6
    return f"{us:.1f}" if us < 1000 else f"{us:,.0f}"


def _pct(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "–"
    return f"{x:.0f} %" if x >= 10 else f"{x:.2g} %"


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False, default=str) + "\n")
    tmp.replace(path)


def _impls_present(cases: list[dict]) -> list[str]:
    seen = {n for c in cases for m in c.get("modes", {}).values() for n in m.get("latency", {})}
    return [n for n in ALL if n in seen]


def _latency_table(cases: list[dict], mode: str) -> list[str]:
    names = _impls_present(cases)
    rows = [c for c in cases if mode in c.get("modes", {})]
    if not rows or not names:
        return []
    head = ["op", "case", "R", "floor µs"] + [f"{n} µs" for n in names] + ["candidate % of floor"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in rows:
        m = c["modes"][mode]
        cells = [
            c["spec"]["op"],
            c["spec"]["name"],
            str(c["spec"]["rows"]),
            _us(c["floor"]["seconds"]),
        ]
        for n in names:
            s = m["latency"].get(n)
            cells.append(f"{_us(s['median'])} [{_us(s['p10'])}–{_us(s['p90'])}]" if s else "–")
        cand = m["candidate"]
        cells.append(f"{_pct(m['pct_of_floor'].get(cand))} ({cand})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _target_table(cases: list[dict]) -> list[str]:
    """The kernels' performance-table cases: the kernel's median against its target and
    the references of the same run (CUDA-graph replay where measured, else eager)."""
    head = ["op", "case", "mode", "target µs", "kernel µs", "met", "ref-compiled µs",
            "ref-vectorised µs", "kernel % of floor"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    count = 0
    for c in cases:
        target = c["spec"].get("target_us")
        modes = c.get("modes", {})
        mode = next((m for m in MODES if m in modes), None)
        if target is None or mode is None:
            continue
        m = modes[mode]
        lat = m["latency"]

        def med(name, lat=lat):
            return lat[name]["median"] if name in lat else None

        kernel = med("kernel")
        met = "–" if kernel is None else ("yes" if kernel * 1e6 <= target else "no")
        ratios = {n: f" ({med(n) / kernel:.1f}x)" if kernel and med(n) else "" for n in lat}
        count += 1
        lines.append(
            "| " + " | ".join([
                c["spec"]["op"], c["spec"]["name"], mode, f"{target:g}", _us(kernel), met,
                _us(med("ref-compiled")) + ratios.get("ref-compiled", ""),
                _us(med("ref-vectorised")) + ratios.get("ref-vectorised", ""),
                _pct(m["pct_of_floor"].get("kernel")),
            ]) + " |"
        )  # fmt: skip
    return lines if count else []


def _comparison_table(cases: list[dict]) -> list[str]:
    head = [
        "op",
        "case",
        "mode",
        "candidate vs baseline",
        "speedup [p10–p90]",
        "wins",
        "baseline drift",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    count = 0
    for c in cases:
        for mode in MODES:
            for comp in c.get("modes", {}).get(mode, {}).get("comparisons", []):
                count += 1
                lines.append(
                    "| " + " | ".join([
                        c["spec"]["op"], c["spec"]["name"], mode,
                        f"{comp['candidate']} vs {comp['baseline']}",
                        f"{comp['speedup_median']:.2f}x [{comp['speedup_p10']:.2f}–{comp['speedup_p90']:.2f}]",
                        f"{comp['wins']}/{comp['pairs']}",
                        f"{comp['drift_pct']:+.2f} %",
                    ]) + " |"
                )  # fmt: skip
    return lines if count else []


def _profile_table(cases: list[dict]) -> list[str]:
    head = [
        "op",
        "case",
        "implementation",
        "device kernels",
        "memcpy DtoH",
        "host-sync ops",
        "CPU events",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    count = 0
    for c in cases:
        for name, p in c.get("profile", {}).items():
            count += 1
            if "error" in p:
                cells = ["error"] * 4
            else:
                cells = [
                    str(p[k])
                    for k in ("device_kernels", "memcpy_dtoh", "host_sync_ops", "cpu_events")
                ]
            lines.append(
                "| " + " | ".join([c["spec"]["op"], c["spec"]["name"], name, *cells]) + " |"
            )
    return lines if count else []


def _checks(cases: list[dict]) -> list[str]:
    out = []
    for c in cases:
        for name, info in c.get("impls", {}).items():
            chk = info.get("check")
            if "error" in info:
                out.append(f"- {c['spec']['op']} / {c['spec']['name']} / {name}: **error** — "
                           f"`{info['error'].splitlines()[-1][:200]}`")  # fmt: skip
            elif chk and not chk.get("ok"):
                out.append(f"- {c['spec']['op']} / {c['spec']['name']} / {name}: disagrees with "
                           f"the reference: {chk}")  # fmt: skip
    return out


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
        f"{cfg['rotation_factor']:g}x the {cfg['cache_bytes'] / 2**20:.0f} MiB cache where memory allows. "
        f"Floor = bytes moved / copy bandwidth "
        f"({bw.get('bandwidth_bytes_per_s', float('nan')) / 1e9:.0f} GB/s, read + written, "
        f"measured in this run).",
        "",
    ]
    targets = _target_table(cases)
    if targets:
        lines += ["## Performance-table cases", "",
                  "Median per call; in brackets the reference's time over the kernel's.", "",
                  *targets, ""]  # fmt: skip
    for mode, title in (
        ("graph", "CUDA-graph replay"),
        ("eager", "Eager (host overhead included)"),
    ):
        table = _latency_table(cases, mode)
        if table:
            lines += [f"## Latency — {title}", "", *table, ""]
    comp = _comparison_table(cases)
    if comp:
        lines += ["## B/C/B comparisons", "",
                  "Speedup = baseline / candidate per pair (median [p10–p90]); a win = the candidate "
                  "beat both baseline units of its pair; drift = second baseline vs first.", "",
                  *comp, ""]  # fmt: skip
    prof = _profile_table(cases)
    if prof:
        lines += ["## Profiler (one warm call)", "", *prof, ""]
    notes = list(data.get("notes", []))
    notes += _checks(cases)
    skipped = sorted({f"{n}: {r}" for c in cases for n, r in c.get("skipped", {}).items()})
    notes += [f"skipped {s}" for s in skipped]
    if notes:
        lines += ["## Notes", "", *[n if n.startswith("- ") else f"- {n}" for n in notes], ""]
    return "\n".join(lines)


def plot(data: dict, path: Path) -> str | None:
    """Latency against context, one panel per (operator, rows), log scales, one line per
    implementation (CUDA-graph medians where measured, else eager), the floor dashed.
    Returns None, or why no plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: matplotlib missing ({exc})"
    cases = [c for c in data["cases"] if c["spec"]["group"] != "seed" and c.get("modes")]
    panels = sorted({(c["spec"]["op"], c["spec"]["rows"]) for c in cases})
    if not panels:
        return "no plot: no measured scale case"
    ops = sorted({p[0] for p in panels})
    rows_by_op = {op: sorted(r for o, r in panels if o == op) for op in ops}
    ncols = max(len(v) for v in rows_by_op.values())
    fig, axes = plt.subplots(
        len(ops), ncols, figsize=(3.6 * ncols, 3.2 * len(ops)), squeeze=False, sharey="row"
    )
    for i, op in enumerate(ops):
        for j in range(ncols):
            ax = axes[i][j]
            if j >= len(rows_by_op[op]):
                ax.set_visible(False)
                continue
            rows = rows_by_op[op][j]
            sel = sorted(
                (c for c in cases if c["spec"]["op"] == op and c["spec"]["rows"] == rows),
                key=lambda c: c["spec"]["context"],
            )
            ctx = [c["spec"]["context"] for c in sel]
            for k, name in enumerate(ALL):
                for mode, style in (("graph", "-o"), ("eager", "--x")):
                    pts = [
                        (c["spec"]["context"], c["modes"][mode]["latency"][name]["median"] * 1e6)
                        for c in sel
                        if name in c["modes"].get(mode, {}).get("latency", {})
                    ]
                    if pts:
                        xs, ys = zip(*pts, strict=True)
                        # one colour per implementation in every panel
                        color = f"C{k}"
                        ax.plot(xs, ys, style, color=color, label=f"{name} ({mode})", ms=4)
                        break  # graph when measured, else eager
            ax.plot(
                ctx, [c["floor"]["seconds"] * 1e6 for c in sel], "k:", lw=2, label="memory floor"
            )
            ax.set_xscale("log", base=2)
            ax.set_xticks(ctx, [f"{x // 1024}K" if x % 1024 == 0 else str(x) for x in ctx])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_title(f"{op}, R={rows}", fontsize=10)
            ax.set_xlabel("context (tokens)")
            if j == 0:
                ax.set_ylabel("latency per call (µs)")
            ax.grid(True, which="both", alpha=0.3)
    handles, labels = {}, []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    fig.legend(
        [handles[lab] for lab in labels],
        labels,
        loc="lower center",
        ncol=min(4, len(labels)),
        fontsize=8,
    )
    env = data["environment"]
    fig.suptitle(
        f"QSA operators on {env.get('device_name')} (torch {env.get('torch')})", fontsize=11
    )
    fig.tight_layout(rect=(0, 0.08 + 0.02 * (len(labels) > 4), 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_all(data: dict, out_dir: Path, stem: str, with_plot: bool = True) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / f"{stem}.json",
        "md": out_dir / f"{stem}.md",
        "png": out_dir / f"{stem}.png",
    }
    if with_plot:
        why = plot(data, paths["png"])
        if why:
            data.setdefault("notes", []).append(why)
            paths.pop("png")
    else:
        paths.pop("png")
    write_json(paths["json"], data)
    paths["md"].write_text(markdown(data) + "\n")
    return paths
