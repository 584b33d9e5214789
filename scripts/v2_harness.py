"""Development harness for contract v2's kernels (GPU host): checks and times the kernels of
this tree (.harness/libqsa_new.so) beside the seed's (.harness/libqsa_old.so) and upstream
vLLM 0.32.0's Triton kernels, through scripts/v2_shim.cu (ctypes, no op layer), on identical
tensors in vLLM's layouts.

    bash scripts/build_v2_harness.sh BASE          # CPU machine (QSA_ALT: variants)
    PYTHONUNBUFFERED=1 python3 scripts/v2_harness.py [--check] [--time] [--only fp8] --out DIR
    ncu -k regex:attention_kernel -s 2 -c 1 python3 scripts/v2_harness.py --once vllm_fp8_784:256

The variants .harness/libqsa_alt_NAME.so are timed beside the new build (the first is also
checked bit for bit against it: expected to differ where its arithmetic does).

Checks: attention against a float64 reference (||out - ref|| / ||ref|| < 2e-3; fp8 against the
dequantised reference), poisoned outputs, holes, duplicates and bad values; selection bit-exact
on integer data against a reference written here; the new build bit-identical to the seed's
on the seed's layout. Timing: CUDA-graph replay, inputs drawn at random from pools far larger
than the L2 (every call reads other tokens: L2-cold), median per call.
"""

from __future__ import annotations

import argparse
import ctypes as C
import faulthandler
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

W = 2051
HEADS, HD = 3, 256
IH, ID = 4, 128
FP8 = torch.float8_e4m3fn
DT = {torch.float16: 0, torch.bfloat16: 1, FP8: 2}
SCALE = 256**-0.5
I64, I32, F32, VP, U64 = C.c_int64, C.c_int, C.c_float, C.c_void_p, C.c_uint64


def load(path: Path, v2: bool):
    lib = C.CDLL(str(path))
    if v2:
        lib.shim_attention.argtypes = (
            [VP] * 8 + [I64] * 11 + [F32] * 3 + [I32] * 3 + [VP, U64, VP, I32, VP]
        )
        lib.shim_select.argtypes = [VP] * 7 + [I64] * 9 + [I32, VP, U64, VP, I32, I32, VP]
    else:
        lib.shim_attention.argtypes = [VP] * 6 + [I64] * 6 + [F32, I32, VP, U64, VP, I32, VP]
        lib.shim_select.argtypes = [VP] * 7 + [I64] * 6 + [VP, U64, VP, I32, I32, VP]
    lib.shim_attention.restype = I32
    lib.shim_select.restype = I32
    lib.shim_attention_ws.argtypes = [I64, I32, I32]
    lib.shim_attention_ws.restype = U64
    lib.shim_select_ws.argtypes = [I64, I64, I64]
    lib.shim_select_ws.restype = U64
    lib.shim_attention_counters.restype = I64
    lib.shim_select_counters.restype = I64
    return lib


def ptr(t):
    return None if t is None else t.data_ptr()


class Lib:
    """A shim library with its own workspace and counters (like the op layer's)."""

    def __init__(self, path: Path, v2: bool):
        self.lib = load(path, v2)
        self.v2 = v2
        self.ws = torch.empty(0, dtype=torch.uint8, device="cuda")
        self.actr = torch.zeros(
            self.lib.shim_attention_counters(), dtype=torch.int32, device="cuda"
        )
        self.sctr = torch.zeros(self.lib.shim_select_counters(), dtype=torch.int32, device="cuda")

    def _ws(self, n):
        if self.ws.numel() < n:
            self.ws = torch.empty(max(n, 2 * self.ws.numel()), dtype=torch.uint8, device="cuda")
        return self.ws

    def reserve_attention(self, rows, splits=0):
        self._ws(self.lib.shim_attention_ws(rows, splits, torch.cuda.current_device()))

    def reserve_select(self, rows, width, c):
        self._ws(self.lib.shim_select_ws(rows, width, c))

    def attention(self, a, splits=0, pdl=1):
        q, k, v = a["q"], a["k"], a["v"]
        idx, table = a["idx"], a["table"]
        st = torch.cuda.current_stream().cuda_stream
        n = self.lib.shim_attention_ws(q.shape[0], splits, torch.cuda.current_device())
        ws = self._ws(n)
        if self.v2:
            err = self.lib.shim_attention(
                ptr(q),
                ptr(k),
                ptr(v),
                ptr(idx),
                ptr(table),
                ptr(a["t2r"]),
                ptr(a["out"]),
                ptr(a.get("gate")),
                q.shape[0],
                table.shape[0],
                table.shape[1],
                k.shape[0],
                k.shape[1],
                k.stride(0),
                k.stride(1),
                v.stride(0),
                v.stride(1),
                idx.stride(0),
                table.stride(0),
                a.get("scale", SCALE),
                a.get("k_scale", 1.0),
                a.get("v_scale", 1.0),
                DT[q.dtype],
                DT[k.dtype],
                splits,
                ptr(ws),
                ws.numel(),
                ptr(self.actr),
                pdl,
                st,
            )
        else:
            err = self.lib.shim_attention(
                ptr(q),
                ptr(a["kv"]),
                ptr(idx),
                ptr(table),
                ptr(a["t2r"]),
                ptr(a["out"]),
                q.shape[0],
                table.shape[0],
                table.shape[1],
                k.shape[0],
                idx.stride(0),
                table.stride(0),
                SCALE,
                splits,
                ptr(ws),
                ws.numel(),
                ptr(self.actr),
                pdl,
                st,
            )
        if err:
            raise RuntimeError(f"attention: cuda error {err}")

    def select(self, a, generic=0, pdl=1):
        q, ck, table, out = a["q"], a["ck"], a["table"], a["out"]
        st = torch.cuda.current_stream().cuda_stream
        c = ck.shape[1]
        ws = self._ws(self.lib.shim_select_ws(q.shape[0], table.shape[1], c))
        common = (
            ptr(q),
            ptr(ck),
            ptr(table),
            ptr(a["t2r"]),
            ptr(a["pos"]),
            ptr(a["lens"]),
            ptr(out),
            q.shape[0],
            table.shape[0],
            table.shape[1],
            ck.shape[0],
            table.stride(0),
            out.stride(0),
        )
        if self.v2:
            err = self.lib.shim_select(
                *common,
                c,
                ck.stride(0),
                ck.stride(1),
                DT[q.dtype],
                ptr(ws),
                ws.numel(),
                ptr(self.sctr),
                generic,
                pdl,
                st,
            )
        else:
            err = self.lib.shim_select(
                *common, ptr(ws), ws.numel(), ptr(self.sctr), generic, pdl, st
            )
        if err:
            raise RuntimeError(f"select: cuda error {err}")


