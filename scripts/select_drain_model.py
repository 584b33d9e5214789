"""A fluid model of the selection launch at R = 256, full rows (development aid, CPU only).

Every SM holds `share` resident CTAs; a CTA runs its prologue (the dependent loads before its
keys), streams its share of the row's keys, arrives on the row's counter, and the row's last
arrival selects the row. While n CTAs stream, each gets min(rmax / its SM's streaming CTAs,
bw / n): HBM's rate (bw, taken from upstream's scoring alone, which is HBM-bound) is shared,
one SM streams at most rmax and a 256-thread CTA at most half of it. The case's bytes,
upstream's scoring time and ours come from the committed dtype records
(results/bench-dtype-<gpu>.json), each timed on the launch named in RECORDS; the per-CTA times
come from v51's stamps (NOTES); rmax is the free parameter. The model's use is to rank the
levers before a build, checked against what was measured:

    python3 scripts/select_drain_model.py [--rmax 45,60]

NOTES-kernels.md (eighteenth session, v57) has its tables, its calibration on the H100 (v49b,
v52 and v57 measured) and what it predicts for the H200.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SMS = 132
RESULTS = Path(__file__).resolve().parents[1] / "results"
# The launches the records timed, as the model's arguments. "main": two 512-thread CTAs per
# row, one per SM (before v57); "v57": one 256-thread CTA per row, two per SM, every row
# resident at once, no arrival (a row of one CTA), each CTA at most half an SM's streaming
# rate; its 8-warp select is taken as 7 us (not measured: v51 stamped the 16-warp one, 5 us).
HALF = {"share": 2, "cta_share": 0.5}  # 256-thread CTAs, two per SM
LAUNCHES = {
    "main": ({}, {}),
    "v57": ({"parts": 1}, {**HALF, "arr": 0.0, "sel": 7.0}),
}
RECORDS = {  # the dtype records the model is calibrated on, and the launch each one timed
    "H100": (RESULTS / "bench-dtype-nvidia-h100-80gb-hbm3.json", "v57"),
    "H200": (RESULTS / "bench-dtype-nvidia-h200.json", "main"),
}


def record_case(path):
    """(the case's bytes in MB, HBM's rate in MB/us = those bytes over upstream's scoring alone,
    our time in us) of float8 selection at R = 256, full rows, graph replay, from a record."""
    for case in json.loads(Path(path).read_text())["cases"]:
        spec = case["spec"]
        if (spec["op"], spec["rows"], spec["layout"]) == ("selection", 256, "vllm_fp8_784"):
            median = {k: v["median"] * 1e6 for k, v in case["modes"]["graph"]["latency"].items()}
            mb = case["floor"]["total"] / 1e6
            return mb, mb / median["upstream-score"], median["kernel"]
    raise SystemExit(f"{path}: no float8 selection case at R = 256")


def launch_us(items, parts, bw, rmax, share=1, pro=1.0, arr=2.0, sel=5.0, cta_share=1.0):
    """The launch's time (us): items = [(row, MB)] in dispatch order, parts[row] = its items;
    bw and rmax in MB/us; one CTA streams at most cta_share * rmax. Event-driven: rates change
    only when a CTA starts or stops streaming."""
    slots = [None] * (SMS * share)  # [phase, left (us or MB), (row, MB)]
    nxt, done, t = 0, {}, 0.0

    def start(i):
        nonlocal nxt
        slots[i] = ["pro", pro, items[nxt]] if nxt < len(items) else None
        nxt += nxt < len(items)

    for i in range(len(slots)):
        start(i)
    while any(slots):
        streaming = [i for i, s in enumerate(slots) if s and s[0] == "score"]
        per_sm = {}
        for i in streaming:
            per_sm[i % SMS] = per_sm.get(i % SMS, 0) + 1
        rate = {
            i: min(rmax / per_sm[i % SMS], cta_share * rmax, bw / len(streaming)) for i in streaming
        }
        # the next event: a timed phase ends or a stream runs out
        dt = min(s[1] / rate[i] if s[0] == "score" else s[1] for i, s in enumerate(slots) if s)
        t += dt
        ended = []
        for i, s in enumerate(slots):
            if s:
                s[1] -= rate[i] * dt if s[0] == "score" else dt
                if s[1] <= 1e-9:
                    ended.append(i)
        for i in ended:
            phase, _, (row, mb) = slots[i]
            if phase == "pro":
                slots[i] = ["score", mb, (row, mb)]
            elif phase == "score":
                slots[i] = ["arr", arr, (row, mb)]
            elif phase == "arr":
                done[row] = done.get(row, 0) + 1
                if done[row] == parts[row]:
                    slots[i] = ["sel", sel, (row, mb)]
                else:
                    start(i)
            else:
                start(i)
    return t


def rows_in_parts(rows, mb_row, tail_rows=0, tail_parts=2, parts=2):
    """`parts` items per row; the last tail_rows rows in tail_parts items (v52's shape)."""
    items, parts_of = [], {}
    for r in range(rows):
        p = tail_parts if r >= rows - tail_rows else parts
        parts_of[r] = p
        items += [(r, mb_row / p)] * p
    return items, parts_of


def model_us(mb, bw, rmax, launch="main", rows_kw=None, launch_kw=None):
    """A launch of `launch`'s shape (LAUNCHES) at R = 256 with the variant's changes."""
    base_rows, base_launch = LAUNCHES[launch]
    items, parts = rows_in_parts(256, mb / 256, **{**base_rows, **(rows_kw or {})})
    return launch_us(items, parts, bw, rmax, **{**base_launch, **(launch_kw or {})})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rmax", default="45,60", help="one SM's streaming rates (GB/s), comma list")
    rmaxes = [float(x) for x in ap.parse_args(argv).rmax.split(",")]
    variants = [  # (name, rows_in_parts' changes, launch_us' changes), from main's launch
        ("main (2 CTAs per row, one per SM)", {}, {}),
        ("v49b: 4 CTAs per row, two per SM", {"parts": 4}, HALF),
        ("v52: the last 32 rows in 4 parts", {"tail_rows": 32, "tail_parts": 4}, {}),
        ("the select 2.5 us (not 5)", {}, {"sel": 2.5}),
        ("the arrival 0.5 us (not 2)", {}, {"arr": 0.5}),
        ("prologue 0.2 us, arrival 1 (a persistent grid)", {}, {"pro": 0.2, "arr": 1.0}),
        ("v57: one CTA per row, two per SM (one wave)", *LAUNCHES["v57"]),
    ]
    cases = {gpu: (record_case(path), launch) for gpu, (path, launch) in RECORDS.items()}
    print("| variant | " + " | ".join(f"{g} rmax {r:g} GB/s" for g in cases for r in rmaxes) + " |")
    print("|---" * (1 + len(cases) * len(rmaxes)) + "|")
    base = {}
    for name, rows_kw, launch_kw in variants:
        cells = []
        for gpu, ((mb, bw, _ours), _launch) in cases.items():
            for rmax in rmaxes:
                t = model_us(mb, bw, rmax / 1e3, "main", rows_kw, launch_kw)
                ref = base.setdefault((gpu, rmax), t)
                cells.append(f"{t:.1f} ({t / ref:.3f})")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print(
        "measured: "
        + ", ".join(f"{g} ours {v[2]:.1f} us (launch {launch})" for g, (v, launch) in cases.items())
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
