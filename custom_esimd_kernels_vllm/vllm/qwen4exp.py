"""vLLM 0.32.0's ``Qwen4ExpForCausalLM`` (and its MTP draft) with QSA on our operators.

Upstream's model (``vllm/models/qwen4_exp/``) stays as it is, except at two call sites:

* the indexer's selection (``QSAIndexer.forward``: upstream's paged decode and prefill
  scoring, its top-k and the expansion kernel) becomes one ``qsa_ops.select_paged_tokens``
  call per layer and step, over the compressed-key cache that upstream's own cache writes
  fill (the fused ``qsa_prepare`` on CUDA; on CPU the same arithmetic in PyTorch);
* the QSA attention (``Qwen4ExpQSAFlashAttentionImpl.forward_qsa``: upstream's Triton
  sparse attention) becomes one ``qsa_ops.sparse_paged_attention`` call, on vLLM's own
  K/V pages (bf16, or fp8-e4m3 with the layer's per-tensor scales) with the output gate.

vLLM's cache writes (K/V, the raw-key ring, the compressed keys) and MTP's ``skip_topk``
(later draft steps reuse step 0's rows) stay upstream's. On a CUDA tensor the operators run
the compiled kernels; on a CPU tensor their PyTorch reference.

``QSA_QWEN4EXP_ROUTING=0`` turns the routing off (upstream's kernels serve QSA; on CPU there
are none, so the model cannot serve there). At load time each QSA layer checks that its rank
is the operators' contract (3 query heads and 1 KV head of 256, an indexer of 4 x 128, budget
2048, ratio 4) and refuses the model otherwise, naming the numbers; the start-up log says
which backend serves QSA.
"""

from __future__ import annotations

import importlib
import os

import torch

from ..qsa_ops import contract

ROUTING_ENV = "QSA_QWEN4EXP_ROUTING"
ARCHITECTURES = ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration", "Qwen4ExpMTP")
MODULE = "custom_esimd_kernels_vllm.vllm.qwen4exp"
UPSTREAM = "vllm.models.qwen4_exp"


