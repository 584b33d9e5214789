"""Bad-input corpus for compute-sanitizer (run by scripts/gpu_session.sh, not by pytest).

    compute-sanitizer --tool memcheck  python tests/gpu/sanitizer_corpus.py all
    compute-sanitizer --tool racecheck python tests/gpu/sanitizer_corpus.py select
    (modes: all, select, attention)

Every case is valid to the contract's validators but full of bad *values*: request ids out
of range, page ids negative / >= P / huge, indices beyond the page table, positions past the
length, negative lengths, empty tables. The kernels must stay in bounds and race-free; the
outputs are also checked against the reference so a silent wrong answer fails too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import KV_PAGE, reference, testing

DEVICE = os.environ.get("QSA_CORPUS_DEVICE", "cuda")
INT32_MAX = 2**31 - 1


def select_corpus():
    from gpu_helpers import ODD_KEYS, distributed_row_case  # beside this file: see __main__

    yield testing.random_select_case(
        6, 2, 3, 4, device=DEVICE, seed=1, integer=True,
        page_table=[[-1, 4, INT32_MAX], [-(2**31), 3, 2]], token_to_req=[-1, 2, INT32_MAX, 0, 1, 1],
        query_positions=[2**62, 5000, 3, -(2**62), 1535, 10**9], sequence_lengths=[INT32_MAX, -5],
        name="bad_ids_positions",
    )  # fmt: skip
    yield testing.random_select_case(3, 2, 0, 4, device=DEVICE, seed=2, integer=True, name="M=0")
    yield testing.random_select_case(3, 0, 3, 4, device=DEVICE, seed=3, integer=True, name="B=0")
    yield testing.random_select_case(4, 2, 5, 1, device=DEVICE, seed=4, integer=True, name="P=1")
    yield testing.random_select_case(0, 2, 5, 3, device=DEVICE, seed=5, integer=True, name="R=0")
    for seed in range(4):
        yield testing.random_select_case(9, 3, 7, 11, device=DEVICE, seed=10 + seed, integer=True)
    yield testing.make_select_case("p8192_saturated", 2, DEVICE, seed=6)
    yield testing.make_select_case("p8192_saturated", 1, DEVICE, seed=6)  # the pairs select
    # more rows than SMs
    yield testing.random_select_case(
        140, 3, 7, 11, device=DEVICE, seed=20, integer=True, name="R=140"
    )
    # long rows of real-valued scores (the fast path's bins and ranks at 2..64 pages)
    yield testing.random_select_case(
        4, 2, 64, 96, device=DEVICE, seed=21, integer=True, bad_values=False, name="long rows"
    )
    # rows of 2 and 4 CTAs over 64 pages (on 132 SMs)
    yield testing.random_select_case(
        64, 3, 64, 96, device=DEVICE, seed=24, integer=True, name="rows of 2 CTAs"
    )
    yield testing.random_select_case(
        33, 3, 64, 96, device=DEVICE, seed=25, integer=True, name="rows of 4 CTAs"
    )
    # rows of more than 16,384 blocks (32,768, 21,504 and 43,008): the last CTA streams them
    yield testing.random_select_case(
        3, 2, 336, 340, device=DEVICE, seed=22, integer=True, bad_values=False,
        token_to_req=[0, 1, 1], query_positions=[131071, 86015, 10**9],
        sequence_lengths=[131072, 336 * KV_PAGE], name="streamed rows",
    )  # fmt: skip
    # one such row: every CTA of it takes part in the select (the distributed select)
    yield distributed_row_case(DEVICE)
    # contract v2: every layout (dtypes, keys per page, spanning page strides, strided rows)
    # with bad values, short rows and rows of more than SMs
    for i, (name, layout) in enumerate(testing.LAYOUTS.items()):
        if layout == testing.SEED:
            continue
        for R, M, P in ((5, 4, 6), (140, 3, 5)):
            yield testing.random_select_case(
                R, 3, M, P, device=DEVICE, seed=100 + i, integer=True, layout=layout,
                name=f"{name} R={R}",
            )  # fmt: skip
    # keys per page whose rows of M * C keys are not a multiple of 4 words (C = 129, 130)
    for i, (name, layout) in enumerate(sorted(ODD_KEYS.items())):
        for R, M, P in ((5, 3, 6), (140, 3, 5)):
            yield testing.random_select_case(
                R, 3, M, P, device=DEVICE, seed=200 + i, integer=True, layout=layout,
                name=f"{name} R={R}",
            )  # fmt: skip


def attention_corpus():
    bad = [-1, -2, -(2**31), INT32_MAX, 3 * KV_PAGE, 4 * KV_PAGE + 7, 5, 600, 1100]
    indices = torch.tensor([bad * 227 + bad[:8]] * 3, dtype=torch.int32)
    yield testing.random_attention_case(
        3, 2, 3, 4, device=DEVICE, seed=1, page_table=[[-1, 4, 1], [INT32_MAX, 0, -(2**31)]],
        token_to_req=[0, 1, 2], name="bad_ids",
    )  # fmt: skip
    case = testing.random_attention_case(3, 2, 3, 4, device=DEVICE, seed=2, name="bad_indices")
    case.logical_indices.copy_(indices)
    yield case
    yield testing.random_attention_case(2, 2, 0, 3, device=DEVICE, seed=3, name="M=0")
    yield testing.random_attention_case(2, 0, 3, 3, device=DEVICE, seed=4, name="B=0")
    yield testing.random_attention_case(0, 1, 3, 3, device=DEVICE, seed=5, name="R=0")
    # a non-zero storage offset (16 bytes: contract v2's caches are 16-byte aligned)
    yield testing.random_attention_case(2, 2, 3, 5, device=DEVICE, seed=6, lead=8, name="offset")
    # the decode-size kernel's two variants, the cluster kernel deep (64) and not (300)
    for R in (1, 2, 7, 8, 64, 300):
        yield testing.random_attention_case(R, 3, 6, 9, device=DEVICE, seed=R)
    # contract v2: every layout (bfloat16, float8 K/V, vLLM's pages and spanning strides,
    # separate K/V, strided rows, the gate) on the decode-size and cluster kernels
    for i, (name, layout) in enumerate(testing.LAYOUTS.items()):
        if layout == testing.SEED:
            continue
        for R in (2, 7, 64):
            yield testing.random_attention_case(
                R, 3, 6, 9, device=DEVICE, seed=200 + 10 * i + R, layout=layout,
                name=f"{name} R={R}",
            )  # fmt: skip


def run_select() -> int:
    """Every case through both selection paths (QSA_SELECT_PATH: the kernel's choice, then
    the generic path for every row)."""
    n = 0
    for case in select_corpus():
        want = case.new_out()
        reference.select_paged_tokens_ref(*case.ref_args()[:-1], want)
        for path in ("auto", "generic"):
            os.environ["QSA_SELECT_PATH"] = path
            case.out.fill_(testing.POISON_INT32)
            qsa_ops.select_paged_tokens(*case.args())
            assert torch.equal(case.out, want), (
                f"{case!r} ({path} path): differs from the reference"
            )
            n += 1
    os.environ.pop("QSA_SELECT_PATH")
    return n


def run_attention() -> int:
    n = 0
    for case in attention_corpus():
        qsa_ops.sparse_paged_attention(*case.args(), **case.kwargs())
        testing.check_attention(case, case.out)
        n += 1
    return n


USAGE = "usage: sanitizer_corpus.py [all | select | attention]"


def main(argv: list[str]) -> int:
    which = argv[0] if argv else "all"
    if which in ("-h", "--help"):
        print(USAGE)
        print(__doc__)
        return 0
    if len(argv) > 1 or which not in ("all", "select", "attention"):
        print(USAGE, file=sys.stderr)
        return 2
    os.environ.setdefault("QSA_BACKEND", "cuda")
    counts = {}
    if which in ("all", "select"):
        counts["select"] = run_select()
    if which in ("all", "attention"):
        counts["attention"] = run_attention()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(f"sanitizer corpus ran: {counts}")
    return 0


if __name__ == "__main__":
    # the suite's helpers sit beside this file; the pipeline runs with PYTHONSAFEPATH set, so
    # the script's own folder is not on the path by itself
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main(sys.argv[1:]))
