"""A real local HTTP server that plays the model: it answers POST .../chat/completions with scripted
OpenAI-format replies (text and/or tool calls), streamed or not as the request asks, and records every
request body and its headers. Episodes then run through the real client, harness and tool wiring; only the
model's choice of reply is fixed."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# A reply: {"content": str | None, "tool_calls": [(name, arguments dict), ...]} (tool_calls optional).
Reply = dict[str, Any]


class ScriptedServer:
    """`replies`: the replies in order (one per request), or a function of the request body giving the reply.

    Use as a context manager; `url` is the OpenAI base URL (ending in /v1). A request with no reply left
    gets HTTP 500, so a rollout that asks more than the script says fails instead of hanging."""

    def __init__(self, replies: list[Reply] | Callable[[dict], Reply]):
        self.replies = replies if callable(replies) else list(replies)
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.paths: list[str] = []
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_port}/v1"

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def _next_reply(self, body: dict, headers: dict[str, str], path: str) -> Reply | None:
        with self._lock:
            self.requests.append(body)
            self.headers.append(headers)
            self.paths.append(path)
            if callable(self.replies):
                return self.replies(body)
            return self.replies.pop(0) if self.replies else None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                if not self.path.endswith("/chat/completions"):
                    return self._send(404, "application/json", json.dumps({"error": {"message": self.path}}))
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                reply = server._next_reply(body, {k.lower(): v for k, v in self.headers.items()}, self.path)
                if reply is None:
                    error = {"error": {"message": f"scripted server: no reply left for request {len(server.requests)}"}}
                    return self._send(500, "application/json", json.dumps(error))
                if body.get("stream"):
                    return self._send(200, "text/event-stream", sse(reply))
                return self._send(200, "application/json", json.dumps(completion(reply)))

            def _send(self, status: int, content_type: str, text: str) -> None:
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client hung up (a cancelled episode)
                    pass

        return Handler


def message(reply: Reply) -> dict[str, Any]:
    """The reply as an OpenAI assistant message (tool call ids call_0, call_1, ...)."""
    out: dict[str, Any] = {"role": "assistant", "content": reply.get("content")}
    if reply.get("tool_calls"):
        out["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for i, (name, args) in enumerate(reply["tool_calls"])
        ]
    return out


def _finish(reply: Reply) -> str:
    return "tool_calls" if reply.get("tool_calls") else "stop"


USAGE = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


def completion(reply: Reply) -> dict[str, Any]:
    return {
        "id": "chatcmpl-scripted",
        "object": "chat.completion",
        "created": 0,
        "model": "scripted",
        "choices": [{"index": 0, "message": message(reply), "finish_reason": _finish(reply)}],
        "usage": USAGE,
    }


def sse(reply: Reply) -> str:
    """The reply as a chat.completion.chunk stream: the message, the finish reason, the usage, [DONE]."""
    delta = message(reply)
    for i, call in enumerate(delta.get("tool_calls", [])):
        call["index"] = i
    chunks = [
        {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": _finish(reply)}]},
        {"choices": [], "usage": USAGE},
    ]
    head = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 0, "model": "scripted"}
    return "".join(f"data: {json.dumps({**head, **c})}\n\n" for c in chunks) + "data: [DONE]\n\n"
