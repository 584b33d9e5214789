"""select_paged_tokens on the CUDA kernels against the reference and the float64 checker.

Integer-valued inputs (values in {-2..2}) make every float32 sum exact in any order, so the
kernel must equal the reference bit for bit, tie order included; random float16 inputs must
give a valid top-k (contract section 4).
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import DEVICE, assert_fully_written, reference_select, row_subset

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import CK_PAGE, KV_PAGE, testing

pytestmark = pytest.mark.gpu


def run_cuda(case: testing.SelectCase) -> torch.Tensor:
    before = testing.snapshot(case)
    assert (case.out == testing.POISON_INT32).all()
    result = qsa_ops.select_paged_tokens(*case.args())
    assert result is case.out
    assert_fully_written(case.out, repr(case))
    testing.assert_inputs_unchanged(case, before)
    return case.out


def assert_equal_reference(case: testing.SelectCase, out: torch.Tensor) -> None:
    want = reference_select(case)
    if not torch.equal(out, want):
        r, c = (out != want).nonzero()[0].tolist()
        raise AssertionError(
            f"{case!r}: differs from the reference at row {r} column {c}: "
            f"got {out[r, c].item()}, expected {want[r, c].item()}"
        )


def check_rows(case: testing.SelectCase, out: torch.Tensor, exact: bool, limit: int = 8) -> None:
    """float64 checker on at most ``limit`` rows spread over the case (it loops in Python)."""
    rows = case.q.shape[0]
    picked = sorted({int(i) for i in torch.linspace(0, rows - 1, min(rows, limit)).round()})
    sub = row_subset(case, picked)
    testing.check_selection(
        sub, out.index_select(0, torch.as_tensor(picked, device=out.device)), exact
    )


@pytest.fixture(params=["auto", "generic"])
def select_path(request, monkeypatch):
    """Both selection paths: the kernel's own choice (the fast bin-rank path unless a row has
    mass ties) and the generic radix path for every row (QSA_SELECT_PATH=generic)."""
    monkeypatch.setenv("QSA_SELECT_PATH", request.param)
    return request.param


@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("name", testing.SELECT_CASES)
def test_seed_case_exact(cuda_backend, select_path, name, R):
    case = testing.make_select_case(name, R, DEVICE, seed=R)
    out = run_cuda(case)
    testing.check_selection(case, out, exact=True)
    assert_equal_reference(case, out)


@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize(
    "name", [n for n in testing.SELECT_CASES if n not in ("exact_ties", "all_zero_scores")]
)
def test_seed_case_random_data(cuda_backend, name, R):
    case = testing.make_select_case(name, R, DEVICE, seed=10 + R, integer=False)
    out = run_cuda(case)
    testing.check_selection(case, out, exact=False)


@pytest.mark.parametrize("R", [1, 64, 256])
def test_p8192_saturated_many_rows(cuda_backend, select_path, R):
    case = testing.make_select_case("p8192_saturated", R, DEVICE, seed=3)
    out = run_cuda(case)
    assert_equal_reference(case, out)
    check_rows(case, out, exact=True, limit=2)


def _one_request(R, context, positions, *, seed, pages=None, sparse=False, name):
    """R rows of one request over ``context`` tokens, integer data; ``pages`` overrides the
    page table (duplicates welcome); ``sparse`` zeroes 95% of q and keys (mass exact ties)."""
    M = -(-context // KV_PAGE)
    gen = torch.Generator().manual_seed(seed)
    table = pages if pages is not None else torch.randperm(M, generator=gen).tolist()
    P = max(max(table) + 1, 1)
    case = testing.random_select_case(
        R, 1, M, P, device=DEVICE, seed=seed, integer=True, bad_values=False,
        page_table=[table], token_to_req=[0] * R, query_positions=positions,
        sequence_lengths=[context], name=name,
    )  # fmt: skip
    if sparse:
        case.q.mul_((torch.rand(case.q.shape, generator=gen) < 0.05).to(DEVICE))
        ck = case.compressed_key_cache
        ck.mul_((torch.rand(ck.shape, generator=gen) < 0.05).to(DEVICE))
    return case


@pytest.mark.parametrize("R", [1, 3])
def test_context_131072(cuda_backend, select_path, R):
    case = _one_request(R, 131072, [131071 - 1000 * r for r in range(R)], seed=7, name="ctx128k")
    out = run_cuda(case)
    assert_equal_reference(case, out)
    check_rows(case, out, exact=True, limit=1)


def test_context_163840_streamed(cuda_backend, select_path):
    """40,960 blocks in one row: the distributed select (every CTA of the row takes part);
    under QSA_SELECT_PATH=generic its last CTA's radix passes. The last-CTA path over streamed
    tiles of 16,384 blocks is test_context_131072 at R = 3 (two whole tiles) and the
    sanitizer corpus's "streamed rows" (partial last tiles)."""
    case = _one_request(1, 163840, [163839], seed=12, name="ctx160k")
    out = run_cuda(case)
    assert_equal_reference(case, out)


