"""``Qwen38QSAForCausalLM``: a Qwen3 decoder whose attention is QSA (see ``qsa_config``).

Checkpoint names are Qwen3's plus, per layer, ``self_attn.index_wq.weight``
([index_n_heads * 128, hidden]: the indexer queries) and ``self_attn.index_wk.weight``
([num_key_value_heads * 128, head_dim]: the indexer key projection of each KV head).
Tensor parallelism shards both by heads, like q/k/v.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CacheConfig, VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader
from vllm.model_executor.models.qwen2 import Qwen2MLP, Qwen2Model
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.utils import maybe_prefix
from vllm.transformers_utils.config import set_default_rope_theta

from ..qsa_ops.contract import ATTN_HEADS, HEAD_DIM, INDEX_DIM, INDEX_HEADS, WIDTH
from .layer import QSAAttention
from .qsa_config import QSAConfig


class IndexKeyProjection(nn.Module):
    """W_ik of this rank's KV head: [128, 256], applied to cached attention keys."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(INDEX_DIM, HEAD_DIM), requires_grad=False)
        self.weight.weight_loader = sharded_weight_loader(0)


class Qwen38QSAAttention(nn.Module):
    def __init__(
        self,
        config,
        cache_config: CacheConfig | None,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        QSAConfig.from_hf(config).check_rank(get_tensor_model_parallel_world_size())
        hidden_size = config.hidden_size
        self.q_size = ATTN_HEADS * HEAD_DIM  # per rank
        self.kv_size = HEAD_DIM
        self.qkv_proj = QKVParallelLinear(
            hidden_size,
            HEAD_DIM,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=getattr(config, "attention_bias", False),
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * HEAD_DIM,
            hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.index_wq = ColumnParallelLinear(
            hidden_size,
            config.index_n_heads * INDEX_DIM,
            bias=False,
            quant_config=None,
            prefix=f"{prefix}.index_wq",
        )
        self.index_wk = IndexKeyProjection()
        self.q_norm = RMSNorm(HEAD_DIM, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(HEAD_DIM, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(
            HEAD_DIM,
            max_position=config.max_position_embeddings,
            rope_parameters=config.rope_parameters,
        )
        self.attn = QSAAttention(scale=HEAD_DIM**-0.5, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, ATTN_HEADS, HEAD_DIM)).reshape(q.shape)
        k = self.k_norm(k.reshape(-1, 1, HEAD_DIM)).reshape(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        index_q, _ = self.index_wq(hidden_states)
        assert index_q.shape[-1] == INDEX_HEADS * INDEX_DIM
        attn_output = self.attn(q, k, v, index_q, positions)
        output, _ = self.o_proj(attn_output)
        return output


class Qwen38QSADecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        cache_config: CacheConfig | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        set_default_rope_theta(config, default_theta=1000000)
        self.self_attn = Qwen38QSAAttention(
            config, cache_config, quant_config, prefix=f"{prefix}.self_attn"
        )
        self.mlp = Qwen2MLP(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            quant_config=quant_config,
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


@support_torch_compile(
    dynamic_arg_dims={
        "input_ids": 0,
        "positions": -1,
        "intermediate_tensors": 0,
        "inputs_embeds": 0,
    }
)
class Qwen38QSAModel(Qwen2Model):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(
            vllm_config=vllm_config, prefix=prefix, decoder_layer_type=Qwen38QSADecoderLayer
        )
        # NOTES: one selection buffer for all QSA layers (they run one after another on one
        # stream), allocated with the weights so vLLM's memory profile counts it; upstream
        # keeps one per layer. A fixed address is what CUDA-graph replay needs.
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.register_buffer(
            "qsa_selected", torch.empty(max_tokens, WIDTH, dtype=torch.int32), persistent=False
        )
        for attn in self.qsa_layers():
            attn.selected = self.qsa_selected

    def qsa_layers(self) -> list[QSAAttention]:
        return [m for m in self.modules() if isinstance(m, QSAAttention)]


class Qwen38QSAForCausalLM(Qwen3ForCausalLM):
    """Qwen3 causal LM with QSA attention; weights load like Qwen3 (q/k/v and gate/up fused)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_config
        self.config = config
        self.vllm_config = vllm_config
        self.quant_config = vllm_config.quant_config
        self.model = Qwen38QSAModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self._init_head(vllm_config, prefix)

    def _init_head(self, vllm_config: VllmConfig, prefix: str) -> None:
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        config = self.config
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            quant_config=self.quant_config,
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        # The update operator takes W_ik in float32: one exact cast at load (none for a
        # float32 checkpoint), never per step.
        for layer in self.model.layers:
            attn = getattr(layer, "self_attn", None)
            if isinstance(attn, Qwen38QSAAttention):
                attn.attn.index_wk = attn.index_wk.weight.detach().float().contiguous()
        for attn in self.model.qsa_layers():
            if attn.index_wk is None:
                raise RuntimeError(f"QSA layer {attn.layer_name}: index_wk was not loaded")
        return loaded
