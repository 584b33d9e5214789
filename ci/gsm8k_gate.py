#!/usr/bin/env python3
"""GSM8K strict-match accuracy gate for any OpenAI-compatible server.

Sends k-shot GSM8K prompts (temperature 0, fixed seed, bounded concurrency) to a server,
extracts each answer with strict matching (``#### N`` or "The answer is N"), and fails when
accuracy < threshold - tolerance. In parity mode the same questions go to two servers (or two
backends of one model) and the gate fails when their accuracies or completions differ by more
than the configured tolerances.

Exit codes: 0 passed, 1 failed (accuracy or parity), 2 error (server, data or config). A
server that keeps answering 5xx, refuses connections or hangs past the request timeout is an
error, never a pass.

Usage (the gate needs ``requests``: ``pip install -r ci/gsm8k/requirements.txt``)::

    python ci/gsm8k_gate.py --config ci/gsm8k/configs/tiny-qsa.json --base-url http://127.0.0.1:8000

Importable: ``extract_answer``, ``load_config``, ``run_gate`` and friends; see docs/gsm8k.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import random
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from decimal import Decimal
from pathlib import Path
from typing import Any

try:
    import requests
except ImportError as exc:  # the gate's one dependency outside the standard library
    raise SystemExit(
        f"ci/gsm8k_gate.py needs requests ({exc}): pip install -r ci/gsm8k/requirements.txt"
    ) from None

GATE_NAME = "gsm8k-strict"
PROGRESS_EVERY_S = 10.0
EXIT_PASSED, EXIT_FAILED, EXIT_ERROR = 0, 1, 2

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BUNDLED_DATA_DIR = HERE / "gsm8k" / "data"

# The official splits (MIT licence), fetched once into a cache by runners that have internet.
GSM8K_URLS = {
    "test": "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/test.jsonl",
    "train": "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/train.jsonl",
}
GSM8K_SPLIT_SIZES = {"test": 1319, "train": 7473}
DEFAULT_CACHE_DIR = Path("~/.cache/gsm8k")

# --------------------------------------------------------------------------------------------
# Strict-match answer extraction
# --------------------------------------------------------------------------------------------

# One number: an optional sign (ASCII or Unicode minus) before or after an optional currency
# symbol, digits with optional well-formed thousands separators, optional decimals. It must end
# the token: a following letter, digit, "/" or a separator followed by a digit ("1,2345", "3/4",
# "18th") makes the match fail rather than silently truncating the number.
_NUMBER = r"""
    (?P<sign>[-+\u2212]?)(?:[$\u20ac\u00a3\u00a5]\s?)?(?P<sign2>[-+\u2212]?)
    (?P<digits>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)
    (?![\w/]|[.,]\d)
