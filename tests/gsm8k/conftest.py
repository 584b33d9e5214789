"""Fixtures of the GSM8K gate tests: a scripted OpenAI-compatible server and the bundled answers."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# ci/ is not a package: its scripts are imported by name, as `python ci/...` would see them.
CI = Path(__file__).resolve().parents[2] / "ci"
if str(CI) not in sys.path:
    sys.path.insert(0, str(CI))

import gsm8k_gate  # noqa: E402
from gsm8k_fakes import FakeServer, Script  # noqa: E402


@pytest.fixture
def fake_server() -> Iterator[Callable[[Script], FakeServer]]:
    servers: list[FakeServer] = []

    def start(script: Script) -> FakeServer:
        server = FakeServer(script).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__(None, None, None)


@pytest.fixture(scope="session")
def bundled_answers() -> dict[str, str]:
    """Question text -> expected normalised answer, for the bundled test split."""
    problems = gsm8k_gate.load_split(gsm8k_gate.BUNDLED_DATA_DIR / "test.jsonl", "test")
    return {p.question: p.expected for p in problems}
