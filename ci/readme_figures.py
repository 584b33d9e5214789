"""The README's measured figures, rendered from the records they cite.

README.md holds each figure that comes from a record between ``<!-- record:NAME -->`` and
``<!-- /record -->``; the text between is what :data:`BLOCKS` renders from the GPU validation
record (results/gpu-validation.json) and the benchmark record it embeds by name
(results/bench-<GPU>.json of the same run). After a new GPU validation run:

    python3 ci/readme_figures.py            rewrite the README's figure blocks from the records
    python3 ci/readme_figures.py --check    exit 1 when a block differs from its rendering

Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "results"
VALIDATION = RESULTS / "gpu-validation.json"
BLOCK = re.compile(r"<!-- record:(?P<name>[\w-]+) -->(?P<body>.*?)<!-- /record -->", re.S)


def load_records(validation: Path = VALIDATION) -> dict[str, Any]:
    """The validation record and the benchmark record it names (``timing.bench_json``)."""
    record = json.loads(validation.read_text())
    bench = json.loads((validation.parent / record["timing"]["bench_json"]).read_text())
    return {"validation": record, "bench": bench}


# --------------------------------------------------------------------------------------------
# The figures
# --------------------------------------------------------------------------------------------


def short(digest: str) -> str:
    return f"{digest[:8]}…"


def validated_wheel(records: dict[str, Any]) -> str:
    """Which wheel the GPU validation is about, and what it passed."""
    v = records["validation"]
    tests = v["tests"]
    commit = (v["built_from"]["git"] or {}).get("commit") or "unknown"
    return (
        f"the wheel `{v['wheel']['name']}` with SHA256 `{short(v['wheel']['sha256'])}`, built on "
        f"the CPU machine from commit `{commit[:7]}` (library `{v['dso']['name']}`, SHA256 "
        f"`{short(v['dso']['sha256'])}`), installed as it is on an {v['gpu']} on "
        f"{v['date'][:10]}: {tests['passed']} GPU tests passed, {tests['failed']} failed, "
        f"{tests['skipped']} skipped"
    )


def _label(case: dict[str, Any]) -> str:
    name = case["case"]
    detail = (
        "P8192 saturated"
        if "P8192" in name
        else "width 2051"
        if "width 2051" in name
        else f"{case['context'] // 1024}K context"
    )
    return f"R={case['rows']}, {detail}"


def _graph_median_us(bench: dict[str, Any], case: dict[str, Any], impl: str) -> float:
    for entry in bench["cases"]:
        spec = entry["spec"]
        if (spec["op"], spec["name"]) == (case["op"], case["case"]):
            return entry["modes"]["graph"]["latency"][impl]["median"] * 1e6
    raise KeyError(f"{case['op']} {case['case']}: not in the benchmark record")


def upstream_of(records: dict[str, Any], case: dict[str, Any]) -> tuple[str, float | None]:
    """Upstream's time as the table shows it and upstream / kernel (None: not measured, e.g.
    upstream takes no float16 queries). Selection: its scoring in this run plus its compiled
    top-k's quoted figure for the same shape (scoring alone where none is quoted)."""
    if case["op"] != "selection":
        if case.get("upstream_us") is None:
            return "—", None
        return f"{case['upstream_us']:.1f}", case["upstream_over_kernel"]
    try:
        score = _graph_median_us(records["bench"], case, "upstream-score")
    except KeyError:
        return "—", None
    quoted = records["bench"]["upstream"].get("quoted_topk_us") or {}
    topk = quoted.get(f"{case['rows']}x{case['context'] // 4}")
    if topk is None:
        return f"{score:.1f} (scoring only)", None
    return f"{score:.1f} + {topk:.1f}", (score + topk) / case["kernel_us"]


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def bench_table(records: dict[str, Any]) -> str:
    rows = [
        "| op | case | dtype / layout | target µs | kernel µs | upstream µs "
        "| upstream / kernel | vectorised ref µs | % of memory floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case in records["validation"]["timing"]["cases"]:
        upstream, ratio = upstream_of(records, case)
        ref = (case.get("references_us") or {}).get("ref-vectorised")
        rows.append(
            f"| {case['op']} | {_label(case)} | {case.get('layout_label') or 'fp16 seed'} "
            f"| {_num(case['target_us'], 'g')} | {case['kernel_us']:.1f} | {upstream} "
            f"| {_num(ratio, '.2f')}{'' if ratio is None else 'x'} | {_num(ref, ',.0f')} "
            f"| {_num(case['kernel_pct_of_floor'], '.0f')} % |"
        )
    return "\n\n" + "\n".join(rows) + "\n\n"


def ratio_range(ratios: list[float]) -> str:
    low, high = f"{min(ratios):.2f}", f"{max(ratios):.2f}"
    return f"{low}x" if low == high else f"{low}-{high}x"


def attention_speedups(records: dict[str, Any]) -> str:
    """upstream / ours over the attention cases where upstream ran on the same inputs."""
    cases = records["validation"]["timing"]["cases"]
    ratios = [
        c["upstream_over_kernel"]
        for c in cases
        if c["op"] == "attention" and c.get("upstream_over_kernel") is not None
    ]
    return "attention " + (ratio_range(ratios) if ratios else "not measured")


def host_cost(records: dict[str, Any]) -> str:
    h = records["validation"]["timing"]["host_overhead"]
    under = "both under" if h["met"] else "not both under"
    return (
        f"`add_` {h['aten_add_us']:.1f} µs, selection {h['select_eager_us']:.1f} µs "
        f"({h['select_ratio']:.2f}x), attention {h['attention_eager_us']:.1f} µs "
        f"({h['attention_ratio']:.2f}x): {under} the {h['target_ratio']:g}x target"
    )


def decode_graph(records: dict[str, Any]) -> str:
    rows = records["validation"]["timing"]["decode_step"]["rows"]
    times = " / ".join(f"{r['graph']['gpu_us_per_layer']:.1f}" for r in rows)
    sizes = " / ".join(str(r["rows"]) for r in rows)
    ratios = ratio_range([r["graph"]["ratio"] for r in rows])
    return f"graph replay {times} µs per layer at R = {sizes}, {ratios} the kernels' own times"


def decode_eager(records: dict[str, Any]) -> str:
    rows = records["validation"]["timing"]["decode_step"]["rows"]
    host = " / ".join(f"{r['eager']['host_us_per_layer']:.1f}" for r in rows)
    adds = [r["eager"]["add_us"] for r in rows]
    per = [r["eager"]["host_us_per_layer"] / r["eager"]["add_us"] for r in rows]
    return (
        f"eager host per layer {host} µs on a slow host (`add_` {min(adds):.1f}-{max(adds):.1f} µs "
        f"in the same reps: ~{min(per):.1f}-{max(per):.1f} `add_` per layer whatever R"
    )


BLOCKS: dict[str, Callable[[dict[str, Any]], str]] = {
    "validated-wheel": validated_wheel,
    "bench-table": bench_table,
    "attention-speedups": attention_speedups,
    "host-cost": host_cost,
    "decode-graph": decode_graph,
    "decode-eager": decode_eager,
}


# --------------------------------------------------------------------------------------------
# The README's blocks
# --------------------------------------------------------------------------------------------


def render(text: str, records: dict[str, Any]) -> str:
    """``text`` with every figure block replaced by its rendering; KeyError names an unknown
    block."""

    def one(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in BLOCKS:
            raise KeyError(f"README block record:{name} has no renderer; known: {list(BLOCKS)}")
        return f"<!-- record:{name} -->{BLOCKS[name](records)}<!-- /record -->"

    return BLOCK.sub(one, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 ci/readme_figures.py",
        description="Render the README's figure blocks from the records they cite.",
        epilog="exit codes: 0 rendered (or, with --check, up to date), 1 a block differs",
    )
    parser.add_argument("--check", action="store_true", help="compare only; change nothing")
    args = parser.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    rendered = render(text, load_records())
    if args.check:
        stale = [
            m["name"]
            for m, r in zip(BLOCK.finditer(text), BLOCK.finditer(rendered), strict=True)
            if m.group(0) != r.group(0)
        ]
        print("README figure blocks differ from the records: " + ", ".join(stale) if stale
              else "README figure blocks match the records")  # fmt: skip
        return 1 if stale else 0
    if rendered != text:
        README.write_text(rendered, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