"""
_NUMBER_RE = re.compile(_NUMBER, re.VERBOSE)
# NOTES: "#" starts a comment in a VERBOSE pattern, hence the escaped "\#".
_HASH_RE = re.compile(r"\#\#\#\#\s*" + _NUMBER, re.VERBOSE)
_ANSWER_IS_RE = re.compile(r"\bthe\s+(?:final\s+)?answer\s+is:?\s*" + _NUMBER, re.VERBOSE | re.I)
_MINUS = ("-", "\u2212")


def _canonical(match: re.Match[str]) -> str | None:
    if match["sign"] and match["sign2"]:  # "-$-5", "+-5": not a number
        return None
    value = Decimal(match["digits"].replace(",", ""))
    if match["sign"] in _MINUS or match["sign2"] in _MINUS:
        value = -value
    if value == value.to_integral_value():
        return str(int(value))  # also turns -0 into 0
    return format(value.normalize(), "f")


def normalize_number(text: str) -> str | None:
    """Canonical form of a number string: ``"$1,234.50" -> "1234.5"``, ``"-3.0" -> "-3"``.

    Returns None for anything that is not one plain decimal number.
    """
    match = _NUMBER_RE.fullmatch(text.strip())
    return _canonical(match) if match else None


def extract_answer(completion: str) -> str | None:
    """Strict-match answer of a completion: the normalised number, or None (counted wrong).

    The first ``#### N`` wins; without one, the first "The answer is N" (case-insensitive,
    optional "final" and colon). Commas, currency symbols, signs and decimals are normalised.
    """
    for pattern in (_HASH_RE, _ANSWER_IS_RE):
        match = pattern.search(completion)
        if match:
            return _canonical(match)
    return None


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


class GateError(Exception):
    """The gate could not produce a verdict (server, data or config problem): exit code 2."""


@dataclasses.dataclass
class ParityConfig:
    base_url: str | None = None
    model: str | None = None
    max_accuracy_delta: float = 0.01
    max_diff_fraction: float = 0.05


@dataclasses.dataclass
class GateConfig:
    name: str
    description: str = ""
    base_url: str | None = None
    model: str | None = None  # None: the first model the server lists at /v1/models
    api: str = "completions"  # or "chat"
    data: Any = "bundled"  # "bundled" | "gsm8k" | {"test": path, "train": path}
    num_questions: int | None = None  # None: the whole test split
    num_shots: int = 8
    seed: int = 1234
    max_tokens: int = 256
    stop: list[str] = dataclasses.field(default_factory=lambda: ["Question:", "\n\n"])
    concurrency: int = 8
    timeout_s: float = 120.0
    retries: int = 3
    backoff_s: float = 1.0
    threshold: float | None = None
    tolerance: float = 0.0
    parity: ParityConfig | None = None
    config_dir: Path = dataclasses.field(default=Path("."), repr=False)

    def validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise GateError(f"config {self.name!r}: {message}")

        need(
            self.api in ("completions", "chat"),
            f"api must be 'completions' or 'chat', got {self.api!r}",
        )
        need(
            self.num_questions is None or self.num_questions >= 1,
            "num_questions must be >= 1 or null",
        )
        need(self.num_shots >= 0, f"num_shots must be >= 0, got {self.num_shots}")
        need(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        need(self.concurrency >= 1, f"concurrency must be >= 1, got {self.concurrency}")
        need(self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}")
        need(self.retries >= 0, f"retries must be >= 0, got {self.retries}")
        need(self.backoff_s >= 0, f"backoff_s must be >= 0, got {self.backoff_s}")
        need(self.tolerance >= 0, f"tolerance must be >= 0, got {self.tolerance}")
        need(
            self.threshold is None or 0.0 <= self.threshold <= 1.0,
            f"threshold must be in [0, 1], got {self.threshold}",
        )
        need(
            isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop),
            "stop must be a list of strings",
        )
        if self.parity is not None:
            need(
                0 <= self.parity.max_accuracy_delta <= 1,
                "parity.max_accuracy_delta must be in [0, 1]",
            )
            need(
                0 <= self.parity.max_diff_fraction <= 1,
                "parity.max_diff_fraction must be in [0, 1]",
            )

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("config_dir")
        return out


def load_config(path: str | os.PathLike[str]) -> GateConfig:
    """Read a per-model JSON config; unknown keys are refused (a typo must not pass silently)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise GateError(f"cannot read config {path}: {exc}") from exc
    if not isinstance(raw, dict) or "name" not in raw:
        raise GateError(f"config {path} must be a JSON object with at least a 'name'")
    return config_from_dict(raw, config_dir=path.resolve().parent)


