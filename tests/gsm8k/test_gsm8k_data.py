"""The shipped GSM8K-format problems and per-model configs are well formed and self-consistent."""

from __future__ import annotations

import ast
import json
import operator
import re
from fractions import Fraction
from pathlib import Path

import gsm8k_gate
import pytest
from gsm8k_gate import GateError

CONFIG_DIR = gsm8k_gate.HERE / "gsm8k" / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.json"))
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def _exact(node: ast.AST) -> Fraction:
    """Exact value of a calculator annotation (+ - * / and parentheses only)."""
    if isinstance(node, ast.Expression):
        return _exact(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_exact(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_exact(node.left), _exact(node.right))
    raise ValueError(f"unsupported expression {ast.dump(node)}")


@pytest.mark.parametrize("split", ["test", "train"])
def test_bundled_split_is_consistent(split: str) -> None:
    path = gsm8k_gate.BUNDLED_DATA_DIR / f"{split}.jsonl"
    problems = gsm8k_gate.load_split(path, split)
    assert len({p.question for p in problems}) == len(problems), "duplicate questions"
    assert len({p.id for p in problems}) == len(problems), "duplicate ids"
    for p in problems:
        annotations = re.findall(r"<<([^=<>]+)=([^<>]+)>>", p.answer)
        assert annotations, f"{p.id}: no calculator annotation"
        for expr, value in annotations:
            assert _exact(ast.parse(expr, mode="eval")) == Fraction(value), (
                f"{p.id}: <<{expr}={value}>>"
            )
            # the annotation's result is repeated in the text right after it, as in GSM8K
            assert f"<<{expr}={value}>>{value}" in p.answer, (
                f"{p.id}: <<{expr}={value}>> not followed by {value}"
            )
        assert p.answer.rstrip().splitlines()[-1] == f"#### {p.expected}", p.id
        assert gsm8k_gate.extract_answer(p.answer) == p.expected, p.id


def test_bundled_splits_are_disjoint() -> None:
    test = gsm8k_gate.load_split(gsm8k_gate.BUNDLED_DATA_DIR / "test.jsonl", "test")
    train = gsm8k_gate.load_split(gsm8k_gate.BUNDLED_DATA_DIR / "train.jsonl", "train")
    assert not {p.question for p in test} & {p.question for p in train}


def test_exemplars_are_seeded_and_stable() -> None:
    train = gsm8k_gate.load_split(gsm8k_gate.BUNDLED_DATA_DIR / "train.jsonl", "train")
    first = gsm8k_gate.select_exemplars(train, 3, seed=1234)
    assert first == gsm8k_gate.select_exemplars(train, 3, seed=1234)
    assert [p.id for p in first] != [p.id for p in gsm8k_gate.select_exemplars(train, 3, seed=7)]
    with pytest.raises(GateError, match="num_shots=9 but the train split has only 8"):
        gsm8k_gate.select_exemplars(train, 9, seed=0)


def test_prompt_format() -> None:
    train = gsm8k_gate.load_split(gsm8k_gate.BUNDLED_DATA_DIR / "train.jsonl", "train")[:2]
    prompt = gsm8k_gate.completion_prompt(train, "How many?")
    assert prompt.startswith(f"Question: {train[0].question}\nAnswer: {train[0].answer}\n\n")
    assert prompt.endswith("\n\nQuestion: How many?\nAnswer:")
    assert prompt.count("Question:") == 3
    messages = gsm8k_gate.chat_messages(train, "How many?")
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert messages[1]["content"] == train[0].answer


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path: Path) -> None:
    config = gsm8k_gate.load_config(path)
    assert config.name == path.stem
    assert config.num_shots <= 8 or config.data != "bundled"


def test_tiny_config_is_a_mechanics_check() -> None:
    config = gsm8k_gate.load_config(CONFIG_DIR / "tiny-qsa.json")
    assert config.threshold == 0.0 and config.data == "bundled"


