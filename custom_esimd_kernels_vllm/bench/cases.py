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
* ``dtype``: the scale rows R in {1, 8, 64, 256} again, in contract v2's other dtypes and
  layouts (``VARIANTS``, from ``qsa_ops.testing.LAYOUTS``): bfloat16 and float8 K/V (+ float8
  indexer) on vLLM's layout (784-token pages whose page stride spans 4 layers, the [T, 2052]
  index buffer viewed as [T, 2051], strided page-table rows, the output gate), and bfloat16 on
  packed 512-token pages (the same layout with the seed's page geometry). One context per R
  (``VARIANT_CONTEXTS``: the performance table's), so that the grid keeps its time budget.

NOTES: the scale inputs are generated here rather than with ``qsa_ops.testing``'s scale
builders for two reasons: those put every row on one request (rows then share most of their
tokens, which an L2 cache serves: not a decode batch), and they draw on the CPU, which for
the 2 GiB pools of R=256 x 128K takes longer than the measurement. Here the data is drawn on
the target device with a seeded generator, so every run measures the same data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..qsa_ops import contract
from ..qsa_ops.reference import visible_tokens
from ..qsa_ops.testing import LAYOUTS, Layout

ATTENTION = "attention"
SELECTION = "selection"
OPS = (ATTENTION, SELECTION)

SCALE_ROWS = (1, 8, 64, 256)
SCALE_CONTEXTS = (8 * 1024, 32 * 1024, 128 * 1024)

# NOTES: attention pages are 512 KiB (512 tokens x 1 KiB). One distinct page per request page
# would need 32 GiB at R=256 x 128K; the pool is capped at 4,096 pages (2 GiB) and requests
# then share physical pages at random. The selected tokens of one call (R x 2,051 KiB, at
# most 513 MiB) still land on random pages, so the cap changes neither the bytes a kernel
# must read nor its access pattern. The cap is in tokens (2M = 4,096 x 512), so that every
# layout draws its rows from as many distinct tokens (an 8.6 GB pool for vLLM's bfloat16
# 784-token pages of 4 layers, whose other layers' pages are allocated, never read).
ATTENTION_POOL_TOKENS = 4096 * contract.KV_PAGE
ATTENTION_POOL_CAP = ATTENTION_POOL_TOKENS // contract.KV_PAGE  # the seed layout's pages
SEED_ATTENTION_CONTEXT = 8 * contract.KV_PAGE  # qsa_ops.testing's valid-width cases: 8 pages
SEED_P8192_POOL = 8192


SEED_LAYOUT = "seed"
# The dtype/layout variants of the grid: name -> (qsa_ops.testing.Layout, label in the reports).
# "bf16_packed_512" is vLLM's bfloat16 layout with the seed's page geometry (packed 512-token
# pages of one layer, no page-table padding): beside "vllm_bf16_784" it isolates the pages.
VARIANTS: dict[str, tuple[Layout, str]] = {
    SEED_LAYOUT: (LAYOUTS["seed"], "fp16 seed p512"),
    "vllm_bf16_784": (LAYOUTS["vllm_bf16_784"], "bf16 vLLM p784 gate"),
    "vllm_fp8_784": (LAYOUTS["vllm_fp8_784"], "fp8 vLLM p784 gate"),
    "bf16_packed_512": (
        dataclasses.replace(
            LAYOUTS["vllm_bf16_784"], page_size=contract.KV_PAGE, keys_per_page=contract.CK_PAGE,
            layers=1, table_pad=0,
        ),
        "bf16 packed p512 gate",
    ),
}  # fmt: skip
DTYPE_VARIANTS = ("vllm_bf16_784", "vllm_fp8_784", "bf16_packed_512")


def layout_of(name: str) -> Layout:
    if name not in VARIANTS:
        raise ValueError(f"layout must be one of {', '.join(VARIANTS)}, got {name!r}")
    return VARIANTS[name][0]


def variant_label(name: str) -> str:
    return VARIANTS[name][1] if name in VARIANTS else name


def dtype_names(layout: Layout) -> dict[str, str]:
    """The dtypes of a layout as short names (reports): q / cache / indexer."""

    def short(dt: torch.dtype) -> str:
        return {torch.float16: "fp16", torch.bfloat16: "bf16", contract.FP8: "fp8"}.get(
            dt, str(dt).replace("torch.", "")
        )

    return {
        "q": short(layout.dtype),
        "kv": short(layout.cache_dtype),
        "index": short(layout.select_dtype),
    }


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
    layout: str = SEED_LAYOUT  # a key of VARIANTS: dtypes and layout of the tensors
    validation: bool = False  # in the validation subset without a latency target

    @property
    def target(self) -> bool:
        return self.target_us is not None

    @property
    def in_validation(self) -> bool:
        return self.target or self.validation

    @property
    def lay(self) -> Layout:
        return layout_of(self.layout)

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
            "layout": self.layout,
            "layout_label": variant_label(self.layout),
            "validation": self.validation,
            "dtypes": dtype_names(self.lay),
        }


def _ctx_label(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def seed_cases() -> list[CaseSpec]:
    full = contract.WIDTH
    attention = [
        CaseSpec(
            ATTENTION, "seed", f"seed R=1 width {w}", 1, SEED_ATTENTION_CONTEXT, width=w,
            profile=(w == full), target_us=4.0 if w == full else None, testing_case=testing_name,
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
            target_us=6.0, testing_case="p8192_saturated",
        ),
    ]  # fmt: skip
    return attention + selection


# The decode-latency targets (graph replay, L2-cold, median): (rows, context) -> target µs for
# the scale cases; the seed targets are "seed R=1 width 2051" (4 µs) and "seed P8192 saturated"
# (6 µs). Attention's context changes only the page table (every row reads 2051 tokens);
# 32K is used.
SCALE_TARGETS: dict[str, dict[tuple[int, int], float]] = {
    ATTENTION: {(8, 32 * 1024): 6.0, (64, 32 * 1024): 42.0, (256, 32 * 1024): 135.0},
    SELECTION: {
        (1, 128 * 1024): 10.0,
        (8, 128 * 1024): 20.0,
        (64, 32 * 1024): 34.0,
        (256, 32 * 1024): 135.0,
    },
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


# One context per R for the dtype variants: the performance table's (attention: 32K, where the
# context changes only the page table; selection: 128K at R <= 8, 32K beyond).
VARIANT_CONTEXTS: dict[str, dict[int, int]] = {
    ATTENTION: {r: 32 * 1024 for r in SCALE_ROWS},
    SELECTION: {1: 128 * 1024, 8: 128 * 1024, 64: 32 * 1024, 256: 32 * 1024},
}
# The targets for the float8 path (graph replay, L2-cold, median, µs) ...
VARIANT_TARGETS: dict[tuple[str, str], dict[tuple[int, int], float]] = {
    (ATTENTION, "vllm_fp8_784"): {(64, 32 * 1024): 25.0, (256, 32 * 1024): 72.0},
    (SELECTION, "vllm_fp8_784"): {(1, 128 * 1024): 11.0},
}
# ... and the bfloat16 vLLM-layout cases of the validation subset (no target of their own)
VARIANT_VALIDATION: dict[tuple[str, str], tuple[tuple[int, int], ...]] = {
    (ATTENTION, "vllm_bf16_784"): ((64, 32 * 1024),),
    (SELECTION, "vllm_bf16_784"): ((1, 128 * 1024),),
}


def dtype_cases(
    rows: tuple[int, ...] = SCALE_ROWS, layouts: tuple[str, ...] = DTYPE_VARIANTS
) -> list[CaseSpec]:
    """The scale rows in the other dtypes and layouts, at one context per R."""
    out = []
    for op in OPS:
        for lay in layouts:
            for r in rows:
                c = VARIANT_CONTEXTS[op][r]
                out.append(CaseSpec(
                    op, "dtype", f"R={r} ctx={_ctx_label(c)} {variant_label(lay)}", r, c,
                    target_us=VARIANT_TARGETS.get((op, lay), {}).get((r, c)), layout=lay,
                    validation=(r, c) in VARIANT_VALIDATION.get((op, lay), ()),
                ))  # fmt: skip
    return out


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


# The parts of the default grid, each also a grid of its own.
PARTS = {"seed": seed_cases, "scale": scale_cases, "dtype": dtype_cases}


def default_cases() -> list[CaseSpec]:
    return [c for part in PARTS.values() for c in part()]


def target_cases() -> list[CaseSpec]:
    """The validation subset (the timing section of the GPU validation record): the
    performance-table cases and the dtype cases with a target or marked for it."""
    return [c for c in default_cases() if c.in_validation]


GRIDS = {"default": default_cases, **PARTS, "targets": target_cases, "quick": quick_cases}


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
    """The arguments of one call (names as in the operator signatures; the float8 scales as
    floats) plus the pool and the buffers the strided views come from: the pool is the physical
    page buffer that rotation tiles, block-outermost ``[P, layers, page, 512]`` (attention: per
    token 256 K then 256 V values) or ``[P, layers, C, 128]`` (selection's compressed keys);
    the caches are views of its last layer (``pool_views``). ``index_buffer`` / ``out_base``
    hold ``logical_indices`` / selection's ``out`` as row views (``row_views``), and the page
    table is a row view of a padded buffer when the layout pads it."""

    op: str
    tensors: dict[str, torch.Tensor]
    pool_name: str
    notes: list[str] = field(default_factory=list)
    layout: Layout = LAYOUTS["seed"]

    @property
    def pool(self) -> torch.Tensor:
        return self.tensors[self.pool_name]

    @property
    def pages(self) -> int:
        return self.pool.shape[0]


POOL_NAMES = {ATTENTION: "kv", SELECTION: "ck_pool"}


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


def pool_views(op: str, pool: torch.Tensor) -> dict[str, torch.Tensor]:
    """The cache views of a block-outermost pool: its last layer's pages (page stride =
    layers x page). Attention: ``k_cache`` / ``v_cache`` [P, page, 1, 256] (for one layer of
    512-token pages exactly the seed's packed views); selection: ``compressed_key_cache``
    [P, C, 1, 128]."""
    layer = pool[:, -1]  # [P, page, D]
    if op == ATTENTION:
        return {
            "k_cache": layer[..., : contract.HEAD_DIM].unsqueeze(2),
            "v_cache": layer[..., contract.HEAD_DIM :].unsqueeze(2),
        }
    return {"compressed_key_cache": layer.unsqueeze(2)}


# views of the row buffers: (view, buffer); the view is the buffer's first 2051 columns
ROW_VIEWS = (("logical_indices", "index_buffer"), ("out", "out_base"))


def row_views(args: dict) -> dict:
    """Set the 2051-column row views of the row buffers present in ``args`` (in place)."""
    for view, base in ROW_VIEWS:
        if base in args:
            args[view] = args[base][:, : contract.WIDTH]
    return args


def padded_rows(table: torch.Tensor, pad: int) -> torch.Tensor:
    """``table`` [B, M] as a row view of a [B, M + pad] buffer (extra columns: page 0, never
    read), as vLLM's block tables are; ``pad`` 0 gives ``table`` itself."""
    if not pad:
        return table
    wide = torch.zeros(table.shape[0], table.shape[1] + pad, dtype=table.dtype,
                       device=table.device)  # fmt: skip
    wide[:, : table.shape[1]] = table
    return wide[:, : table.shape[1]]


def random_values(
    shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, device
) -> torch.Tensor:
    """Standard normal values in ``dtype``, drawn on ``device``; float8 is drawn in bfloat16
    and converted, page by page (dim 0) in chunks of about 2**26 elements."""
    if dtype != contract.FP8:
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)
    out = torch.empty(shape, dtype=dtype, device=device)
    per = max(1, out[0].numel()) if out.dim() and shape[0] else 1
    step = max(1, (1 << 26) // per)
    for start in range(0, shape[0] if out.dim() else 0, step):
        part = out[start : start + step]
        part.copy_(torch.randn(part.shape, generator=g, device=device, dtype=torch.bfloat16))
    return out


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


def _pages_for(tokens: int, page: int = contract.KV_PAGE) -> int:
    return max(1, -(-tokens // page))


def index_buffer(indices: torch.Tensor, stride: int) -> torch.Tensor:
    """[R, stride] int32 holding ``indices`` [R, 2051] (valid entries first, then -1) in its
    first 2051 columns; with stride > 2051 (vLLM's [T, 2052]), column 2051 holds each row's
    valid count, as vLLM's expand kernel writes it (vLLM's attention reads it)."""
    rows = indices.shape[0]
    buf = torch.full((rows, max(stride, contract.WIDTH)), -1, dtype=torch.int32,
                     device=indices.device)  # fmt: skip
    buf[:, : contract.WIDTH] = indices
    if stride > contract.WIDTH:
        buf[:, contract.WIDTH] = (indices >= 0).sum(dim=1).to(torch.int32)
    return buf


def build_attention(spec: CaseSpec, device: torch.device, seed: int = 0) -> CaseInputs:
    lay = spec.lay
    if lay.kv != "packed":
        raise ValueError(f"the benchmark builds packed K/V layouts only, got {lay.kv!r}")
    g = _generator(device, seed)
    rows, requests = spec.rows, spec.rows
    page = lay.page_size
    pages_per_request = _pages_for(spec.context, page)
    pool = spec.pool_pages or min(requests * pages_per_request, ATTENTION_POOL_TOKENS // page)
    pool = max(pool, pages_per_request)
    kv = random_values((pool, lay.layers, page, 2 * contract.HEAD_DIM), lay.cache_dtype, g, device)
    indices = torch.full((rows, contract.WIDTH), -1, dtype=torch.int32, device=device)
    tokens = random_distinct_tokens(rows, spec.width, spec.context, g, device)
    indices[:, : spec.width] = tokens.to(torch.int32)
    heads = (rows, contract.ATTN_HEADS, contract.HEAD_DIM)
    tensors = {
        "q": random_values(heads, lay.dtype, g, device),
        "kv": kv,
        **pool_views(ATTENTION, kv),
        "index_buffer": index_buffer(indices, lay.index_stride),
        "page_table": padded_rows(
            random_page_table(requests, pages_per_request, pool, g, device), lay.table_pad
        ),
        "token_to_req": torch.arange(rows, dtype=torch.int32, device=device),
        "out": torch.empty(heads, dtype=lay.dtype, device=device),
    }
    if lay.gate:
        tensors["gate"] = 2 * random_values(heads, lay.dtype, g, device)
    k_scale, v_scale = lay.scales
    if k_scale is not None:
        tensors["k_scale"], tensors["v_scale"] = k_scale, v_scale
    return CaseInputs(ATTENTION, row_views(tensors), "kv", layout=lay)


def build_selection(spec: CaseSpec, device: torch.device, seed: int = 0) -> CaseInputs:
    lay = spec.lay
    g = _generator(device, seed)
    rows, requests = spec.rows, spec.rows
    per_page = lay.keys_per_page
    pages_per_request = _pages_for(spec.context, contract.COMPRESS_RATIO * per_page)
    pool = max(spec.pool_pages or requests * pages_per_request, pages_per_request)
    dtype = lay.select_dtype
    ck_pool = random_values((pool, lay.layers, per_page, contract.INDEX_DIM), dtype, g, device)
    out_base = torch.empty(rows, max(lay.index_stride, contract.WIDTH), dtype=torch.int32,
                           device=device)  # fmt: skip
    tensors = {
        "q": random_values((rows, contract.INDEX_HEADS, contract.INDEX_DIM), dtype, g, device),
        "ck_pool": ck_pool,
        **pool_views(SELECTION, ck_pool),
        "page_table": padded_rows(
            random_page_table(requests, pages_per_request, pool, g, device), lay.table_pad
        ),
        "token_to_req": torch.arange(rows, dtype=torch.int32, device=device),
        "query_positions": torch.full((rows,), spec.context - 1, dtype=torch.int64, device=device),
        "sequence_lengths": torch.full((requests,), spec.context, dtype=torch.int32, device=device),
        "out_base": out_base,
    }
    return CaseInputs(SELECTION, row_views(tensors), "ck_pool", layout=lay)


def build_seed(spec: CaseSpec, device: torch.device, seed: int = 0) -> CaseInputs:
    """A seed case from ``qsa_ops.testing`` (random float16 data), as CaseInputs."""
    from ..qsa_ops import testing

    if spec.layout != SEED_LAYOUT:
        raise ValueError(f"the seed cases are built in the seed layout only, got {spec.layout}")
    lay = spec.lay
    if spec.op == ATTENTION:
        case = testing.make_attention_case(spec.testing_case, spec.rows, device, seed)
        pages = case.k_cache.shape[0]
        lead = case.k_cache.storage_offset()
        kv = case.kv[lead : lead + pages * contract.KV_PAGE * 2 * contract.HEAD_DIM].view(
            pages, 1, contract.KV_PAGE, 2 * contract.HEAD_DIM
        )
        indices = case.logical_indices.clone()
        indices[:, spec.width :] = -1  # width 1024: the full-width case cut to 1024 entries
        tensors = {
            "q": case.q,
            "kv": kv,
            **pool_views(ATTENTION, kv),
            "index_buffer": indices,
            "page_table": case.page_table,
            "token_to_req": case.token_to_req,
            "out": case.out,
        }
        return CaseInputs(ATTENTION, row_views(tensors), "kv", layout=lay)
    case = testing.make_select_case(spec.testing_case, spec.rows, device, seed, integer=False)
    ck = case.compressed_key_cache
    storage = case.storage if case.storage is not None else ck
    ck_pool = storage.view(ck.shape[0], 1, ck.shape[1], contract.INDEX_DIM)
    names = ("q", "page_table", "token_to_req", "query_positions", "sequence_lengths")
    tensors = {n: getattr(case, n) for n in names}
    tensors.update(ck_pool=ck_pool, **pool_views(SELECTION, ck_pool), out_base=case.out_base)
    return CaseInputs(SELECTION, row_views(tensors), "ck_pool", layout=lay)


def build(spec: CaseSpec, device: torch.device, seed: int = 0) -> CaseInputs:
    device = torch.device(device)
    if spec.testing_case:
        return build_seed(spec, device, seed)
    builder = build_attention if spec.op == ATTENTION else build_selection
    return builder(spec, device, seed)


# ----------------------------------------------------------------------------------------
# the decode step: the layer's QSA path on our operators (selection, then attention)
# ----------------------------------------------------------------------------------------

DECODE_ROWS = (1, 8, 64)
DECODE_LAYERS = 8
DECODE_CONTEXT = 32 * 1024  # tokens per request; the new token is the last one


def build_decode(
    rows: int, context: int, layers: int, device: torch.device, seed: int = 0
) -> dict[str, object]:
    """One decode step of ``rows`` requests (one new token each, at position context - 1) over
    ``layers`` layers, each with its own caches, in the seed's layout: ``{"shared": metadata,
    "layers": [...]}``. Requests own distinct pages; the K/V pages and the compressed-key
    pages share the page table (page x holds tokens 512x.. and their 128 compressed keys);
    the selection's output is the attention's index tensor."""
    device = torch.device(device)
    g = _generator(device, seed)
    half = torch.float16
    pages_per_request = _pages_for(context)
    pool = rows * pages_per_request
    table = random_page_table(rows, pages_per_request, pool, g, device)
    shared = {
        "page_table": table,
        "token_to_req": torch.arange(rows, dtype=torch.int32, device=device),
        "query_positions": torch.full((rows,), context - 1, dtype=torch.int64, device=device),
        "sequence_lengths": torch.full((rows,), context, dtype=torch.int32, device=device),
        "indices": torch.full((rows, contract.WIDTH), -1, dtype=torch.int32, device=device),
    }
    per_layer = []
    for _ in range(layers):
        kv = torch.randn(pool, 1, contract.KV_PAGE, 2 * contract.HEAD_DIM, generator=g,
                         device=device, dtype=half)  # fmt: skip

        def rand(*shape):
            return torch.randn(*shape, generator=g, device=device, dtype=half)

        per_layer.append({
            "kv": kv, **pool_views(ATTENTION, kv),
            "compressed_key_cache": rand(pool, contract.CK_PAGE, 1, contract.INDEX_DIM),
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
#     q (R x 3 x 256 x q's bytes), the selected tokens' K and V (256 + 256 values of the cache's
#     dtype: 1 KiB per token in float16/bfloat16, 512 B in float8), counted once per
#     **distinct physical token** of the call (a token listed twice, or by two rows, is read
#     once by an ideal kernel), the indices (R x 2051 x 4 B: the 2051 columns the operator
#     reads, also of vLLM's [T, 2052] buffer), the page table (B x M x 4 B, all of it),
#     token_to_req (R x 4 B), the gate where there is one (R x 3 x 256 x q's bytes); written:
#     out (R x 3 x 256 x q's bytes).
# selection
#     q (R x 4 x 128 x its bytes: 2, or 1 in float8), the usable compressed keys (128 values:
#     256 B, or 128 B in float8), once per **distinct physical key** of the call (rows of one
#     request share their keys), the page table (B x M x 4 B), token_to_req (R x 4 B),
#     query_positions (R x 8 B), sequence_lengths (B x 4 B); written: out (R x 2051 x 4 B).
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


def attention_bytes(
    rows: int,
    requests: int,
    max_pages: int,
    distinct_tokens: int,
    q_bytes: int = 2,
    kv_bytes: int = 2,
    gate: bool = False,
) -> FloorBytes:
    """``q_bytes``: bytes per element of q, out and gate; ``kv_bytes``: of the caches."""
    heads = rows * contract.ATTN_HEADS * contract.HEAD_DIM
    read = {
        "q": heads * q_bytes,
        "kv_tokens": distinct_tokens * 2 * contract.HEAD_DIM * kv_bytes,
        "logical_indices": rows * contract.WIDTH * 4,
        "page_table": requests * max_pages * 4,
        "token_to_req": rows * 4,
    }
    if gate:
        read["gate"] = heads * q_bytes
    return FloorBytes(
        read=read,
        written={"out": heads * q_bytes},
        counts={"distinct_tokens": distinct_tokens},
    )


def selection_bytes(
    rows: int, requests: int, max_pages: int, distinct_keys: int, elem_bytes: int = 2
) -> FloorBytes:
    """``elem_bytes``: bytes per element of q and of the keys (2, or 1 in float8)."""
    return FloorBytes(
        read={
            "q": rows * contract.INDEX_HEADS * contract.INDEX_DIM * elem_bytes,
            "compressed_keys": distinct_keys * contract.INDEX_DIM * elem_bytes,
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
    pages, page_size = t["k_cache"].shape[:2]
    if requests == 0 or max_pages == 0:
        return 0, 0
    ok_req, b = _request_of_rows(t["token_to_req"], requests)
    idx = t["logical_indices"].long()
    page = torch.div(idx, page_size, rounding_mode="floor")
    valid = (idx >= 0) & (page < max_pages) & ok_req[:, None]
    phys = table[b[:, None], page.clamp(0, max_pages - 1)]
    valid &= (phys >= 0) & (phys < pages)
    token_id = phys * page_size + idx.clamp_min(0) % page_size
    return int(torch.unique(token_id[valid]).numel()), int(valid.sum())


def count_selection_keys(
    t: dict[str, torch.Tensor], chunk_elements: int = 1 << 24
) -> tuple[int, int]:
    """(distinct physical keys, usable blocks summed over rows) of one call."""
    table = t["page_table"].long()
    requests, max_pages = table.shape
    pages, per_page = t["compressed_key_cache"].shape[:2]
    rows = t["q"].shape[0]
    if requests == 0 or max_pages == 0 or rows == 0:
        return 0, 0
    ok_req, b = _request_of_rows(t["token_to_req"], requests)
    n = visible_tokens(t["query_positions"], t["sequence_lengths"].long()[b])
    nb = torch.where(ok_req, n // contract.COMPRESS_RATIO, 0)
    blocks = max_pages * per_page
    j = torch.arange(blocks, device=table.device)
    ids, usable_total = [], 0
    step = max(1, chunk_elements // blocks)
    for start in range(0, rows, step):
        s = slice(start, min(rows, start + step))
        phys = table[b[s]].repeat_interleave(per_page, dim=1)  # [C, M * per_page]
        usable = (j < nb[s, None]) & (phys >= 0) & (phys < pages)
        key_id = phys * per_page + j % per_page
        ids.append(torch.unique(key_id[usable]))
        usable_total += int(usable.sum())
    distinct = int(torch.unique(torch.cat(ids)).numel()) if ids else 0
    return distinct, usable_total


def floor_bytes(op: str, t: dict[str, torch.Tensor]) -> FloorBytes:
    rows = t["q"].shape[0]
    requests, max_pages = t["page_table"].shape
    if op == ATTENTION:
        distinct, occurrences = count_attention_tokens(t)
        fb = attention_bytes(
            rows, requests, max_pages, distinct, t["q"].element_size(),
            t["k_cache"].element_size(), t.get("gate") is not None,
        )  # fmt: skip
        fb.counts["valid_entries"] = occurrences
    else:
        distinct, usable = count_selection_keys(t)
        fb = selection_bytes(
            rows, requests, max_pages, distinct, t["compressed_key_cache"].element_size()
        )
        fb.counts["usable_blocks"] = usable
    return fb


def percent_of_floor(floor_seconds: float, measured_seconds: float) -> float:
    """floor / measured, in percent (100 % = at copy bandwidth)."""
    return 100.0 * floor_seconds / measured_seconds if measured_seconds > 0 else float("nan")