def config_from_dict(raw: dict[str, Any], config_dir: Path = Path(".")) -> GateConfig:
    fields = {f.name for f in dataclasses.fields(GateConfig)} - {"config_dir"}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise GateError(
            f"config {raw.get('name')!r}: unknown keys {unknown}; known: {sorted(fields)}"
        )
    raw = dict(raw)
    if raw.get("parity") is not None:
        parity_fields = {f.name for f in dataclasses.fields(ParityConfig)}
        bad = sorted(set(raw["parity"]) - parity_fields)
        if bad:
            raise GateError(
                f"config {raw['name']!r}: unknown parity keys {bad}; known: {sorted(parity_fields)}"
            )
        raw["parity"] = ParityConfig(**raw["parity"])
    config = GateConfig(**raw, config_dir=config_dir)
    config.validate()
    return config


# --------------------------------------------------------------------------------------------
# Data
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
# Prompts
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


# --------------------------------------------------------------------------------------------
# HTTP client
# --------------------------------------------------------------------------------------------


class ServerError(GateError):
    """The server failed a request after all retries (5xx, transport error, timeout, bad body)."""


_RETRYABLE_STATUS = {429, 500, 502, 503, 504}


class OpenAIClient:
    """A minimal OpenAI-compatible client: retries transport errors and 5xx with backoff."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        retries: int,
        backoff_s: float,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self._sleep = sleep
        self._local = threading.local()

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        url = f"{self.base_url}{path}"
        attempts = self.retries + 1
        last = ""
        for attempt in range(attempts):
            if attempt:
                self._sleep(min(self.backoff_s * 2 ** (attempt - 1), 30.0))
            try:
                response = self._session().request(method, url, json=body, timeout=self.timeout_s)
            except requests.Timeout:
                last = f"no response within the {self.timeout_s:g} s request timeout (server hung?)"
                continue
            except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as exc:
                last = f"connection failed: {exc}"
                continue
            except requests.RequestException as exc:  # a bad URL and the like: not transient
                raise ServerError(f"{method} {url} cannot be sent: {exc}") from exc
            if response.status_code in _RETRYABLE_STATUS:
                last = f"HTTP {response.status_code}: {response.text[:300]!r}"
                continue
            if response.status_code >= 400:
                raise ServerError(
                    f"{method} {url} was refused: HTTP {response.status_code}: {response.text[:500]!r}"
                )
            try:
                return response.json()
            except ValueError as exc:
                raise ServerError(
                    f"{method} {url} returned a body that is not JSON: {response.text[:300]!r}"
                ) from exc
        raise ServerError(f"{method} {url} failed after {attempts} attempt(s): {last}")

    def first_model(self) -> str:
        models = self.request("GET", "/models").get("data") or []
        if not models or "id" not in models[0]:
            raise ServerError(f"{self.base_url}/models lists no model; set 'model' in the config")
        return models[0]["id"]

    def generate(
        self, config: GateConfig, model: str, exemplars: Sequence[Problem], question: str
    ) -> tuple[str, str | None]:
        """One greedy completion: (text, finish_reason)."""
        common = {
            "model": model,
            "max_tokens": config.max_tokens,
            "temperature": 0.0,
            "seed": config.seed,
            "n": 1,
        }
        if config.stop:
            common["stop"] = config.stop
        if config.api == "chat":
            body = self.request(
                "POST",
                "/chat/completions",
                {**common, "messages": chat_messages(exemplars, question)},
            )
        else:
            body = self.request(
                "POST", "/completions", {**common, "prompt": completion_prompt(exemplars, question)}
            )
        try:
            choice = body["choices"][0]
            text = choice["message"]["content"] if config.api == "chat" else choice["text"]
        except (KeyError, IndexError, TypeError) as exc:
            raise ServerError(
                f"{self.base_url}: malformed {config.api} response {str(body)[:300]!r}"
            ) from exc
        if not isinstance(text, str):
            raise ServerError(
                f"{self.base_url}: {config.api} response has no text: {str(body)[:300]!r}"
            )
        return text, choice.get("finish_reason")


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Evaluation:
    base_url: str
    model: str
    records: list[dict[str, Any]]
    duration_s: float

    @property
    def correct(self) -> int:
        return sum(r["correct"] for r in self.records)

    @property
    def accuracy(self) -> float:
        return self.correct / len(self.records) if self.records else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "model": self.model,
            "total": len(self.records),
            "correct": self.correct,
            "accuracy": self.accuracy,
            "unextracted": sum(r["extracted"] is None for r in self.records),
            "duration_s": round(self.duration_s, 3),
        }


def evaluate(
    client: OpenAIClient,
    config: GateConfig,
    model: str,
    problems: Sequence[Problem],
    exemplars: Sequence[Problem],
    progress: Callable[[str], None] | None = None,
) -> Evaluation:
    """Ask every problem with bounded concurrency; the first server error aborts the run."""
    start = time.monotonic()
    records: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()
    abort = threading.Event()
    failures: list[BaseException] = []
    last_report = start  # progress: a line every PROGRESS_EVERY_S and at the end

    def answer(problem: Problem) -> dict[str, Any]:
        text, finish = client.generate(config, model, exemplars, problem.question)
        extracted = extract_answer(text)
        return {
            "id": problem.id,
            "completion": text,
            "finish_reason": finish,
            "extracted": extracted,
            "expected": problem.expected,
            "correct": extracted is not None and extracted == problem.expected,
        }

    def ask(problem: Problem) -> None:
        nonlocal last_report
        if abort.is_set():  # an earlier question failed: send nothing more
            return
        try:
            record = answer(problem)
        except BaseException as exc:
            with lock:
                failures.append(exc)
            abort.set()
            raise
        with lock:
            records[problem.id] = record
            done = len(records)
            now = time.monotonic()
            if progress and (now - last_report >= PROGRESS_EVERY_S or done == len(problems)):
                last_report = now
                hits = sum(r["correct"] for r in records.values())
                progress(f"{client.base_url}: {done}/{len(problems)} answered, {hits} correct")

    with ThreadPoolExecutor(max_workers=config.concurrency, thread_name_prefix="gsm8k") as pool:
        futures = [pool.submit(ask, p) for p in problems]
        wait(futures, return_when=FIRST_EXCEPTION)
        if abort.is_set():
            for future in futures:
                future.cancel()
    if failures:
        raise failures[0]  # the first question that failed, in time order
    ordered = [records[p.id] for p in problems]
    return Evaluation(client.base_url, model, ordered, time.monotonic() - start)


def parity_report(a: Evaluation, b: Evaluation, parity: ParityConfig) -> dict[str, Any]:
    differing = [
        ra["id"]
        for ra, rb in zip(a.records, b.records, strict=True)
        if ra["completion"] != rb["completion"]
    ]
    answer_diff = [
        ra["id"]
        for ra, rb in zip(a.records, b.records, strict=True)
        if ra["extracted"] != rb["extracted"]
    ]
    delta = abs(a.accuracy - b.accuracy)
    diff_fraction = len(differing) / len(a.records) if a.records else 0.0
    reasons = []
    if delta > parity.max_accuracy_delta:
        reasons.append(
            f"accuracy differs by {delta:.4f} > max_accuracy_delta {parity.max_accuracy_delta}"
        )
    if diff_fraction > parity.max_diff_fraction:
        reasons.append(
            f"{len(differing)}/{len(a.records)} completions differ ({diff_fraction:.4f} > max_diff_fraction {parity.max_diff_fraction})"
        )
    return {
        "accuracy_delta": delta,
        "max_accuracy_delta": parity.max_accuracy_delta,
        "completion_diff_fraction": diff_fraction,
        "max_diff_fraction": parity.max_diff_fraction,
        "differing_completions": differing,
        "differing_answers": answer_diff,
        "passed": not reasons,
        "reasons": reasons,
    }


# --------------------------------------------------------------------------------------------
# The gate
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class GateResult:
    status: str  # "passed" | "failed" | "error"
    message: str
    result: dict[str, Any]

    @property
    def exit_code(self) -> int:
        return {"passed": EXIT_PASSED, "failed": EXIT_FAILED}.get(self.status, EXIT_ERROR)


def _write_jsonl(path: Path, records: Sequence[dict[str, Any]]) -> None:
    path.write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8"
    )


def run_gate(
    config: GateConfig,
    output_dir: Path,
    *,
    data_dir: Path | None = None,
    config_path: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> GateResult:
    """Run the gate (and the parity comparison when ``config.parity`` names a second server).

    Always writes ``result.json`` (and ``config.json``, the config actually used) to
    ``output_dir``, plus ``questions.jsonl`` (and ``questions.parity.jsonl``) when the
    questions were answered. Never raises a GateError: errors become status "error".
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("result.json", "questions.jsonl", "questions.parity.jsonl"):
        (output_dir / stale).unlink(missing_ok=True)
    started = time.time()
    result: dict[str, Any] = {
        "gate": GATE_NAME,
        "config_name": config.name,
        "config_path": display_path(config_path) if config_path else None,
        "config_sha256": sha256_file(config_path) if config_path and config_path.exists() else None,
        "config": config.to_json(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
    }
    (output_dir / "config.json").write_text(json.dumps(config.to_json(), indent=2) + "\n")

    def finish(status: str, message: str) -> GateResult:
        result.update(
            status=status,
            passed=status == "passed",
            message=message,
            duration_s=round(time.time() - started, 3),
        )
        (output_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        return GateResult(status, message, result)

    try:
        if not config.base_url:
            raise GateError(
                f"config {config.name!r}: no base_url (set it in the config or pass --base-url)"
            )
        parity_mode = config.parity is not None and config.parity.base_url is not None
        if not parity_mode and config.threshold is None:
            raise GateError(
                f"config {config.name!r} has no threshold: set it to the checkpoint's recorded GSM8K "
                f"strict-match accuracy, or pass --threshold or --baseline RESULT_JSON"
            )
        problems, exemplars, result["data"] = prepare_questions(config, data_dir)

        def client_for(url: str) -> OpenAIClient:
            return OpenAIClient(
                url, timeout_s=config.timeout_s, retries=config.retries, backoff_s=config.backoff_s
            )

        servers = [(client_for(config.base_url), config.model)]
        if parity_mode:
            servers.append(
                (client_for(config.parity.base_url), config.parity.model or config.model)
            )
        evaluations = []
        for client, model in servers:
            model = model or client.first_model()
            if progress:
                progress(
                    f"{client.base_url}: model {model!r}, {len(problems)} questions, {len(exemplars)}-shot, {config.api} API"
                )
            evaluations.append(evaluate(client, config, model, problems, exemplars, progress))
        _write_jsonl(output_dir / "questions.jsonl", evaluations[0].records)
        result["log"] = "questions.jsonl"
        result["servers"] = [ev.summary() for ev in evaluations]
        primary = evaluations[0]
        result.update(
            total=len(primary.records), correct=primary.correct, accuracy=primary.accuracy
        )

        if parity_mode:
            _write_jsonl(output_dir / "questions.parity.jsonl", evaluations[1].records)
            report = parity_report(primary, evaluations[1], config.parity)
            result["parity"] = report
            accs = f"accuracy {primary.accuracy:.4f} vs {evaluations[1].accuracy:.4f}"
            if report["passed"]:
                return finish(
                    "passed",
                    f"parity PASSED: {accs}, {len(report['differing_completions'])} completions differ",
                )
            return finish("failed", f"parity FAILED: {accs}; " + "; ".join(report["reasons"]))

        required = config.threshold - config.tolerance
        result.update(threshold=config.threshold, tolerance=config.tolerance, required=required)
        summary = (
            f"accuracy {primary.accuracy:.4f} ({primary.correct}/{len(primary.records)}) vs threshold "
            f"{config.threshold:.4f} - tolerance {config.tolerance:.4f} = {required:.4f}"
        )
        if primary.accuracy < required:
            return finish("failed", f"gsm8k gate FAILED: {summary}")
        return finish("passed", f"gsm8k gate PASSED: {summary}")
    except GateError as exc:
        return finish("error", f"gsm8k gate ERROR (no verdict, counts as a failure): {exc}")
    except Exception as exc:  # a bug: still leave an "error" record, then show the traceback
        finish("error", f"gsm8k gate ERROR (internal, no verdict): {type(exc).__name__}: {exc}")
        raise


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"exit codes: {EXIT_PASSED} passed, {EXIT_FAILED} failed (accuracy or parity), "
        f"{EXIT_ERROR} error (server, data or config: no verdict)",
    )
    p.add_argument(
        "--config", required=True, type=Path, help="per-model JSON config (ci/gsm8k/configs/*.json)"
    )
    p.add_argument(
        "--base-url", help="server URL, e.g. http://127.0.0.1:8000 (overrides the config)"
    )
    p.add_argument(
        "--model", help="served model name (overrides the config; default: first of /v1/models)"
    )
    p.add_argument(
        "--threshold", type=float, help="required accuracy in [0, 1] (overrides the config)"
    )
    p.add_argument(
        "--baseline", type=Path, help="a previous result.json whose accuracy becomes the threshold"
    )
    p.add_argument("--tolerance", type=float, help="allowed accuracy drop below the threshold")
    p.add_argument(
        "--num-questions", type=int, help="first N test questions (overrides the config)"
    )
    p.add_argument("--num-shots", type=int, help="k-shot exemplars (overrides the config)")
    p.add_argument("--concurrency", type=int, help="requests in flight (overrides the config)")
    p.add_argument("--parity-base-url", help="second server: run in parity mode against it")
    p.add_argument("--parity-model", help="served model name on the second server")
    p.add_argument("--data-dir", type=Path, help="cache dir of the official splits (data: 'gsm8k')")
    p.add_argument(
        "--output-dir",
        type=Path,
        help="where result.json and the logs go (default results/gsm8k/<name>)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def apply_overrides(config: GateConfig, args: argparse.Namespace) -> GateConfig:
    overrides = {
        key: getattr(args, key)
        for key in (
            "base_url",
            "model",
            "threshold",
            "tolerance",
            "num_questions",
            "num_shots",
            "concurrency",
        )
        if getattr(args, key) is not None
    }
    if args.baseline is not None:
        if args.threshold is not None:
            raise GateError("pass either --threshold or --baseline, not both")
        try:
            overrides["threshold"] = float(json.loads(args.baseline.read_text())["accuracy"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise GateError(
                f"cannot read an accuracy from the baseline {args.baseline}: {exc}"
            ) from exc
    if args.parity_base_url is not None or args.parity_model is not None:
        parity = dataclasses.replace(config.parity or ParityConfig())
        parity.base_url = args.parity_base_url or parity.base_url
        parity.model = args.parity_model or parity.model
        overrides["parity"] = parity
    config = dataclasses.replace(config, **overrides)
    config.validate()
    return config


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    progress = (
        None if args.quiet else (lambda line: print(f"gsm8k: {line}", file=sys.stderr, flush=True))
    )
    try:
        config = apply_overrides(load_config(args.config), args)
    except GateError as exc:
        print(f"gsm8k gate ERROR (no verdict, counts as a failure): {exc}", file=sys.stderr)
        return EXIT_ERROR
    output_dir = args.output_dir or Path("results") / "gsm8k" / config.name
    outcome = run_gate(
        config, output_dir, data_dir=args.data_dir, config_path=args.config, progress=progress
    )
    print(outcome.message, file=sys.stderr if outcome.status == "error" else sys.stdout)
    print(f"gsm8k: result written to {output_dir / 'result.json'}", file=sys.stderr)
    return outcome.exit_code


if __name__ == "__main__":
    sys.exit(main())
