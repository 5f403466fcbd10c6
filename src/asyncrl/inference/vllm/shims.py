"""Request and response rewrites that let vLLM serve what RL clients send and read; no vllm imports.

- `NullAssistantFieldsMiddleware`: drops null fields of assistant turns from chat bodies (verifiers
  sends `{"content": null, "tool_calls": null, ...}` for an all-reasoning turn; vLLM's schema rejects it),
  and refuses a /v1/chat/completions body that is no chat request (`ChatShape`: roles, content, tools,
  JSON types, where vLLM's schema is laxer than OpenAI's) with the embedded engine's 400 and error body;
- `NullAssistantFieldsMiddleware` also refuses a Responses API `input` whose assistant message item has
  no text first (`responses_input_error`; vLLM reads `content[0].text` and answers 500);
- `ErrorBodyMiddleware`: rewrites vLLM's own error answers that are not the one error body (the Responses
  routes' `type: invalid_request_error`, the Anthropic routes' `{"type": "error", "error": {...}}`) into
  it, so every error on vLLM's app reads the same (an Anthropic client still finds `error.message`);
- `with_token_strings`: adds `token: "token_id:N"` beside each `token_id` of /inference/v1/generate
  logprobs, as the embedded engine answers.

Both leave anything they do not recognize untouched (vLLM reports it).
"""

import json
from typing import Any

from pydantic import ValidationError

from asyncrl.inference.api.errors import error_body, error_response, validation_message
from asyncrl.inference.api.schemas import ChatShape


def with_token_strings(body: dict[str, Any]) -> dict[str, Any]:
    """Add `token: "token_id:N"` next to each `token_id` in generate logprobs (older clients read it)."""
    for choice in body.get("choices") or []:
        for entry in (choice.get("logprobs") or {}).get("content") or []:
            for item in [entry, *(entry.get("top_logprobs") or [])]:
                if "token_id" in item and "token" not in item:
                    item["token"] = f"token_id:{item['token_id']}"
    return body


def shape_error(body: bytes) -> tuple[str, str | None] | None:
    """(message, param) when a chat body fails `ChatShape`, as the embedded engine words it; else None."""
    try:
        ChatShape.model_validate_json(body)
    except ValidationError as e:
        if any(err.get("type") == "json_invalid" for err in e.errors()):
            return None  # vLLM reports it
        return validation_message(e.errors(include_url=False))
    return None


def responses_input_error(body: bytes) -> tuple[str, str | None] | None:
    """(message, param) when a Responses API `input` holds an assistant message item vLLM cannot read (it takes
    the text of the item's first content part: none, or a refusal, is an IndexError / AttributeError there)."""
    try:
        data = json.loads(body)
    except ValueError:
        return None  # vLLM reports it
    items = data.get("input") if isinstance(data, dict) else None
    for i, item in enumerate(items if isinstance(items, list) else []):
        if not isinstance(item, dict) or (item.get("role"), item.get("type")) != ("assistant", "message"):
            continue
        content = item.get("content")
        if isinstance(content, list) and not (content and isinstance(content[0], dict) and "text" in content[0]):
            return f"input[{i}].content: an assistant message item must start with an output_text part", "input"
    return None


def drop_null_assistant_fields(body: bytes) -> bytes:
    """Remove null-valued fields (e.g. `tool_calls: null`) from assistant messages of a chat body."""
    try:
        data = json.loads(body)
    except ValueError:
        return body  # vLLM reports it
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list):
        return body
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "assistant":
            for key in [k for k, v in m.items() if v is None and k != "content"]:
                del m[key]
    return json.dumps(data).encode()


class NullAssistantFieldsMiddleware:
    """verifiers sends earlier assistant turns back as `{"content": null, "tool_calls": null, ...}` when
    a turn was all reasoning; vLLM's schema rejects that combination (OpenAI's accepts it), so such
    null fields are dropped from chat bodies before vLLM parses them. Bodies that fail a check of CHECKS
    are refused here with a 400."""

    PATHS = ("/tokenize", "/v1/chat/completions", "/v1/chat/completions/tokens",
             "/v1/responses", "/v1/responses/render")  # fmt: skip
    CHECKS = {"/v1/chat/completions": shape_error, "/v1/responses": responses_input_error,
              "/v1/responses/render": responses_input_error}  # fmt: skip

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope["path"] not in self.PATHS:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # disconnected while sending the body
                return await self.app(scope, receive, send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = drop_null_assistant_fields(b"".join(chunks))
        check = self.CHECKS.get(scope["path"])
        if check is not None and (bad := check(body)) is not None:
            return await error_response(400, *bad)(scope, receive, send)
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # later messages (disconnects) come from the client
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


class ErrorBodyMiddleware:
    """Error answers (status >= 400) that are another JSON error body are sent as the one error body.

    vLLM answers most errors in the one body already; some handlers write their own (the Responses API's
    `invalid_request_error` type, the Anthropic API's shape). Every other answer passes untouched.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, chunks = None, []

        async def send_fixed(message):
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the whole body is known
                return
            if start is None or message["type"] != "http.response.body":
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = one_error_body(b"".join(chunks), start["status"])
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, send_fixed)


def one_error_body(body: bytes, status: int) -> bytes:
    """`body` as the one error body when it is another error body (`{"error": {"message": ...}, ...}`)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return body
    param = error.get("param") if isinstance(error.get("param"), str) else None
    fixed = error_body(status, error["message"], param)
    return body if data == fixed else json.dumps(fixed).encode()
