"""QSA (query-sparse attention) operators for vLLM.

``from custom_esimd_kernels_vllm import qsa_ops`` gives the two operators
``select_paged_tokens`` and ``sparse_paged_attention`` (see docs/contract.md).
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import qsa_ops  # noqa: E402

__all__ = ["qsa_ops", "__version__"]