def test_distributed_short_row(cuda_backend, select_path):
    """A short row (375 blocks, all of them win) in a launch of the distributed select (a table
    of 256 pages), beside a row of 20,000 blocks."""
    gen = torch.Generator().manual_seed(21)
    table = torch.randperm(256, generator=gen).tolist()
    case = testing.random_select_case(
        2, 2, 256, 256, device=DEVICE, seed=21, integer=True, bad_values=False,
        page_table=[table, table[::-1]], token_to_req=[0, 1], query_positions=[1499, 79999],
        sequence_lengths=[1500, 80000], name="dist_short",
    )  # fmt: skip
    out = run_cuda(case)
    assert_equal_reference(case, out)


def test_distributed_wide_octaves(cuda_backend, select_path):
    """Scores over ~35 octaves in a distributed row: 100 blocks 2^23 times larger than the
    rest, and the 512-th key among the small ones, further below the largest key than the
    first digit's 16 octaves reach. Integer keys times powers of two keep every sum exact, so
    the result equals the reference bit for bit."""
    case = _one_request(1, 163840, [163839], seed=22, name="ctx160k_octaves")
    gen = torch.Generator().manual_seed(22)
    ck = case.compressed_key_cache  # [P, 128, 1, 128]
    ints = torch.randint(-8, 9, ck.shape, generator=gen, dtype=torch.int32)
    exp = torch.full(ck.shape[:2], -12, dtype=torch.int32)
    exp.view(-1)[torch.randperm(exp.numel(), generator=gen)[:100]] = 11
    scale = torch.pow(2.0, exp.double())[:, :, None, None]
    ck.copy_((ints.double() * scale).to(ck.dtype))
    out = run_cuda(case)
    assert_equal_reference(case, out)


def test_streamed_launch_workspace(cuda_backend):
    """The workspace of a launch whose rows can be streamed (64 rows, a table of 256 pages):
    the rows' keys (4 bytes per candidate block) and the distributed select's 40 KiB only for
    the few rows that can take it (at most 8), not for every row (before: 2.5 MiB more here,
    up to 10 MiB)."""
    rows, pages = 64, 256
    case = testing.random_select_case(rows, 4, pages, 300, device=DEVICE, seed=31, integer=True)
    keys = rows * pages * CK_PAGE * 4
    stream = torch.cuda.Stream()  # a fresh stream: its workspace does not exist yet
    with torch.cuda.stream(stream):
        stream.synchronize()
        before = torch.cuda.memory_allocated()
        qsa_ops.select_paged_tokens(*case.args())
        grown = torch.cuda.memory_allocated() - before
        stream.synchronize()
    assert keys <= grown < keys + (1 << 20), f"the workspace took {grown} bytes for {keys} of keys"
    assert_fully_written(case.out, repr(case))
    assert_equal_reference(case, case.out)


def test_context_131072_mass_ties(cuda_backend, select_path):
    case = _one_request(2, 131072, [131071, 100000], seed=8, sparse=True, name="ctx128k_ties")
    out = run_cuda(case)
    assert_equal_reference(case, out)


def test_duplicate_pages_long_context(cuda_backend, select_path):
    """64 logical pages mapped onto 5 physical ones: every score appears many times."""
    pages = [p % 5 for p in range(64)]
    case = _one_request(
        2, 64 * KV_PAGE, [64 * KV_PAGE - 1, 20000], seed=9, pages=pages, name="dups"
    )
    out = run_cuda(case)
    assert_equal_reference(case, out)
    check_rows(case, out, exact=True, limit=2)


@pytest.mark.parametrize("R", [16, 33, 44, 64])
def test_rows_of_2_to_8_ctas_exact(cuda_backend, select_path, R):
    """Rows of 2 to 8 CTAs over a resident table of 64 pages (on 132 SMs: R = 64 takes 2 CTAs
    per row, 44 takes 3, 33 takes 4, 16 takes 8), with holes, short rows and invalid requests
    among them: bit-exact with the reference."""
    case = testing.random_select_case(R, 5, 64, 300, device=DEVICE, seed=40 + R, integer=True)
    out = run_cuda(case)
    assert_equal_reference(case, out)
    check_rows(case, out, exact=True, limit=4)


