"""vLLM integration of the QSA operators: the ``Qwen38QSAForCausalLM`` model.

Modules that import vLLM (``model``, ``layer``, ``backend``, ``spec``, ``plugin``) are loaded
only by vLLM itself, through the ``vllm.general_plugins`` entry point ``qsa`` or the source
overlay ``patches/vllm-0.32.0-qsa.patch``. ``qsa_config``, ``paging`` and
``reference_model`` depend on torch only, so tests and tools use them without vLLM.
"""

from __future__ import annotations

ARCHITECTURE = "Qwen38QSAForCausalLM"
MODEL_MODULE = "custom_esimd_kernels_vllm.vllm.model"
# the layer's one custom op (layer.py) and its name in vLLM's splitting-op list
OP_NAME = "qsa_attention"
SPLITTING_OP = f"vllm::{OP_NAME}"

__all__ = ["ARCHITECTURE", "MODEL_MODULE", "OP_NAME", "SPLITTING_OP"]