def test_release_config_demands_a_threshold() -> None:
    config = gsm8k_gate.load_config(CONFIG_DIR / "qwen4exp-qsa-tp8.json")
    assert config.threshold is None and config.data == "gsm8k" and config.num_questions is None


def _write(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"name": "x", "treshold": 0.5}, r"unknown keys \['treshold'\]"),
        ({"name": "x", "api": "responses"}, "api must be 'completions' or 'chat'"),
        ({"name": "x", "threshold": 1.5}, r"threshold must be in \[0, 1\]"),
        ({"name": "x", "concurrency": 0}, "concurrency must be >= 1"),
        ({"name": "x", "num_questions": 0}, "num_questions must be >= 1"),
        ({"name": "x", "tolerance": -0.1}, "tolerance must be >= 0"),
        ({"name": "x", "stop": "Question:"}, "stop must be a list of strings"),
        ({"name": "x", "parity": {"max_delta": 0.1}}, r"unknown parity keys \['max_delta'\]"),
        ({"threshold": 0.5}, "must be a JSON object with at least a 'name'"),
    ],
)
def test_bad_configs_are_refused(tmp_path: Path, raw: dict, match: str) -> None:
    with pytest.raises(GateError, match=match):
        gsm8k_gate.load_config(_write(tmp_path, raw))


def test_unreadable_config(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text("{not json")
    with pytest.raises(GateError, match="cannot read config"):
        gsm8k_gate.load_config(tmp_path / "c.json")


def test_explicit_data_files_resolve_relative_to_the_config(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    for split in ("test", "train"):
        (tmp_path / "d" / f"{split}.jsonl").write_text(
            json.dumps({"question": "q?", "answer": "1 + 1 = <<1+1=2>>2\n#### 2"}) + "\n"
        )
    path = _write(
        tmp_path, {"name": "x", "data": {"test": "d/test.jsonl", "train": "d/train.jsonl"}}
    )
    files = gsm8k_gate.resolve_data_files(gsm8k_gate.load_config(path))
    assert files["test"] == tmp_path / "d" / "test.jsonl"
    assert gsm8k_gate.load_split(files["test"], "test")[0].expected == "2"


def test_cached_official_splits_are_used_without_download(tmp_path: Path, monkeypatch) -> None:
    for split in ("test", "train"):
        (tmp_path / f"{split}.jsonl").write_text(
            json.dumps({"question": "q?", "answer": "#### 1,600"}) + "\n"
        )

    def no_network(*args, **kwargs):
        raise AssertionError("the cache was present: no download expected")

    monkeypatch.setattr(gsm8k_gate.requests, "get", no_network)
    config = gsm8k_gate.config_from_dict({"name": "x", "data": "gsm8k"})
    files = gsm8k_gate.resolve_data_files(config, data_dir=tmp_path)
    assert gsm8k_gate.load_split(files["test"], "test")[0].expected == "1600"


def test_failed_download_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    def offline(*args, **kwargs):
        raise gsm8k_gate.requests.ConnectionError("no route to host")

    monkeypatch.setattr(gsm8k_gate.requests, "get", offline)
    config = gsm8k_gate.config_from_dict({"name": "x", "data": "gsm8k"})
    with pytest.raises(GateError, match="cannot download the GSM8K test split .*no route to host"):
        gsm8k_gate.resolve_data_files(config, data_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / "test.jsonl").exists()


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"question": "q"}', "not a GSM8K record"),
        ("not json", "not a GSM8K record"),
        ('{"question": "q", "answer": "it is 4"}', r"does not end in '#### <number>'"),
    ],
)
def test_malformed_split_is_refused(tmp_path: Path, line: str, match: str) -> None:
    (tmp_path / "test.jsonl").write_text(line + "\n")
    with pytest.raises(GateError, match=match):
        gsm8k_gate.load_split(tmp_path / "test.jsonl", "test")
