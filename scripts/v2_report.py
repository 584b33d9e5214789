"""Tables and a plot from scripts/v2_harness.py's JSON (CPU machine):

    python3 scripts/v2_report.py RUN.json results/bench-v2-nvidia-h200

writes PREFIX.md, PREFIX.json (a copy with the derived ratios) and PREFIX.png.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def _attention_rows(timing):
    by = defaultdict(dict)  # (pool, gate, R) -> impl -> [us]
    for t in timing:
        if t.get("op") != "attention":
            continue
        key = (t["pool"], t["gate"], t["R"])
        by[key].setdefault(t["impl"], []).append(t)
    return by


def _med(recs):
    xs = sorted(r["us"] for r in recs)
    return xs[len(xs) // 2]


def main(src: str, prefix: str) -> None:
    data = json.loads(Path(src).read_text())
    timing = data["timing"]
    bw = next((t["copy_bandwidth_GBps"] for t in timing if "copy_bandwidth_GBps" in t), None)
    lines = [
        f"# Contract v2 kernels: {data['device']} (torch {data['torch']}, CUDA {data['cuda']})",
        "",
        "scripts/v2_harness.py: CUDA-graph replay, every call on other random tokens of a "
        "pool far larger than the L2 (L2-cold), median per call in us; floor = the bytes "
        f"the call must read at the measured copy bandwidth ({bw:.0f} GB/s, read + write). "
        "upstream = vLLM 0.32.0's Triton kernels on the same tensors (its attention with "
        "its packed [T, 2052] index buffer, the same one our op views as [T, 2051]; "
        "its indexer's scoring alone: its top-k is a compiled op not in the wheel).",
        "",
    ]
    att = _attention_rows(timing)
    rows = sorted({k[2] for k in att})
    pools = [
        "packed512_fp16",
        "packed512_bf16",
        "vllm784_bf16",
        "vllm1568_bf16",
        "packed512_fp8",
        "vllm784_fp8",
    ]
    lines += [
        "## Attention",
        "",
        "| layout | gate | impl | " + " | ".join(f"R={r}" for r in rows) + " |",
        "|---|---|---|" + "---|" * len(rows),
    ]
    for pool in pools:
        for gate in (False, True):
            impls = sorted(
                {i for (p, g, r), d in att.items() if p == pool and g == gate for i in d},
                key=lambda i: ("seed", "new", "alt", "upstream").index(i),
            )
            for impl in impls:
                cells = []
                for r in rows:
                    recs = att.get((pool, gate, r), {}).get(impl)
                    if not recs:
                        cells.append("")
                        continue
                    us = _med(recs)
                    cells.append(f"{us:.1f} ({100 * recs[0]['floor_us'] / us:.0f}%)")
                name = {
                    "new": "ours (v2)",
                    "seed": "ours (seed build)",
                    "alt": "ours (v2 candidate)",
                }.get(impl, impl)
                lines.append(
                    f"| {pool} | {'yes' if gate else ''} | {name} | " + " | ".join(cells) + " |"
                )
    lines += ["", "(percent: of the floor)", ""]
    sel = defaultdict(dict)
    for t in timing:
        if t.get("op") == "select":
            sel[(t["pool"], t["R"], t["ctx"])].setdefault(t["impl"], []).append(t)
    cases = sorted({(k[1], k[2]) for k in sel})
    lines += [
        "## Selection",
        "",
        "| keys | impl | " + " | ".join(f"R={r} ctx={c}" for r, c in cases) + " |",
        "|---|---|" + "---|" * len(cases),
    ]
    for pool in ("seed_fp16", "bf16", "fp8", "vllm196_bf16", "vllm196_fp8"):
        impls = sorted(
            {i for (p, r, c), d in sel.items() if p == pool for i in d},
            key=lambda i: ("seed", "new", "upstream_scoring").index(i),
        )
        for impl in impls:
            cells = []
            for r, c in cases:
                recs = sel.get((pool, r, c), {}).get(impl)
                if not recs:
                    cells.append("")
                    continue
                us = _med(recs)
                cells.append(f"{us:.1f} ({100 * recs[0]['floor_us'] / us:.0f}%)")
            name = {
                "new": "ours (v2)",
                "seed": "ours (seed build)",
                "upstream_scoring": "upstream scoring only",
            }.get(impl, impl)
            lines.append(f"| {pool} | {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Upstream's compiled top-k (not in the wheel), measured separately on the "
        "H200 (/work/shared/anchors/README.md): 1x2303 3.7 us; 1x32768 9.3; 8x32768 9.9; "
        "64x8192 5.9; 256x8192 11.1.",
        "",
    ]
    Path(prefix + ".md").write_text("\n".join(lines) + "\n")
    Path(prefix + ".json").write_text(json.dumps(data, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        ax = axes[0]
        for pool in pools:
            for gate in (False, True):
                for impl in ("new", "upstream"):
                    pts = [
                        (r, _med(att[(pool, gate, r)][impl]))
                        for r in rows
                        if impl in att.get((pool, gate, r), {})
                    ]
                    if pts:
                        ax.plot(
                            *zip(*pts, strict=False),
                            marker="o" if impl == "new" else "x",
                            linestyle="-" if impl == "new" else "--",
                            label=f"{'ours' if impl == 'new' else 'upstream'} {pool}"
                            f"{' gate' if gate else ''}",
                        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows R")
        ax.set_ylabel("us per call (graph replay, L2-cold)")
        ax.set_title("sparse_paged_attention")
        ax.legend(fontsize=6)
        ax = axes[1]
        for pool in ("seed_fp16", "bf16", "fp8", "vllm196_bf16", "vllm196_fp8"):
            for impl in ("new", "upstream_scoring"):
                pts = [
                    (f"{r}x{c // 1024}K", _med(sel[(pool, r, c)][impl]))
                    for r, c in cases
                    if impl in sel.get((pool, r, c), {})
                ]
                if pts:
                    ax.plot(
                        *zip(*pts, strict=False),
                        marker="o" if impl == "new" else "x",
                        linestyle="-" if impl == "new" else "--",
                        label=f"{'ours' if impl == 'new' else 'upstream scoring'} {pool}",
                    )
        ax.set_yscale("log")
        ax.set_xlabel("rows x context")
        ax.set_title("select_paged_tokens")
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(prefix + ".png", dpi=110)
    except ImportError:
        pass


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
