"""The gate's per-model configuration (ci/gsm8k/configs/*.json): what to ask, of which server,
and the threshold or parity tolerances; unknown keys and out-of-range values are refused."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

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
