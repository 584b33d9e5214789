"""A scripted OpenAI-compatible HTTP server for the GSM8K gate tests."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

FAKE_MODEL = "fake-gsm8k-model"
HANG = object()  # a script returns HANG to make the server never answer that request

# A script maps (path, request body, call number of this question) to (HTTP status, body) or HANG.
Script = Callable[[str, dict[str, Any], int], Any]


def last_question(body: dict[str, Any]) -> str:
    """The question being asked: the text after the last "Question: " of the prompt."""
    if "messages" in body:
        text = body["messages"][-1]["content"]
    else:
        text = body["prompt"]
    return text.rsplit("Question: ", 1)[1].rsplit("\nAnswer:", 1)[0]


def completion_body(body: dict[str, Any], text: str) -> dict[str, Any]:
    if "messages" in body:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text}
    return {
        "id": "cmpl-fake",
        "model": body.get("model"),
        "choices": [{**choice, "finish_reason": "stop"}],
    }


class FakeServer:
    """An OpenAI-compatible HTTP server on 127.0.0.1 that answers from a script."""

    def __init__(self, script: Script):
        self.script = script
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.release = threading.Event()  # set to free hanging handlers
        self._calls: dict[str, int] = {}
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: Any) -> None:
                payload = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(
                        200, {"object": "list", "data": [{"id": FAKE_MODEL, "object": "model"}]}
                    )
                else:
                    self._send(404, {"error": f"no route {self.path}"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                key = last_question(body)
                with server._lock:
                    server.requests.append((self.path, body))
                    call = server._calls.get(key, 0)
                    server._calls[key] = call + 1
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                # NOTES: a request stops counting as in flight BEFORE its reply is sent: once
                # the client has the reply it may send its next request, which could otherwise
                # arrive before this handler's decrement and be counted as a third concurrent
                # request (seen as max_in_flight 3 at concurrency 2 on a loaded machine).
                try:
                    reply = server.script(self.path, body, call)
                    if reply is HANG:
                        server.release.wait(timeout=30)
                        return
                finally:
                    with server._lock:
                        server.in_flight -= 1
                self._send(*reply)

        return Handler

    def __enter__(self) -> FakeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=10)
