"""End to end: real vLLM OpenAI servers serving the tiny QSA checkpoint (``nox -s e2e``).

Four server lives collect every answer first (``served``); the tests then compare them:

* A, vLLM's default compilation mode, one-shot prefill (--max-num-batched-tokens 4096):
  first answers, a concurrent batch, a prefix-cache hit (asserted from /metrics), malformed
  requests, clean shutdown;
* B, eager (--enforce-eager), one-shot, no prefix caching, a tiny KV space (6 usable
  pages), restarted through the overlay alone: every prompt again, one by one (compiled ==
  eager, and the uncached answers), then four concurrent prompts that cannot all stay
  resident (preemption, asserted from /metrics, == the same prompts one by one);
* C, eager, forced chunked prefill (--max-num-batched-tokens 64): every prompt (chunked ==
  one-shot);
* D, TP=2 in the default mode: == the dense and the QSA references.

Short prompts == dense transformers Qwen3; the 2100-token prompt (truly sparse) == the
pure-PyTorch QSA reference model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

pytest.importorskip("vllm", reason="the E2E suite runs in a vLLM environment (nox -s e2e)")

from client import MODEL, greedy, greedy_concurrently, prompt  # noqa: E402
from servers import QSAServer, metric  # noqa: E402
from vllm_server import VLLMServerError, _group_alive  # noqa: E402

from custom_esimd_kernels_vllm.qsa_ops.contract import WIDTH  # noqa: E402

# NOTES: rows of at most WIDTH = 2051 visible tokens keep every token (dense-equivalent);
# 1100 crosses two KV pages; 2100 + 8 new tokens makes the last rows drop up to 14 blocks.
SHORT = (3, 61, 517, 1100)
LONG = (2100,)
SERVER_TIMEOUT = float(os.environ.get("QSA_E2E_SERVER_TIMEOUT", "600"))
ONE_SHOT = ("--max-num-batched-tokens", "4096")  # every prompt here prefills in one step
CHUNK = 64
# 7 blocks of 512 tokens (block 0 is vLLM's null block): four 1020-token prompts prefilled
# in one step take 2 pages each (three fit) and need a third at their 1025th token, so a
# running request must be preempted.
TINY_KV = ("--num-gpu-blocks-override", "7", "--max-model-len", "2304")
PREEMPT_PROMPTS = 4
PREEMPT_LENGTH = 1020
PREFIX_HIT = "vllm:prefix_cache_hits_total"
PREEMPTIONS = "vllm:num_preemptions_total"


@dataclass
class Served:
    prompts: dict[int, list[int]]
    first: dict[int, list[int]] = field(default_factory=dict)
    batch: list[list[int]] = field(default_factory=list)
    batch_lengths: tuple[int, ...] = ()
    malformed: dict[str, int] = field(default_factory=dict)
    after_malformed: list[int] = field(default_factory=list)
    restart: dict[int, list[int]] = field(default_factory=dict)
    shutdown: dict[str, object] = field(default_factory=dict)
    shared_prefix: list[int] = field(default_factory=list)  # 1024 tokens of prompts[1100] + 60
    prefix: dict[str, object] = field(default_factory=dict)
    eager: dict[str, list[int]] = field(default_factory=dict)  # B, keyed like _all_prompts
    chunked: dict[str, list[int]] = field(default_factory=dict)  # C
    preempt: dict[str, object] = field(default_factory=dict)


def _all_prompts(run: Served) -> dict[str, list[int]]:
    named = {str(n): ids for n, ids in run.prompts.items()}
    named["shared_prefix"] = run.shared_prefix
    for i in range(PREEMPT_PROMPTS):
        named[f"preempt{i}"] = prompt(PREEMPT_LENGTH, seed=10 + i)
    return named


def _malformed(url: str) -> dict[str, int]:
    completions = f"{url}/v1/completions"
    good = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0.0}
    cases = {
        "body is not JSON": {"data": b"{not json", "headers": {"Content-Type": "application/json"}},
        "no prompt": {"json": {"model": MODEL, "max_tokens": 2}},
        "token id out of vocabulary": {"json": {**good, "prompt": [5, 10**7]}},
        "prompt longer than max_model_len": {"json": {**good, "prompt": [5] * 5000}},
        "negative max_tokens": {"json": {**good, "max_tokens": -3}},
        "temperature not a number": {"json": {**good, "temperature": "hot"}},
        "unknown model": {"json": {**good, "model": "no-such-model"}},
    }
    return {
        name: requests.post(completions, timeout=60, **kwargs).status_code
        for name, kwargs in cases.items()
    }


@pytest.fixture(scope="module")
def served(tiny_model) -> Served:
    run = Served(prompts={n: prompt(n, seed=0) for n in SHORT + LONG})
    run.shared_prefix = run.prompts[1100][:1024] + prompt(60, seed=5)
    named = _all_prompts(run)
    # A: default compilation mode, one-shot prefill
    server = QSAServer(tiny_model, timeout=SERVER_TIMEOUT, extra_args=ONE_SHOT)
    with server as url:
        run.first = {n: greedy(url, ids) for n, ids in run.prompts.items()}
        run.batch_lengths = (*SHORT, 61)  # one prompt twice in the same batch
        run.batch = greedy_concurrently(url, [run.prompts[n] for n in run.batch_lengths])
        hits = metric(url, PREFIX_HIT)
        run.prefix["repeat"] = greedy(url, run.prompts[1100])  # its 2 whole pages are cached
        run.prefix["shared"] = greedy(url, run.shared_prefix)  # the same 2 pages again
        run.prefix["hits"] = metric(url, PREFIX_HIT) - hits
        run.malformed = _malformed(url)
        run.after_malformed = greedy(url, run.prompts[61])
        workdir, pgid = server.workdir, server.proc.pid
    # QSAServer.stop() raised already if anything survived; check again independently
    run.shutdown = {
        "temporary directory left": workdir.exists(),
        "process group alive": _group_alive(pgid),
        "shared memory left": sorted(p for p in server.shared_memory if Path(p).exists()),
        "server used shared memory": bool(server.shared_memory),
    }
    # B: eager, one-shot, no prefix caching. NOTES: nox -s e2e patched this vLLM with the
    # overlay (QSA_E2E_OVERLAY=1); this restarted server then loads no plugin, so the overlay
    # alone must provide the same model.
    overlay_only = {"VLLM_PLUGINS": ""} if os.environ.get("QSA_E2E_OVERLAY") == "1" else {}
    eager_args = [*ONE_SHOT, "--no-enable-prefix-caching", *TINY_KV]
    with QSAServer(
        tiny_model, eager=True, timeout=SERVER_TIMEOUT, env=overlay_only, extra_args=eager_args
    ) as url:
        run.eager = {name: greedy(url, ids) for name, ids in named.items()}
        preempted = metric(url, PREEMPTIONS)
        names = [f"preempt{i}" for i in range(PREEMPT_PROMPTS)]
        answers = greedy_concurrently(url, [named[n] for n in names])
        run.preempt = {
            "answers": dict(zip(names, answers, strict=True)),
            "preemptions": metric(url, PREEMPTIONS) - preempted,
        }
    # C: eager, forced chunked prefill
    chunked_args = ["--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "8"]
    with QSAServer(tiny_model, eager=True, timeout=SERVER_TIMEOUT, extra_args=chunked_args) as url:
        run.chunked = {str(n): greedy(url, ids) for n, ids in run.prompts.items()}
    return run


def test_deterministic_across_requests(served):
    for length, ids in zip(served.batch_lengths, served.batch, strict=True):
        assert ids == served.first[length], f"prompt of {length} tokens: batch != first request"
    assert served.after_malformed == served.first[61]


def test_compiled_equals_eager(served):
    """A (default compilation mode) == B (--enforce-eager, restarted, overlay alone)."""
    for length, ids in served.first.items():
        assert served.eager[str(length)] == ids, f"prompt of {length} tokens: compiled != eager"


def test_chunked_prefill_equals_one_shot(served):
    """C (64-token prefill chunks) == B (one-shot prefill)."""
    for name, ids in served.chunked.items():
        assert ids == served.eager[name], f"prompt of {name} tokens: chunked != one-shot"
    assert any(int(name) > CHUNK for name in served.chunked)


def test_prefix_cache_hit_gives_the_same_tokens(served):
    # two requests, each reusing the 2 whole 512-token pages of prompts[1100]
    assert served.prefix["hits"] >= 2 * 1024, f"prefix-cache hits: {served.prefix['hits']}"
    assert served.prefix["repeat"] == served.first[1100]
    assert served.prefix["shared"] == served.eager["shared_prefix"]  # B caches nothing


def test_preemption_gives_the_same_tokens(served):
    assert served.preempt["preemptions"] >= 1, "no request was preempted"
    for name, ids in served.preempt["answers"].items():
        assert ids == served.eager[name], f"{name}: preempted != one by one"


def test_concurrent_batch_equals_one_by_one(served):
    got = dict(zip(served.batch_lengths, served.batch, strict=True))
    assert got == {n: served.first[n] for n in served.batch_lengths}


def test_short_prompts_equal_dense_reference(served, tiny_model):
    from dense_reference import DenseReference

    dense = DenseReference(tiny_model)
    for length in SHORT:
        expected = dense.generate(served.prompts[length], len(served.first[length]))
        assert served.first[length] == expected, f"prompt of {length} tokens differs from dense"


def test_long_prompts_equal_qsa_reference(served, tiny_model):
    from custom_esimd_kernels_vllm.vllm.reference_model import QSAReferenceModel

    model = QSAReferenceModel(tiny_model)
    for length in LONG:
        expected = model.generate(served.prompts[length], len(served.first[length]))
        # the last row saw more than WIDTH tokens and kept exactly WIDTH: truly sparse
        assert length + len(expected) - 1 > WIDTH
        assert int((model.last_selected >= 0).sum()) == WIDTH
        assert served.first[length] == expected, (
            f"prompt of {length} tokens differs from QSA reference"
        )


def test_long_prompts_equal_independent_sparse_reference(served, tiny_model):
    """The same answers from transformers' Qwen3 with QSA attention written from the docs
    alone (tests/e2e/dense_reference.py shares no code with the integration)."""
    from dense_reference import SparseReference

    model = SparseReference(tiny_model)
    for length in LONG:
        expected = model.generate(served.prompts[length], len(served.first[length]))
        assert model.last_row_tokens() == WIDTH  # the last row kept exactly 2051 tokens
        assert served.first[length] == expected, f"prompt of {length} tokens differs"


def test_malformed_requests_get_4xx(served):
    bad = {name: code for name, code in served.malformed.items() if not 400 <= code < 500}
    assert not bad, f"malformed requests not answered with 4xx: {bad}"


def test_clean_shutdown(served):
    assert served.shutdown == {
        "temporary directory left": False,
        "process group alive": False,
        "shared memory left": [],
        "server used shared memory": served.shutdown["server used shared memory"],
    }


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP=2 on CPU needs one core per rank")
def test_tensor_parallel_2_matches_references(tiny_model_tp2):
    """6 query / 2 KV / 8 indexer heads at TP=2: each rank is exactly the operator contract."""
    from dense_reference import DenseReference

    from custom_esimd_kernels_vllm.vllm.reference_model import QSAReferenceModel

    prompts = {n: prompt(n, seed=1) for n in (61, 517)}
    server = QSAServer(
        tiny_model_tp2,
        timeout=SERVER_TIMEOUT,
        extra_args=["--tensor-parallel-size", "2"],
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},  # one core per rank
    )
    got: dict[int, list[int]] = {}
    shutdown_error = None
    try:
        with server as url:
            got = {n: greedy(url, ids) for n, ids in prompts.items()}
    except VLLMServerError as exc:  # an unclean shutdown: still check the answers first
        if len(got) != len(prompts):
            raise
        shutdown_error = exc
    dense = DenseReference(tiny_model_tp2)
    for length, ids in prompts.items():
        assert got[length] == dense.generate(ids, len(got[length])), f"TP=2, {length} tokens"
    qsa = QSAReferenceModel(tiny_model_tp2)
    assert got[61] == qsa.generate(prompts[61], len(got[61]))
    if shutdown_error is not None:
        raise shutdown_error
