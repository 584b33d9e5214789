"""Benchmark cases: the grid (what is measured) and the input builders (what is fed).

Two groups of cases:

* ``seed``: the shapes the original SYCL change reported, built by ``qsa_ops.testing`` (the
  same cases the test suites check): attention at R=1 with valid widths 32, 1024 and 2051
  (one request of 8 pages; width 1024 is the full-width case with entries 1024.. turned into
  holes), selection "cross-page tail" (519 visible tokens = 129 blocks + 3 tail tokens) and
  "P8192 saturated" (a pool of 8,192 physical pages; 9,215 visible tokens = 2,303 blocks, so
  the 2,051-wide row is full). Random float16 data (not the small-integer variant).
* ``scale``: rows R in {1, 8, 64, 256} times context C in {8K, 32K, 128K} tokens, for both
  operators, built here. Each row is one decode request (B = R) whose query sees all C
  tokens. For attention every row lists 2,051 distinct valid tokens drawn from its C tokens,
  so C only changes the page table (M = C / 512 pages per request) and the pool size; for
  selection C is the work: C / 4 blocks are scored per row.

NOTES: the scale inputs are generated here rather than with ``qsa_ops.testing``'s scale
builders for two reasons: those put every row on one request (rows then share most of their
tokens, which an L2 cache serves: not a decode batch), and they draw on the CPU, which for
the 2 GiB pools of R=256 x 128K takes longer than the measurement. Here the data is drawn on
the target device with a seeded generator, so every run measures the same data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..qsa_ops import contract
from ..qsa_ops.reference import visible_tokens

ATTENTION = "attention"
SELECTION = "selection"
OPS = (ATTENTION, SELECTION)

SCALE_ROWS = (1, 8, 64, 256)
SCALE_CONTEXTS = (8 * 1024, 32 * 1024, 128 * 1024)

# NOTES: attention pages are 512 KiB (512 tokens x 1 KiB). One distinct page per request page
# would need 32 GiB at R=256 x 128K; the pool is capped at 4,096 pages (2 GiB) and requests
# then share physical pages at random. The selected tokens of one call (R x 2,051 KiB, at
# most 513 MiB) still land on random pages, so the cap changes neither the bytes a kernel
# must read nor its access pattern.
ATTENTION_POOL_CAP = 4096
SEED_ATTENTION_CONTEXT = 8 * contract.KV_PAGE  # qsa_ops.testing's valid-width cases: 8 pages
SEED_P8192_POOL = 8192


@dataclass(frozen=True)
class CaseSpec:
    """One benchmark case. ``context`` is the number of tokens each request has (attention:
    the span of its page table; selection: the tokens its query sees)."""

    op: str
    group: str  # "seed" | "scale" | "quick"
    name: str
    rows: int
    context: int
    width: int = contract.WIDTH  # attention: valid entries per row (the rest are -1 holes)
    pool_pages: int | None = None  # physical pages P; None = derived (see builders)
    profile: bool = False  # capture the profiler counts on this case
    # the kernels' performance table: the latency target (graph replay, median, µs) of the
    # cases it lists; torch.compile runs on these by default
    target_us: float | None = None
    testing_case: str | None = None  # the qsa_ops.testing seed case it is built from

    @property
    def target(self) -> bool:
        return self.target_us is not None

    @property
    def key(self) -> str:
        return f"{self.op}/{self.name}"

    def to_dict(self) -> dict[str, object]:
        return {
            "op": self.op,
            "group": self.group,
            "name": self.name,
            "rows": self.rows,
            "context": self.context,
            "width": self.width,
            "pool_pages": self.pool_pages,
            "profile": self.profile,
            "target_us": self.target_us,
            "testing_case": self.testing_case,
        }


def _ctx_label(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def seed_cases() -> list[CaseSpec]:
    full = contract.WIDTH
    attention = [
        CaseSpec(
            ATTENTION, "seed", f"seed R=1 width {w}", 1, SEED_ATTENTION_CONTEXT, width=w,
            profile=(w == full), target_us=5.0 if w == full else None, testing_case=testing_name,
        )
        for w, testing_name in ((32, "valid_width_32"), (1024, "full_width_2051"),
                                (full, "full_width_2051"))
    ]  # fmt: skip
    selection = [
        CaseSpec(
            SELECTION, "seed", "seed cross-page tail (129 blocks / 519 tokens)", 1, 519,
            testing_case="cross_page_tail",
        ),
        CaseSpec(
            SELECTION, "seed", "seed P8192 saturated (2303 blocks / 2051 tokens)", 1,
            2303 * contract.COMPRESS_RATIO + 3, pool_pages=SEED_P8192_POOL, profile=True,
            target_us=8.0, testing_case="p8192_saturated",
        ),
    ]  # fmt: skip
    return attention + selection


# The kernels' performance table (graph replay, median): (rows, context) -> target µs for the
# scale cases; the seed targets are "seed R=1 width 2051" (5 µs) and "seed P8192 saturated"
# (8 µs). The table gives no context for attention at R=64 / R=256 (context changes only the
# page table there); 32K is used.
SCALE_TARGETS: dict[str, dict[tuple[int, int], float]] = {
    ATTENTION: {(64, 32 * 1024): 45.0, (256, 32 * 1024): 150.0},
    SELECTION: {(1, 128 * 1024): 15.0, (64, 32 * 1024): 60.0},
}


def scale_cases(
    rows: tuple[int, ...] = SCALE_ROWS, contexts: tuple[int, ...] = SCALE_CONTEXTS
) -> list[CaseSpec]:
    return [
        CaseSpec(
            op, "scale", f"R={r} ctx={_ctx_label(c)}", r, c, target_us=SCALE_TARGETS[op].get((r, c))
        )
        for op in OPS
        for r in rows
        for c in contexts
    ]


def quick_cases() -> list[CaseSpec]:
    """A tiny grid for the CPU reference (CI proves the harness): two seeds, then two rows
    times two contexts per operator."""
    seeds = {c.name: c for c in seed_cases()}
    return [
        seeds["seed R=1 width 32"],
        seeds["seed cross-page tail (129 blocks / 519 tokens)"],
    ] + [
        CaseSpec(op, "quick", f"R={r} ctx={_ctx_label(c)}", r, c, profile=(r == 1 and c == 4096))
        for op in OPS
        for r in (1, 2)
        for c in (4096, 8192)
    ]


def target_cases() -> list[CaseSpec]:
    """The performance-table cases only (the timing section of the GPU validation record)."""
    return [c for c in seed_cases() + scale_cases() if c.target]


GRIDS = {
    "default": lambda: seed_cases() + scale_cases(),
    "seed": seed_cases,
    "scale": scale_cases,
    "targets": target_cases,
    "quick": quick_cases,
}


def grid(name: str, ops: tuple[str, ...] = OPS) -> list[CaseSpec]:
    if name not in GRIDS:
        raise ValueError(f"grid must be one of {', '.join(GRIDS)}, got {name!r}")
    bad = [op for op in ops if op not in OPS]
    if bad:
        raise ValueError(f"ops must be among {', '.join(OPS)}, got {', '.join(bad)}")
    return [c for c in GRIDS[name]() if c.op in ops]


# ----------------------------------------------------------------------------------------
# builders
# ----------------------------------------------------------------------------------------


@dataclass
class CaseInputs:
    """The arguments of one call (names as in the operator signatures) plus the pool: the
    physical page buffer that rotation tiles (``kv`` [P, 512, 512] for attention, the
    compressed-key cache [P, 128, 1, 128] for selection)."""

    op: str
    tensors: dict[str, torch.Tensor]
    pool_name: str
    notes: list[str] = field(default_factory=list)

    @property
    def pool(self) -> torch.Tensor:
        return self.tensors[self.pool_name]

    @property
    def pages(self) -> int:
        return self.pool.shape[0]


def _generator(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def packed_kv_views(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact-packed K and V views [P, 512, 1, 256] of a [P, 512, 512] buffer."""
    pages = kv.shape[0]
    shape = (pages, contract.KV_PAGE, 1, contract.HEAD_DIM)
    strides = (
        contract.KV_PAGE * 2 * contract.HEAD_DIM,
        2 * contract.HEAD_DIM,
        contract.HEAD_DIM,
        1,
    )
    base = kv.storage_offset()
    k = kv.as_strided(shape, strides, base)
    v = kv.as_strided(shape, strides, base + contract.V_OFFSET)
    return k, v


