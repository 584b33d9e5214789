"""vLLM config hook of ``Qwen38QSAForCausalLM`` (vLLM calls it while it builds the config,
before the platform's checks and before any weight is loaded).

* KV-cache block size: the operators fix a page at 512 tokens, so the hook sets
  ``--block-size 512`` (warning when the user asked for another size).
* Compilation: the layer's QSA path is one custom op (``vllm::qsa_attention``); the hook
  adds it to the splitting ops of vLLM's piecewise graphs, next to vLLM's own attention ops.
  vLLM's default compilation and CUDA-graph modes are kept (FULL graphs for uniform decode
  batches: the builder reports UNIFORM_BATCH).
* Refusals, each naming the setting and what would work: pipeline parallelism, speculative
  decoding, a quantized KV cache, decode/prefill context parallelism, and a tensor-parallel
  size whose ranks are not exactly the operator contract.
"""

from __future__ import annotations

from vllm.config import CompilationConfig
from vllm.logger import init_logger
from vllm.model_executor.models.config import VerifyAndUpdateConfig

from ..qsa_ops.contract import KV_PAGE
from . import SPLITTING_OP
from .qsa_config import QSAConfig

logger = init_logger(__name__)


class UnsupportedQSAConfig(ValueError):
    """A vLLM setting the QSA model cannot serve."""


def check_supported(vllm_config) -> None:
    """Raise UnsupportedQSAConfig for settings QSA cannot serve (the first one found)."""
    parallel = vllm_config.parallel_config
    pp = getattr(parallel, "pipeline_parallel_size", 1)
    if pp != 1:
        raise UnsupportedQSAConfig(
            f"QSA: --pipeline-parallel-size {pp} is not supported (the QSA layers and their "
            f"caches are not split into pipeline stages); use --pipeline-parallel-size 1 and "
            f"scale with --tensor-parallel-size"
        )
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel, name, 1) or 1
        if size != 1:
            flag = "--" + name.replace("_", "-")
            raise UnsupportedQSAConfig(
                f"QSA: {flag} {size} is not supported (each rank holds whole KV pages); "
                f"use {flag} 1"
            )
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise UnsupportedQSAConfig(
            "QSA: speculative decoding (--speculative-config) is not supported (the "
            "compressed-key cache has no rollback for rejected draft tokens); serve without "
            "--speculative-config"
        )
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype not in ("auto", "float16", "half"):
        raise UnsupportedQSAConfig(
            f"QSA: --kv-cache-dtype {cache_dtype} is not supported (the QSA operators read "
            f"float16 K/V and compressed keys); use --kv-cache-dtype auto"
        )
    model_config = vllm_config.model_config
    if model_config is not None:
        tp = parallel.tensor_parallel_size
        qsa = QSAConfig.from_hf(model_config.hf_config)
        try:
            qsa.check_rank(tp)
        except ValueError as exc:
            raise UnsupportedQSAConfig(
                f"QSA: --tensor-parallel-size {tp} does not fit this checkpoint: {exc}; "
                f"use --tensor-parallel-size {qsa.num_kv_heads} (one KV head per rank)"
            ) from exc


def add_splitting_op(compilation_config) -> None:
    """Make ``vllm::qsa_attention`` a splitting op (vLLM's defaults kept)."""
    ops = compilation_config.splitting_ops
    if ops == []:  # the user asked for no splitting (one graph): leave it so
        logger.info("QSA: splitting_ops=[] kept; %s is captured inside the graph", SPLITTING_OP)
        return
    if ops is None:
        ops = list(CompilationConfig._attention_ops)  # what vLLM uses for None
    if SPLITTING_OP not in ops:
        ops = [*ops, SPLITTING_OP]
    compilation_config.splitting_ops = ops


class Qwen38QSAConfig(VerifyAndUpdateConfig):
    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        check_supported(vllm_config)
        cache_config = vllm_config.cache_config
        if cache_config.user_specified_block_size and cache_config.block_size != KV_PAGE:
            logger.warning(
                "QSA: --block-size %s replaced by %s (one KV page of the QSA operators)",
                cache_config.block_size,
                KV_PAGE,
            )
        cache_config.block_size = KV_PAGE
        cache_config.user_specified_block_size = True
        add_splitting_op(vllm_config.compilation_config)
