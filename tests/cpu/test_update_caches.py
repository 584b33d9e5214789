"""update_caches on the CPU (reference backend): bit-exact against the independent numpy
rule of qsa_ops.testing, chunking invariance, padded slots, and every refusal (type, message,
both caches untouched)."""

from __future__ import annotations

import re

import pytest
import torch

from custom_esimd_kernels_vllm.qsa_ops import contract, reference, testing, update_caches


@pytest.mark.parametrize("T", [0, 1, 3, 8, 37, 260])
@pytest.mark.parametrize("seed", [0, 1])
def test_bit_exact_against_rule(T, seed):
    case = testing.make_update_case(T, seed=seed)
    run = case.clone()
    before = {k: v.clone() for k, v in case.inputs().items()}
    update_caches(*run.args())
    testing.check_update(case, run.kv_cache, run.compressed_key_cache)
    for name, t in case.inputs().items():
        assert torch.equal(t, before[name]), f"input {name} was modified"


def test_every_row_compressed_and_custom_op_direct():
    case = testing.make_update_case(41, seed=3, every_row=True, padded=0)
    run = case.clone()
    torch.ops.qsa.update_caches(*run.args())  # the op body validates on its own
    testing.check_update(case, run.kv_cache, run.compressed_key_cache)


def test_rule_is_the_fold_order():
    """fold_sum is the contract's halving order: it differs from torch.sum on some inputs
    and equals the parity recursion of the checker on all of them."""
    import numpy as np

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2000, 256, generator=gen) * torch.logspace(-3, 3, 256)
    folded = reference.fold_sum(x)
    rule = torch.from_numpy(testing._pairwise_rule(x.numpy().astype(np.float32)))
    assert torch.equal(folded, rule)
    assert not torch.equal(folded, x.sum(dim=-1))  # the order matters in float32


def _prefill(length: int, chunks: list[int], seed: int = 7):
    """Caches after writing one request's ``length`` prompt tokens in steps of ``chunks``."""
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(length, 256, generator=gen).half()
    value = torch.randn(length, 256, generator=gen).half()
    wk = torch.randn(128, 256, generator=gen) * 0.1
    kv_pages, ck_pages = [3, 0, 2], [1, 4, 0]
    kv = torch.randn(4, 512, 512, generator=gen).half()
    ck = torch.randn(5, 128, 1, 128, generator=gen).half()
    start = 0
    for size in chunks:
        pos = range(start, min(length, start + size))
        slots, ck_slots = testing.update_slots(pos, kv_pages, ck_pages)
        rows = slice(pos.start, pos.stop)
        update_caches(
            key[rows].contiguous(),
            value[rows].contiguous(),
            torch.tensor(slots, dtype=torch.int64),
            torch.tensor(ck_slots, dtype=torch.int64),
            wk,
            kv,
            ck,
        )
        start = pos.stop
    assert start == length
    return kv, ck


