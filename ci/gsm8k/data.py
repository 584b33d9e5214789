"""The gate's questions: the GSM8K splits (bundled, the official ones downloaded once into a
cache, or given by path), the seeded k-shot exemplars, and the prompts built from them."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import requests

from .answers import normalize_number
from .config import GateConfig, GateError

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BUNDLED_DATA_DIR = HERE / "data"

# The official splits (MIT licence), fetched once into a cache by runners that have internet.
GSM8K_URLS = {
    "test": "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/test.jsonl",
    "train": "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/train.jsonl",
}
GSM8K_SPLIT_SIZES = {"test": 1319, "train": 7473}
DEFAULT_CACHE_DIR = Path("~/.cache/gsm8k")


# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
    id: str
    question: str
    answer: str  # the full worked solution ending in "#### N"
    expected: str  # normalised final number


def _expected_answer(answer: str, where: str) -> str:
    final = answer.rsplit("####", 1)
    expected = normalize_number(final[1]) if len(final) == 2 else None
    if expected is None:
        raise GateError(f"{where}: the answer does not end in '#### <number>': {answer[-80:]!r}")
    return expected


def load_split(path: Path, split: str) -> list[Problem]:
    """GSM8K JSONL: one ``{"question", "answer"}`` object a line (an optional ``id`` is kept)."""
    problems = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise GateError(f"cannot read the GSM8K {split} split {path}: {exc}") from exc
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
            question, answer = row["question"], row["answer"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise GateError(f"{where}: not a GSM8K record ({exc})") from exc
        pid = str(row.get("id", f"{split}-{len(problems):04d}"))
        problems.append(Problem(pid, question, answer, _expected_answer(answer, where)))
    if not problems:
        raise GateError(f"the GSM8K {split} split {path} is empty")
    return problems


def _download_split(split: str, dest: Path) -> None:
    """Fetch one official split into the cache, atomically, and check its size."""
    url = GSM8K_URLS[split]
    print(f"gsm8k: downloading the {split} split into {dest} ...", file=sys.stderr)
    try:
        response = requests.get(url, timeout=60)
        response.raise_for_status()
    except requests.RequestException as exc:
        raise GateError(
            f"cannot download the GSM8K {split} split from {url}: {exc}. On a host without "
            f"internet, place test.jsonl and train.jsonl in the cache dir yourself."
        ) from exc
    rows = [line for line in response.text.splitlines() if line.strip()]
    if len(rows) != GSM8K_SPLIT_SIZES[split]:
        raise GateError(
            f"downloaded {split} split has {len(rows)} rows, expected {GSM8K_SPLIT_SIZES[split]}"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    tmp.write_text("\n".join(rows) + "\n", encoding="utf-8")
    tmp.replace(dest)


def resolve_data_files(config: GateConfig, data_dir: Path | None = None) -> dict[str, Path]:
    """Paths of the test and train splits named by ``config.data`` (downloading if asked)."""
    data = config.data
    if data == "bundled":
        return {split: BUNDLED_DATA_DIR / f"{split}.jsonl" for split in ("test", "train")}
    if data == "gsm8k":
        cache = Path(data_dir or os.environ.get("GSM8K_DATA_DIR") or DEFAULT_CACHE_DIR).expanduser()
        files = {split: cache / f"{split}.jsonl" for split in ("test", "train")}
        for split, path in files.items():
            if not path.exists():
                _download_split(split, path)
        return files
    if isinstance(data, dict) and set(data) == {"test", "train"}:
        return {
            split: (config.config_dir / Path(data[split]).expanduser())
            for split in ("test", "train")
        }
    raise GateError(
        f"config {config.name!r}: data must be 'bundled', 'gsm8k' or {{'test': path, 'train': path}}, got {data!r}"
    )


def display_path(path: Path) -> str:
    """A path as the result records it: relative to the repository when inside it."""
    path = Path(path).resolve()
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)


def _provenance() -> Any:
    """The package's provenance module, by path (standard library only: no torch needed)."""
    path = REPO / "custom_esimd_kernels_vllm" / "qsa_ops" / "provenance.py"
    spec = importlib.util.spec_from_file_location("_qsa_provenance", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sha256_file = _provenance().sha256_file


# --------------------------------------------------------------------------------------------


def select_exemplars(train: Sequence[Problem], num_shots: int, seed: int) -> list[Problem]:
    """The k-shot exemplars: a seeded sample of the train split, the same for every question."""
    if num_shots > len(train):
        raise GateError(f"num_shots={num_shots} but the train split has only {len(train)} problems")
    return random.Random(seed).sample(list(train), num_shots)


def prepare_questions(
    config: GateConfig, data_dir: Path | None = None
) -> tuple[list[Problem], list[Problem], dict[str, Any]]:
    """The questions to ask, the k-shot exemplars, and a record of the data used."""
    files = resolve_data_files(config, data_dir)
    test, train = load_split(files["test"], "test"), load_split(files["train"], "train")
    if config.num_questions and config.num_questions > len(test):
        raise GateError(
            f"num_questions={config.num_questions} but the test split has only {len(test)} problems"
        )
    problems = test[: config.num_questions] if config.num_questions else test
    exemplars = select_exemplars(train, config.num_shots, config.seed)
    record = {
        "source": config.data,
        "test": display_path(files["test"]),
        "test_sha256": sha256_file(files["test"]),
        "train": display_path(files["train"]),
        "train_sha256": sha256_file(files["train"]),
        "num_questions": len(problems),
        "num_shots": len(exemplars),
        "exemplar_ids": [ex.id for ex in exemplars],
    }
    return problems, exemplars, record


def completion_prompt(exemplars: Sequence[Problem], question: str) -> str:
    shots = "".join(f"Question: {ex.question}\nAnswer: {ex.answer}\n\n" for ex in exemplars)
    return f"{shots}Question: {question}\nAnswer:"


def chat_messages(exemplars: Sequence[Problem], question: str) -> list[dict[str, str]]:
    messages = []
    for ex in exemplars:
        messages.append({"role": "user", "content": f"Question: {ex.question}\nAnswer:"})
        messages.append({"role": "assistant", "content": ex.answer})
    messages.append({"role": "user", "content": f"Question: {question}\nAnswer:"})
    return messages
