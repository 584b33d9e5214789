"""The third QSA operator, ``update_caches``: the step's cache writes (docs/contract.md).

``update_caches(key, value, slot_mapping, compressed_slot_mapping, index_wk, kv_cache,
compressed_key_cache)`` stores the new K/V rows at their slots of the exact-packed cache and
then refreshes, from the 4 cached keys of its block, the compressed key of every row that
has a compressed slot. It validates every argument first (``contract.validate_update_args``;
nothing is written on refusal) and runs the ``torch.ops.qsa.update_caches`` custom op.

TRANSITIONAL REGISTRATION (until the stable-ABI op layer carries this op): the custom op is
registered here with torch.library; its body validates (unless the public function just did)
and runs the PyTorch reference on every device. When the op layer lands, the schema moves
into its schema table, the C++ validation and the launch of ``csrc/qsa/update_caches.cu``
into its C++ ops, and this module keeps only the public function.
"""

from __future__ import annotations

import torch

from . import contract, dispatch, reference


def update_caches(
    key: torch.Tensor,  # [T, 256] float16
    value: torch.Tensor,  # [T, 256] float16
    slot_mapping: torch.Tensor,  # [T] int64: page * 512 + offset, -1 = padded row
    compressed_slot_mapping: torch.Tensor,  # [T] int64: page * 128 + j, -1 = none
    index_wk: torch.Tensor,  # [128, 256] float32
    kv_cache: torch.Tensor,  # [P, 512, 512] float16 exact-packed, written
    compressed_key_cache: torch.Tensor,  # [Q, 128, 1, 128] float16, written
) -> None:
    """Write the step's K/V and refresh the compressed keys (contract section 3)."""
    args = (
        key,
        value,
        slot_mapping,
        compressed_slot_mapping,
        index_wk,
        kv_cache,
        compressed_key_cache,
    )
    compiling = torch.compiler.is_compiling()
    contract.validate_update_args(*args, check_storage=not compiling)
    if compiling:
        torch.ops.qsa.update_caches(*args)
    else:
        dispatch.validated_call(torch.ops.qsa.update_caches, *args)


# ---- TRANSITIONAL: torch.library registration (moves into the op layer) -------------------


@torch.library.custom_op("qsa::update_caches", mutates_args=("kv_cache", "compressed_key_cache"))
def update_caches_op(
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    compressed_slot_mapping: torch.Tensor,
    index_wk: torch.Tensor,
    kv_cache: torch.Tensor,
    compressed_key_cache: torch.Tensor,
) -> None:
    args = (
        key,
        value,
        slot_mapping,
        compressed_slot_mapping,
        index_wk,
        kv_cache,
        compressed_key_cache,
    )
    if not dispatch._take_validated():
        contract.validate_update_args(*args)
    reference.update_caches_ref(*args)


@update_caches_op.register_fake
def _(key, value, slot_mapping, compressed_slot_mapping, index_wk, kv_cache,
      compressed_key_cache) -> None:  # fmt: skip
    return None