@pytest.mark.parametrize("chunks", [[1] * 37, [5, 2, 30], [3, 1, 33], [36, 1], [4] * 10])
def test_chunking_invariance(chunks):
    one_shot = _prefill(37, [37])
    chunked = _prefill(37, chunks)
    for a, b in zip(one_shot, chunked, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_chunking_invariance_across_pages():
    one_shot = _prefill(1100, [1100])
    for chunks in ([513, 587], [511, 2, 587], [100] * 11):
        chunked = _prefill(1100, chunks)
        for a, b in zip(one_shot, chunked, strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_padded_and_out_of_range_slots_write_nothing():
    case = testing.make_update_case(12, seed=2, padded=0)
    bad = case.clone()
    p, q = case.kv_cache.shape[0], case.compressed_key_cache.shape[0]
    slots = torch.tensor([-1, -5, p * 512, p * 512 + 9] + [-1] * 8, dtype=torch.int64)
    ck_slots = torch.tensor([0, 1, 2, q * 128] + [-1] * 8, dtype=torch.int64)
    kv0, ck0 = bad.kv_cache.clone(), bad.compressed_key_cache.clone()
    update_caches(bad.key, bad.value, slots, ck_slots, bad.index_wk, bad.kv_cache,
                  bad.compressed_key_cache)  # fmt: skip
    assert torch.equal(bad.kv_cache.view(torch.int16), kv0.view(torch.int16))
    assert torch.equal(bad.compressed_key_cache.view(torch.int16), ck0.view(torch.int16))


def test_valid_slot_without_compressed_slot_and_vice_versa():
    case = testing.make_update_case(9, seed=4, padded=0)
    run = case.clone()
    ck_slots = case.compressed_slot_mapping.clone()
    ck_slots[0] = 5  # a valid compressed slot on a row whose block is not complete yet
    slots = case.slot_mapping.clone()
    slots[1] = -1
    mixed = testing.UpdateCase("mixed", case.key, case.value, slots, ck_slots, case.index_wk,
                               case.kv_cache, case.compressed_key_cache)  # fmt: skip
    run = mixed.clone()
    update_caches(*run.args())
    testing.check_update(mixed, run.kv_cache, run.compressed_key_cache)


# ------------------------------------------------------------------------------------------
# refusals: one test per path, in the validation order
# ------------------------------------------------------------------------------------------

NAMES = contract.UPDATE_ARG_NAMES


def _refuses(args, exc, match):
    kv, ck = args[5], args[6]
    kv0 = kv.clone() if isinstance(kv, torch.Tensor) else None
    ck0 = ck.clone() if isinstance(ck, torch.Tensor) else None
    with pytest.raises(exc, match=match):
        update_caches(*args)
    with pytest.raises(exc, match=match):
        torch.ops.qsa.update_caches(*args)
    if kv0 is not None:
        assert torch.equal(kv.view(torch.int16), kv0.view(torch.int16)), "kv_cache written"
    if ck0 is not None:
        assert torch.equal(ck.view(torch.int16), ck0.view(torch.int16)), "ck cache written"


def _args(**changes):
    case = testing.make_update_case(6, seed=9, padded=1)
    args = list(case.args())
    for name, value in changes.items():
        args[NAMES.index(name)] = value
    return args


@pytest.mark.parametrize("name", NAMES)
def test_refuses_non_tensor(name):
    # the custom op's schema refuses a non-tensor itself; the public function names it
    args = _args(**{name: [1, 2]})
    with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got list"):
        update_caches(*args)


@pytest.mark.parametrize("name", NAMES[1:])
def test_refuses_other_device(name):
    args = _args()
    args[NAMES.index(name)] = args[NAMES.index(name)].to("meta")
    with pytest.raises(ValueError, match=re.escape(f"{name} must be on the same device as key")):
        update_caches(*args)


@pytest.mark.parametrize(
    "name, bad, want",
    [
        ("key", torch.float32, "torch.float16"),
        ("value", torch.bfloat16, "torch.float16"),
        ("slot_mapping", torch.int32, "torch.int64"),
        ("compressed_slot_mapping", torch.int32, "torch.int64"),
        ("index_wk", torch.float16, "torch.float32"),
        ("kv_cache", torch.float32, "torch.float16"),
        ("compressed_key_cache", torch.float32, "torch.float16"),
    ],
)
def test_refuses_dtype(name, bad, want):
    args = _args()
    args[NAMES.index(name)] = args[NAMES.index(name)].to(bad)
    _refuses(args, TypeError, re.escape(f"{name} must have dtype {want}, got {bad}"))


@pytest.mark.parametrize("name", ["key", "index_wk", "kv_cache", "compressed_key_cache"])
def test_refuses_non_contiguous(name):
    args = _args()
    t = args[NAMES.index(name)]
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    args[NAMES.index(name)] = wide[..., : t.shape[-1]]
    _refuses(args, ValueError, f"{name} must be contiguous, got strides")


@pytest.mark.parametrize(
    "name, shape, pattern",
    [
        ("key", (6, 128), "(T, 256)"),
        ("value", (6, 1, 256), "(T, 256)"),
        ("slot_mapping", (6, 1), "(T,)"),
        ("index_wk", (256, 128), "(128, 256)"),
        ("kv_cache", (2, 512, 256), "(P, 512, 512)"),
        ("compressed_key_cache", (2, 128, 128), "(Q, 128, 1, 128)"),
    ],
)
def test_refuses_shape(name, shape, pattern):
    args = _args()
    t = args[NAMES.index(name)]
    args[NAMES.index(name)] = torch.zeros(shape, dtype=t.dtype)
    _refuses(args, ValueError, re.escape(f"{name} must have shape {pattern}, got {shape}"))


@pytest.mark.parametrize("name", ["value", "slot_mapping", "compressed_slot_mapping"])
def test_refuses_row_count(name):
    args = _args()
    t = args[NAMES.index(name)]
    args[NAMES.index(name)] = torch.cat([t, t[:1]])
    _refuses(args, ValueError, re.escape("(T = 6 from key), got (7"))


def test_refuses_cache_overlapping_an_input():
    args = _args()
    kv = args[5]
    args[0] = kv.view(-1, 256)[:6]
    _refuses(args, ValueError, "kv_cache must not overlap any input, got overlap with key")


def test_refuses_compressed_cache_overlapping_an_input():
    args = _args()
    ck = args[6]
    args[1] = ck.view(-1, 256)[:6]
    _refuses(
        args, ValueError, "compressed_key_cache must not overlap any input, got overlap with value"
    )


def test_refuses_overlapping_outputs():
    args = _args()
    kv = args[5]
    args[6] = kv.view(-1)[: 2 * 128 * 128].view(2, 128, 1, 128)
    _refuses(args, ValueError, re.escape("compressed_key_cache must not overlap kv_cache"))


def test_fake_kernel_traces_under_compile():
    case = testing.make_update_case(8, seed=1)
    run = case.clone()

    @torch.compile(fullgraph=True, backend="eager")
    def step(*args):
        update_caches(*args)

    step(*run.args())
    testing.check_update(case, run.kv_cache, run.compressed_key_cache)


def test_opcheck_cpu():
    case = testing.make_update_case(10, seed=8)
    torch.library.opcheck(torch.ops.qsa.update_caches.default, case.clone().args())
