"""Testing helpers shipped with the package: case builders, poison helpers and independent
float64 checkers. Used by the CPU and GPU test suites, the benchmark and the vLLM layer.

* ``make_select_case(name, R, device, seed)`` / ``make_attention_case(...)``: the seed cases
  of the contract (``SELECT_CASES`` / ``ATTENTION_CASES``).
* ``random_select_case(...)`` / ``random_attention_case(...)``: random generators (holes,
  duplicates, bad values) used by property tests and the benchmark.
* ``scale_select_case(...)`` / ``scale_attention_case(...)``: long contexts (8K..128K tokens)
  with modest memory.
* ``Layout`` / ``LAYOUTS``: contract v2's dtypes and layouts (bfloat16, float8 K/V with scales
  and an fp8 indexer, vLLM's page sizes with page strides spanning other layers, separate K
  and V, strided index and page-table rows, the output gate); every builder takes
  ``layout=`` (default: the seed's float16 exact-packed 512-token pages).
* ``check_selection(case, out, exact)`` / ``check_attention(case, out)``: float64 checkers
  written with plain loops over rows, independent of ``qsa_ops.reference``. They raise
  AssertionError naming the case, the row and the column.

All random data is drawn on the CPU from a seeded generator and then moved to ``device``,
so a case is identical on every device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .contract import (
    ATTN_HEADS,
    BLOCK_TOPK,
    CK_PAGE,
    COMPRESS_RATIO,
    FP8,
    HEAD_DIM,
    INDEX_DIM,
    INDEX_HEADS,
    KV_PAGE,
    KV_STRIDES,
    PACKED_TOKEN_STRIDE,
    TOKEN_TOPK,
    V_OFFSET,
    WIDTH,
    resolve_softmax_scale,
)

POISON_INT32 = -7  # never a valid selection output (valid entries are >= -1)
ATTENTION_TOLERANCE = 2e-3  # contract section 4: ||out - ref|| / ||ref||
# NOTES: float32 sums of 128 products in another order differ by a few ulp of the largest
# partial sum; 1e-4 of the largest score covers that with a wide margin (contract section 4).
SELECTION_TOLERANCE = 1e-4


# ----------------------------------------------------------------------------------------
# layouts (contract v2)
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How a case's tensors are typed and laid out. The default is the seed's case."""

    dtype: torch.dtype = torch.float16  # attention q / out / gate
    kv_dtype: torch.dtype | None = None  # attention caches (None: dtype; FP8: scaled)
    index_dtype: torch.dtype | None = None  # selection q and keys (None: dtype)
    page_size: int = KV_PAGE  # attention: tokens per page
    keys_per_page: int = CK_PAGE  # selection: compressed keys per page (C)
    kv: str = "packed"  # "packed": K then V per token in one storage; "separate"
    layers: int = 1  # pages interleaved with other layers' pages: page stride spans them
    index_stride: int = WIDTH  # row stride of logical_indices / selection out (2052: vLLM)
    table_pad: int = 0  # extra columns per page_table row (strided rows)
    gate: bool = False  # attention's output gate
    k_scale: float = 0.5  # float8 caches only
    v_scale: float = 2.0

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype

    @property
    def select_dtype(self) -> torch.dtype:
        return self.index_dtype or self.dtype

    @property
    def scales(self) -> tuple[float | None, float | None]:
        return (self.k_scale, self.v_scale) if self.cache_dtype == FP8 else (None, None)


SEED = Layout()
# NOTES: vLLM sizes QSA pages itself (hybrid alignment: 784, 800, 1568, 1600 in its tests) in
# block-outermost layouts whose page stride spans every layer's page; its index buffer is
# [T, 2052] (a count column after the 2051 entries), viewed as [T, 2051].
LAYOUTS: dict[str, Layout] = {
    "seed": SEED,
    "bf16": Layout(dtype=torch.bfloat16),
    "bf16_gate": Layout(dtype=torch.bfloat16, gate=True),
    "fp16_gate_page16": Layout(page_size=16, keys_per_page=4, gate=True, table_pad=1),
    "vllm_bf16_784": Layout(
        dtype=torch.bfloat16, page_size=784, keys_per_page=196, layers=4, index_stride=2052,
        table_pad=3, gate=True,
    ),
    "vllm_bf16_1568_separate": Layout(
        dtype=torch.bfloat16, page_size=1568, keys_per_page=392, kv="separate", layers=2,
        index_stride=2052,
    ),
    "fp8_kv": Layout(dtype=torch.bfloat16, kv_dtype=FP8, index_dtype=FP8),
    "vllm_fp8_784": Layout(
        dtype=torch.bfloat16, kv_dtype=FP8, index_dtype=FP8, page_size=784, keys_per_page=196,
        layers=4, index_stride=2052, table_pad=3, gate=True,
    ),
    "vllm_fp8_800_separate": Layout(
        dtype=torch.bfloat16, kv_dtype=FP8, page_size=800, keys_per_page=200, kv="separate",
        layers=3, gate=True,
    ),
}  # fmt: skip


