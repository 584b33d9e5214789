"""vLLM general plugin ``qsa`` (entry point group ``vllm.general_plugins``).

vLLM calls ``register()`` in every process it starts (API server, engine core, workers):
it registers the ``Qwen38QSAForCausalLM`` architecture (imported lazily, when a checkpoint
asks for it), its config hook, and the ``torch.ops.qsa`` custom ops with their fake
kernels. It is idempotent and a no-op for what the source overlay already provides.
"""

from __future__ import annotations

from . import ARCHITECTURE, MODEL_MODULE


def register() -> None:
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from .. import qsa_ops  # noqa: F401  registers torch.ops.qsa.* and their fake kernels
    from .config_hook import Qwen38QSAConfig

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{MODEL_MODULE}:{ARCHITECTURE}")
    MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, Qwen38QSAConfig)