def test_rows_of_2_ctas_mass_ties(cuda_backend, select_path):
    """Mass ties in rows of 2 CTAs: the bins overflow the fast path's buffer and the row's last
    CTA runs the generic path over the keys of both."""
    positions = [32767 - 300 * r for r in range(64)]
    case = _one_request(64, 32768, positions, seed=13, sparse=True, name="ties_2_ctas")
    out = run_cuda(case)
    assert_equal_reference(case, out)


def test_prefill_chunk_2048_rows(cuda_backend):
    """A prefill chunk: 2,048 rows of one request at consecutive positions."""
    start = 6000
    case = _one_request(2048, 8048, list(range(start, start + 2048)), seed=11, name="prefill2048")
    out = run_cuda(case)
    assert_equal_reference(case, out)
    check_rows(case, out, exact=True, limit=4)


@pytest.mark.parametrize("R, B, M, P", [(256, 8, 16, 100), (129, 3, 40, 64), (256, 64, 64, 4096)])
def test_many_rows_many_requests(cuda_backend, select_path, R, B, M, P):
    case = testing.random_select_case(R, B, M, P, device=DEVICE, seed=R + M, integer=True)
    out = run_cuda(case)
    assert_equal_reference(case, out)
    check_rows(case, out, exact=True, limit=6)


def test_zero_rows(cuda_backend):
    case = testing.random_select_case(0, 2, 4, 8, device=DEVICE, seed=1, integer=True)
    out = qsa_ops.select_paged_tokens(*case.args())
    assert out.shape == (0, qsa_ops.WIDTH)


@pytest.mark.parametrize("seed", range(12))
def test_random_bad_values_exact(cuda_backend, select_path, seed):
    """Random shapes with invalid request ids, page ids -1 / >= P, negative lengths and
    positions past the length: bit-exact with the reference."""
    gen = torch.Generator().manual_seed(seed)
    R, B, M, P = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in
                  ((1, 40), (1, 6), (1, 12), (1, 30)))  # fmt: skip
    case = testing.random_select_case(R, B, M, P, device=DEVICE, seed=seed, integer=True)
    out = run_cuda(case)
    assert_equal_reference(case, out)
    testing.check_selection(case, out, exact=True)


@pytest.mark.parametrize("seed", range(6))
def test_random_data_valid_topk(cuda_backend, seed):
    case = testing.random_select_case(16, 3, 12, 40, device=DEVICE, seed=100 + seed)
    out = run_cuda(case)
    testing.check_selection(case, out, exact=False)


@pytest.mark.parametrize(
    "R, B, M, P, seed",
    [(1, 1, 5, 8, 21), (1, 1, 256, 300, 22), (8, 2, 64, 160, 23), (64, 4, 16, 80, 24)],
)
def test_fast_path_equals_generic_on_random_data(cuda_backend, monkeypatch, R, B, M, P, seed):
    """Both paths rank the same stored keys, so on random float data (where the fast path runs
    and the order is non-trivial) they must agree bit for bit."""
    case = testing.random_select_case(
        R, B, M, P, device=DEVICE, seed=seed, integer=False, bad_values=False
    )
    fast, generic = _auto_then_generic(case, monkeypatch)
    assert torch.equal(fast, generic), (fast != generic).nonzero()[:4].tolist()
    check_rows(case, fast, exact=False, limit=4)


