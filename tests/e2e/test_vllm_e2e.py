"""End to end: a real vLLM OpenAI server serving the tiny QSA checkpoint (``nox -s e2e``).

One server life per checkpoint collects every answer first (``served``); the tests then
compare them: determinism across requests and restarts, concurrent batch == one by one,
short prompts == dense transformers Qwen3, long (truly sparse) prompts == the pure-PyTorch
QSA reference model, 4xx for malformed requests, clean shutdown; and TP=2 == references.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

pytest.importorskip("vllm", reason="the E2E suite runs in a vLLM environment (nox -s e2e)")

from client import MODEL, greedy, greedy_concurrently, prompt  # noqa: E402
from vllm_server import VLLMServer, _group_alive  # noqa: E402

from custom_esimd_kernels_vllm.qsa_ops.contract import WIDTH  # noqa: E402

# NOTES: rows of at most WIDTH = 2051 visible tokens keep every token (dense-equivalent);
# 1100 crosses two KV pages; 2100 + 8 new tokens makes the last rows drop up to 14 blocks.
SHORT = (3, 61, 517, 1100)
LONG = (2100,)
SERVER_TIMEOUT = float(os.environ.get("QSA_E2E_SERVER_TIMEOUT", "600"))


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
    server = VLLMServer(tiny_model, timeout=SERVER_TIMEOUT)
    with server as url:
        run.first = {n: greedy(url, ids) for n, ids in run.prompts.items()}
        run.batch_lengths = (*SHORT, 61)  # one prompt twice in the same batch
        run.batch = greedy_concurrently(url, [run.prompts[n] for n in run.batch_lengths])
        run.malformed = _malformed(url)
        run.after_malformed = greedy(url, run.prompts[61])
        workdir, pgid = server.workdir, server.proc.pid
    # VLLMServer.stop() raised already if anything survived; check again independently
    run.shutdown = {
        "temporary directory left": workdir.exists(),
        "process group alive": _group_alive(pgid),
        "shared memory left": sorted(p for p in server.shared_memory if Path(p).exists()),
        "server used shared memory": bool(server.shared_memory),
    }
    # NOTES: nox -s e2e patched this vLLM with the overlay (QSA_E2E_OVERLAY=1); the restarted
    # server then loads no plugin, so the overlay alone must provide the same model.
    overlay_only = {"VLLM_PLUGINS": ""} if os.environ.get("QSA_E2E_OVERLAY") == "1" else {}
    with VLLMServer(tiny_model, timeout=SERVER_TIMEOUT, env=overlay_only) as url:
        run.restart = {n: greedy(url, run.prompts[n]) for n in (61, 517)}
    return run


def test_deterministic_across_requests(served):
    for length, ids in zip(served.batch_lengths, served.batch, strict=True):
        assert ids == served.first[length], f"prompt of {length} tokens: batch != first request"
    assert served.after_malformed == served.first[61]


def test_deterministic_across_restarts(served):
    for length, ids in served.restart.items():
        assert ids == served.first[length], f"prompt of {length} tokens changed after a restart"


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
    server = VLLMServer(
        tiny_model_tp2,
        timeout=SERVER_TIMEOUT,
        extra_args=["--tensor-parallel-size", "2"],
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},  # one core per rank
    )
    with server as url:
        got = {n: greedy(url, ids) for n, ids in prompts.items()}
    dense = DenseReference(tiny_model_tp2)
    for length, ids in prompts.items():
        assert got[length] == dense.generate(ids, len(got[length])), f"TP=2, {length} tokens"
    qsa = QSAReferenceModel(tiny_model_tp2)
    assert got[61] == qsa.generate(prompts[61], len(got[61]))
