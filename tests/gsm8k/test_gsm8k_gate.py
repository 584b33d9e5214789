"""The gate against a scripted OpenAI-compatible server: verdicts, logs, retries, errors, parity."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import gsm8k_gate
import pytest
from gsm8k import answers
from gsm8k_fakes import FAKE_MODEL, HANG, completion_body, last_question

N = 12  # questions per run: enough for fractions, fast enough for CI


def config(url: str, **overrides: Any) -> gsm8k_gate.GateConfig:
    raw = {
        "name": "fake",
        "base_url": url,
        "data": "bundled",
        "num_questions": N,
        "num_shots": 3,
        "max_tokens": 64,
        "concurrency": 3,
        "timeout_s": 5,
        "retries": 2,
        "backoff_s": 0.01,
        "threshold": 0.75,
        "tolerance": 0.05,
    }
    return gsm8k_gate.config_from_dict({**raw, **overrides})


def answering(answers: dict[str, str], right: int = N, style: str = "#### {}") -> Any:
    """A script answering the first `right` bundled questions correctly and the rest wrongly."""
    order = list(answers)

    def script(path: str, body: dict[str, Any], call: int) -> Any:
        question = last_question(body)
        value = answers[question] if order.index(question) < right else "999999"
        return 200, completion_body(body, " Some working.\n" + style.format(value))

    return script


def read_log(out: Path, name: str = "questions.jsonl") -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def test_correct_answers_pass(fake_server, bundled_answers, tmp_path: Path) -> None:
    server = fake_server(answering(bundled_answers))
    outcome = gsm8k_gate.run_gate(config(server.url), tmp_path)
    assert outcome.status == "passed" and outcome.exit_code == 0, outcome.message
    assert "accuracy 1.0000 (12/12)" in outcome.message
    result = json.loads((tmp_path / "result.json").read_text())
    assert (
        result["passed"] and result["accuracy"] == 1.0 and result["required"] == pytest.approx(0.7)
    )
    assert result["servers"][0]["model"] == FAKE_MODEL  # discovered from /v1/models
    assert result["data"]["num_shots"] == 3 and len(result["data"]["test_sha256"]) == 64
    assert json.loads((tmp_path / "config.json").read_text())["threshold"] == 0.75
    log = read_log(tmp_path)
    assert [r["id"] for r in log] == [f"test-{i:04d}" for i in range(N)]
    assert set(log[0]) == {"id", "completion", "finish_reason", "extracted", "expected", "correct"}
    assert all(r["correct"] and r["extracted"] == r["expected"] for r in log)


def test_requests_are_greedy_seeded_and_bounded(
    fake_server, bundled_answers, tmp_path: Path
) -> None:
    server = fake_server(answering(bundled_answers))
    gsm8k_gate.run_gate(config(server.url, concurrency=2, seed=77, model="served-name"), tmp_path)
    assert len(server.requests) == N
    for path, body in server.requests:
        assert path == "/v1/completions"
        assert body["temperature"] == 0.0 and body["seed"] == 77 and body["model"] == "served-name"
        assert body["stop"] == ["Question:", "\n\n"] and body["max_tokens"] == 64
        assert body["prompt"].count("Question:") == 4  # 3 shots + the question
    assert 1 <= server.max_in_flight <= 2
    prompts = {last_question(b): b["prompt"] for _, b in server.requests}
    assert len({p.rsplit("Question: ", 1)[0] for p in prompts.values()}) == 1  # same exemplars


def test_normalised_answers_count_as_correct(fake_server, tmp_path: Path) -> None:
    # Every answer in dollars with thousands separators and trailing zeros, via "The answer is".
    problems = gsm8k_gate.load_split(gsm8k_gate.BUNDLED_DATA_DIR / "test.jsonl", "test")
    expected = {p.question: p.expected for p in problems}

    def script(path: str, body: dict[str, Any], call: int) -> Any:
        value = float(expected[last_question(body)])
        return 200, completion_body(body, f" Working. The answer is ${value:,.2f}.")

    server = fake_server(script)
    outcome = gsm8k_gate.run_gate(config(server.url, num_questions=len(problems)), tmp_path)
    assert outcome.status == "passed", outcome.message
    assert all(r["correct"] for r in read_log(tmp_path)), read_log(tmp_path)


def test_below_threshold_fails_with_exit_code(fake_server, bundled_answers, tmp_path: Path) -> None:
    server = fake_server(answering(bundled_answers, right=8))  # 8/12 = 0.667 < 0.75 - 0.05
    outcome = gsm8k_gate.run_gate(config(server.url), tmp_path)
    assert outcome.status == "failed" and outcome.exit_code == 1
    assert "FAILED: accuracy 0.6667 (8/12)" in outcome.message and "= 0.7000" in outcome.message
    assert json.loads((tmp_path / "result.json").read_text())["passed"] is False
    assert sum(r["correct"] for r in read_log(tmp_path)) == 8


def test_tolerance_admits_a_small_drop(fake_server, bundled_answers, tmp_path: Path) -> None:
    server = fake_server(answering(bundled_answers, right=9))  # 0.75
    assert (
        gsm8k_gate.run_gate(config(server.url, threshold=0.8, tolerance=0.05), tmp_path).status
        == "passed"
    )
    assert (
        gsm8k_gate.run_gate(config(server.url, threshold=0.8, tolerance=0.04), tmp_path).status
        == "failed"
    )


def test_unextractable_answers_are_wrong(fake_server, bundled_answers, tmp_path: Path) -> None:
    server = fake_server(answering(bundled_answers, style="The result is {}"))
    outcome = gsm8k_gate.run_gate(config(server.url), tmp_path)
    assert outcome.status == "failed" and "(0/12)" in outcome.message
    assert all(r["extracted"] is None for r in read_log(tmp_path))
    assert json.loads((tmp_path / "result.json").read_text())["servers"][0]["unextracted"] == N


def test_transient_5xx_are_retried(fake_server, bundled_answers, tmp_path: Path) -> None:
    correct = answering(bundled_answers)

    def flaky(path: str, body: dict[str, Any], call: int) -> Any:
        return (503, {"error": "warming up"}) if call < 2 else correct(path, body, call)

    server = fake_server(flaky)
    outcome = gsm8k_gate.run_gate(config(server.url, retries=2), tmp_path)
    assert outcome.status == "passed", outcome.message
    assert len(server.requests) == 3 * N


def test_persistent_500_fails_the_gate(fake_server, tmp_path: Path) -> None:
    server = fake_server(
        lambda path, body, call: (500, {"error": "CUDA error: an illegal memory access"})
    )
    outcome = gsm8k_gate.run_gate(config(server.url, threshold=0.0), tmp_path)
    assert outcome.status == "error" and outcome.exit_code == 2
    assert "failed after 3 attempt(s): HTTP 500" in outcome.message
    assert "illegal memory access" in outcome.message
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "error" and result["passed"] is False
    assert not (tmp_path / "questions.jsonl").exists()
    assert len(server.requests) < 3 * N  # the run stopped at the first failed question


def test_hanging_server_fails_by_timeout(fake_server, tmp_path: Path) -> None:
    server = fake_server(lambda path, body, call: HANG)
    start = time.monotonic()
    outcome = gsm8k_gate.run_gate(
        config(server.url, threshold=0.0, timeout_s=0.5, retries=1), tmp_path
    )
    assert outcome.status == "error" and outcome.exit_code == 2
    assert "no response within the 0.5 s request timeout" in outcome.message
    assert time.monotonic() - start < 10


def test_client_errors_are_not_retried(fake_server, tmp_path: Path) -> None:
    server = fake_server(
        lambda path, body, call: (400, {"error": "prompt is longer than max_model_len"})
    )
    outcome = gsm8k_gate.run_gate(config(server.url, concurrency=1), tmp_path)
    assert (
        outcome.status == "error"
        and "HTTP 400" in outcome.message
        and "max_model_len" in outcome.message
    )
    assert len(server.requests) == 1


def test_malformed_response_is_an_error(fake_server, tmp_path: Path) -> None:
    server = fake_server(lambda path, body, call: (200, {"choices": []}))
    outcome = gsm8k_gate.run_gate(config(server.url), tmp_path)
    assert outcome.status == "error" and "malformed completions response" in outcome.message


def test_unreachable_server_is_an_error(tmp_path: Path) -> None:
    outcome = gsm8k_gate.run_gate(config("http://127.0.0.1:9", retries=1), tmp_path)
    assert outcome.status == "error" and outcome.exit_code == 2
    assert "connection failed" in outcome.message


def test_missing_threshold_is_an_error(fake_server, tmp_path: Path) -> None:
    outcome = gsm8k_gate.run_gate(config("http://127.0.0.1:9", threshold=None), tmp_path)
    assert outcome.status == "error" and "has no threshold" in outcome.message


def test_chat_api(fake_server, bundled_answers, tmp_path: Path) -> None:
    server = fake_server(answering(bundled_answers))
    outcome = gsm8k_gate.run_gate(config(server.url, api="chat", stop=[]), tmp_path)
    assert outcome.status == "passed", outcome.message
    path, body = server.requests[0]
    assert path == "/v1/chat/completions" and len(body["messages"]) == 7 and "stop" not in body


def _parity_config(url_a: str, url_b: str, **overrides: Any) -> gsm8k_gate.GateConfig:
    parity = {"base_url": url_b, "max_accuracy_delta": 0.1, "max_diff_fraction": 0.25}
    return config(url_a, threshold=None, parity=parity, **overrides)


def test_parity_identical_servers_pass(fake_server, bundled_answers, tmp_path: Path) -> None:
    a, b = fake_server(answering(bundled_answers)), fake_server(answering(bundled_answers))
    outcome = gsm8k_gate.run_gate(_parity_config(a.url, b.url), tmp_path)
    assert outcome.status == "passed", outcome.message
    parity = json.loads((tmp_path / "result.json").read_text())["parity"]
    assert parity["accuracy_delta"] == 0 and parity["differing_completions"] == []
    assert len(read_log(tmp_path, "questions.parity.jsonl")) == N
    assert len(a.requests) == len(b.requests) == N


def test_parity_fails_on_accuracy_delta(fake_server, bundled_answers, tmp_path: Path) -> None:
    a, b = fake_server(answering(bundled_answers)), fake_server(answering(bundled_answers, right=9))
    outcome = gsm8k_gate.run_gate(_parity_config(a.url, b.url, num_questions=N), tmp_path)
    assert outcome.status == "failed" and outcome.exit_code == 1
    assert "accuracy differs by 0.2500 > max_accuracy_delta 0.1" in outcome.message


def test_parity_fails_on_differing_completions(
    fake_server, bundled_answers, tmp_path: Path
) -> None:
    # Same answers, different working on every question: accuracy agrees, completions do not.
    a = fake_server(answering(bundled_answers))
    b = fake_server(answering(bundled_answers, style="Other working.\n#### {}"))
    outcome = gsm8k_gate.run_gate(_parity_config(a.url, b.url), tmp_path)
    assert outcome.status == "failed"
    assert "12/12 completions differ (1.0000 > max_diff_fraction 0.25)" in outcome.message
    parity = json.loads((tmp_path / "result.json").read_text())["parity"]
    assert parity["differing_answers"] == [] and len(parity["differing_completions"]) == N


def test_parity_second_server_error_is_an_error(
    fake_server, bundled_answers, tmp_path: Path
) -> None:
    a = fake_server(answering(bundled_answers))
    b = fake_server(lambda path, body, call: (502, {"error": "bad gateway"}))
    outcome = gsm8k_gate.run_gate(_parity_config(a.url, b.url, retries=0), tmp_path)
    assert outcome.status == "error" and b.url in outcome.message


# ---- the command line -------------------------------------------------------------------------


def _cli_config(tmp_path: Path, **raw: Any) -> Path:
    path = tmp_path / "cfg.json"
    base = {"name": "cli", "data": "bundled", "num_questions": 6, "num_shots": 2, "retries": 0}
    path.write_text(json.dumps({**base, **raw}))
    return path


def test_cli_pass_and_fail(fake_server, bundled_answers, tmp_path: Path, capsys) -> None:
    server = fake_server(answering(bundled_answers, right=3))  # 3/6
    cfg = _cli_config(tmp_path, threshold=0.5)
    out = tmp_path / "out"
    args = ["--config", str(cfg), "--base-url", server.url, "--output-dir", str(out), "--quiet"]
    assert gsm8k_gate.main(args) == 0
    assert "gsm8k gate PASSED: accuracy 0.5000 (3/6)" in capsys.readouterr().out
    assert gsm8k_gate.main([*args, "--threshold", "0.6"]) == 1
    assert "gsm8k gate FAILED" in capsys.readouterr().out
    assert json.loads((out / "result.json").read_text())["threshold"] == 0.6


def test_cli_baseline_sets_the_threshold(fake_server, bundled_answers, tmp_path: Path) -> None:
    server = fake_server(answering(bundled_answers, right=3))
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"accuracy": 0.9}))
    cfg, out = _cli_config(tmp_path), tmp_path / "out"
    args = ["--config", str(cfg), "--base-url", server.url, "--output-dir", str(out), "--quiet"]
    assert gsm8k_gate.main([*args, "--baseline", str(baseline), "--tolerance", "0.4"]) == 0
    assert gsm8k_gate.main([*args, "--baseline", str(baseline), "--tolerance", "0.3"]) == 1
    assert gsm8k_gate.main([*args, "--baseline", str(baseline), "--threshold", "0.1"]) == 2


def test_cli_parity(fake_server, bundled_answers, tmp_path: Path) -> None:
    a, b = fake_server(answering(bundled_answers)), fake_server(answering(bundled_answers))
    cfg, out = _cli_config(tmp_path), tmp_path / "out"
    args = [
        "--config",
        str(cfg),
        "--base-url",
        a.url,
        "--parity-base-url",
        b.url,
        "--output-dir",
        str(out),
    ]
    assert gsm8k_gate.main([*args, "--quiet"]) == 0
    assert json.loads((out / "result.json").read_text())["parity"]["passed"] is True


def test_cli_error_paths(tmp_path: Path, capsys) -> None:
    assert gsm8k_gate.main(["--config", str(tmp_path / "missing.json")]) == 2
    assert "cannot read config" in capsys.readouterr().err
    cfg = _cli_config(tmp_path, threshold=0.5)
    out = tmp_path / "out"
    assert gsm8k_gate.main(["--config", str(cfg), "--output-dir", str(out), "--quiet"]) == 2
    assert "no base_url" in capsys.readouterr().err
    assert json.loads((out / "result.json").read_text())["status"] == "error"


def test_stale_results_are_removed(fake_server, bundled_answers, tmp_path: Path) -> None:
    server = fake_server(answering(bundled_answers))
    gsm8k_gate.run_gate(config(server.url), tmp_path)
    assert (tmp_path / "questions.jsonl").exists()
    gsm8k_gate.run_gate(config("http://127.0.0.1:9", retries=0), tmp_path)
    assert not (tmp_path / "questions.jsonl").exists()  # no log of a previous run left behind


def test_url_without_scheme_is_an_error(tmp_path: Path) -> None:
    outcome = gsm8k_gate.run_gate(config("127.0.0.1:8000"), tmp_path)
    assert outcome.status == "error" and "cannot be sent" in outcome.message


def test_internal_errors_leave_an_error_record(fake_server, tmp_path: Path, monkeypatch) -> None:
    server = fake_server(lambda path, body, call: (200, completion_body(body, "#### 1")))

    def broken(completion: str) -> str:
        raise ZeroDivisionError("bug")

    monkeypatch.setattr(answers, "extract_answer", broken)  # where the gate's evaluation reads it
    with pytest.raises(ZeroDivisionError):
        gsm8k_gate.run_gate(config(server.url), tmp_path)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "error" and "ZeroDivisionError" in result["message"]


def test_more_questions_than_the_split_is_an_error(tmp_path: Path) -> None:
    outcome = gsm8k_gate.run_gate(config("http://127.0.0.1:9", num_questions=31), tmp_path)
    assert outcome.status == "error" and "test split has only 30 problems" in outcome.message