def _auto_then_generic(case, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection of ``case`` on the path the library picks, then (out poisoned again) on
    the generic path forced by QSA_SELECT_PATH."""
    monkeypatch.setenv("QSA_SELECT_PATH", "auto")
    auto = run_cuda(case).clone()
    case.out.fill_(testing.POISON_INT32)
    monkeypatch.setenv("QSA_SELECT_PATH", "generic")
    return auto, run_cuda(case)


def _pairs_case(R: int, positions: list[int], seed: int, integer: bool) -> testing.SelectCase:
    """R rows of one request on a 40-page table (5,120 blocks: no streamed row), at the given
    query positions."""
    gen = torch.Generator().manual_seed(seed)
    return testing.random_select_case(
        R, 1, 40, 48, device=DEVICE, seed=seed, integer=integer, bad_values=False,
        page_table=[torch.randperm(48, generator=gen)[:40].tolist()], token_to_req=[0] * R,
        query_positions=positions, sequence_lengths=[20480], name=f"pairs_R{R}",
    )  # fmt: skip


# Rows of a launch of at most 4 rows take the pairs select (every CTA ranks its share of the
# blocks) when the row has at most ceil(blocks / CTAs) * blocks <= 65,536 compares per CTA; the
# others take the last-CTA select in the same launch. At R = 1 (132 SMs: up to 2,904 blocks),
# R = 3 (44 CTAs: 1,680) and R = 4 (33 CTAs: 1,440), rows on both sides of the bound, rows
# whose blocks all win, and a row with a tail only.
_PAIRS_POSITIONS = {
    1: [[9214], [11615], [11619], [1999], [2], [2050], [16383]],
    3: [[3999, 4799, 20479], [7, 2047, 5887]],
    4: [[5887, 1022, 20479, 4095], [5759, 5919, 12, 3]],
}


@pytest.mark.parametrize("R", sorted(_PAIRS_POSITIONS))
def test_pairs_select_rows_exact(cuda_backend, R):
    """Integer data (mass ties): bit-exact with the reference on both sides of the pairs
    select's bound, rows of both selects in one launch, and out rows of every alignment."""
    for k, positions in enumerate(_PAIRS_POSITIONS[R]):
        case = _pairs_case(R, positions, seed=90 + k, integer=True)
        out = run_cuda(case)
        assert_equal_reference(case, out)


@pytest.mark.parametrize("R", sorted(_PAIRS_POSITIONS))
def test_pairs_select_equals_generic_on_random_data(cuda_backend, monkeypatch, R):
    """Random float data (a non-trivial order, few ties): the pairs select, the last-CTA
    select and the generic path rank the same stored keys, so they agree bit for bit."""
    for k, positions in enumerate(_PAIRS_POSITIONS[R]):
        case = _pairs_case(R, positions, seed=95 + k, integer=False)
        auto, generic = _auto_then_generic(case, monkeypatch)
        assert torch.equal(auto, generic), (positions, (auto != generic).nonzero()[:4].tolist())
        check_rows(case, auto, exact=False, limit=4)


def test_pairs_select_counters_across_calls(cuda_backend):
    """The pairs select's row counters are never reset (each call adds one epoch): launches of
    132, 44 and 33 CTAs per row and of the last-CTA select (R = 8) interleaved on one stream
    give each call's first result bit for bit, many times over."""
    cases = [
        _pairs_case(1, [9214], seed=101, integer=False),
        _pairs_case(3, [3999, 100, 2999], seed=102, integer=False),
        _pairs_case(4, [1022, 5000, 4095, 3], seed=103, integer=False),
        _pairs_case(8, [9214, 1022, 20479, 4095, 3, 5000, 2999, 100], seed=104, integer=False),
    ]

    def call(case: testing.SelectCase) -> torch.Tensor:
        testing.poison_(case.out)
        return qsa_ops.select_paged_tokens(*case.args())

    firsts = [call(case).clone() for case in cases]
    for case, first in zip(cases, firsts, strict=True):
        check_rows(case, first, exact=False)
    for round_ in range(40):
        for case, first in zip(cases, firsts, strict=True):
            assert torch.equal(call(case), first), f"round {round_}, {case!r}"


def test_select_path_knob_refuses_unknown_values(cuda_backend, monkeypatch):
    case = testing.make_select_case("full_page", 1, DEVICE)
    monkeypatch.setenv("QSA_SELECT_PATH", "fastest")
    with pytest.raises(
        RuntimeError, match="QSA_SELECT_PATH must be 'auto' or 'generic', got 'fastest'"
    ):
        qsa_ops.select_paged_tokens(*case.args())
    assert (case.out == testing.POISON_INT32).all()


def test_empty_page_table_and_no_requests(cuda_backend):
    for B, M in ((2, 0), (0, 3)):
        case = testing.random_select_case(3, B, M, 4, device=DEVICE, seed=5, integer=True)
        out = run_cuda(case)
        assert_equal_reference(case, out)


def test_refusals_on_cuda(cuda_backend):
    case = testing.make_select_case("full_page", 1, DEVICE)
    args = list(case.args())
    args[0] = case.q.float()
    with pytest.raises(TypeError, match="q"):
        qsa_ops.select_paged_tokens(*args)
    args = list(case.args())
    args[-1] = torch.empty(1, 2050, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="out"):
        qsa_ops.select_paged_tokens(*args)
    assert (case.out == testing.POISON_INT32).all()
