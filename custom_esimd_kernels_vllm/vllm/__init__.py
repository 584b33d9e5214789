"""vLLM integration of the QSA operators: vLLM's own ``Qwen4ExpForCausalLM`` with its QSA
selection and attention routed to ``qsa_ops`` (``qwen4exp``; on vLLM's CPU backend with the
PyTorch equivalents of upstream's CUDA-only pieces, ``qwen4exp_cpu``).

vLLM loads the routing through the ``vllm.general_plugins`` entry point ``qsa`` (``plugin``) or
the source overlay ``patches/vllm-0.32.0-qsa.patch``. ``paging`` depends on torch only.
"""
