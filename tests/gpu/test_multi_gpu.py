"""Two GPUs: every operator launches on its tensors' device whatever the current device is
(eager and inside a CUDA graph captured on cuda:1), with per-device workspaces; mixed devices
are refused with the contract's message; two threads driving two GPUs agree with one thread;
and the TP=2 check (tests/gpu/tp2_check.py under torchrun, NCCL) composes the per-rank contract.

Skipped, saying so, where fewer than two CUDA devices are visible.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path

import pytest
import torch

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import testing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2,
        reason=f"needs 2 CUDA devices, {torch.cuda.device_count()} visible",
    ),
]
ROOT = Path(__file__).resolve().parents[2]
CALLS = 1000


OPS = ["select_paged_tokens", "sparse_paged_attention"]


def _cases(device: str):
    """One case of each operator on ``device`` (identical data on every device)."""
    sel = testing.make_select_case("p8192_saturated", 2, device, seed=7)
    att = testing.random_attention_case(3, 2, 6, 9, device=device, seed=7, valid_fraction=0.8)
    return {
        "select_paged_tokens": (qsa_ops.select_paged_tokens, sel.args(), sel.out),
        "sparse_paged_attention": (qsa_ops.sparse_paged_attention, att.args(), att.out),
    }


def _run(fn, args, out) -> torch.Tensor:
    testing.poison_(out)
    fn(*args)
    return out.clone()


@pytest.mark.parametrize("op", OPS)
def test_runs_on_its_tensors_device(cuda_backend, op):
    torch.cuda.set_device(0)
    fn, args, out = _cases("cuda:0")[op]
    want = _run(fn, args, out).cpu()
    fn1, args1, out1 = _cases("cuda:1")[op]
    got = _run(fn1, args1, out1)
    assert torch.cuda.current_device() == 0, "the call changed the current device"
    torch.cuda.synchronize(1)
    assert got.device == torch.device("cuda:1")
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("op", OPS)
def test_graph_captured_on_the_second_device(cuda_backend, op):
    torch.cuda.set_device(0)
    fn, args, out = _cases("cuda:0")[op]
    want = _run(fn, args, out).cpu()
    fn1, args1, out1 = _cases("cuda:1")[op]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(1):
        fn1(*args1)  # warm the cuda:1 workspace of this stream
        stream = torch.cuda.Stream()
        with torch.cuda.graph(graph, stream=stream):
            fn1(*args1)
    assert torch.cuda.current_device() == 0
    for _ in range(20):
        testing.poison_(out1)
        graph.replay()
    torch.cuda.synchronize(1)
    assert torch.equal(out1.cpu(), want)


@pytest.mark.parametrize("op", ["select_paged_tokens", "sparse_paged_attention"])
def test_mixed_devices_refused(cuda_backend, op):
    fn, args, out = _cases("cuda:1")[op]
    args = list(args)
    index = 3 if op == "select_paged_tokens" else 4  # token_to_req / page_table
    name = "token_to_req" if op == "select_paged_tokens" else "page_table"
    args[index] = args[index].to("cuda:0")
    testing.poison_(out)
    with pytest.raises(ValueError, match=f"^{name} must be on the same device as q \\(cuda:1\\), "):
        fn(*args)
    assert (out.isnan() if out.is_floating_point() else out == testing.POISON_INT32).all()


def test_two_threads_two_devices(cuda_backend):
    """Each thread drives one GPU (its own current device and stream) for CALLS calls of each
    operator; every output equals the single-threaded result."""
    expected = {}
    for dev in ("cuda:0", "cuda:1"):
        for op, (fn, args, out) in _cases(dev).items():
            expected[dev, op] = _run(fn, args, out).cpu()
    errors: list[str] = []

    def drive(dev: str) -> None:
        try:
            torch.cuda.set_device(dev)
            cases = _cases(dev)
            with torch.cuda.stream(torch.cuda.Stream()):
                for i in range(CALLS):
                    for op, (fn, args, out) in cases.items():
                        fn(*args)
                        if i % 100 == 99:
                            torch.cuda.current_stream().synchronize()
                            if not torch.equal(out.cpu(), expected[dev, op]):
                                errors.append(f"{dev} {op}: call {i} differs")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"{dev}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=drive, args=(d,)) for d in ("cuda:0", "cuda:1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_tp2_nccl(tmp_path):
    """tests/gpu/tp2_check.py on 2 GPUs (NCCL): the sharded block equals the one-device run
    within the contract's tolerance; its record names commit and DSO SHA256."""
    spec = importlib.util.spec_from_file_location(
        "tp2_check", ROOT / "tests" / "gpu" / "tp2_check.py"
    )
    tp2 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tp2)
    record = tmp_path / "tp2.json"
    for res in tp2.spawn("cuda", record, timeout=120):
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(record.read_text())
    assert result["passed"], result
