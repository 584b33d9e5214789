"""`nox -s gsm8k` (ci/nox_gsm8k.py) with a stand-in for the nox session."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


class Skip(Exception):
    pass


class FakeSession:
    def __init__(self, posargs: list[str], venv_backend: str = "venv"):
        self.posargs = posargs
        self.venv_backend = venv_backend
        self.runs: list[tuple[tuple[str, ...], dict[str, Any]]] = []
        self.installs: list[tuple[str, ...]] = []
        self.logs: list[str] = []

    def run(self, *args: str, **kwargs: Any) -> None:
        self.runs.append((args, kwargs))

    def install(self, *args: str) -> None:
        self.installs.append(args)

    def log(self, message: str) -> None:
        self.logs.append(message)

    def skip(self, reason: str) -> None:
        raise Skip(reason)


class Record:
    def __init__(self) -> None:
        self.artifacts: dict[str, str] = {}
        self.details: dict[str, Any] = {}

    def artifact(self, path: Path) -> None:
        self.artifacts[str(path)] = "sha"


@pytest.fixture
def nox_gsm8k(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location(
        "nox_gsm8k_under_test", REPO / "ci" / "nox_gsm8k.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "RESULTS", tmp_path / "results")
    monkeypatch.delenv("GSM8K_GATE_ARGS", raising=False)
    monkeypatch.delenv("QSA_VLLM_PYTHON", raising=False)
    return module


def test_base_url_gates_a_running_server_with_the_release_config(nox_gsm8k) -> None:
    session = FakeSession(["--base-url", "http://gpu-runner:8000", "--threshold", "0.9"])
    nox_gsm8k.gsm8k(session)
    assert session.installs == [("-r", str(nox_gsm8k.GATE_REQUIREMENTS))]
    (args, _), *_ = session.runs
    assert args[1].endswith("gsm8k_gate.py")
    assert args[2:4] == ("--config", str(nox_gsm8k.RELEASE_CONFIG))
    assert args[4:] == ("--base-url", "http://gpu-runner:8000", "--threshold", "0.9")


def test_gate_args_from_the_environment(nox_gsm8k, monkeypatch) -> None:
    monkeypatch.setenv("GSM8K_GATE_ARGS", "--config c.json --base-url=http://h:1")
    session = FakeSession([], venv_backend="none")
    nox_gsm8k.gsm8k(session)
    assert session.installs == []  # no virtualenv: nothing installed
    assert session.runs[0][0][2:] == ("--config", "c.json", "--base-url=http://h:1")


def test_without_vllm_the_mechanics_check_is_skipped_with_the_reason(
    nox_gsm8k, monkeypatch
) -> None:
    monkeypatch.setattr(nox_gsm8k, "_has_vllm", lambda python: False)
    with pytest.raises(Skip, match="GSM8K mechanics check needs vLLM: none of these interpreters"):
        nox_gsm8k.gsm8k(FakeSession([], venv_backend="none"))


def test_a_fresh_checkout_installs_the_serving_recipe_into_the_session(
    nox_gsm8k, monkeypatch, tmp_path
) -> None:
    session = FakeSession([])
    session.bin = str(tmp_path / "bin")
    venv_python = str(tmp_path / "bin" / "python")
    installed = []

    class NoxVllm:
        @staticmethod
        def install_serving_env(s) -> None:
            installed.append(s)

    monkeypatch.setattr(nox_gsm8k, "_load", lambda name: NoxVllm)
    monkeypatch.setattr(nox_gsm8k, "_has_vllm", lambda python: python == venv_python)
    nox_gsm8k.gsm8k(session)
    assert installed == [session]
    (args, _), *_ = session.runs
    assert args[0] == venv_python and args[2] == "mechanics"


def test_mechanics_check_runs_in_the_vllm_interpreter(nox_gsm8k, monkeypatch) -> None:
    monkeypatch.setenv("QSA_VLLM_PYTHON", "vllm-env/bin/python")
    monkeypatch.setattr(nox_gsm8k, "_has_vllm", lambda python: python == "vllm-env/bin/python")
    session = FakeSession([])
    nox_gsm8k.gsm8k(session)
    (args, kwargs), *_ = session.runs
    assert args[0] == "vllm-env/bin/python" and args[1].endswith("nox_gsm8k.py")
    assert args[2:] == ("mechanics", "--out", str(nox_gsm8k.RESULTS)) and kwargs["external"]


def test_the_pipeline_runs_the_gate_in_the_e2e_steps_interpreter(nox_gsm8k, monkeypatch) -> None:
    monkeypatch.setattr(nox_gsm8k, "_has_vllm", lambda python: python == "e2e/bin/python")
    monkeypatch.setattr(nox_gsm8k, "_load", lambda name: pytest.fail(f"loaded {name}"))
    session = FakeSession([])
    nox_gsm8k.gsm8k(session, serving_python="e2e/bin/python")
    assert session.installs == []  # nothing installed: the e2e step's recipe serves
    (args, _), *_ = session.runs
    assert args[0] == "e2e/bin/python" and args[2] == "mechanics"


def test_results_land_in_the_step_record(nox_gsm8k, monkeypatch) -> None:
    def fake_run(*args: str, **kwargs: Any) -> None:  # what the gate CLI would write
        out = nox_gsm8k.RESULTS / "qwen4exp-qsa-tp8"
        out.mkdir(parents=True)
        (out / "result.json").write_text(json.dumps({"status": "failed", "accuracy": 0.5}))
        (out / "config.json").write_text("{}")
        raise RuntimeError("gate exited 1")

    session = FakeSession(["--base-url", "http://h:1"])
    session.run = fake_run
    record = Record()
    with pytest.raises(RuntimeError):
        nox_gsm8k.gsm8k(session, record)
    assert sorted(Path(p).name for p in record.artifacts) == ["config.json", "result.json"]
    assert record.details["gsm8k"]["qwen4exp-qsa-tp8"]["status"] == "failed"


def test_mechanics_logic_against_a_stand_in_server(nox_gsm8k, monkeypatch, tmp_path) -> None:
    """run_mechanics with the vLLM server replaced by the scripted one (always wrong answers):
    the real-server version is tests/gsm8k/test_gsm8k_vllm.py."""
    import types

    from gsm8k_fakes import FakeServer, completion_body

    class StandIn:
        def __init__(self, model_dir, python, **server_args):
            self.server = FakeServer(
                lambda path, body, call: (200, completion_body(body, "#### 999"))
            )

        def __enter__(self) -> str:
            return self.server.__enter__().url

        def __exit__(self, *exc) -> None:
            self.server.__exit__(*exc)

    monkeypatch.setitem(sys.modules, "vllm_server", types.SimpleNamespace(VLLMServer=StandIn))
    summary = nox_gsm8k.run_mechanics(tmp_path, model_dir=tmp_path)
    assert summary["ok"], summary
    runs = {c["run"]: (c["status"], c["exit_code"]) for c in summary["checks"]}
    assert runs == {
        "tiny-qsa": ("passed", 0),
        "tiny-qsa-above-threshold": ("failed", 1),
        "tiny-qsa-parity": ("passed", 0),
        "tiny-qsa-server-down": ("error", 2),
    }
    assert json.loads((tmp_path / "tiny-qsa-above-threshold" / "result.json").read_text())[
        "threshold"
    ] == pytest.approx(1 / 8)
