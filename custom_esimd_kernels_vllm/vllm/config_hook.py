"""vLLM config hook of ``Qwen38QSAForCausalLM`` (vLLM calls it before the platform's checks).

* KV-cache block size: the operators fix a page at 512 tokens, so the hook sets
  ``--block-size 512`` (warning when the user asked for another size).
* Eager execution: the layer reads per-step metadata through vLLM's forward context in
  Python, which a captured CUDA graph would not re-run, so the hook turns CUDA graphs and
  ``torch.compile`` off (the operators themselves are graph-capturable).
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.model_executor.models.config import VerifyAndUpdateConfig

from ..qsa_ops.contract import KV_PAGE

logger = init_logger(__name__)


class Qwen38QSAConfig(VerifyAndUpdateConfig):
    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        cache_config = vllm_config.cache_config
        if cache_config.user_specified_block_size and cache_config.block_size != KV_PAGE:
            logger.warning(
                "QSA: --block-size %s replaced by %s (one KV page of the QSA operators)",
                cache_config.block_size,
                KV_PAGE,
            )
        cache_config.block_size = KV_PAGE
        cache_config.user_specified_block_size = True
        model_config = vllm_config.model_config
        if not model_config.enforce_eager:
            logger.info("QSA: enforcing eager mode (the QSA layer is not CUDA-graph safe yet)")
            model_config.enforce_eager = True
