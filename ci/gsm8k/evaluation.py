"""Asking every question of one server with bounded concurrency (the first server error
aborts the run), and the parity report of two such runs."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

from . import answers
from .client import OpenAIClient
from .config import GateConfig, ParityConfig
from .data import Problem

PROGRESS_EVERY_S = 10.0


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
        extracted = answers.extract_answer(text)
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