def _rows_view(
    rows: int, width: int, stride: int, dtype, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(base [rows, stride], view [rows, width]): a row-strided view, the base poisoned."""
    base = poison_(torch.empty(rows, max(stride, width), dtype=dtype, device=device))
    return base, base[:, :width]


def paged_cache(values: torch.Tensor, layers: int, device, lead: int = 0):
    """(owner, cache): ``values`` [P, S, 1, D] placed as layer ``layers - 1`` of a
    block-outermost [P, layers, S, D] buffer (other layers random), after ``lead`` spare
    elements; the cache view has page stride layers * S * D."""
    pages, slots, _, dim = values.shape
    size = lead + pages * layers * slots * dim
    if layers > 1:  # the other layers' pages hold data a wrong stride would read
        owner = torch.randn(size).to(values.dtype).to(device)
    else:
        owner = torch.zeros(size, dtype=values.dtype, device=device)
    block = owner[lead:].view(pages, layers, slots, dim)
    cache = block[:, layers - 1].unsqueeze(2)
    cache.copy_(values.to(device))
    return owner, cache


def layout_kv(values: torch.Tensor, layout: Layout, device, lead: int = 0):
    """(owners, k_cache, v_cache) for K/V ``values`` [P, S, 512] (per token 256 K then 256 V)
    in ``layout``: packed in one storage or separate, page stride spanning ``layers``."""
    values = values.to(layout.cache_dtype)
    pages, slots = values.shape[:2]
    if layout.kv == "packed":
        owner, both = paged_cache(values.unsqueeze(2), layout.layers, device, lead)
        both = both[:, :, 0]
        return (owner,), both[:, :, :HEAD_DIM].unsqueeze(2), both[:, :, HEAD_DIM:].unsqueeze(2)
    k_owner, k_cache = paged_cache(values[:, :, None, :HEAD_DIM], layout.layers, device, lead)
    v_owner, v_cache = paged_cache(values[:, :, None, HEAD_DIM:], layout.layers, device, lead)
    return (k_owner, v_owner), k_cache, v_cache


# ----------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------


@dataclass
class SelectCase:
    name: str
    q: torch.Tensor  # [R, 4, 128] float16 / bfloat16 / float8_e4m3fn
    compressed_key_cache: torch.Tensor  # [P, C, 1, 128] q's dtype, last stride 1
    page_table: torch.Tensor  # [B, M] int32, last stride 1
    token_to_req: torch.Tensor  # [R] int32
    query_positions: torch.Tensor  # [R] int64
    sequence_lengths: torch.Tensor  # [B] int32
    out: torch.Tensor  # [R, 2051] int32 (poisoned), a view of out_base
    integer: bool = False  # small-integer data: the output is exactly determined
    layout: Layout = SEED
    out_base: torch.Tensor | None = None  # [R, index_stride] owner of out (poisoned)
    storage: torch.Tensor | None = None  # owner of compressed_key_cache

    def args(self) -> tuple:
        """Positional arguments of ``qsa_ops.select_paged_tokens``."""
        return (*self.ref_args()[:-1], TOKEN_TOPK, COMPRESS_RATIO, self.out)

    def ref_args(self) -> tuple:
        """Positional arguments of ``reference.select_paged_tokens_ref``."""
        return (
            self.q,
            self.compressed_key_cache,
            self.page_table,
            self.token_to_req,
            self.query_positions,
            self.sequence_lengths,
            self.out,
        )

    def inputs(self) -> dict[str, torch.Tensor]:
        names = ("q", "page_table", "token_to_req", "query_positions", "sequence_lengths")
        tensors = {n: getattr(self, n) for n in names}
        tensors["compressed_key_cache"] = (
            self.compressed_key_cache if self.storage is None else self.storage
        )
        return tensors

    def new_out(self) -> torch.Tensor:
        """A fresh poisoned ``out`` in the case's layout (sets ``out_base``)."""
        rows = self.out.shape[0]
        self.out_base, out = _rows_view(
            rows, WIDTH, self.layout.index_stride, torch.int32, self.out.device
        )
        return out

    def __repr__(self) -> str:
        b, m = self.page_table.shape
        return (
            f"SelectCase({self.name}: R={self.q.shape[0]}, B={b}, M={m}, "
            f"P={self.compressed_key_cache.shape[0]}, C={self.compressed_key_cache.shape[1]}, "
            f"{self.q.dtype}, integer={self.integer})"
        )


@dataclass
class AttentionCase:
    name: str
    q: torch.Tensor  # [R, 3, 256] float16 / bfloat16
    kv: torch.Tensor  # owner of k_cache's storage (and of v_cache's when packed)
    k_cache: torch.Tensor  # [P, page_size, 1, 256] q's dtype or float8_e4m3fn
    v_cache: torch.Tensor  # same shape and dtype, in kv or in v_storage
    logical_indices: torch.Tensor  # [R, 2051] int32 (rows may be strided)
    page_table: torch.Tensor  # [B, M] int32 (rows may be strided)
    token_to_req: torch.Tensor  # [R] int32
    out: torch.Tensor  # [R, 3, 256] q's dtype (poisoned)
    softmax_scale: float | None = None
    k_scale: float | None = None
    v_scale: float | None = None
    gate: torch.Tensor | None = None  # [R, 3, 256] q's dtype
    v_storage: torch.Tensor | None = None  # owner of v_cache when K and V are separate
    layout: Layout = SEED

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[1]

    def args(self) -> tuple:
        """Positional arguments of ``qsa_ops.sparse_paged_attention`` (and of its operator)."""
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.logical_indices,
            self.page_table,
            self.token_to_req,
            self.page_size,
            self.out,
            self.softmax_scale,
        )

    def kwargs(self) -> dict:
        """Keyword arguments: the float8 scales and the gate."""
        return {"k_scale": self.k_scale, "v_scale": self.v_scale, "gate": self.gate}

    def ref_args(self) -> tuple:
        """Positional arguments of ``reference.sparse_paged_attention_ref`` (then kwargs())."""
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.logical_indices,
            self.page_table,
            self.token_to_req,
            self.out,
            self.softmax_scale,
        )

    def inputs(self) -> dict[str, torch.Tensor]:
        tensors = {
            "q": self.q,
            "kv": self.kv,
            "logical_indices": self.logical_indices,
            "page_table": self.page_table,
            "token_to_req": self.token_to_req,
        }
        if self.v_storage is not None:
            tensors["v_storage"] = self.v_storage
        if self.gate is not None:
            tensors["gate"] = self.gate
        return tensors

    def new_out(self) -> torch.Tensor:
        return poison_(torch.empty_like(self.out))

    def __repr__(self) -> str:
        b, m = self.page_table.shape
        return (
            f"AttentionCase({self.name}: R={self.q.shape[0]}, B={b}, M={m}, "
            f"P={self.k_cache.shape[0]}, page={self.page_size}, {self.q.dtype}, "
            f"kv {self.k_cache.dtype}{', gate' if self.gate is not None else ''})"
        )


