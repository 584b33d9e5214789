"""A stream of a CUDA green context (an SM partition of the device), and the graph check on it.

``green_stream(sms)`` makes the green context with the CUDA driver's own API (ctypes), so that
the GPU suite needs no binding package; ``torch_green_stream(sms)`` with torch's own
``torch.cuda.GreenContext`` (what a user of torch would take). Both raise ``Unsupported`` (the
test skips with the reason) where the driver, the device or torch has no green contexts.

    python tests/gpu/green_ctx.py --sms 16 [--api torch]

runs the graph check (what test_partitioned_gpu.py runs in a child process, so that a replay
that never finishes fails one test instead of stopping the suite): both ops captured into one
CUDA graph on the partition's stream, replayed from poisoned outputs, every replay equal to
the eager result on the same stream and the selection to the reference. Prints one JSON line
and exits 0 when the check passes, 1 when a result differs, 3 when a replay does not finish.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import torch

CU_DEV_RESOURCE_TYPE_SM = 1
CU_GREEN_CTX_DEFAULT_STREAM = 1
CU_STREAM_NON_BLOCKING = 1
CUDA_ERROR_NOT_SUPPORTED = 801
REPLAYS = 20
REPLAY_DEADLINE_S = 60.0


class Unsupported(RuntimeError):
    """The driver or the device has no green contexts."""


class _SmResource(ctypes.Structure):
    """CUdevResource of cuda.h (resource ABI version 1: 144 bytes), its SM fields."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("_internal_padding", ctypes.c_ubyte * 92),
        ("sm_count", ctypes.c_uint),
        ("min_partition_size", ctypes.c_uint),
        ("coscheduled_alignment", ctypes.c_uint),
        ("_oversize", ctypes.c_ubyte * 36),
    ]


class _Driver:
    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise Unsupported(
                f"no CUDA driver library to make a green context with: {exc}"
            ) from exc

    def __call__(self, name: str, *args) -> None:
        fn = getattr(self.lib, name, None)
        if fn is None:
            raise Unsupported(f"the CUDA driver has no {name} (green contexts need a 12.4+ driver)")
        rc = fn(*args)
        if rc == CUDA_ERROR_NOT_SUPPORTED:
            raise Unsupported(f"{name}: green contexts are not supported on this device")
        if rc != 0:
            raise RuntimeError(f"{name} returned CUresult {rc}")


@contextlib.contextmanager
def green_stream(sms: int, device: str = "cuda"):
    """(torch stream of a green context of about ``sms`` SMs, its SM count); the driver rounds
    the request up to its partition granularity."""
    torch.zeros(1, device=device)  # the primary context exists and is current
    cu = _Driver()
    dev = ctypes.c_int()
    cu("cuDeviceGet", ctypes.byref(dev), torch.cuda.current_device())
    whole = _SmResource()
    cu("cuDeviceGetDevResource", dev, ctypes.byref(whole), CU_DEV_RESOURCE_TYPE_SM)
    total = torch.cuda.get_device_properties(device).multi_processor_count
    if whole.sm_count != total:
        raise RuntimeError(f"CUdevResource layout: read {whole.sm_count} SMs, not {total}")
    part, rest, groups = _SmResource(), _SmResource(), ctypes.c_uint(1)
    cu(
        "cuDevSmResourceSplitByCount",
        ctypes.byref(part),
        ctypes.byref(groups),
        ctypes.byref(whole),
        ctypes.byref(rest),
        0,
        sms,
    )
    if groups.value != 1 or not 0 < part.sm_count < total:
        raise RuntimeError(f"split of {sms} SMs: {groups.value} groups of {part.sm_count}")
    desc, ctx, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    cu("cuDevResourceGenerateDesc", ctypes.byref(desc), ctypes.byref(part), 1)
    cu("cuGreenCtxCreate", ctypes.byref(ctx), desc, dev, CU_GREEN_CTX_DEFAULT_STREAM)
    try:
        cu("cuGreenCtxStreamCreate", ctypes.byref(stream), ctx, CU_STREAM_NON_BLOCKING, 0)
        try:
            yield torch.cuda.ExternalStream(stream.value), int(part.sm_count)
            torch.cuda.synchronize()
        finally:
            cu("cuStreamDestroy_v2", stream)
    finally:
        cu("cuGreenCtxDestroy", ctx)