def random_page_table(
    requests: int, pages_per_request: int, pool_pages: int, g: torch.Generator, device
) -> torch.Tensor:
    """[B, M] int32; pages are distinct within a request, and across requests too when the
    pool has room (otherwise requests share pages at random)."""
    if requests * pages_per_request <= pool_pages:
        perm = torch.randperm(pool_pages, generator=g, device=device)
        table = perm[: requests * pages_per_request].view(requests, pages_per_request)
    else:
        keys = torch.rand(requests, pool_pages, generator=g, device=device)
        table = keys.argsort(dim=1)[:, :pages_per_request]
    return table.to(torch.int32).contiguous()


def random_distinct_tokens(
    rows: int, count: int, context: int, g: torch.Generator, device
) -> torch.Tensor:
    """[rows, count] int64: ``count`` distinct token positions of [0, context) per row, in
    random order (as the selection emits them: score order, not position order)."""
    if count > context:
        raise ValueError(f"cannot draw {count} distinct tokens from a context of {context}")
    parts = []
    step = max(1, (1 << 24) // max(1, context))  # bound the [rows, context] temporary
    for start in range(0, rows, step):
        n = min(rows, start + step) - start
        keys = torch.rand(n, context, generator=g, device=device)
        parts.append(keys.argsort(dim=1)[:, :count])
    return torch.cat(parts) if parts else torch.empty(0, count, dtype=torch.long, device=device)


def _pages_for(tokens: int) -> int:
    return max(1, -(-tokens // contract.KV_PAGE))


def build_attention(spec: CaseSpec, device: torch.device, seed: int = 0) -> CaseInputs:
    g = _generator(device, seed)
    rows, requests = spec.rows, spec.rows
    pages_per_request = _pages_for(spec.context)
    pool = spec.pool_pages or min(requests * pages_per_request, ATTENTION_POOL_CAP)
    pool = max(pool, pages_per_request)
    half = torch.float16
    kv = torch.randn(
        pool, contract.KV_PAGE, 2 * contract.HEAD_DIM, generator=g, device=device, dtype=half
    )
    k_cache, v_cache = packed_kv_views(kv)
    indices = torch.full((rows, contract.WIDTH), -1, dtype=torch.int32, device=device)
    tokens = random_distinct_tokens(rows, spec.width, spec.context, g, device)
    indices[:, : spec.width] = tokens.to(torch.int32)
    tensors = {
        "q": torch.randn(
            rows, contract.ATTN_HEADS, contract.HEAD_DIM, generator=g, device=device, dtype=half
        ),
        "kv": kv,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "logical_indices": indices,
        "page_table": random_page_table(requests, pages_per_request, pool, g, device),
        "token_to_req": torch.arange(rows, dtype=torch.int32, device=device),
        "out": torch.empty(rows, contract.ATTN_HEADS, contract.HEAD_DIM, dtype=half, device=device),
    }
    return CaseInputs(ATTENTION, tensors, "kv")


def build_selection(spec: CaseSpec, device: torch.device, seed: int = 0) -> CaseInputs:
    g = _generator(device, seed)
    rows, requests = spec.rows, spec.rows
    pages_per_request = _pages_for(spec.context)
    pool = max(spec.pool_pages or requests * pages_per_request, pages_per_request)
    half = torch.float16
    tensors = {
        "q": torch.randn(
            rows, contract.INDEX_HEADS, contract.INDEX_DIM, generator=g, device=device, dtype=half
        ),
        "compressed_key_cache": torch.randn(
            pool, contract.CK_PAGE, 1, contract.INDEX_DIM, generator=g, device=device, dtype=half
        ),
        "page_table": random_page_table(requests, pages_per_request, pool, g, device),
        "token_to_req": torch.arange(rows, dtype=torch.int32, device=device),
        "query_positions": torch.full((rows,), spec.context - 1, dtype=torch.int64, device=device),
        "sequence_lengths": torch.full((requests,), spec.context, dtype=torch.int32, device=device),
        "out": torch.empty(rows, contract.WIDTH, dtype=torch.int32, device=device),
    }
    return CaseInputs(SELECTION, tensors, "compressed_key_cache")


def build_seed(spec: CaseSpec, device: torch.device, seed: int = 0) -> CaseInputs:
    """A seed case from ``qsa_ops.testing`` (random float16 data), as CaseInputs."""
    from ..qsa_ops import testing

    if spec.op == ATTENTION:
        case = testing.make_attention_case(spec.testing_case, spec.rows, device, seed)
        pages = case.k_cache.shape[0]
        lead = case.k_cache.storage_offset()
        kv = case.kv[lead : lead + pages * contract.KV_PAGE * 2 * contract.HEAD_DIM].view(
            pages, contract.KV_PAGE, 2 * contract.HEAD_DIM
        )
        indices = case.logical_indices.clone()
        indices[:, spec.width :] = -1  # width 1024: the full-width case cut to 1024 entries
        k_cache, v_cache = packed_kv_views(kv)
        tensors = {
            "q": case.q,
            "kv": kv,
            "k_cache": k_cache,
            "v_cache": v_cache,
            "logical_indices": indices,
            "page_table": case.page_table,
            "token_to_req": case.token_to_req,
            "out": case.out,
        }
        return CaseInputs(ATTENTION, tensors, "kv")
    case = testing.make_select_case(spec.testing_case, spec.rows, device, seed, integer=False)
    names = ("q", "compressed_key_cache", "page_table", "token_to_req", "query_positions",
             "sequence_lengths", "out")  # fmt: skip
    return CaseInputs(SELECTION, {n: getattr(case, n) for n in names}, "compressed_key_cache")


def build(spec: CaseSpec, device: torch.device, seed: int = 0) -> CaseInputs:
    device = torch.device(device)
    if spec.testing_case:
        return build_seed(spec, device, seed)
    builder = build_attention if spec.op == ATTENTION else build_selection
    return builder(spec, device, seed)


# ----------------------------------------------------------------------------------------
# the decode step: the layer's whole QSA path (cache update, selection, attention)
# ----------------------------------------------------------------------------------------

DECODE_ROWS = (1, 8, 64)
DECODE_LAYERS = 8
# 32K tokens per request; a multiple of 4, so that every row's new token completes a block
# and the cache update refreshes one compressed key per row (its worst case)
DECODE_CONTEXT = 32 * 1024


def build_decode(
    rows: int, context: int, layers: int, device: torch.device, seed: int = 0
) -> dict[str, object]:
    """One decode step of ``rows`` requests (one new token each, at position context - 1) over
    ``layers`` layers, each with its own caches: ``{"shared": metadata, "layers": [...]}``.
    Requests own distinct pages; the K/V pages and the compressed-key pages share the page
    table (page x holds tokens 512x.. and their 128 compressed keys)."""
    device = torch.device(device)
    g = _generator(device, seed)
    half = torch.float16
    pages_per_request = _pages_for(context)
    pool = rows * pages_per_request
    table = random_page_table(rows, pages_per_request, pool, g, device)
    pos = context - 1
    page = table[:, pos // contract.KV_PAGE].long()
    offset = pos % contract.KV_PAGE
    completes = pos % contract.COMPRESS_RATIO == contract.COMPRESS_RATIO - 1
    ck_slot = page * contract.CK_PAGE + offset // contract.COMPRESS_RATIO
    shared = {
        "page_table": table,
        "token_to_req": torch.arange(rows, dtype=torch.int32, device=device),
        "query_positions": torch.full((rows,), pos, dtype=torch.int64, device=device),
        "sequence_lengths": torch.full((rows,), context, dtype=torch.int32, device=device),
        "slot_mapping": (page * contract.KV_PAGE + offset).contiguous(),
        "compressed_slot_mapping": ck_slot if completes else torch.full_like(ck_slot, -1),
        "indices": torch.full((rows, contract.WIDTH), -1, dtype=torch.int32, device=device),
    }
    per_layer = []
    for _ in range(layers):
        kv = torch.randn(
            pool, contract.KV_PAGE, 2 * contract.HEAD_DIM, generator=g, device=device, dtype=half
        )
        k_cache, v_cache = packed_kv_views(kv)

        def rand(*shape, dtype=half):
            return torch.randn(*shape, generator=g, device=device, dtype=dtype)

        per_layer.append({
            "kv": kv, "k_cache": k_cache, "v_cache": v_cache,
            "compressed_key_cache": rand(pool, contract.CK_PAGE, 1, contract.INDEX_DIM),
            "index_wk": rand(contract.INDEX_DIM, contract.HEAD_DIM, dtype=torch.float32),
            "key": rand(rows, contract.HEAD_DIM),
            "value": rand(rows, contract.HEAD_DIM),
            "q_index": rand(rows, contract.INDEX_HEADS, contract.INDEX_DIM),
            "q": rand(rows, contract.ATTN_HEADS, contract.HEAD_DIM),
            "out": torch.empty(rows, contract.ATTN_HEADS, contract.HEAD_DIM, device=device,
                               dtype=half),
        })  # fmt: skip
    return {"shared": shared, "layers": per_layer}


# ----------------------------------------------------------------------------------------
# the memory floor
# ----------------------------------------------------------------------------------------

# The memory floor: the bytes one call must move, over the copy bandwidth of the device.
#
# What is counted (each input read once, the output written once):
#
# attention
#     q (R x 3 x 256 x 2 B), the selected tokens' K and V (1 KiB per token: 256 + 256 float16),
#     counted once per **distinct physical token** of the call (a token listed twice, or by two
#     rows, is read once by an ideal kernel), the indices (R x 2051 x 4 B), the page table
#     (B x M x 4 B, all of it), token_to_req (R x 4 B); written: out (R x 3 x 256 x 2 B).
# selection
#     q (R x 4 x 128 x 2 B), the usable compressed keys (256 B each), once per **distinct
#     physical key** of the call (rows of one request share their keys), the page table
#     (B x M x 4 B), token_to_req (R x 4 B), query_positions (R x 8 B), sequence_lengths
#     (B x 4 B); written: out (R x 2051 x 4 B).
#
# The floor time is ``bytes / bandwidth`` with the bandwidth of a large device-to-device copy
# measured in the same run, counted as bytes read + bytes written. "% of floor" is
# ``floor time / measured time``: 100 % is a kernel that streams its bytes at copy speed.

KV_TOKEN_BYTES = 2 * contract.HEAD_DIM * 2  # K and V halves of one token, float16: 1 KiB
KEY_BYTES = contract.INDEX_DIM * 2  # one compressed key, float16: 256 B


@dataclass(frozen=True)
class FloorBytes:
    read: dict[str, int]
    written: dict[str, int]
    counts: dict[str, int]  # the token/key counts behind the byte figures

    @property
    def total(self) -> int:
        return sum(self.read.values()) + sum(self.written.values())

    def seconds(self, bandwidth_bytes_per_s: float) -> float:
        return self.total / bandwidth_bytes_per_s

    def to_dict(self) -> dict[str, object]:
        return {
            "read": self.read,
            "written": self.written,
            "counts": self.counts,
            "total": self.total,
        }


def attention_bytes(rows: int, requests: int, max_pages: int, distinct_tokens: int) -> FloorBytes:
    return FloorBytes(
        read={
            "q": rows * contract.ATTN_HEADS * contract.HEAD_DIM * 2,
            "kv_tokens": distinct_tokens * KV_TOKEN_BYTES,
            "logical_indices": rows * contract.WIDTH * 4,
            "page_table": requests * max_pages * 4,
            "token_to_req": rows * 4,
        },
        written={"out": rows * contract.ATTN_HEADS * contract.HEAD_DIM * 2},
        counts={"distinct_tokens": distinct_tokens},
    )


def selection_bytes(rows: int, requests: int, max_pages: int, distinct_keys: int) -> FloorBytes:
    return FloorBytes(
        read={
            "q": rows * contract.INDEX_HEADS * contract.INDEX_DIM * 2,
            "compressed_keys": distinct_keys * KEY_BYTES,
            "page_table": requests * max_pages * 4,
            "token_to_req": rows * 4,
            "query_positions": rows * 8,
            "sequence_lengths": requests * 4,
        },
        written={"out": rows * contract.WIDTH * 4},
        counts={"distinct_keys": distinct_keys},
    )


def _request_of_rows(
    token_to_req: torch.Tensor, requests: int
) -> tuple[torch.Tensor, torch.Tensor]:
    b = token_to_req.long()
    return (b >= 0) & (b < requests), b.clamp(0, max(requests - 1, 0))


def count_attention_tokens(t: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(distinct physical tokens, valid entries counted per occurrence) of one call."""
    table = t["page_table"].long()
    requests, max_pages = table.shape
    pages = t["k_cache"].shape[0]
    if requests == 0 or max_pages == 0:
        return 0, 0
    ok_req, b = _request_of_rows(t["token_to_req"], requests)
    idx = t["logical_indices"].long()
    page = torch.div(idx, contract.KV_PAGE, rounding_mode="floor")
    valid = (idx >= 0) & (page < max_pages) & ok_req[:, None]
    phys = table[b[:, None], page.clamp(0, max_pages - 1)]
    valid &= (phys >= 0) & (phys < pages)
    token_id = phys * contract.KV_PAGE + idx.clamp_min(0) % contract.KV_PAGE
    return int(torch.unique(token_id[valid]).numel()), int(valid.sum())


def count_selection_keys(
    t: dict[str, torch.Tensor], chunk_elements: int = 1 << 24
) -> tuple[int, int]:
    """(distinct physical keys, usable blocks summed over rows) of one call."""
    table = t["page_table"].long()
    requests, max_pages = table.shape
    pages = t["compressed_key_cache"].shape[0]
    rows = t["q"].shape[0]
    if requests == 0 or max_pages == 0 or rows == 0:
        return 0, 0
    ok_req, b = _request_of_rows(t["token_to_req"], requests)
    n = visible_tokens(t["query_positions"], t["sequence_lengths"].long()[b])
    nb = torch.where(ok_req, n // contract.COMPRESS_RATIO, 0)
    blocks = max_pages * contract.CK_PAGE
    j = torch.arange(blocks, device=table.device)
    ids, usable_total = [], 0
    step = max(1, chunk_elements // blocks)
    for start in range(0, rows, step):
        s = slice(start, min(rows, start + step))
        phys = table[b[s]].repeat_interleave(contract.CK_PAGE, dim=1)  # [C, M * 128]
        usable = (j < nb[s, None]) & (phys >= 0) & (phys < pages)
        key_id = phys * contract.CK_PAGE + j % contract.CK_PAGE
        ids.append(torch.unique(key_id[usable]))
        usable_total += int(usable.sum())
    distinct = int(torch.unique(torch.cat(ids)).numel()) if ids else 0
    return distinct, usable_total


def floor_bytes(op: str, t: dict[str, torch.Tensor]) -> FloorBytes:
    rows = t["q"].shape[0]
    requests, max_pages = t["page_table"].shape
    if op == ATTENTION:
        distinct, occurrences = count_attention_tokens(t)
        fb = attention_bytes(rows, requests, max_pages, distinct)
        fb.counts["valid_entries"] = occurrences
    else:
        distinct, usable = count_selection_keys(t)
        fb = selection_bytes(rows, requests, max_pages, distinct)
        fb.counts["usable_blocks"] = usable
    return fb


def percent_of_floor(floor_seconds: float, measured_seconds: float) -> float:
    """floor / measured, in percent (100 % = at copy bandwidth)."""
    return 100.0 * floor_seconds / measured_seconds if measured_seconds > 0 else float("nan")