# ----------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with a value no operator writes: NaN (floating) or POISON_INT32 (integer)."""
    return t.fill_(float("nan") if t.is_floating_point() else POISON_INT32)


def snapshot(case: SelectCase | AttentionCase) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in case.inputs().items()}


def assert_inputs_unchanged(
    case: SelectCase | AttentionCase, before: dict[str, torch.Tensor]
) -> None:
    for name, t in case.inputs().items():
        if not torch.equal(t, before[name]) and not (
            t.is_floating_point() and torch.equal(t.nan_to_num(7.0), before[name].nan_to_num(7.0))
        ):
            raise AssertionError(f"{case!r}: input {name} was modified by the call")


def packed_kv(num_pages: int, device, *, dtype=torch.float16, lead: int = 0):
    """(buffer, k_cache, v_cache): one storage holding ``lead`` spare elements and then
    [P, 512, 512] exact-packed K/V; ``lead`` > 0 gives k_cache a non-zero storage offset."""
    buffer = torch.zeros(lead + num_pages * KV_STRIDES[0], dtype=dtype, device=device)
    shape = (num_pages, KV_PAGE, 1, HEAD_DIM)
    k_cache = buffer.as_strided(shape, KV_STRIDES, lead)
    v_cache = buffer.as_strided(shape, KV_STRIDES, lead + V_OFFSET)
    return buffer, k_cache, v_cache


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _values(shape, gen: torch.Generator, integer: bool, lo: int = -2, hi: int = 2) -> torch.Tensor:
    """float16 CPU tensor: integers in [lo, hi] (exact mode) or standard normal values."""
    if integer:
        return torch.randint(lo, hi + 1, shape, generator=gen).to(torch.float16)
    return torch.randn(shape, generator=gen).to(torch.float16)


def _i32(values, device) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int32).to(device)


def _table(page_table, device, pad: int = 0) -> torch.Tensor:
    """[B, M] int32 from a tensor or a non-empty list of rows; ``pad`` > 0 makes its rows
    strided (a view of a [B, M + pad] buffer whose extra columns hold page 0, a valid page)."""
    if isinstance(page_table, torch.Tensor):
        table = page_table.to(device=device, dtype=torch.int32).contiguous()
    else:
        table = _i32(page_table, device).reshape(len(page_table), -1)
    if not pad:
        return table
    wide = torch.zeros(table.shape[0], table.shape[1] + pad, dtype=torch.int32, device=device)
    wide[:, : table.shape[1]] = table
    return wide[:, : table.shape[1]]


def _select_case(
    name, q, ck, page_table, token_to_req, positions, lengths, device, integer, layout=SEED
) -> SelectCase:
    rows = q.shape[0]
    dtype = layout.select_dtype
    table = _table(page_table, device, layout.table_pad)
    storage, cache = paged_cache(ck.to(dtype), layout.layers, device)
    out_base, out = _rows_view(rows, WIDTH, layout.index_stride, torch.int32, device)
    return SelectCase(
        name=name,
        q=q.to(dtype).to(device),
        compressed_key_cache=cache,
        page_table=table,
        token_to_req=_i32(token_to_req, device).reshape(rows),
        query_positions=torch.as_tensor(positions, dtype=torch.int64).reshape(rows).to(device),
        sequence_lengths=_i32(lengths, device).reshape(-1),
        out=out,
        integer=integer,
        layout=layout,
        out_base=out_base,
        storage=storage,
    )


# ----------------------------------------------------------------------------------------
# selection cases (contract section 5)
# ----------------------------------------------------------------------------------------

# name -> (visible tokens per row, cycled over rows; pages per request M; pages P)
SELECT_CASES: tuple[str, ...] = (
    "empty",  # n < 4: tail tokens only
    "short_tail",  # a few blocks + 3 tail tokens
    "full_page",  # 128 blocks exactly (one page)
    "cross_page_tail",  # 129 blocks + 3 tail tokens = 519 tokens over two pages
    "dup_physical_page",  # two logical pages -> one physical page: exact ties j, j+128
    "exact_ties",  # integer data with mass ties across the 512 cut
    "all_zero_scores",  # every dot product negative: all scores 0 after ReLU
    "p8192_saturated",  # P = 8192, 2303 visible blocks: full width 2051
    "multi_request",  # rows of three requests, positions past and before the length
)


