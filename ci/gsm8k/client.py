"""A minimal OpenAI-compatible client: completions or chat, greedy, retrying transport errors
and 5xx with backoff; a server that keeps failing is a ServerError (no verdict)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import requests

from .config import GateConfig, GateError
from .data import Problem, chat_messages, completion_prompt

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
