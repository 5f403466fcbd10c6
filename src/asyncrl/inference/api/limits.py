"""Request limits checked before any route runs: body size (413), valid Unicode (400), message count and JSON
nesting (400).

`RequestLimits` is one ASGI middleware, installed by `install_api` on the embedded app and on vLLM's app:

- a body larger than `server.max_body_mib` is refused at once: from its Content-Length before a byte of it is
  read, or as soon as a streamed (chunked) body passes the limit. The 413 closes the connection (its unread
  body would otherwise be read as the next request);
- a JSON body is parsed off the event loop (in `cpu.run`'s worker thread) and refused if a string in it holds
  a lone UTF-16 surrogate (`"\\ud800"`: valid JSON, but no text: every tokenizer and JSON encoder fails on it),
  if its `messages` has more than `server.max_messages` entries, or if it nests deeper than `MAX_JSON_DEPTH`
  (Python's parsers recurse: a 1 KB body nested 1,000 deep raised RecursionError in every route, a 500). The
  route then parses the same bytes again; that second parse is fast next to the checks it saves.

A lone surrogate reaches a parsed string only from a `\\uD800`-`\\uDFFF` escape or from one decoded as such
(json.loads decodes bytes with "surrogatepass"), so a body whose decoded text holds neither (`_MAY_HOLD_SURROGATE`,
one regex scan) is valid Unicode; only the rest (escaped emoji: surrogate pairs) are re-encoded to find out.

Refusals are the one error body (errors.py), one line.
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from asyncrl.config.inference import ServerConfig
from asyncrl.inference.api import cpu
from asyncrl.inference.api.errors import error_response

MIB = 1024 * 1024
INLINE_BYTES = 64 * 1024  # bodies up to this are checked on the event loop (a thread hop costs more)
_MAY_HOLD_SURROGATE = re.compile(r"[\ud800-\udfff]|\\u[dD][89abcdefABCDEF]")  # a surrogate, or its JSON escape
MAX_JSON_DEPTH = 128  # lists and objects inside each other; a request's deepest (a tool's JSON schema) is far less
_TOO_DEEP = f"request body nests JSON more than {MAX_JSON_DEPTH} levels deep: flatten it"


def install_limits(app, server: ServerConfig) -> None:
    """Check `app`'s requests against `server`'s body size and message count limits."""
    app.add_middleware(RequestLimits, max_body_bytes=int(server.max_body_mib * MIB), max_messages=server.max_messages)


class BodyTooLarge(Exception):
    pass


class RequestLimits:
    def __init__(self, app: ASGIApp, max_body_bytes: int, max_messages: int):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_messages = max_messages

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            return await self._too_large(scope, receive, send)
        try:
            body, disconnected = await self._read_body(receive)
        except BodyTooLarge:
            return await self._too_large(scope, receive, send)
        if disconnected:
            return
        problem = await self._check(body)
        if problem is not None:
            return await error_response(400, problem)(scope, receive, send)
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> tuple[bytes, bool]:
        """The whole body, or (partial body, True) if the client went away first."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", True
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False

    async def _check(self, body: bytes) -> str | None:
        if body.lstrip()[:1] not in (b"{", b"["):
            return None
        if len(body) <= INLINE_BYTES:
            return check_json(body, self.max_messages)
        return await cpu.run(check_json, body, self.max_messages)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = f"{self.max_body_bytes / MIB:g} MiB"
        response = error_response(413, f"request body is larger than {limit} (the server's --server.max-body-mib)")
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def check_json(body: bytes, max_messages: int) -> str | None:
    """Why this JSON body is refused, or None (also None for invalid JSON: the route reports that)."""
    try:
        text = body.decode(json.detect_encoding(body), "surrogatepass")  # as json.loads decodes bytes
        obj = json.loads(text)
    except ValueError:
        return None
    except RecursionError:  # nested deeper than the interpreter's recursion limit
        return _TOO_DEEP
    if _too_deep(text, obj):
        return _TOO_DEEP
    messages = obj.get("messages") if isinstance(obj, dict) else None
    if isinstance(messages, list) and len(messages) > max_messages:  # first: a count needs no second pass
        return f"messages: {len(messages)} messages; at most {max_messages} (the server's --server.max-messages)"
    if _MAY_HOLD_SURROGATE.search(text) and not _valid_unicode(obj):
        return "request body holds a lone UTF-16 surrogate (e.g. \\ud800): strings must be valid Unicode"
    return None


def _too_deep(text: str, obj: Any) -> bool:
    """Whether `obj` (parsed from `text`) nests lists and objects deeper than MAX_JSON_DEPTH; walked only when
    `text` holds that many brackets at all."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return False
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _valid_unicode(obj: Any) -> bool:
    """Whether every string in `obj` is valid Unicode (a full json.dumps: for bodies that may hold a surrogate)."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP layer refuses it
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the app the body already read, then waits on the client as usual."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