def make_select_case(
    name: str,
    R: int,
    device="cpu",
    seed: int = 0,
    integer: bool = True,
    layout: Layout = SEED,
) -> SelectCase:
    """The seed case ``name`` with ``R`` rows in ``layout``; ``integer`` draws values in
    {-2..2} so the output is exactly determined (use check_selection(exact=True)). The case's
    token counts are the seed's; pages hold ``layout.keys_per_page`` blocks."""
    gen = _gen(seed)
    C = layout.keys_per_page
    q = _values((R, INDEX_HEADS, INDEX_DIM), gen, integer)

    def one_request(n_per_row: Sequence[int], num_pages: int, pages: Sequence[int]):
        ns = [n_per_row[r % len(n_per_row)] for r in range(R)]
        length = [max(n_per_row)]  # the request's length, also with R = 0 rows
        ck = _values((num_pages, C, 1, INDEX_DIM), gen, integer)
        return _select_case(
            name,
            q,
            ck,
            [list(pages)],
            [0] * R,
            [n - 1 for n in ns],
            length,
            device,
            integer,
            layout,
        )

    if name == "empty":
        return one_request([3, 0, 1, 2], 2, [1])
    if name == "short_tail":
        return one_request([23, 14], 2, [1])
    if name == "full_page":
        return one_request([512], 3, [2])
    if name == "cross_page_tail":
        return one_request([519], 4, [3, 1])
    if name == "dup_physical_page":
        return one_request([1024, 700], 4, [2, 2])
    if name == "exact_ties":
        # sparse {-1, 0, 1} data: scores take few distinct values, so the 512 cut and the
        # order inside the cut are decided by the tie rule (lower j first)
        q = _values((R, INDEX_HEADS, INDEX_DIM), gen, True, -1, 1) * (
            torch.rand(R, INDEX_HEADS, INDEX_DIM, generator=gen) < 0.05
        )
        ck = _values((6, C, 1, INDEX_DIM), gen, True, -1, 1) * (
            torch.rand(6, C, 1, INDEX_DIM, generator=gen) < 0.05
        )
        ns = [4 * 600 + 1, 4 * 513]
        length = max(ns)  # the request's length, also with R = 0 rows
        ns = [ns[r % 2] for r in range(R)]
        return _select_case(
            name,
            q,
            ck,
            [[5, 0, 3, 4, 1]],
            [0] * R,
            [n - 1 for n in ns],
            [length],
            device,
            True,
            layout,
        )
    if name == "all_zero_scores":
        q = -_values((R, INDEX_HEADS, INDEX_DIM), gen, True, 1, 2)
        ck = _values((3, C, 1, INDEX_DIM), gen, True, 1, 2)
        return _select_case(
            name,
            q,
            ck,
            [[2, 0, 1, 1, 0, 2]],
            [0] * R,
            [4 * 700 + 2] * R,
            [4 * 700 + 3],
            device,
            True,
            layout,
        )
    if name == "p8192_saturated":
        num_pages = 8192
        pages = torch.randperm(num_pages, generator=gen)[:18].tolist()
        ck = torch.zeros(num_pages, C, 1, INDEX_DIM, dtype=torch.float16)
        ck[pages] = _values((18, C, 1, INDEX_DIM), gen, integer)  # only these are read
        n = 2303 * COMPRESS_RATIO + 3
        return _select_case(
            name, q, ck, [pages], [0] * R, [n - 1] * R, [n], device, integer, layout
        )
    if name == "multi_request":
        ck = _values((12, C, 1, INDEX_DIM), gen, integer)
        page_table = [[3, 7, 1, 10, 0], [5, -1, 11, 2, 4], [6, 8, 9, -1, -1]]
        lengths = [519, 40, 2000]
        rows_req = [2, 0, 1, 2, 0, 1]
        rows_pos = [1999, 518, 5000, 1022, 300, 39]  # 5000: past the length (clamped to 40)
        return _select_case(
            name,
            q,
            ck,
            page_table,
            [rows_req[r % 6] for r in range(R)],
            [rows_pos[r % 6] for r in range(R)],
            lengths,
            device,
            integer,
            layout,
        )
    raise KeyError(f"unknown selection case {name!r}; known: {', '.join(SELECT_CASES)}")


def random_select_case(
    R: int,
    B: int,
    M: int,
    P: int,
    *,
    device="cpu",
    seed: int = 0,
    integer: bool = False,
    bad_values: bool = True,
    page_table: Sequence[Sequence[int]] | None = None,
    token_to_req: Sequence[int] | None = None,
    query_positions: Sequence[int] | None = None,
    sequence_lengths: Sequence[int] | None = None,
    name: str = "random",
    layout: Layout = SEED,
) -> SelectCase:
    """Random selection case. Unless given, the page table mixes valid pages, duplicates
    and (``bad_values``) holes -1 / P / large; lengths and positions are random (negative,
    past the length), and a few rows have an invalid request."""
    gen = _gen(seed)

    def randint(lo, hi, shape):
        return torch.randint(lo, hi + 1, shape, generator=gen)

    q = _values((R, INDEX_HEADS, INDEX_DIM), gen, integer)
    ck = _values((P, layout.keys_per_page, 1, INDEX_DIM), gen, integer)
    if page_table is None:
        pt = randint(0, max(P - 1, 0), (B, M)) if P > 0 else torch.full((B, M), -1)
        if bad_values and B * M > 0:
            bad = torch.tensor([-1, P, -5, P + 3, 2**31 - 1])[randint(0, 4, (B, M))]
            pt = torch.where(torch.rand(B, M, generator=gen) < 0.15, bad, pt)
        page_table = pt.tolist()
    if sequence_lengths is None:
        cap = M * COMPRESS_RATIO * layout.keys_per_page + 8
        sequence_lengths = randint(0, cap, (B,)).tolist()
        if bad_values and B > 0:
            sequence_lengths[0] = -3 if B > 1 else sequence_lengths[0]
    if token_to_req is None:
        ttr = randint(0, max(B - 1, 0), (R,)) if B > 0 else torch.full((R,), -1)
        if bad_values and R > 0:
            ttr = torch.where(torch.rand(R, generator=gen) < 0.1, torch.tensor(B), ttr)
        token_to_req = ttr.tolist()
    if query_positions is None:
        top = M * COMPRESS_RATIO * layout.keys_per_page + 16
        query_positions = randint(-3, top, (R,)).tolist()
    return _select_case(
        name,
        q,
        ck,
        page_table if B > 0 else torch.zeros(0, M, dtype=torch.int32),
        token_to_req,
        query_positions,
        sequence_lengths,
        device,
        integer,
        layout,
    )


