"""The server's one error body, and the exception handlers that answer with it.

Every error, on the embedded app and on vLLM's app alike, is vLLM's shape:
`{"error": {"message": str, "type": <the status' error name>, "param": str | None, "code": <int status>}}`
(`BadRequestError`/400, `AuthenticationError`/401, `NotFoundError`/404, `InternalServerError`/500, ...).
A client's mistake is a 4xx: `InvalidRequest` from any layer, a body that fails validation, an
unknown route. Only a fault of the server is a 5xx. Nothing here imports torch or vllm.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from loguru import logger
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# OpenAI's (and vLLM's) names; any other status gets its HTTP phrase, e.g. 405: MethodNotAllowedError
_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class InvalidRequest(Exception):
    """A request the server refuses (bad field, bad weights dir, unknown adapter, ...): a 4xx answer."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    return "".join(phrase.replace("-", " ").split()) + "Error"


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """The one error body; text that cannot be UTF-8 (a lone surrogate echoed from a request) is escaped."""
    return JSONResponse(error_body(status, _utf8(message), param and _utf8(param)), status_code=status)


def _utf8(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def install_error_handlers(app: FastAPI) -> None:
    """Answer `app`'s errors with the one body. On vLLM's app these replace its validation and HTTP
    error handlers; its remaining ones (engine errors, the catch-all) already answer in this shape."""
    app.add_exception_handler(InvalidRequest, _invalid)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(HTTPException, _http)  # FastAPI's subclass, which vLLM registers by name
    if Exception not in app.exception_handlers:
        app.add_exception_handler(Exception, _internal)
    app.add_middleware(InternalErrors)


async def _invalid(_: Request, exc: InvalidRequest) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param)


async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = validation_message(exc.errors())
    return error_response(400, message, param)


async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail))


async def _internal(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in a request")
    return internal_error(exc)


def internal_error(exc: BaseException) -> JSONResponse:
    return error_response(500, " ".join(f"internal server error: {type(exc).__name__}: {exc}".split()))


class InternalErrors:
    """An unhandled exception is answered here (the one 500 body) and not raised further, so the connection
    stays usable: Starlette's outermost middleware re-raises after answering it, and uvicorn then closes the
    keep-alive connection (the client's next request on it is reset, a pipelined one never answered).
    Only a response already half sent is left to that (nothing else can end it)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = {"start": False, "end": False}

        async def tracking_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent["start"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["end"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if sent["start"] and not sent["end"]:
                raise
            logger.opt(exception=exc).error(f"unhandled error in {scope['method']} {scope['path']}")
            if not sent["start"]:
                await internal_error(exc)(scope, receive, send)


def validation_message(errors: list) -> tuple[str, str | None]:
    """(message, param) of the first error of a failed body validation."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if not isinstance(first, dict):  # some validators (vLLM's content-type check) report plain strings
        return str(first), None
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    msg = first.get("msg", "invalid value")
    return (f"{'.'.join(loc)}: {msg}" if loc else msg), (loc[0] if loc else None)
