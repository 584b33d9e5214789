"""Input rotation: several copies of one case's inputs, so that the L2 cache does not keep the
working set between calls (H200: 60 MB of L2; a call that re-reads the bytes of the previous
call would be timed from L2 instead of HBM).

Copy ``k`` computes exactly the same thing as the original case but reads it at other
addresses:

1. *compact*: the pool (physical pages) is reduced to the pages the page table references
   (valid entries, in ``[0, P)``); the page table is renumbered accordingly;
2. *tile*: the compact pool is repeated ``S`` times (``S`` slabs, within a memory budget);
3. *remap*: copy ``k`` uses slab ``k mod S``: valid entry ``x`` becomes
   ``slab * U + rank(x)``. Invalid entries stay invalid: negatives unchanged, entries
   ``>= P`` moved to ``>= S * U`` (the new pool size).

When the budget allows ``S >= copies`` every copy reads the same values (``exact``: its
results equal the original's). Otherwise copies beyond ``S`` also permute the pages inside
their slab (same structure, other values) and ``exact`` is False. The small per-row tensors
(q, indices, positions, out) are cloned per copy.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from .cases import ATTENTION, CaseInputs, packed_kv_views


@dataclass(frozen=True)
class RotationPlan:
    copies: int  # copies of the inputs, used round-robin call after call
    slabs: int  # distinct physical slabs of the pool
    compact_pages: int  # pages per slab (U)
    slab_bytes: int  # bytes of one slab
    bytes_per_call: int  # floor bytes of one call (what one call must touch)
    target_bytes: int  # what the copies together should exceed (2 x L2)
    exact: bool

    @property
    def touched_bytes(self) -> int:
        """Distinct bytes the copies touch in total, at most (when not exact, the permuted
        copies share the slabs, so the tiled pool bounds it)."""
        total = self.copies * self.bytes_per_call
        return total if self.exact else min(total, self.slabs * self.slab_bytes)

    @property
    def beats_cache(self) -> bool:
        return self.touched_bytes >= self.target_bytes

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["touched_bytes"] = self.touched_bytes
        d["beats_cache"] = self.beats_cache
        return d


def plan(
    bytes_per_call: int,
    page_bytes: int,
    compact_pages: int,
    target_bytes: int,
    max_copies: int,
    memory_budget: int,
) -> RotationPlan:
    """How many copies and slabs (pure arithmetic; unit-tested)."""
    if max_copies < 1:
        raise ValueError(f"max_copies must be >= 1, got {max_copies}")
    per_call = max(1, bytes_per_call)
    copies = max(1, min(max_copies, math.ceil(target_bytes / per_call)))
    slab_bytes = max(1, compact_pages * page_bytes)
    slabs = max(1, min(copies, memory_budget // slab_bytes))
    return RotationPlan(
        copies=copies,
        slabs=slabs,
        compact_pages=compact_pages,
        slab_bytes=slab_bytes,
        bytes_per_call=bytes_per_call,
        target_bytes=target_bytes,
        exact=slabs >= copies,
    )


def remap_page_table(
    table: torch.Tensor, ranks: torch.Tensor, pages: int, slab: int, compact: int, slabs: int,
    perm: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Page table of one copy (see the module docstring). ``ranks[x]`` is the compact index of
    physical page ``x`` (only read for valid ``x``); ``perm`` permutes the compact pages."""
    t = table.long()
    valid = (t >= 0) & (t < pages)
    rank = ranks[t.clamp(0, max(pages - 1, 0))] if pages > 0 else torch.zeros_like(t)
    if perm is not None:
        rank = perm[rank]
    mapped = torch.where(valid, slab * compact + rank, t)
    mapped = torch.where(t >= pages, t - pages + slabs * compact, mapped)
    return mapped.to(table.dtype).contiguous()


def used_pages(inputs: CaseInputs) -> torch.Tensor:
    """Sorted distinct physical pages the page table references (valid entries only)."""
    table = inputs.tensors["page_table"].long()
    return torch.unique(table[(table >= 0) & (table < inputs.pages)])


def page_bytes(inputs: CaseInputs) -> int:
    return inputs.pool[0].numel() * inputs.pool.element_size() if inputs.pages else 0


def make_copies(
    inputs: CaseInputs, rotation: RotationPlan, seed: int = 0
) -> tuple[list[dict[str, torch.Tensor]], dict[str, object]]:
    """The argument sets of ``rotation.copies`` copies sharing one tiled pool."""
    t = inputs.tensors
    pool = inputs.pool
    pages = pool.shape[0]
    device = pool.device
    used = used_pages(inputs)
    compact = int(used.numel())
    ranks = torch.zeros(max(pages, 1), dtype=torch.long, device=device)
    if compact:
        ranks[used] = torch.arange(compact, device=device)
        compact_pool = pool if compact == pages else pool.index_select(0, used)
    else:  # nothing valid: keep one page so that every shape stays well formed
        compact_pool = pool[:1]
    slabs = rotation.slabs
    if slabs == 1 and compact == pages:  # every page used, one slab: the pool as it is
        tiled = pool
    else:
        tiled = compact_pool.repeat(slabs, *([1] * (pool.dim() - 1))).contiguous()
    g = torch.Generator(device=device)
    g.manual_seed(seed + 1)

    shared: dict[str, torch.Tensor] = {inputs.pool_name: tiled}
    if inputs.op == ATTENTION:
        shared["k_cache"], shared["v_cache"] = packed_kv_views(tiled)
    per_copy_names = [n for n in t if n not in shared and n != "page_table"]
    copies = []
    for k in range(rotation.copies):
        perm = None
        if k >= slabs and compact > 1:
            perm = torch.randperm(compact, generator=g, device=device)
        args = dict(shared)
        args["page_table"] = remap_page_table(
            t["page_table"], ranks, pages, k % slabs, max(compact, 1), slabs, perm
        )
        for name in per_copy_names:
            args[name] = t[name].clone() if k else t[name]
        copies.append(args)
    info = {"original_pages": pages, "pool_pages": int(tiled.shape[0]), "pool_bytes": tiled.nbytes}
    return copies, info