def scale_select_case(
    context_tokens: int,
    R: int,
    device="cpu",
    seed: int = 0,
    requests: int = 1,
    layout: Layout = SEED,
) -> SelectCase:
    """Decode-like rows over ``requests`` requests of ``context_tokens`` tokens each (pages
    shuffled); P = requests * ceil(context / 512) pages, so memory is 32 KiB per 512 tokens."""
    gen = _gen(seed)
    C = layout.keys_per_page
    pages_per_req = -(-context_tokens // (COMPRESS_RATIO * C))
    num_pages = requests * pages_per_req
    perm = torch.randperm(num_pages, generator=gen).reshape(requests, pages_per_req)
    q = torch.randn(R, INDEX_HEADS, INDEX_DIM, generator=gen).to(torch.float16)
    ck = torch.randn(num_pages, C, 1, INDEX_DIM, generator=gen).to(torch.float16)
    req = [r % requests for r in range(R)]
    return _select_case(
        f"scale{context_tokens}",
        q,
        ck,
        perm.tolist(),
        req,
        [context_tokens - 1] * R,
        [context_tokens] * requests,
        device,
        False,
        layout,
    )


# ----------------------------------------------------------------------------------------
# attention cases (contract section 5)
# ----------------------------------------------------------------------------------------

ATTENTION_CASES: tuple[str, ...] = (
    "empty",  # every entry a hole: zeros
    "holes_dups_cross_page",  # holes anywhere, duplicates, three pages, bad values
    "valid_width_32",  # 32 valid entries then holes
    "full_width_2051",  # all 2051 entries valid
)


def _attention_case(
    name,
    q,
    kv_values,
    indices,
    page_table,
    token_to_req,
    device,
    softmax_scale=None,
    lead=0,
    layout: Layout = SEED,
    gen: torch.Generator | None = None,
) -> AttentionCase:
    rows = q.shape[0]
    owners, k_cache, v_cache = layout_kv(kv_values, layout, device, lead)
    table = _table(page_table, device, layout.table_pad)
    index_base = torch.zeros(rows, layout.index_stride, dtype=torch.int32, device=device)
    index_base[:, :WIDTH] = _i32(indices, device).reshape(rows, WIDTH)  # extra columns: token 0
    gate = None
    if layout.gate:
        gen = gen or _gen(0)
        gate = (2 * torch.randn(rows, ATTN_HEADS, HEAD_DIM, generator=gen)).to(layout.dtype)
    k_scale, v_scale = layout.scales
    return AttentionCase(
        name=name,
        q=q.to(layout.dtype).to(device),
        kv=owners[0],
        k_cache=k_cache,
        v_cache=v_cache,
        logical_indices=index_base[:, :WIDTH],
        page_table=table,
        token_to_req=_i32(token_to_req, device).reshape(rows),
        out=poison_(torch.empty(rows, ATTN_HEADS, HEAD_DIM, dtype=layout.dtype, device=device)),
        softmax_scale=softmax_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        gate=None if gate is None else gate.to(device),
        v_storage=owners[1] if len(owners) > 1 else None,
        layout=layout,
    )


def _kv_values(num_pages: int, gen: torch.Generator, page_size: int = KV_PAGE) -> torch.Tensor:
    return torch.randn(num_pages, page_size, PACKED_TOKEN_STRIDE, generator=gen).to(torch.float16)


def make_attention_case(
    name: str, R: int, device="cpu", seed: int = 0, layout: Layout = SEED
) -> AttentionCase:
    """The seed case ``name`` with ``R`` rows (random data) in ``layout``; its token positions
    follow ``layout.page_size`` (page boundaries stay page boundaries)."""
    gen = _gen(seed)
    KV_PAGE = layout.page_size  # noqa: N806 (the seed's name for the page size)
    q = torch.randn(R, ATTN_HEADS, HEAD_DIM, generator=gen).to(torch.float16)
    if name == "empty":
        indices = torch.full((R, WIDTH), -1)
        return _attention_case(
            name,
            q,
            _kv_values(2, gen, KV_PAGE),
            indices,
            [[1]],
            [0] * R,
            device,
            layout=layout,
            gen=gen,
        )
    if name == "holes_dups_cross_page":
        num_pages, page_table = 5, [[4, 1, 3], [2, -1, 0]]
        context = 3 * KV_PAGE
        indices = torch.randint(0, context, (R, WIDTH), generator=gen)
        roll = torch.rand(R, WIDTH, generator=gen)
        indices = torch.where(roll < 0.3, torch.tensor(-1), indices)  # holes anywhere
        indices[:, 1::7] = indices[:, 0:1]  # duplicates: token indices[r, 0] many times
        indices[:, 5] = KV_PAGE - 1  # last slot of page 0 and ...
        indices[:, 6] = KV_PAGE  # ... first slot of page 1
        indices[:, 9] = -2  # negative other than -1
        indices[:, 10] = 3 * KV_PAGE  # logical page 3 >= M
        indices[:, 11] = 2**31 - 1
        reqs = [r % 2 for r in range(R)]  # request 1 has a -1 page-table entry (holes)
        return _attention_case(
            name,
            q,
            _kv_values(num_pages, gen, KV_PAGE),
            indices,
            page_table,
            reqs,
            device,
            layout=layout,
            gen=gen,
        )
    if name in ("valid_width_32", "full_width_2051"):
        valid = 32 if name == "valid_width_32" else WIDTH
        num_pages = max(8, -(-WIDTH // KV_PAGE))  # small pages: enough for 2051 tokens
        context = num_pages * KV_PAGE
        indices = torch.full((R, WIDTH), -1)
        for r in range(R):
            indices[r, :valid] = torch.randperm(context, generator=gen)[:valid]
        page_table = [torch.randperm(num_pages, generator=gen).tolist()]
        return _attention_case(
            name,
            q,
            _kv_values(num_pages, gen, KV_PAGE),
            indices,
            page_table,
            [0] * R,
            device,
            layout=layout,
            gen=gen,
        )
    raise KeyError(f"unknown attention case {name!r}; known: {', '.join(ATTENTION_CASES)}")


def random_attention_case(
    R: int,
    B: int,
    M: int,
    P: int,
    *,
    device="cpu",
    seed: int = 0,
    valid_fraction: float = 0.7,
    bad_values: bool = True,
    softmax_scale: float | None = None,
    lead: int = 0,
    page_table: Sequence[Sequence[int]] | None = None,
    token_to_req: Sequence[int] | None = None,
    name: str = "random",
    layout: Layout = SEED,
) -> AttentionCase:
    """Random attention case: indices mix tokens of the request's pages (duplicates likely),
    holes -1 and (``bad_values``) other negatives and positions past the page table; the
    page table has duplicates and, with ``bad_values``, entries -1 / P."""
    gen = _gen(seed)
    q = torch.randn(R, ATTN_HEADS, HEAD_DIM, generator=gen).to(torch.float16)
    if page_table is None:
        pt = torch.randint(0, max(P, 1), (B, M), generator=gen) if P > 0 else torch.full((B, M), -1)
        if bad_values and B * M > 0:
            bad = torch.tensor([-1, P])[torch.randint(0, 2, (B, M), generator=gen)]
            pt = torch.where(torch.rand(B, M, generator=gen) < 0.15, bad, pt)
        page_table = pt.tolist() if B > 0 else torch.zeros(0, M, dtype=torch.int32)
    if token_to_req is None:
        ttr = torch.randint(0, max(B, 1), (R,), generator=gen) if B > 0 else torch.full((R,), -1)
        if bad_values and R > 0:
            ttr = torch.where(torch.rand(R, generator=gen) < 0.1, torch.tensor(-1), ttr)
        token_to_req = ttr.tolist()
    context = max(M, 1) * layout.page_size
    indices = torch.randint(0, context, (R, WIDTH), generator=gen)
    roll = torch.rand(R, WIDTH, generator=gen)
    indices = torch.where(roll >= valid_fraction, torch.tensor(-1), indices)
    if bad_values:
        bad = torch.tensor([-2, -(2**31), context, 2**31 - 1])[
            torch.randint(0, 4, (R, WIDTH), generator=gen)
        ]
        indices = torch.where(roll >= 1 - (1 - valid_fraction) / 4, bad, indices)
    return _attention_case(
        name,
        q,
        _kv_values(P, gen, layout.page_size),
        indices,
        page_table,
        token_to_req,
        device,
        softmax_scale,
        lead,
        layout,
        gen,
    )


def scale_attention_case(
    context_tokens: int, R: int, device="cpu", seed: int = 0, layout: Layout = SEED
) -> AttentionCase:
    """Rows of one request over ``context_tokens`` tokens, every row with 2051 random
    (possibly repeated) tokens; memory is the KV buffer, 512 KiB per 512 tokens."""
    gen = _gen(seed)
    num_pages = -(-context_tokens // layout.page_size)
    q = torch.randn(R, ATTN_HEADS, HEAD_DIM, generator=gen).to(torch.float16)
    indices = torch.randint(0, context_tokens, (R, WIDTH), generator=gen)
    page_table = [torch.randperm(num_pages, generator=gen).tolist()]
    return _attention_case(
        f"scale{context_tokens}",
        q,
        _kv_values(num_pages, gen, KV_PAGE),
        indices,
        page_table,
        [0] * R,
        device,
    )


# ----------------------------------------------------------------------------------------
# independent float64 checkers (plain loops; no use of qsa_ops.reference)
# ----------------------------------------------------------------------------------------


def _cpu_lists(*tensors: torch.Tensor) -> list[list]:
    return [t.detach().cpu().tolist() for t in tensors]


def expected_selection_row(case: SelectCase, r: int, lists: list | None = None):
    """(usable blocks, their float64 scores, n, nb, t) of row ``r``, or None when the row's
    request is invalid. Scores are sum_h relu(q.k) / sqrt(128) in float64. ``lists`` caches
    the integer inputs as Python lists and q and the keys on the CPU (see _selection_lists)."""
    page_table, token_to_req, positions, lengths, keys_cpu, q_cpu = lists or _selection_lists(case)
    num_requests = len(lengths)
    num_pages, per_page = case.compressed_key_cache.shape[:2]
    b = token_to_req[r]
    if not 0 <= b < num_requests:
        return None
    n = max(0, min(positions[r] + 1, lengths[b]))
    nb, t = divmod(n, COMPRESS_RATIO)
    max_pages = len(page_table[b])
    usable = []
    for j in range(nb):
        if j // per_page >= max_pages:
            break
        phys = page_table[b][j // per_page]
        if 0 <= phys < num_pages:
            usable.append(j)
    if usable:
        phys = torch.tensor([page_table[b][j // per_page] for j in usable])
        slots = torch.tensor([j % per_page for j in usable])
        keys = keys_cpu[phys, slots, 0].double()  # [U, 128]
        qr = q_cpu[r].double()  # [4, 128]
        scores = (qr @ keys.T).clamp_min(0.0).sum(dim=0) / math.sqrt(INDEX_DIM)
    else:
        scores = torch.zeros(0, dtype=torch.float64)
    return usable, scores, n, nb, t


def _selection_lists(case: SelectCase) -> list:
    """The inputs a row's expectation reads, copied off the device once per check, not once
    per row (the key cache of an R = 300 case is copied once, not 300 times)."""
    return [
        *_cpu_lists(
            case.page_table, case.token_to_req, case.query_positions, case.sequence_lengths
        ),
        case.compressed_key_cache.detach().cpu(),
        case.q.detach().cpu(),
    ]


def check_selection(case: SelectCase, out: torch.Tensor, exact: bool | None = None) -> None:
    """Check ``out`` against the contract with float64 scores; raise AssertionError naming the
    case, row and column. ``exact`` (default: ``case.integer``) requires the exact tie order
    (valid for small-integer data only); otherwise a valid top-k within 1e-4 * max|score|."""
    exact = case.integer if exact is None else exact
    got = out.detach().cpu()
    rows = case.q.shape[0]
    if tuple(got.shape) != (rows, WIDTH):
        raise AssertionError(
            f"{case!r}: out has shape {tuple(got.shape)}, expected ({rows}, {WIDTH})"
        )
    if case.out_base is not None and case.out_base.shape[1] > WIDTH:
        extra = case.out_base[:, WIDTH:].cpu()
        if (extra != POISON_INT32).any():
            raise AssertionError(f"{case!r}: a column past {WIDTH} of out's rows was written")
    got_rows = got.tolist()
    lists = _selection_lists(case)
    for r in range(rows):
        row = got_rows[r]

        def fail(col: int, what: str, row=row, r=r) -> None:
            raise AssertionError(f"{case!r}: row {r} column {col}: {what} (got {row[col]})")

        expected = expected_selection_row(case, r, lists)
        if expected is None:
            for col, v in enumerate(row):
                if v != -1:
                    fail(col, "row of an invalid request must be all -1")
            continue
        usable, scores, n, nb, t = expected
        kb = min(BLOCK_TOPK, len(usable))
        score_of = dict(zip(usable, scores.tolist(), strict=True))
        chosen = []
        for k in range(kb):
            first = row[4 * k]
            if first < 0 or first % COMPRESS_RATIO:
                fail(4 * k, f"expected the first token of a block (selection {k} of {kb})")
            for i in range(1, COMPRESS_RATIO):
                if row[4 * k + i] != first + i:
                    fail(4 * k + i, f"expected token {first + i} (block expansion)")
            j = first // COMPRESS_RATIO
            if j not in score_of:
                fail(4 * k, f"block {j} is not a usable visible block")
            chosen.append(j)
        if len(set(chosen)) != kb:
            dup = next(k for k, j in enumerate(chosen) if chosen.index(j) != k)
            fail(4 * dup, f"block {chosen[dup]} chosen twice")
        for s in range(t):
            if row[4 * kb + s] != 4 * nb + s:
                fail(4 * kb + s, f"expected tail token {4 * nb + s}")
        for col in range(4 * kb + t, WIDTH):
            if row[col] != -1:
                fail(col, "expected -1 padding")
        if exact:
            order = sorted(usable, key=lambda j: (-score_of[j], j))[:kb]
            for k, (j_got, j_want) in enumerate(zip(chosen, order, strict=True)):
                if j_got != j_want:
                    fail(
                        4 * k,
                        f"expected block {j_want} (score {score_of[j_want]}), got block {j_got} "
                        f"(score {score_of[j_got]}); order is score desc, then lower j",
                    )
        elif kb:
            tol = SELECTION_TOLERANCE * float(scores.abs().max())
            chosen_set = set(chosen)
            rest = [score_of[j] for j in usable if j not in chosen_set]
            worst_chosen = min(range(kb), key=lambda k: score_of[chosen[k]])
            if rest and score_of[chosen[worst_chosen]] < max(rest) - tol:
                fail(
                    4 * worst_chosen,
                    f"not a top-{kb}: chosen score {score_of[chosen[worst_chosen]]} < "
                    f"unchosen {max(rest)} - tol {tol}",
                )
            for k in range(1, kb):
                if score_of[chosen[k]] > score_of[chosen[k - 1]] + tol:
                    fail(
                        4 * k,
                        f"order not descending: {score_of[chosen[k]]} after {score_of[chosen[k - 1]]}",
                    )


def expected_attention(case: AttentionCase) -> torch.Tensor:
    """float64 [R, 3, 256] expected output, computed with loops over rows and entries. K and V
    are the cached values times their scales (float8 caches); with a gate, the attention is
    rounded to q's dtype (the contract's one intermediate rounding) and multiplied by
    sigmoid(gate) in float64."""
    indices, page_table, token_to_req = _cpu_lists(
        case.logical_indices, case.page_table, case.token_to_req
    )
    scale = resolve_softmax_scale(case.softmax_scale)
    num_pages, page_size = case.k_cache.shape[:2]
    k_cache = case.k_cache.detach().cpu()
    v_cache = case.v_cache.detach().cpu()
    k_scale = 1.0 if case.k_scale is None else case.k_scale
    v_scale = 1.0 if case.v_scale is None else case.v_scale
    q = case.q.detach().cpu().double()
    rows = q.shape[0]
    result = torch.zeros(rows, ATTN_HEADS, HEAD_DIM, dtype=torch.float64)
    for r in range(rows):
        b = token_to_req[r]
        if not 0 <= b < len(page_table):
            continue
        phys, slots = [], []
        for i in indices[r]:
            if i < 0 or i // page_size >= len(page_table[b]):
                continue
            p = page_table[b][i // page_size]
            if 0 <= p < num_pages:
                phys.append(p)
                slots.append(i % page_size)
        if not phys:
            continue
        keys = k_cache[phys, slots, 0].double() * k_scale  # [N, 256]
        values = v_cache[phys, slots, 0].double() * v_scale
        for h in range(ATTN_HEADS):
            logits = scale * (keys @ q[r, h])
            w = torch.exp(logits - logits.max())
            result[r, h] = (w / w.sum()) @ values
    if case.gate is not None:
        rounded = result.to(case.q.dtype).double()
        result = rounded * torch.sigmoid(case.gate.detach().cpu().double())
    return result


def check_attention(
    case: AttentionCase, out: torch.Tensor, tol: float = ATTENTION_TOLERANCE
) -> float:
    """Check ``out`` against the float64 expectation: no NaN, rows without valid entries
    exactly zero, ||out - ref|| / ||ref|| < tol. Returns the relative error."""
    got = out.detach().cpu().double()
    want = expected_attention(case)
    if got.shape != want.shape:
        raise AssertionError(f"{case!r}: out has shape {got.shape}, expected {want.shape}")
    bad = (~torch.isfinite(got)).nonzero().tolist()
    if len(bad):
        r, h, d = bad[0]
        raise AssertionError(
            f"{case!r}: {len(bad)} non-finite outputs (poison not overwritten?), first at [{r}, {h}, {d}]"
        )
    for r in range(want.shape[0]):
        if not want[r].any() and got[r].any():
            h, d = (got[r] != 0).nonzero()[0].tolist()
            raise AssertionError(
                f"{case!r}: row {r} has no valid entry and must be zero, got {float(got[r, h, d])} at [{h}, {d}]"
            )
    norm = float(torch.linalg.vector_norm(want))
    err = float(torch.linalg.vector_norm(got - want)) / norm if norm > 0 else 0.0
    if err >= tol:
        diff = (got - want).abs()
        r, h, d = (int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(
            f"{case!r}: relative error {err:.3e} >= {tol:.0e}; worst at [{r}, {h}, {d}]: "
            f"got {float(got[r, h, d])}, expected {float(want[r, h, d])}"
        )
    return err


# ----------------------------------------------------------------------------------------
# refusal corpus: arguments outside the contract, one change at a time (tests of the
# validators and of their C++ twin; hypothesis combines several)
# ----------------------------------------------------------------------------------------

_OTHER_DTYPES = (torch.float32, torch.int32, torch.int64, torch.bfloat16, torch.uint8, torch.bool)


def _reshaped(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    return torch.zeros(tuple(shape), dtype=t.dtype, device=t.device)


def _strided_like(t: torch.Tensor) -> torch.Tensor:
    """Same shape, dtype and device, not contiguous (every other element of a wider tensor)."""
    return torch.zeros((*t.shape, 2), dtype=t.dtype, device=t.device)[..., 0]


def _sharing_storage(t: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t', other') equal to (t, other) but laid out in one byte buffer so that they overlap."""
    nbytes = max(t.numel() * t.element_size(), other.numel() * other.element_size(), 4)
    buf = torch.zeros(nbytes + 64, dtype=torch.uint8, device=t.device)

    def view(x: torch.Tensor) -> torch.Tensor:
        n = x.numel() * x.element_size()
        return buf[:n].view(x.dtype).view(x.shape).copy_(x)

    return view(t), view(other)


def refusal_mutations(
    args: Sequence,
    names: Sequence[str],
    shapes: dict[str, tuple],
    outputs: Sequence[str] = ("out",),
):
    """``(label, index, new_value)`` changes of positional ``args`` (argument names ``names``;
    ``shapes[name]`` the contract's shape pattern of each tensor argument, symbols as str), each
    of which puts one argument outside the contract. ``outputs`` names the written tensors
    ("out" for the selection and the attention; each must not overlap an input or another)."""
    changes = []
    out_index = names.index(outputs[0])
    for i, (name, value) in enumerate(zip(names, args, strict=True)):
        if not isinstance(value, torch.Tensor):
            continue
        for dtype in _OTHER_DTYPES:
            if dtype != value.dtype:
                changes.append((f"{name}: dtype {dtype}", i, value.to(dtype)))
                break
        changes.append((f"{name}: bfloat16", i, value.to(torch.bfloat16)))
        changes.append((f"{name}: extra dim", i, value.unsqueeze(0)))
        if value.dim() > 1:
            changes.append((f"{name}: flattened", i, value.reshape(-1)))
        if value.dim() > 0:
            changes.append((f"{name}: not contiguous", i, _strided_like(value)))
        for dim, size in enumerate(shapes.get(name, ())):
            shape = list(value.shape)
            shape[dim] += 1
            kind = "symbolic" if isinstance(size, str) else "fixed"
            changes.append((f"{name}: {kind} size {dim} + 1", i, _reshaped(value, shape)))
        changes.append((f"{name}: on meta", i, value.to("meta")))
        if len(outputs) == 1 and i != out_index and value.numel() and args[out_index].numel():
            inp, out = _sharing_storage(value, args[out_index])
            changes.append((f"out overlaps {name}", (i, out_index), (inp, out)))
    if len(outputs) > 1:  # every output against every tensor before it (inputs, outputs)
        for o in outputs:
            j = names.index(o)
            for i, (name, value) in enumerate(zip(names[:j], args[:j], strict=True)):
                if isinstance(value, torch.Tensor) and value.numel() and args[j].numel():
                    inp, out = _sharing_storage(value, args[j])
                    changes.append((f"{o} overlaps {name}", (i, j), (inp, out)))
    return changes


def _unaligned_strides(t: torch.Tensor) -> torch.Tensor:
    """Same shape and dtype, every stride but the last one element off a 16-byte multiple."""
    wide = torch.zeros((*t.shape[:-1], t.shape[-1] + 1), dtype=t.dtype, device=t.device)
    return wide[..., : t.shape[-1]]


def _unaligned_start(t: torch.Tensor) -> torch.Tensor:
    """Same shape, strides and dtype, starting one element past a 16-byte boundary."""
    buf = torch.zeros(t.numel() + 16, dtype=t.dtype, device=t.device)
    return buf[1 : 1 + t.numel()].view(t.shape)


def contract_v2_mutations(args: Sequence, names: Sequence[str]):
    """``(label, index, new_value)`` changes of ``args`` (every schema argument in order,
    keyword-only ones included) outside contract v2's layouts and values: cache strides or
    data off 16 bytes, no keys per page, overlapping ``out`` rows, page sizes, the float8
    scales, float8 caches without scales."""
    changes = []
    at = {name: i for i, name in enumerate(names)}
    for name in ("compressed_key_cache", "k_cache", "v_cache"):
        if name in at and args[at[name]].numel():
            t = args[at[name]]
            changes.append((f"{name}: strides off 16 bytes", at[name], _unaligned_strides(t)))
            changes.append((f"{name}: start off 16 bytes", at[name], _unaligned_start(t)))
    if "compressed_key_cache" in at:
        ck = args[at["compressed_key_cache"]]
        changes.append(("compressed_key_cache: C = 0", at["compressed_key_cache"], ck[:, :0]))
        out = args[at["out"]]
        if out.shape[0] > 1:
            rows = out.as_strided(out.shape, (WIDTH - 1, 1))
            changes.append(("out: overlapping rows", at["out"], rows))
    if "page_size" in at:
        i = at["page_size"]
        for value in (6, 0, args[i] + 4):
            changes.append((f"page_size {value}", i, value))
    if "k_scale" in at:
        fp8 = args[at["k_cache"]].dtype == FP8
        for name in ("k_scale", "v_scale"):
            values = (None, -1.0, 0.0, math.nan, math.inf) if fp8 else (0.5, 1.0)
            for value in values:
                changes.append((f"{name} {value!r}", at[name], value))
        if not fp8:
            both = (at["k_cache"], at["v_cache"])
            fp8_caches = (args[both[0]].to(FP8), args[both[1]].to(FP8))
            changes.append(("float8 caches without scales", both, fp8_caches))
    return changes


def apply_mutation(args: Sequence, index, value) -> list:
    """``args`` with one change of refusal_mutations applied."""
    new = list(args)
    if isinstance(index, tuple):
        for j, v in zip(index, value, strict=True):
            new[j] = v
    else:
        new[index] = value
    return new
