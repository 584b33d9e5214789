"""update_caches on the GPU: bit-exact against the independent numpy rule, chunking
invariance, padded rows, CUDA-graph replay and the launch count of the CUDA kernel."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import DEVICE
from torch.profiler import ProfilerActivity, profile

from custom_esimd_kernels_vllm.qsa_ops import ops, testing, update_caches

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T", [1, 8, 64, 300, 4099])
@pytest.mark.parametrize("every_row", [False, True])
def test_update_bit_exact(cuda_backend, T, every_row):
    case = testing.make_update_case(T, DEVICE, seed=T, every_row=every_row)
    run = case.clone()
    update_caches(*run.args())
    torch.cuda.synchronize()
    testing.check_update(case.to("cpu"), run.kv_cache, run.compressed_key_cache)


def test_update_matches_cpu_reference_bitwise(cuda_backend):
    case = testing.make_update_case(777, "cpu", seed=11)
    cpu, gpu = case.clone(), case.to(DEVICE)
    update_caches(*cpu.args())
    update_caches(*gpu.args())
    torch.cuda.synchronize()
    assert torch.equal(gpu.kv_cache.cpu().view(torch.int16), cpu.kv_cache.view(torch.int16))
    assert torch.equal(
        gpu.compressed_key_cache.cpu().view(torch.int16),
        cpu.compressed_key_cache.view(torch.int16),
    )


def test_update_unaligned_inputs(cuda_backend):
    """key/value with a storage offset that breaks 16-byte alignment (the scalar path)."""
    case = testing.make_update_case(33, DEVICE, seed=2)
    wide = torch.empty(33 * 256 + 1, dtype=torch.float16, device=DEVICE)
    key = wide[1:].view(33, 256)
    key.copy_(case.key)
    odd = testing.UpdateCase("unaligned", key, *case.args()[1:])
    run = odd.clone()
    update_caches(*run.args())
    torch.cuda.synchronize()
    testing.check_update(odd.to("cpu"), run.kv_cache, run.compressed_key_cache)


def test_chunking_invariance_on_gpu(cuda_backend):
    gen = torch.Generator().manual_seed(3)
    length = 1100
    key = torch.randn(length, 256, generator=gen).half().to(DEVICE)
    value = torch.randn(length, 256, generator=gen).half().to(DEVICE)
    wk = (torch.randn(128, 256, generator=gen) * 0.1).to(DEVICE)
    kv0 = torch.randn(4, 512, 512, generator=gen).half().to(DEVICE)
    ck0 = torch.randn(5, 128, 1, 128, generator=gen).half().to(DEVICE)
    results = []
    for chunks in ([1100], [513, 587], [1] * 9 + [1091], [511, 2, 587]):
        kv, ck = kv0.clone(), ck0.clone()
        start = 0
        for size in chunks:
            pos = range(start, start + size)
            slots, ck_slots = testing.update_slots(pos, [3, 0, 2], [1, 4, 0])
            update_caches(
                key[start : start + size],
                value[start : start + size],
                torch.tensor(slots, dtype=torch.int64, device=DEVICE),
                torch.tensor(ck_slots, dtype=torch.int64, device=DEVICE),
                wk,
                kv,
                ck,
            )
            start += size
        torch.cuda.synchronize()
        results.append((kv.view(torch.int16).cpu(), ck.view(torch.int16).cpu()))
    for kv, ck in results[1:]:
        assert torch.equal(kv, results[0][0]) and torch.equal(ck, results[0][1])


def test_update_graph_replay(cuda_backend):
    case = testing.make_update_case(64, DEVICE, seed=5)
    expected = case.clone()
    update_caches(*expected.args())
    run = case.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        update_caches(*case.clone().args())  # warm-up on the capture stream
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        update_caches(*run.args())
    for _ in range(3):
        run.kv_cache.copy_(case.kv_cache)
        run.compressed_key_cache.copy_(case.compressed_key_cache)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(run.kv_cache, expected.kv_cache)
        assert torch.equal(run.compressed_key_cache, expected.compressed_key_cache)


def test_update_launch_count(cuda_backend):
    """Two kernels (K/V rows, then compressed keys), no device-to-host copy."""
    case = testing.make_update_case(64, DEVICE, seed=6)
    update_caches(*case.args())
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        update_caches(*case.args())
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e.name for e in events if not any(w in e.name.lower() for w in ("memcpy", "memset"))]
    copies = [e.name for e in prof.events() if "dtoh" in e.name.lower().replace(" ", "")]
    assert len(kernels) == ops.launch_counts(64, 1)["update_caches"] == 2, kernels
    assert not copies, f"device-to-host copies: {copies}"


def test_opcheck_update_cuda(cuda_backend):
    case = testing.make_update_case(10, DEVICE, seed=8)
    torch.library.opcheck(torch.ops.qsa.update_caches.default, case.args())
