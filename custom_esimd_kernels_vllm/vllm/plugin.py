"""vLLM general plugin ``qsa`` (entry point group ``vllm.general_plugins``).

vLLM calls ``register()`` in every process it starts (API server, engine core, workers): it
registers the ``torch.ops.qsa`` custom ops with their fake kernels and routes vLLM's own
``Qwen4ExpForCausalLM``, ``Qwen4ExpForConditionalGeneration`` and ``Qwen4ExpMTP`` to
``qwen4exp`` (upstream's model with QSA on our operators; imported lazily, when a checkpoint
asks for it) unless ``QSA_QWEN4EXP_ROUTING=0`` or on ROCm. It is idempotent and a no-op for
what the source overlay already provides.
"""

from __future__ import annotations


def register() -> None:
    from vllm import ModelRegistry

    from .. import qsa_ops  # noqa: F401  registers torch.ops.qsa.* and their fake kernels
    from . import qwen4exp

    if qwen4exp.routing_enabled() and not _rocm():
        _route_qwen4exp(ModelRegistry, qwen4exp)


def _rocm() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_rocm()


def _route_qwen4exp(registry, qwen4exp) -> None:
    """Point vLLM's Qwen4Exp architectures at ``qwen4exp`` (the overlay already does)."""
    models = getattr(registry, "models", {})
    for arch in qwen4exp.ARCHITECTURES:
        current = models.get(arch)
        if getattr(current, "module_name", None) == qwen4exp.MODULE:
            continue
        registry.register_model(arch, f"{qwen4exp.MODULE}:{arch}")