# ---------------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------------


def paged(values, layers, gen_other=True):
    """values [P, S, D] -> (owner, view [P, S, 1, D]) as layer layers-1 of [P, layers, S, D]."""
    P, S, D = values.shape
    if layers > 1:
        owner = torch.randn(P, layers, S, D, device=values.device).to(values.dtype)
    else:
        owner = torch.empty(P, layers, S, D, device=values.device, dtype=values.dtype)
    view = owner[:, layers - 1]
    view.copy_(values)
    return owner, view.unsqueeze(2)


def kv_layout(kv_values, kv_dtype, packed=True, layers=1):
    """kv_values [P, S, 512] float -> dict(k, v, owners, kv (packed storage view))."""
    vals = kv_values.to(kv_dtype)
    if packed:
        owner, both = paged(vals, layers)
        both = both[:, :, 0]
        return {
            "k": both[:, :, :HD].unsqueeze(2),
            "v": both[:, :, HD:].unsqueeze(2),
            "owners": (owner,),
            "kv": both,
        }
    ko, k = paged(vals[:, :, :HD].contiguous(), layers)
    vo, v = paged(vals[:, :, HD:].contiguous(), layers)
    return {"k": k, "v": v, "owners": (ko, vo)}


def rows_view(base_rows, width, stride, dtype, fill):
    base = torch.full((base_rows, max(stride, width)), fill, dtype=dtype, device="cuda")
    return base[:, :width]


# ---------------------------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------------------------


def ref_attention(a):
    q, k, v, idx, table, t2r = a["q"], a["k"], a["v"], a["idx"], a["table"], a["t2r"]
    ps = k.shape[1]
    _R, B, M, P = q.shape[0], table.shape[0], table.shape[1], k.shape[0]
    b = t2r.long()
    row_ok = (b >= 0) & (b < B)
    i = idx.long()
    lp = torch.div(i.clamp(min=0), ps, rounding_mode="floor")
    ok = row_ok[:, None] & (i >= 0) & (lp < M)
    page = table.long()[b.clamp(0, max(B - 1, 0))].gather(1, lp.clamp(max=max(M - 1, 0)))
    ok &= (page >= 0) & (page < P)
    slot = i.clamp(min=0) % ps
    pg = page.clamp(0, P - 1)
    K = k[pg, slot, 0].double() * a.get("k_scale", 1.0)
    V = v[pg, slot, 0].double() * a.get("v_scale", 1.0)
    s = torch.einsum("rhd,rwd->rhw", q.double(), K) * SCALE
    s = s.masked_fill(~ok[:, None, :], -math.inf)
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)
    o = torch.einsum("rhw,rwd->rhd", p, V)
    if a.get("gate") is not None:
        # the contract's order of roundings: dtype(attn) first, then the gate (float64 here)
        o = o.to(q.dtype).double() * torch.sigmoid(a["gate"].double())
    return o


