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
The parts live in ci/gsm8k/ (its __init__ lists them); this file is the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

try:
    import requests
except ImportError as exc:  # the gate's one dependency outside the standard library
    raise SystemExit(
        f"ci/gsm8k_gate.py needs requests ({exc}): pip install -r ci/gsm8k/requirements.txt"
    ) from None

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # loaded by path (not run as a script): its parts sit beside it
    sys.path.append(str(HERE))

from gsm8k.answers import extract_answer, normalize_number  # noqa: E402
from gsm8k.client import OpenAIClient, ServerError  # noqa: E402
from gsm8k.config import GateConfig, GateError, ParityConfig, config_from_dict, load_config  # noqa: E402
from gsm8k.data import (  # noqa: E402
    BUNDLED_DATA_DIR,
    Problem,
    chat_messages,
    completion_prompt,
    load_split,
    prepare_questions,
    resolve_data_files,
    select_exemplars,
)
from gsm8k.evaluation import Evaluation, evaluate, parity_report  # noqa: E402
from gsm8k.gate import EXIT_ERROR, EXIT_FAILED, EXIT_PASSED, GateResult, run_gate  # noqa: E402

__all__ = [
    "BUNDLED_DATA_DIR",
    "EXIT_ERROR",
    "EXIT_FAILED",
    "EXIT_PASSED",
    "Evaluation",
    "GateConfig",
    "GateError",
    "GateResult",
    "OpenAIClient",
    "ParityConfig",
    "Problem",
    "ServerError",
    "apply_overrides",
    "chat_messages",
    "completion_prompt",
    "config_from_dict",
    "evaluate",
    "extract_answer",
    "load_config",
    "load_split",
    "main",
    "normalize_number",
    "parity_report",
    "prepare_questions",
    "requests",
    "resolve_data_files",
    "run_gate",
    "select_exemplars",
]


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
