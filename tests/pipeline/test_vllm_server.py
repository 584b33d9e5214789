"""ci/vllm_server.py's shutdown rules without a server: drain flag, leftover detection."""

from __future__ import annotations

import importlib.util
import os
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "qsa_vllm_server_rules", ROOT / "ci" / "vllm_server.py"
)
server = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server)


def test_the_server_drains_on_sigterm_and_is_killed_only_after_that():
    args = list(server.DEFAULT_ARGS)
    assert args[args.index("--shutdown-timeout") + 1] == str(server.SHUTDOWN_TIMEOUT_S)
    assert server.SHUTDOWN_TIMEOUT_S > 0  # vLLM's default 0 aborts and leaks its workers' shm
    assert server.VLLMServer("x").grace > server.SHUTDOWN_TIMEOUT_S


@pytest.mark.skipif(not server.SHM.is_dir(), reason="no /dev/shm on this host")
def test_an_unheld_vllm_segment_is_a_leftover_and_a_held_one_is_not():
    path = server.SHM / f"vllm_qsa_test_{uuid.uuid4().hex}"
    path.write_bytes(b"x")
    try:
        assert str(path) in server.vllm_shm()
        assert server.orphaned({str(path)}) == {str(path)}
        fd = os.open(path, os.O_RDONLY)  # held by a live process (this one): not a leftover
        try:
            assert server.orphaned({str(path)}) == set()
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    assert server.orphaned({str(path)}) == set()  # gone: nothing left


def test_a_server_that_never_started_stops_cleanly(tmp_path):
    s = server.VLLMServer(tmp_path)
    s.stop()  # no process, no workdir: nothing to clean, nothing raised
    assert s.proc is None and not Path(tmp_path / "server.log").exists()