def ref_select(a):
    q, ck, table, t2r, pos, lens = a["q"], a["ck"], a["table"], a["t2r"], a["pos"], a["lens"]
    R, B, M, P, Cp = q.shape[0], table.shape[0], table.shape[1], ck.shape[0], ck.shape[1]
    out = torch.full((R, W), -1, dtype=torch.int32, device="cuda")
    sc = torch.tensor(128**-0.5, dtype=torch.float32)
    for r in range(R):
        b = int(t2r[r])
        if not 0 <= b < B:
            continue
        n = max(min(int(pos[r]) + 1, int(lens[b])), 0)
        nb = n // 4
        nbv = min(nb, M * Cp)
        j = torch.arange(nbv, device="cuda")
        page = table[b].long()[j // Cp] if nbv else j
        usable = (page >= 0) & (page < P)
        keys = ck[page.clamp(0, P - 1), j % Cp, 0].double()
        s = torch.relu(q[r].double() @ keys.T).sum(0).float() * sc.cuda()
        s = s.masked_fill(~usable, -math.inf)
        order = torch.sort(s, descending=True, stable=True).indices
        kb = min(512, int(usable.sum()))
        chosen = order[:kb]
        tok = (chosen[:, None] * 4 + torch.arange(4, device="cuda")).flatten()
        tail = torch.arange(nb * 4, n, device="cuda")
        row = torch.cat([tok, tail]).to(torch.int32)
        out[r, : row.numel()] = row
    return out


# ---------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------


def attention_case(
    R,
    dtype,
    kv_dtype,
    ps,
    packed,
    layers,
    idx_stride,
    table_pad,
    gate,
    gen,
    P=None,
    ctx=None,
    holes=True,
    bad=True,
    scales=(0.5, 2.0),
):
    ctx = ctx or 3 * W
    M = (ctx + ps - 1) // ps
    P = P or M + 3
    kvals = torch.randn(P, ps, 2 * HD, generator=gen, device="cuda")
    if kv_dtype == FP8:
        kvals = kvals * 4  # a range fp8 resolves
    lay = kv_layout(kvals, kv_dtype, packed, layers)
    B = 2
    tab = torch.stack([torch.randperm(P, generator=gen, device="cuda")[:M] for _ in range(B)])
    if bad:
        tab[1, M - 1] = -1  # a hole in the table
        tab[1, 0] = P + 5  # out of range
    table = rows_view(B, M, M + table_pad, torch.int32, 0)
    table.copy_(tab.to(torch.int32))
    idx = rows_view(R, W, idx_stride, torch.int32, -5)
    vals = torch.randint(0, ctx, (R, W), generator=gen, device="cuda")
    if holes:
        m = torch.rand(R, W, generator=gen, device="cuda")
        vals = torch.where(m < 0.05, -1, vals)
        vals = torch.where((m > 0.05) & (m < 0.07), M * ps + 7, vals)  # beyond the table
    idx.copy_(vals.to(torch.int32))
    t2r = torch.randint(0, B, (R,), generator=gen, device="cuda").to(torch.int32)
    if bad and R >= 3:
        t2r[2] = B  # a bad request: zeros
        idx[1, :] = -1  # no valid entry: zeros
    a = {
        "q": torch.randn(R, HEADS, HD, generator=gen, device="cuda").to(dtype),
        **lay,
        "idx": idx,
        "table": table,
        "t2r": t2r,
        "out": torch.full((R, HEADS, HD), float("nan"), dtype=dtype, device="cuda"),
    }
    if kv_dtype == FP8:
        a["k_scale"], a["v_scale"] = scales
    if gate:
        a["gate"] = (2 * torch.randn(R, HEADS, HD, generator=gen, device="cuda")).to(dtype)
    return a


def select_case(
    R,
    dtype,
    Cp,
    layers,
    out_stride,
    table_pad,
    gen,
    ctx=9212,
    P=None,
    bad=True,
    integer=True,
    B=2,
):
    M = (ctx // 4 + Cp - 1) // Cp + 1
    P = P or M + 2
    if integer:
        vals = torch.randint(-2, 3, (P, Cp, ID), generator=gen, device="cuda").float()
        qv = torch.randint(-2, 3, (R, IH, ID), generator=gen, device="cuda").float()
    else:
        vals = torch.randn(P, Cp, ID, generator=gen, device="cuda")
        qv = torch.randn(R, IH, ID, generator=gen, device="cuda")
    owner, ck = paged(vals.to(dtype), layers)
    tab = torch.stack([torch.randperm(P, generator=gen, device="cuda")[:M] for _ in range(B)])
    if bad:
        tab[1, 1] = -1
        tab[1, 2] = P + 1
    table = rows_view(B, M, M + table_pad, torch.int32, 0)
    table.copy_(tab.to(torch.int32))
    lens = torch.tensor([ctx, ctx - 5] + [ctx] * (B - 2), dtype=torch.int32, device="cuda")
    pos = torch.randint(ctx // 2, ctx + 10, (R,), generator=gen, device="cuda")
    t2r = torch.randint(0, B, (R,), generator=gen, device="cuda").to(torch.int32)
    if B == R:  # a request per row
        t2r = torch.arange(R, dtype=torch.int32, device="cuda")
    if bad and R >= 3:
        t2r[2] = -1
    out = rows_view(R, W, out_stride, torch.int32, -7)
    return {
        "q": qv.to(dtype),
        "ck": ck,
        "owner": owner,
        "table": table,
        "t2r": t2r,
        "pos": pos,
        "lens": lens,
        "out": out,
    }


ATT_LAYOUTS = {
    # name: (dtype, kv_dtype, page_size, packed, layers, idx_stride, table_pad, gate)
    "seed_fp16": (torch.float16, torch.float16, 512, True, 1, W, 0, False),
    "bf16": (torch.bfloat16, torch.bfloat16, 512, True, 1, W, 0, False),
    "bf16_gate": (torch.bfloat16, torch.bfloat16, 512, True, 1, W, 0, True),
    "fp16_gate_page16": (torch.float16, torch.float16, 16, True, 1, W, 1, True),
    "vllm_bf16_784": (torch.bfloat16, torch.bfloat16, 784, True, 4, 2052, 3, True),
    "vllm_bf16_1568_sep": (torch.bfloat16, torch.bfloat16, 1568, False, 2, 2052, 0, False),
    "fp8_kv": (torch.bfloat16, FP8, 512, True, 1, W, 0, False),
    "fp8_kv_fp16q": (torch.float16, FP8, 512, True, 1, W, 0, True),
    "vllm_fp8_784": (torch.bfloat16, FP8, 784, True, 4, 2052, 3, True),
    "vllm_fp8_800_sep": (torch.bfloat16, FP8, 800, False, 3, W, 0, True),
}
SEL_LAYOUTS = {
    # name: (dtype, C, layers, out_stride, table_pad)
    "seed_fp16": (torch.float16, 128, 1, W, 0),
    "bf16": (torch.bfloat16, 128, 1, W, 0),
    "fp8": (FP8, 128, 1, W, 0),
    "fp16_c4": (torch.float16, 4, 1, W, 1),
    "vllm_bf16_196": (torch.bfloat16, 196, 4, 2052, 3),
    "vllm_bf16_392": (torch.bfloat16, 392, 2, 2052, 0),
    "vllm_fp8_196": (FP8, 196, 4, 2052, 3),
    "fp8_c200": (FP8, 200, 3, W, 0),
}


def rel_err(out, ref):
    o = out.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - ref).norm() / ref.norm().clamp(min=1e-30))


def check(new: Lib, old: Lib, results: list, fails: list, alts: dict):
    gen = torch.Generator(device="cuda")
    # attention over layouts and the kernel paths (R = 1, 2: small4; 5: small8; 20, 64: deep
    # cluster; 200: cluster), forced splits for the multi-cluster merge
    for name, (dt, kdt, ps, packed, layers, ist, tpad, gate) in ATT_LAYOUTS.items():
        for R, splits in ((1, 0), (2, 0), (5, 0), (20, 0), (64, 0), (200, 0), (9, 24), (3, 1)):
            gen.manual_seed(hash((name, R, splits)) % (1 << 31))
            a = attention_case(R, dt, kdt, ps, packed, layers, ist, tpad, gate, gen)
            new.attention(a, splits=splits)
            torch.cuda.synchronize()
            ref = ref_attention(a)
            err = rel_err(a["out"], ref)
            zero_rows = [1, 2] if R >= 3 else []
            zeros_ok = all(bool((a["out"][r] == 0).all()) for r in zero_rows)
            ok = err < 2e-3 and zeros_ok
            results.append(
                {
                    "op": "attention",
                    "layout": name,
                    "R": R,
                    "splits": splits,
                    "rel_err": err,
                    "zeros_ok": zeros_ok,
                    "ok": ok,
                }
            )
            if not ok:
                fails.append(results[-1])
            o1 = a["out"].clone()
            for an, alt in alts.items():  # each candidate variant: against float64 too
                a["out"].fill_(float("nan"))
                alt.attention(a, splits=splits)
                torch.cuda.synchronize()
                ea = rel_err(a["out"], ref)
                same = bool(torch.equal(o1.view(torch.int16), a["out"].view(torch.int16)))
                results.append(
                    {
                        "op": "attention",
                        "layout": name,
                        "R": R,
                        "splits": splits,
                        "build": an,
                        "rel_err": ea,
                        "identical_to_new": same,
                        "ok": ea < 2e-3,
                    }
                )
                if not results[-1]["ok"]:
                    fails.append(results[-1])
            a["out"].copy_(o1)
            if name == "seed_fp16":  # the seed's kernels on the same tensors: identical bits
                o1 = a["out"].clone()
                a["out"].fill_(float("nan"))
                old.attention(a, splits=splits)
                torch.cuda.synchronize()
                same = bool(torch.equal(o1.view(torch.int16), a["out"].view(torch.int16)))
                results.append(
                    {
                        "op": "attention",
                        "layout": name,
                        "R": R,
                        "splits": splits,
                        "identical_to_seed_build": same,
                        "ok": same,
                    }
                )
                if not same:
                    fails.append(results[-1])
    # selection: integer data, bit-exact, every dtype and page geometry, both select paths,
    # short rows (pairs / last-CTA) and long ones (streamed, distributed)
    for name, (dt, Cp, layers, ost, tpad) in SEL_LAYOUTS.items():
        for R, ctx, generic in (
            (1, 9212, 0),
            (3, 9212, 0),
            (64, 9212, 0),
            (1, 131072, 0),
            (8, 131072, 0),
            (5, 20000, 1),
            (300, 2000, 0),
            # more rows than SMs (a split float8 launch, v40): resident, streamed, generic
            (140, 9212, 0),
            (136, 70000, 0),
            (140, 20000, 1),
        ):
            gen.manual_seed(hash((name, R, ctx, generic)) % (1 << 31))
            a = select_case(R, dt, Cp, layers, ost, tpad, gen, ctx=ctx)
            new.select(a, generic=generic)
            torch.cuda.synchronize()
            ref = ref_select(a)
            eq = a["out"] == ref
            ok = bool(eq.all())
            rec = {"op": "select", "layout": name, "R": R, "ctx": ctx, "generic": generic, "ok": ok}
            if not ok:
                bad = (~eq).nonzero()[:3].tolist()
                rec["first_mismatch"] = bad
            results.append(rec)
            if not ok:
                fails.append(rec)
            o0 = a["out"].clone()
            for an, alt in alts.items():  # each candidate variant: bit-exact too
                a["out"].fill_(-7)
                alt.select(a, generic=generic)
                torch.cuda.synchronize()
                results.append(
                    {"op": "select", "layout": name, "R": R, "ctx": ctx, "generic": generic,
                     "build": an, "ok": bool(torch.equal(a["out"], ref))}
                )  # fmt: skip
                if not results[-1]["ok"]:
                    fails.append(results[-1])
            a["out"].copy_(o0)
            if name == "seed_fp16":
                o1 = a["out"].clone()
                a["out"].fill_(-7)
                old.select(a, generic=generic)
                torch.cuda.synchronize()
                same = bool(torch.equal(o1, a["out"]))
                results.append(
                    {
                        "op": "select",
                        "layout": name,
                        "R": R,
                        "ctx": ctx,
                        "identical_to_seed_build": same,
                        "ok": same,
                    }
                )
                if not same:
                    fails.append(results[-1])


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------


def graph_time(fn_list, reps=15):
    """Median, min and max us per call over ``reps`` replays of one graph of every call in
    fn_list (each on other inputs): the benchmark's graph unit, its first replay untimed."""
    from custom_esimd_kernels_vllm.bench.timing import GraphUnit

    unit = GraphUnit(lambda fn: fn(), fn_list, len(fn_list), torch.device("cuda"))
    try:
        unit()
        times = [unit() * 1e6 for _ in range(reps)]
    finally:
        unit.close()
    return statistics.median(times), min(times), max(times)


class AttnPool:
    """One large K/V pool per layout; each timed call reads other random tokens."""

    def __init__(self, dtype, kv_dtype, ps, packed, layers, tokens, gen):
        self.ps = ps
        M = (tokens + ps - 1) // ps
        self.M = M
        P = M
        kvals = torch.empty(P, ps, 2 * HD, device="cuda")
        kvals.normal_(generator=gen)
        if kv_dtype == FP8:
            kvals *= 4
        self.lay = kv_layout(kvals, kv_dtype, packed, layers)
        del kvals
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.table = torch.randperm(P, generator=gen, device="cuda")[None, :M].to(torch.int32)

    def copies(self, R, n, gen, gate, idx_stride=W, upstream=False):
        out = []
        tokens = self.M * self.ps
        for _ in range(n):
            idx = torch.randint(0, tokens, (R, idx_stride), generator=gen, device="cuda")
            idx = idx.to(torch.int32)
            if upstream:
                idx[:, W] = W  # the count column of vLLM's [T, 2052] buffer
            a = {
                "q": torch.randn(R, HEADS, HD, generator=gen, device="cuda").to(self.dtype),
                **self.lay,
                "idx": idx[:, :W],
                "idx_full": idx,
                "table": self.table,
                "t2r": torch.zeros(R, dtype=torch.int32, device="cuda"),
                "out": torch.empty(R, HEADS, HD, dtype=self.dtype, device="cuda"),
            }
            if self.kv_dtype == FP8:
                a["k_scale"], a["v_scale"] = 0.5, 2.0
            if gate:
                a["gate"] = torch.randn(R, HEADS, HD, generator=gen, device="cuda").to(self.dtype)
            out.append(a)
        return out


def att_floor_us(R, kv_dtype, bw):
    per_tok = 2 * HD * (1 if kv_dtype == FP8 else 2)
    nbytes = R * (W * per_tok + W * 4 + 2 * HEADS * HD * 2)
    return nbytes / bw * 1e6


def time_all(
    new: Lib, old: Lib, up, results: list, rows_att, rows_sel, budget_s, alt=None, only=None
):
    t_start = time.time()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234)
    # copy bandwidth (read + write)
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(10):
        e0.record()
        y.copy_(x)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    bw = 2 * x.numel() / statistics.median(ts)
    del x, y
    results.append({"copy_bandwidth_GBps": bw / 1e9})
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)

    tokens = 1 << 20  # 1M tokens: 1 GiB of fp16 K/V per layer
    pools = {
        "packed512_fp16": AttnPool(torch.float16, torch.float16, 512, True, 1, tokens, gen),
        "packed512_bf16": AttnPool(torch.bfloat16, torch.bfloat16, 512, True, 1, tokens, gen),
        "vllm784_bf16": AttnPool(torch.bfloat16, torch.bfloat16, 784, True, 4, tokens, gen),
        "vllm1568_bf16": AttnPool(torch.bfloat16, torch.bfloat16, 1568, True, 2, tokens, gen),
        "packed512_fp8": AttnPool(torch.bfloat16, FP8, 512, True, 1, tokens, gen),
        "vllm784_fp8": AttnPool(torch.bfloat16, FP8, 784, True, 4, tokens, gen),
    }
    for R in rows_att:
        n = max(2, min(256, (256 << 20) // (R * W * 1024)))  # calls per graph
        for pname, pool in pools.items():
            if only and not any(o in pname for o in only):
                continue
            vllm = pname.startswith("vllm")
            for gate in (
                (False, True)
                if pname in ("packed512_bf16", "vllm784_bf16", "vllm784_fp8")
                else (False,)
            ):
                copies = pool.copies(R, n, gen, gate, idx_stride=2052 if vllm else W, upstream=vllm)
                new.reserve_attention(R)
                old.reserve_attention(R)
                impls = [("new", lambda a: new.attention(a))]
                for aname, alib in (alt or {}).items():
                    alib.reserve_attention(R)
                    impls.append((aname, lambda a, alib=alib: alib.attention(a)))
                if pname == "packed512_fp16":
                    impls = (
                        [("seed", lambda a: old.attention(a))]
                        + impls
                        + [("seed", lambda a: old.attention(a))]
                    )
                if vllm and gate and up is not None:
                    fn = up.attention.qsa_sparse_paged_attention
                    impls.append(
                        (
                            "upstream",
                            lambda a, fn=fn: fn(
                                a["q"],
                                a["k"],
                                a["v"],
                                a["idx_full"],
                                a["table"],
                                a["t2r"],
                                False,
                                a["out"],
                                a.get("k_scale"),
                                a.get("v_scale"),
                                output_gate=a["gate"],
                            ),
                        )
                    )
                for iname, call in impls:
                    med, lo, hi = graph_time([lambda a=a, call=call: call(a) for a in copies])
                    fl = att_floor_us(R, pool.kv_dtype, bw)
                    rec = {
                        "op": "attention",
                        "pool": pname,
                        "R": R,
                        "gate": gate,
                        "impl": iname,
                        "us": med,
                        "min": lo,
                        "max": hi,
                        "floor_us": fl,
                        "pct_floor": 100 * fl / med,
                    }
                    results.append(rec)
                    print(
                        f"attention {pname:15s} R={R:4d} gate={int(gate)} {iname:8s} "
                        f"{med:8.2f} us  (floor {fl:6.2f}, {100 * fl / med:5.1f}%)",
                        flush=True,
                    )
                del copies
        if time.time() - t_start > budget_s:
            print("time budget: stop", flush=True)
            return
    del pools
    torch.cuda.empty_cache()
    # selection: key pools of 256K blocks; each call's table maps other pages
    sel_cases = [(1, 9212), (1, 131072), (8, 131072), (64, 32768), (256, 32768)]
    sel_cases = [c for c in sel_cases if c[0] in rows_sel]
    spools = {}
    for pname, (dt, Cp, layers) in {
        "seed_fp16": (torch.float16, 128, 1),
        "bf16": (torch.bfloat16, 128, 1),
        "fp8": (FP8, 128, 1),
        "vllm196_bf16": (torch.bfloat16, 196, 4),
        "vllm196_fp8": (FP8, 196, 4),
    }.items():
        blocks = 1 << 21  # 2M keys: 512 MiB fp16
        P = blocks // Cp
        vals = torch.randn(P, Cp, ID, generator=gen, device="cuda")
        owner, ck = paged(vals.to(dt), layers)
        del vals
        spools[pname] = (dt, Cp, owner, ck, P)
    for R, ctx in sel_cases:
        for pname, (dt, Cp, _owner, ck, P) in spools.items():
            if only and not any(o in pname for o in only):
                continue
            M = (ctx // 4 + Cp - 1) // Cp
            per_call = R * M * Cp * ID * (1 if dt == FP8 else 2)
            n = max(2, min(256, (256 << 20) // per_call))
            copies = []
            for _ in range(n):
                table = torch.stack(
                    [torch.randperm(P, generator=gen, device="cuda")[:M] for _ in range(R)]
                ).to(torch.int32)
                a = {
                    "q": torch.randn(R, IH, ID, generator=gen, device="cuda").to(dt),
                    "ck": ck,
                    "table": table,
                    "t2r": torch.arange(R, dtype=torch.int32, device="cuda"),
                    "pos": torch.full((R,), ctx - 1, dtype=torch.int64, device="cuda"),
                    "lens": torch.full((R,), ctx, dtype=torch.int32, device="cuda"),
                    "out": torch.empty(R, W, dtype=torch.int32, device="cuda"),
                    "vis": torch.full((R,), ctx // 4, dtype=torch.int32, device="cuda"),
                    "bidx": torch.empty(R, 512, dtype=torch.int32, device="cuda"),
                }
                copies.append(a)
            new.reserve_select(R, M, Cp)
            impls = [("new", lambda a: new.select(a))]
            for aname, alib in (alt or {}).items():
                alib.reserve_select(R, M, Cp)
                impls.append((aname, lambda a, alib=alib: alib.select(a)))
            if pname == "seed_fp16":
                old.reserve_select(R, M, Cp)
                impls = (
                    [("seed", lambda a: old.select(a))]
                    + impls
                    + [("seed", lambda a: old.select(a))]
                )
            if pname in ("vllm196_bf16", "vllm196_fp8", "bf16", "fp8") and up is not None:
                mod = up.indexer

                impls.append(("upstream_scoring", functools.partial(upstream_scoring, mod)))
            for iname, call in impls:
                if iname == "upstream_scoring":
                    saved = up.indexer._topk
                    up.indexer._topk = lambda *args: None
                try:
                    med, lo, hi = graph_time([lambda a=a, call=call: call(a) for a in copies])
                finally:
                    if iname == "upstream_scoring":
                        up.indexer._topk = saved
                fl = per_call / bw * 1e6
                rec = {
                    "op": "select",
                    "pool": pname,
                    "R": R,
                    "ctx": ctx,
                    "impl": iname,
                    "us": med,
                    "min": lo,
                    "max": hi,
                    "floor_us": fl,
                    "pct_floor": 100 * fl / med,
                }
                results.append(rec)
                print(
                    f"select {pname:13s} R={R:4d} ctx={ctx:6d} {iname:16s} {med:8.2f} us "
                    f"(floor {fl:6.2f}, {100 * fl / med:5.1f}%)",
                    flush=True,
                )
            del copies
        if time.time() - t_start > budget_s:
            print("time budget: stop", flush=True)
            return


ONCE_CALLS = 3


def upstream_scoring(mod, a):
    """vLLM 0.32.0's paged decode scoring (``mod``: its indexer module) of a selection case
    that carries the visible blocks per row (``vis``) and an output (``bidx``)."""
    mod.qsa_select_paged_decode(a["q"], a["ck"], a["table"], a["vis"], 2048, 4, 1, a["bidx"])


def _upstream_scoring_once(a, case):
    """--once-lib upstream: ``upstream_scoring`` (its Triton kernel, top-k stubbed) on a
    --once selection case, each row its own request, visible blocks from the row's position;
    for a profiler (ncu -k regex:qsa_mqa)."""
    if not case.startswith("sel:"):
        raise SystemExit(f"--once-lib upstream: selection cases only, got {case!r}")
    from custom_esimd_kernels_vllm.bench import upstream as upmod

    up = upmod.load(str(ROOT / ".upstream"))
    if not up.ok:
        raise SystemExit(f"upstream not loaded: {up.to_dict()}")
    up.indexer._topk = lambda *args: None
    R = a["q"].shape[0]
    assert bool((a["t2r"] == torch.arange(R, device="cuda")).all()), "a request per row"
    a["table"], lens = a["table"][:R], a["lens"][:R].long()  # R = 1: a second, unused request
    a["vis"] = (torch.minimum(a["pos"].reshape(R) + 1, lens) // 4).to(torch.int32)
    a["bidx"] = torch.empty(R, 512, dtype=torch.int32, device="cuda")
    return functools.partial(upstream_scoring, up.indexer)


# R of the suite's attention layouts test (tests/gpu/test_v2_gpu.py) and of its selection ones,
# with 300 added (more rows than SMs: the float8 selection's CTAs per row)
SUITE_ATT_ROWS = (1, 2, 5, 9, 40, 160)
SUITE_SEL_ROWS = (1, 3, 64, 300)


def suite(libs: dict, limit_s: float, device: str = "cuda") -> int:
    """The GPU suite's own v2 cases (qsa_ops.testing: every layout, R and case of the layouts
    tests) through each build, each call announced first and watched: a call that has not
    returned after limit_s ends the process with every stack (faulthandler), so the last
    "RUN" line names the build and case that never finished."""
    from custom_esimd_kernels_vllm.qsa_ops import contract, testing

    fails = 0
    for lname, lib in libs.items():
        for lay_name, lay in testing.LAYOUTS.items():
            for R in SUITE_ATT_ROWS:
                for name in testing.ATTENTION_CASES:
                    case = testing.make_attention_case(name, R, device, seed=R + 7, layout=lay)
                    a = {
                        "q": case.q, "k": case.k_cache, "v": case.v_cache,
                        "idx": case.logical_indices, "table": case.page_table,
                        "t2r": case.token_to_req, "out": case.out, "gate": case.gate,
                        "scale": contract.resolve_softmax_scale(case.softmax_scale),
                        "k_scale": case.k_scale or 1.0, "v_scale": case.v_scale or 1.0,
                    }  # fmt: skip
                    fails += suite_call(
                        f"{lname} attention {lay_name} R={R} {name}", limit_s,
                        lambda lib=lib, a=a, R=R: (lib.reserve_attention(R), lib.attention(a)),
                        lambda case=case: testing.check_attention(case, case.out),
                    )  # fmt: skip
            for R in SUITE_SEL_ROWS:
                for name in testing.SELECT_CASES:
                    case = testing.make_select_case(name, R, device, seed=R, layout=lay)
                    ck, table = case.compressed_key_cache, case.page_table
                    a = {
                        "q": case.q, "ck": ck, "table": table, "t2r": case.token_to_req,
                        "pos": case.query_positions, "lens": case.sequence_lengths,
                        "out": case.out,
                    }  # fmt: skip
                    fails += suite_call(
                        f"{lname} select {lay_name} R={R} {name}", limit_s,
                        lambda lib=lib, a=a, R=R, t=table, c=ck: (
                            lib.reserve_select(R, t.shape[1], c.shape[1]), lib.select(a)
                        ),
                        lambda case=case: testing.check_selection(case, case.out, exact=True),
                    )  # fmt: skip
    print(f"suite: {fails} failed", flush=True)
    return 1 if fails else 0


def suite_call(tag, limit_s, call, check) -> int:
    print("RUN", tag, flush=True)
    faulthandler.dump_traceback_later(limit_s, exit=True)
    try:
        call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        faulthandler.cancel_dump_traceback_later()
    try:
        check()
    except AssertionError as exc:
        print("FAIL", tag, str(exc).splitlines()[0][:300], flush=True)
        return 1
    return 0


STAMP_CTAS, STAMP_SLOTS = 4096, 32  # select_paged_tokens.cu, QSA_SELECT_STAMPS
STAMP_PHASES = ("load", "histogram", "scan", "gather", "rank+write", "tail")  # points 2 -> 8


def _q(xs: list[float], f: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(f * len(xs)))] if xs else float("nan")


def sel_once_case(case: str, gen, full: bool = False):
    """The tensors of a selection case sel:LAYOUT:R[:CTX][:full] (SEL_LAYOUTS; CTX tokens, 32K,
    of a request per row; rows at positions from CTX / 2 to CTX, or, with :full in the case or
    the argument full, every row at its request's full length, as the benchmark's cases), with
    R and the layout's C."""
    _, name, rows, *rest = case.split(":")
    full = full or "full" in rest
    rest = [x for x in rest if x != "full"]
    dt, Cp, layers, ost, tpad = SEL_LAYOUTS[name]
    R, ctx = int(rows), int(rest[0]) if rest else 32768
    a = select_case(R, dt, Cp, layers, ost, tpad, gen, ctx=ctx, P=R * (ctx * 50 // 32768),
                    bad=False, integer=False, B=R)  # fmt: skip
    if full:
        a["pos"].copy_(a["lens"][a["t2r"].long()].to(a["pos"].dtype) - 1)
    return a, R, Cp


def stamps(lname: str, lib: Lib, cases: str, out: Path) -> int:
    """--stamps: the selection's phase stamps (a build with -DQSA_SELECT_STAMPS=1) of one call
    per case, every row at its request's full length (as the benchmark's cases): the CTAs'
    scoring, the last CTA's select phase by phase, and each SM's busy and idle time."""
    report = {"build": lname, "device": torch.cuda.get_device_name(), "cases": {}}
    for case in cases.split(","):
        gen = torch.Generator(device="cuda")
        gen.manual_seed(1)
        a, R, Cp = sel_once_case(case, gen, full=True)
        lib.reserve_select(R, a["table"].shape[1], Cp)
        for _ in range(3):
            lib.select(a)
        torch.cuda.synchronize()
        if lib.lib.qsa_select_stamps(None, 1):
            raise RuntimeError("qsa_select_stamps: clear failed")
        lib.select(a)
        torch.cuda.synchronize()
        buf = (C.c_uint64 * (STAMP_CTAS * STAMP_SLOTS))()
        if lib.lib.qsa_select_stamps(C.addressof(buf), 0):
            raise RuntimeError("qsa_select_stamps: copy failed")
        ctas = [list(buf[i * STAMP_SLOTS : (i + 1) * STAMP_SLOTS]) for i in range(STAMP_CTAS)]
        ctas = [c for c in ctas if c[0]]
        t0 = min(c[0] for c in ctas)
        ends = [max(c[k] for k in range(9) if c[k]) for c in ctas]
        span = max(ends) - t0
        last = [c for c in ctas if c[8]]
        res = {
            "rows": R,
            "ctas": len(ctas),
            "span_us": span / 1e3,
            "score_us": [_q([(c[1] - c[0]) / 1e3 for c in ctas], f) for f in (0.1, 0.5, 0.9)],
            "arrive_us": [_q([(c[2] - c[1]) / 1e3 for c in ctas], f) for f in (0.1, 0.5, 0.9)],
            "select_us": [_q([(c[8] - c[2]) / 1e3 for c in last], f) for f in (0.1, 0.5, 0.9)],
            "phases_us": {},
            "phases_cycles": {},
        }
        for k, ph in enumerate(STAMP_PHASES, start=2):
            ok = [c for c in last if c[k] and c[k + 1]]
            res["phases_us"][ph] = [
                _q([(c[k + 1] - c[k]) / 1e3 for c in ok], f) for f in (0.5, 0.9)
            ]
            res["phases_cycles"][ph] = _q([c[16 + k + 1] - c[16 + k] for c in ok], 0.5)
        sms: dict[int, list] = {}
        for c, e in zip(ctas, ends, strict=True):
            sms.setdefault(int(c[15]), []).append((c[0] - t0, e - t0))
        busy = [sum(e - b for b, e in v) for v in sms.values()]
        tail = [span - max(e for _, e in v) for v in sms.values()]
        res["sms"] = len(sms)
        res["sm_busy_fraction"] = sum(busy) / (len(sms) * span)
        res["sm_tail_us"] = [_q([t / 1e3 for t in tail], f) for f in (0.1, 0.5, 0.9)]
        res["select_sm_us_total"] = sum((c[8] - c[2]) / 1e3 for c in last)
        report["cases"][case] = res
        print(f"STAMPS {case}: span {res['span_us']:.1f} us, {len(ctas)} CTAs on {len(sms)} SMs "
              f"(busy {res['sm_busy_fraction']:.1%}, tail p10/50/90 "
              f"{'/'.join(f'{x:.1f}' for x in res['sm_tail_us'])} us); score p10/50/90 "
              f"{'/'.join(f'{x:.2f}' for x in res['score_us'])} us; select "
              f"{'/'.join(f'{x:.2f}' for x in res['select_us'])} us (sum "
              f"{res['select_sm_us_total']:.0f} SM-us)", flush=True)  # fmt: skip
        for ph in STAMP_PHASES:
            m, p9 = res["phases_us"][ph]
            print(f"  {ph:11s} median {m:6.2f} us  p90 {p9:6.2f} us  "
                  f"({res['phases_cycles'][ph]} cycles)", flush=True)  # fmt: skip
        del a
    out.mkdir(parents=True, exist_ok=True)
    (out / "v2_stamps.json").write_text(json.dumps(report, indent=1))
    return 0


# Kernels that a call launches before its last one (a split selection's scores: v40, in builds
# of its candidate branches; deleted on main): their durations count towards the next kernel.
LEADING_KERNELS = ("select_kernel_scores",)


def ab_report(log: Path):
    """Median duration (us) of each --once case and build, from ncu's CSV in the same log: a
    call's kernels summed (the leading kernels of LEADING_KERNELS with the kernel after them)."""
    import csv

    order, times, name_col, lead = [], [], None, 0.0
    for line in log.read_text().splitlines():
        if line.startswith("ONCE "):
            _, case, lname, n = line.split()
            order.append((case, lname, int(n)))
        elif line.startswith('"ID"'):
            name_col = next(csv.reader([line])).index("Kernel Name")
        elif line.startswith('"') and "gpu__time_duration.sum" in line:
            row = next(csv.reader([line]))
            scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3}
            t = float(row[-1].replace(",", "")) * scale[row[-2]]
            if name_col is not None and any(k in row[name_col] for k in LEADING_KERNELS):
                lead += t
                continue
            times.append(lead + t)
            lead = 0.0
    calls = sum(n for _, _, n in order)
    if calls != len(times):
        print(
            f"ab-report: {calls} calls but {len(times)} profiled (a call: its leading kernels "
            f"{LEADING_KERNELS} and one more)"
        )
        return 1
    k, table = 0, {}
    for case, lname, n in order:
        table.setdefault(case, {})[lname] = statistics.median(times[k : k + n])
        k += n
    for case, row in table.items():
        ref = row.get("new")
        cells = [
            f"{ln} {t:7.2f}" + (f" ({t / ref:.3f})" if ref and ln != "new" else "")
            for ln, t in row.items()
        ]
        print(f"{case:24s} " + "  ".join(cells))
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows-att", default="1,8,64,256")
    ap.add_argument("--rows-sel", default="1,8,64,256")
    ap.add_argument("--budget", type=float, default=300)
    ap.add_argument("--only", default="", help="comma list: time the pools whose name has one")
    ap.add_argument(
        "--once",
        default="",
        metavar="CASES",
        help="comma list of LAYOUT:R[:SPLITS] (attention, ATT_LAYOUTS, 512K-token pool; SPLITS "
        "CTAs per row, default the library's choice) or "
        "sel:LAYOUT:R[:CTX][:full] (selection, SEL_LAYOUTS, CTX tokens (32K) of a request per "
        "row, positions CTX/2-CTX, or with :full every row at its full length): "
        "ONCE_CALLS calls of each "
        "--once-lib build, for a profiler (ncu -k regex:attention|select_kernel)",
    )
    ap.add_argument(
        "--once-lib",
        default="new",
        help="--once's builds: new, old, alt_NAME or upstream (vLLM's scoring kernel, selection "
        "cases; .upstream beside the tree), comma list",
    )
    ap.add_argument(
        "--suite",
        type=float,
        default=0,
        metavar="LIMIT_S",
        help="the GPU suite's v2 layout cases through this tree's build and every variant, "
        "each call announced and ended (with every stack) if it has not returned in LIMIT_S",
    )
    ap.add_argument(
        "--suite-libs", default="", help="--suite's builds (new, alt_NAME; comma list; default all)"
    )
    ap.add_argument(
        "--alts",
        default="",
        metavar="NAMES",
        help="load only these candidate builds (alt_NAME, comma list; default every "
        ".harness/libqsa_alt_*.so): one build per process, so that a fault stops only its own",
    )
    ap.add_argument(
        "--stamps",
        default="",
        metavar="CASES",
        help="comma list of sel:LAYOUT:R[:CTX]: the selection's phase stamps of one call per "
        "case (every row at its request's full length), from the --alts build made with "
        "-DQSA_SELECT_STAMPS=1; v2_stamps.json in --out",
    )
    ap.add_argument(
        "--ab-report",
        default="",
        metavar="LOG",
        help="LOG: stdout of --once under ncu --csv --metrics gpu__time_duration.sum; prints "
        "each case's median kernel time per build",
    )
    args = ap.parse_args()
    if args.ab_report:  # ncu --csv durations of a --once run, per case and build
        return ab_report(Path(args.ab_report))
    new = Lib(ROOT / ".harness/libqsa_new.so", True)
    old = Lib(ROOT / ".harness/libqsa_old.so", False)
    # candidate variants of this tree (.harness/libqsa_alt*.so), timed beside it
    keep = {n for n in args.alts.split(",") if n}
    alt = {
        f.stem.removeprefix("libqsa_"): Lib(f, True)
        for f in sorted((ROOT / ".harness").glob("libqsa_alt*.so"))
        if not keep or f.stem.removeprefix("libqsa_") in keep
    }
    if keep - set(alt):
        sys.exit(f"--alts: no build {', '.join(sorted(keep - set(alt)))} in .harness")
    if args.suite:
        libs = {"new": new, **alt}
        keep = [n for n in args.suite_libs.split(",") if n] or list(libs)
        return suite({n: libs[n] for n in keep}, args.suite)
    if args.stamps:  # the first --alts build made with -DQSA_SELECT_STAMPS=1
        lname, lib = next(
            ((n, b) for n, b in alt.items() if hasattr(b.lib, "qsa_select_stamps")), ("", None)
        )
        if lib is None:
            sys.exit("--stamps: no build in .harness made with -DQSA_SELECT_STAMPS=1")
        lib.lib.qsa_select_stamps.argtypes = [VP, I32]
        lib.lib.qsa_select_stamps.restype = I32
        return stamps(lname, lib, args.stamps, Path(args.out))
    if args.once:
        libs = {"new": new, "old": old, **alt}
        for case in args.once.split(","):
            gen = torch.Generator(device="cuda")
            gen.manual_seed(1)
            if case.startswith("sel:"):  # a selection case (sel_once_case)
                a, R, Cp = sel_once_case(case, gen)
            else:  # an attention case of ATT_LAYOUTS on a 512K-token pool (LAYOUT:R[:SPLITS])
                name, rows, *sp = case.split(":")
                dt, kdt, ps, packed, layers, ist, tpad, gate = ATT_LAYOUTS[name]
                R, splits = int(rows), int(sp[0]) if sp else 0
                a = attention_case(R, dt, kdt, ps, packed, layers, ist, tpad, gate, gen,
                                   ctx=1 << 19, holes=False, bad=False)  # fmt: skip
            for lname in args.once_lib.split(","):
                if lname == "upstream":  # upstream's scoring kernel on the same tensors
                    call = _upstream_scoring_once(a, case)
                elif case.startswith("sel:"):
                    libs[lname].reserve_select(R, a["table"].shape[1], Cp)
                    call = libs[lname].select
                else:
                    libs[lname].reserve_attention(R, splits)
                    call = functools.partial(libs[lname].attention, splits=splits)
                for _ in range(ONCE_CALLS):
                    call(a)
                torch.cuda.synchronize()
                print(f"ONCE {case} {lname} {ONCE_CALLS}", flush=True)
            del a
        return 0
    out = Path(args.out)
    res = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "checks": [],
        "timing": [],
    }
    fails = []
    if args.check:
        t = time.time()
        check(new, old, res["checks"], fails, alt)
        print(
            f"checks: {len(res['checks'])} run, {len(fails)} failed ({time.time() - t:.0f} s)",
            flush=True,
        )
        for f in fails[:40]:
            print("FAIL", f, flush=True)
        (out / "v2_checks.json").write_text(json.dumps(res["checks"], indent=1))
    if args.time:
        up = None
        try:
            from custom_esimd_kernels_vllm.bench import upstream as upmod

            u = upmod.load(str(ROOT / ".upstream"))
            up = u if u.ok else None
            print("upstream:", u.to_dict(), flush=True)
        except Exception as exc:  # noqa: BLE001
            print("upstream not loaded:", exc, flush=True)
        rows_att = [int(x) for x in args.rows_att.split(",") if x]
        rows_sel = [int(x) for x in args.rows_sel.split(",") if x]
        time_all(
            new,
            old,
            up,
            res["timing"],
            rows_att,
            rows_sel,
            args.budget,
            alt,
            [o for o in args.only.split(",") if o],
        )
    (out / "v2_harness.json").write_text(json.dumps(res, indent=1))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