def routing_enabled() -> bool:
    value = os.environ.get(ROUTING_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ROUTING_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


class QSAShapeError(ValueError):
    """A rank's QSA shapes are not the operators' contract."""


def check_rank_shapes(
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    index_heads: int,
    index_kv_heads: int,
    index_dim: int,
    token_topk: int,
    compress_ratio: int,
    tp_size: int,
) -> None:
    """Raise QSAShapeError naming every number of this rank that the contract does not take."""
    want = {
        "query heads per rank": (num_heads, contract.ATTN_HEADS),
        "KV heads per rank": (num_kv_heads, 1),
        "head dim": (head_dim, contract.HEAD_DIM),
        "indexer heads": (index_heads, contract.INDEX_HEADS),
        "indexer KV heads": (index_kv_heads, 1),
        "indexer head dim": (index_dim, contract.INDEX_DIM),
        "indexer budget": (token_topk, contract.TOKEN_TOPK),
        "compression ratio": (compress_ratio, contract.COMPRESS_RATIO),
    }
    bad = [
        f"{name} {got} (the operators take {exp})"
        for name, (got, exp) in want.items()
        if got != exp
    ]
    if bad:
        raise QSAShapeError(
            f"Qwen4Exp QSA at --tensor-parallel-size {tp_size}: this rank's shapes are not the "
            f"QSA operators' contract: {'; '.join(bad)}. Serve a checkpoint whose ranks have "
            f"3 query heads and 1 KV head of 256 per rank (e.g. 24 query / 8 KV heads at TP 8, "
            f"or fewer KV heads, replicated), or set {ROUTING_ENV}=0 for upstream's kernels"
        )


def _backend_name() -> str:
    """What runs the operators for this host's tensors."""
    from .. import qsa_ops

    if _on_cpu():
        return "PyTorch reference"
    return f"{qsa_ops.build_info()['cuda_backend']} backend"


def _upstream(name: str):
    return importlib.import_module(f"{UPSTREAM}.{name}")


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


# --------------------------------------------------------------------------------------------
# the routed classes (built lazily: they subclass vLLM's, which import vLLM's model stack)
# --------------------------------------------------------------------------------------------

_classes: dict[str, type] = {}


def _helpers():
    """Side-cache helpers: upstream's CUDA ones, or the PyTorch equivalents on CPU."""
    if _on_cpu():
        from . import qwen4exp_cpu as cpu

        return cpu.apply_rope, cpu.compress_groups, cpu.store_cache_rows
    indexer = _upstream("nvidia.indexer_qsa")
    ops = _upstream("nvidia.ops.qsa")
    return indexer.apply_qsa_rope, ops.qsa_compress_groups_with_ratio, ops.qsa_store_cache_rows


def _make_indexer_cls(base: type) -> type:
    from .. import qsa_ops

    class RoutedQSAIndexer(base):
        """Upstream's indexer; its selection is ``qsa_ops.select_paged_tokens``."""

        def _prepare(self, projected_qk, positions, raw_md, ck_md, attn, qkv, slot_mapping):
            """Upstream's cache writes for this step; returns the indexer query
            [T, 4, 128] and, with the fused prepare, the main (query, gate)."""
            num_tokens = projected_qk.shape[0]
            projected_q, raw_keys = projected_qk.split(
                (
                    self.index_n_heads * self.index_head_dim,
                    self.index_kv_heads * self.index_head_dim,
                ),
                dim=-1,
            )
            ring = self.raw_key_cache
            compressed_cache = self.compressed_key_cache.kv_cache
            if attn.use_fused_qsa_prepare:
                qsa_prepare = _upstream("nvidia.indexer_qsa").qsa_prepare
                q = projected_q.new_empty(
                    num_tokens, self.index_n_heads, self.index_head_dim, dtype=self.indexer_dtype
                )
                main_kv_cache = attn.kv_cache.transpose(1, 2)
                if attn.kv_cache_dtype in ("fp8", "fp8_e4m3"):
                    main_kv_cache = main_kv_cache.view(torch.float8_e4m3fn)
                main_outputs = qsa_prepare(
                    projected_q,
                    raw_keys,
                    positions,
                    self.rotary_emb.cos_sin_cache,
                    self.q_layernorm.weight,
                    self.k_layernorm.weight,
                    self.q_layernorm.variance_epsilon,
                    q,
                    ring.kv_cache,
                    raw_md.slot_mapping,
                    raw_md.block_table,
                    raw_md.query_start_loc,
                    raw_md.logical_positions,
                    compressed_cache,
                    ck_md.slot_mapping,
                    ck_md.k_work_metadata,
                    compress_ratio=self.compress_ratio,
                    mrope_section=getattr(self.rotary_emb, "mrope_section", None),
                    rope_pos_offset=(
                        ring.rope_position_offset if ring.rope_position_cache is not None else None
                    ),
                    main_qkv=qkv[:num_tokens],
                    main_q_norm_weight=attn.q_norm.weight,
                    main_k_norm_weight=attn.k_norm.weight,
                    main_eps=attn.q_norm.variance_epsilon,
                    main_kv_cache=main_kv_cache,
                    main_slot_mapping=slot_mapping[:num_tokens],
                    main_k_scale=attn._k_scale_float,
                    main_v_scale=attn._v_scale_float,
                )
                return q, main_outputs

            rope, compress, store = _helpers()
            q = projected_q.reshape(num_tokens, self.index_n_heads, self.index_head_dim)
            q = rope(self.rotary_emb, positions, self.q_layernorm(q)).to(self.indexer_dtype)
            raw_key_cache = ring.key_cache
            rope_position_cache = ring.rope_position_cache
            if rope_position_cache is None:
                position_rows = raw_md.logical_positions.view(-1, 1, 1).expand(-1, 1, 3)
            else:
                canonical = _upstream("common.qsa_cache").canonical_qsa_rope_positions
                position_rows = canonical(positions).to(device=raw_key_cache.device)
            pooled, first_positions = compress(
                raw_keys.reshape(-1, 1, self.index_head_dim),
                position_rows,
                raw_key_cache,
                raw_md.block_table,
                raw_md.token_to_req,
                raw_md.query_start_loc,
                raw_md.logical_positions,
                ck_md.slot_mapping,
                self.compress_ratio,
                rope_position_cache,
            )
            compressed = self.k_layernorm(pooled.reshape(-1, self.index_head_dim))
            if getattr(self.rotary_emb, "mrope_section", None):
                first_positions = first_positions.transpose(0, 1)
            else:
                first_positions = first_positions[:, 0]
            compressed = rope(
                self.rotary_emb, first_positions, compressed.reshape(-1, 1, self.index_head_dim)
            )
            store(compressed_cache, ck_md.slot_mapping, compressed.to(compressed_cache.dtype))
            store(raw_key_cache, raw_md.slot_mapping, raw_keys)
            if rope_position_cache is not None:
                store(rope_position_cache, raw_md.slot_mapping, position_rows)
            return q, None

        def forward(self, projected_qk, positions, out=None, *, attn, qkv=None, slot_mapping=None):
            metadata = self._metadata()
            if metadata is None:  # profile and dummy runs: upstream's inert rows
                _reserve_workspaces(self, projected_qk)
                return super().forward(
                    projected_qk, positions, out, attn=attn, qkv=qkv, slot_mapping=slot_mapping
                )
            raw_md, ck_md = metadata
            num_tokens = raw_md.num_actual_tokens
            q, main_outputs = self._prepare(
                projected_qk[:num_tokens],
                positions[..., :num_tokens],
                raw_md,
                ck_md,
                attn,
                qkv,
                slot_mapping,
            )
            if self.skip_topk:  # MTP: later draft steps reuse step 0's rows
                if out is None:
                    raise RuntimeError("QSA top-k reuse requires an output buffer")
                return out, main_outputs
            if out is None:
                out = torch.empty(
                    num_tokens, self.packed_output_width, dtype=torch.int32, device=q.device
                )
            # The buffer's last column (upstream's per-row count for its own attention) is
            # not read by ours; the selection writes columns 0..2050 of every row.
            qsa_ops.select_paged_tokens(
                q,
                self.compressed_key_cache.kv_cache,  # [P, C, 1, 128]
                ck_md.block_table,
                ck_md.token_to_req,
                ck_md.logical_positions,
                ck_md.seq_lens,
                self.token_topk,
                self.compress_ratio,
                out[:, : contract.WIDTH],
            )
            return out, main_outputs

    return RoutedQSAIndexer


def _make_impl_cls(base: type) -> type:
    from .. import qsa_ops

    class RoutedQSAImpl(base):
        """Upstream's QSA attention impl; its attention is ``qsa_ops.sparse_paged_attention``."""

        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
            if _on_cpu():
                from .qwen4exp_cpu import store_kv

                scales = None
                if self.kv_cache_dtype in ("fp8", "fp8_e4m3"):
                    scales = (layer._k_scale_float, layer._v_scale_float)
                store_kv(key, value, kv_cache, slot_mapping, scales)
                return
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

        def forward_qsa(
            self,
            layer,
            query,
            key,
            value,
            kv_cache,
            attn_metadata,
            output,
            token_to_req,
            use_prefill_config,
            output_gate,
            output_scale=None,
            output_block_scale=None,
        ):
            del key, value, use_prefill_config
            if output_scale is not None or output_block_scale is not None:
                raise NotImplementedError("QSA does not support fused output quantization")
            num_tokens = attn_metadata.num_actual_tokens
            output[num_tokens:].zero_()
            if num_tokens == 0:
                return output
            key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
            scales = {}
            if self.kv_cache_dtype in ("fp8", "fp8_e4m3"):
                key_cache = key_cache.view(torch.float8_e4m3fn)
                value_cache = value_cache.view(torch.float8_e4m3fn)
                scales = {"k_scale": layer._k_scale_float, "v_scale": layer._v_scale_float}
            gate = output_gate[:num_tokens]
            gate = gate.reshape(num_tokens, self.num_heads, self.head_size)
            if not gate.is_contiguous():
                gate = gate.contiguous()
            qsa_ops.sparse_paged_attention(
                query[:num_tokens],
                key_cache,
                value_cache,
                layer.topk_indices_buffer[:num_tokens, : contract.WIDTH],
                attn_metadata.block_table,
                token_to_req[:num_tokens],
                key_cache.shape[1],
                output[:num_tokens],
                self.scale,
                gate=gate,
                **scales,
            )
            return output

    return RoutedQSAImpl


_announced = False
# (device, stream, rows) whose op-layer workspaces were reserved in a profiling forward
_reserved: set[tuple] = set()


def _reserve_workspaces(indexer, projected_qk: torch.Tensor) -> None:
    """In vLLM's profiling forward (no metadata), on CUDA: run both operators once at the
    step's row count and the longest page table (paging.reserve_workspaces), so that their
    workspaces count in the memory vLLM measures before it sizes the KV cache."""
    geometry = getattr(indexer, "_qsa_geometry", None)
    if not projected_qk.is_cuda or geometry is None:
        return
    rows, device = projected_qk.shape[0], projected_qk.device
    key = (device, torch.cuda.current_stream(device).cuda_stream, rows)
    if rows == 0 or key in _reserved:
        return
    from .paging import reserve_workspaces

    max_model_len, page_size = geometry
    dtype = projected_qk.dtype
    q = torch.zeros(rows, contract.ATTN_HEADS, contract.HEAD_DIM, dtype=dtype, device=device)
    index_q = torch.zeros(
        rows, contract.INDEX_HEADS, contract.INDEX_DIM, dtype=dtype, device=device
    )
    positions = torch.zeros(rows, dtype=torch.int64, device=device)
    selected = torch.empty(rows, contract.WIDTH, dtype=torch.int32, device=device)
    max_pages = -(-max_model_len // page_size)
    reserve_workspaces(q, index_q, positions, selected, torch.empty_like(q), max_pages, page_size)
    _reserved.add(key)


def _check_layer(attn, vllm_config) -> None:
    global _announced
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.logger import init_logger

    indexer = attn.indexer
    check_rank_shapes(
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        index_heads=indexer.index_n_heads,
        index_kv_heads=indexer.index_kv_heads,
        index_dim=indexer.index_head_dim,
        token_topk=indexer.token_topk,
        compress_ratio=indexer.compress_ratio,
        tp_size=get_tensor_model_parallel_world_size(),
    )
    if not _announced:
        _announced = True
        # under vLLM's logger, so that the server's log shows it
        init_logger("vllm.qsa").info(
            "QSA of Qwen4Exp served by custom_esimd_kernels_vllm.qsa_ops (%s for %s tensors; "
            "K/V cache %s, indexer cache %s; %s=0 for upstream's kernels)",
            _backend_name(),
            "CPU" if _on_cpu() else "CUDA",
            attn.kv_cache_dtype,
            str(indexer.indexer_dtype).removeprefix("torch."),
            ROUTING_ENV,
        )


def install() -> None:
    """Route upstream's QSA classes to ours (idempotent). On CPU also installs the PyTorch
    equivalents of the CUDA/Triton-only pieces (qwen4exp_cpu)."""
    if _classes:
        return
    if _on_cpu():
        from . import qwen4exp_cpu

        qwen4exp_cpu.install()
    qsa = _upstream("nvidia.qsa")
    indexer_cls = _make_indexer_cls(_upstream("nvidia.indexer_qsa").QSAIndexer)
    impl_cls = _make_impl_cls(qsa.Qwen4ExpQSAFlashAttentionImpl)
    # The QSA owner builds its indexer and impl from these module names.
    qsa.QSAIndexer = indexer_cls
    qsa.Qwen4ExpQSAFlashAttentionImpl = impl_cls
    _classes.update(indexer=indexer_cls, impl=impl_cls)


def _route_model(model: torch.nn.Module, vllm_config) -> None:
    owner_cls = _upstream("nvidia.qsa").Qwen4ExpQSAAttention
    for module in model.modules():
        if isinstance(module, owner_cls):
            if not isinstance(module.indexer, _classes["indexer"]) or not isinstance(
                module.impl, _classes["impl"]
            ):
                raise RuntimeError(f"{module.layer_name}: QSA was built before the routing")
            _check_layer(module, vllm_config)
            page_size = vllm_config.cache_config.block_size or contract.KV_PAGE
            if page_size % contract.COMPRESS_RATIO == 0:  # else the first step allocates
                module.indexer._qsa_geometry = (vllm_config.model_config.max_model_len, page_size)


def _upstream_model_cls(name: str) -> type:
    # the NVIDIA model (also what vLLM's CPU backend runs), named by module: the overlay's
    # vllm.models.qwen4_exp.__getattr__ hands these names to this module
    return getattr(_upstream("nvidia.mtp" if name == "Qwen4ExpMTP" else "nvidia.model"), name)


def __getattr__(name: str):
    """``Qwen4ExpForCausalLM``, ``Qwen4ExpForConditionalGeneration``, ``Qwen4ExpMTP``:
    upstream's classes, QSA routed."""
    if name not in ARCHITECTURES:
        raise AttributeError(name)
    if name in _classes:
        return _classes[name]
    if _on_cpu():
        from . import qwen4exp_cpu

        qwen4exp_cpu.ensure_torchvision_importable()
    base = _upstream_model_cls(name)
    install()

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs) -> None:
        base.__init__(self, vllm_config=vllm_config, prefix=prefix, **kwargs)
        _route_model(self, vllm_config)

    cls = type(name, (base,), {"__init__": __init__, "__module__": MODULE, "__qualname__": name})
    _classes[name] = cls
    return cls
