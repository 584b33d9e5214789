"""The gate: one verdict (passed, failed, or error when there is none) for a config, and its
record in the output directory (result.json, config.json, questions.jsonl)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .client import OpenAIClient
from .config import GateConfig, GateError
from .data import display_path, prepare_questions, sha256_file
from .evaluation import evaluate, parity_report

GATE_NAME = "gsm8k-strict"
EXIT_PASSED, EXIT_FAILED, EXIT_ERROR = 0, 1, 2


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