@contextlib.contextmanager
def torch_green_stream(sms: int, device: str = "cuda"):
    """(the stream of a ``torch.cuda.GreenContext`` of ``sms`` SMs, ``sms``)."""
    from torch.cuda import green_contexts

    if not getattr(green_contexts, "SUPPORTED", False):
        raise Unsupported(f"torch {torch.__version__} was built without green contexts")
    torch.zeros(1, device=device)
    ctx = green_contexts.GreenContext.create(num_sms=sms, device_id=torch.cuda.current_device())
    yield ctx.Stream(), sms
    torch.cuda.synchronize()


def on_stream(stream, call):
    """call() on ``stream``, ordered after the default stream's work and waited for."""
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        result = call()
    stream.synchronize()
    return result


def _wait(stream, what: str) -> None:
    """Wait for ``stream`` with a deadline: a replay whose CTAs wait for CTAs that never
    become resident does not finish."""
    done = torch.cuda.Event()
    done.record(stream)
    start = time.monotonic()
    while not done.query():
        if time.monotonic() - start > REPLAY_DEADLINE_S:
            print(json.dumps({"ok": False, "hung": what}), flush=True)
            os._exit(3)  # the kernels still run: no clean-up can finish
        time.sleep(0.001)


def graph_check(sms: int, api: str = "driver") -> dict:
    """Both ops captured into one graph on a partition's stream, replayed REPLAYS times."""
    from gpu_helpers import DEVICE, distributed_row_case, reference_select

    from custom_esimd_kernels_vllm import qsa_ops
    from custom_esimd_kernels_vllm.qsa_ops import testing

    make = torch_green_stream if api == "torch" else green_stream
    with make(sms) as (stream, got):
        selects = [
            distributed_row_case(),
            testing.make_select_case("p8192_saturated", 1, DEVICE, seed=6),
        ]
        attentions = [
            testing.random_attention_case(R, 3, 8, 16, device=DEVICE, seed=R, valid_fraction=0.8)
            for R in (1, 8)
        ]

        def step():
            for c in selects:
                qsa_ops.select_paged_tokens(*c.args())
            for c in attentions:
                qsa_ops.sparse_paged_attention(*c.args())

        outs = [c.out for c in selects + attentions]
        on_stream(stream, step)  # warm-up: the stream's workspace, the eager results
        eager = [o.clone() for o in outs]
        for c, o in zip(selects, eager[: len(selects)], strict=True):
            if not torch.equal(o, reference_select(c)):
                return {"ok": False, "sms": got, "differs": f"eager {c!r} from the reference"}
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            step()
        for i in range(REPLAYS):
            with torch.cuda.stream(stream):
                for o in outs:
                    testing.poison_(o)
                graph.replay()
            _wait(stream, f"replay {i} on {got} SMs")
            for k, (o, e) in enumerate(zip(outs, eager, strict=True)):
                if not torch.equal(o, e):
                    return {"ok": False, "sms": got, "differs": f"replay {i}, output {k}"}
        return {"ok": True, "sms": got, "replays": REPLAYS, "outputs": len(outs)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sms", type=int, required=True, help="SMs of the partition")
    parser.add_argument(
        "--api",
        choices=("driver", "torch"),
        default="driver",
        help="who makes the green context: the driver (ctypes) or torch",
    )
    args = parser.parse_args()
    # the suite's helpers sit beside this file; the pipeline runs with PYTHONSAFEPATH set, so
    # the script's own folder is not on the path by itself
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        result = graph_check(args.sms, args.api)
    except Unsupported as exc:
        result = {"ok": True, "skipped": str(exc)}
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
