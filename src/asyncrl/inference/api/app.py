"""The OpenAI-compatible HTTP server: app factory, auth, OpenAI-style errors, `run_server`.

Backend-agnostic: it serves any `Backend` (the embedded engine by default). The routes live in
routes_openai.py (chat/completions) and routes_extra.py (tokenize, token routes, weights, LoRA);
this module wires them with auth and the error handlers. It never imports vllm or verifiers.
"""

from __future__ import annotations

import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from loguru import logger
from starlette.exceptions import HTTPException as StarletteHTTPException

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.api.backend import Backend, InvalidRequest
from asyncrl.inference.api.chat import TemplateError

_STATUS_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "BadRequestError",
    409: "ConflictError",
    413: "BadRequestError",
    422: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code or _STATUS_TYPES.get(status)}}
    return JSONResponse(body, status_code=status)


@dataclass
class ServerState:
    """What every route needs: the backend and the serving options of the config."""

    backend: Backend
    config: InferenceConfig

    @property
    def served_name(self) -> str:
        return self.backend.model_name

    def resolve_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model); unknown names are 404."""
        if name is None or name == self.served_name:
            return None
        if name in self.backend.lora_names():
            return name
        raise InvalidRequest(
            f"The model `{name}` does not exist. Served: {[self.served_name, *self.backend.lora_names()]}",
            param="model",
            status=404,
            code="model_not_found",
        )


def _auth_dependency(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), api_key):
            raise InvalidRequest("Invalid or missing API key (send 'Authorization: Bearer <key>')", status=401)

    return check


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(loc)
    msg = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', msg)}", None
    return (f"{where}: {msg}" if where else msg), (loc[0] if loc else None)


def create_app(backend: Backend, config: InferenceConfig) -> FastAPI:
    """The FastAPI app serving `backend`; starting/stopping the app starts/stops the backend."""
    from asyncrl.inference.api import completions, tokens

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await backend.start()
        try:
            yield
        finally:
            await backend.shutdown()

    app = FastAPI(title="asyncrl inference", lifespan=lifespan)
    state = ServerState(backend, config)
    app.state.server = state

    @app.exception_handler(InvalidRequest)
    async def _invalid(_: Request, exc: InvalidRequest):
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(TemplateError)
    async def _template(_: Request, exc: TemplateError):
        return error_response(400, str(exc), "messages")

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        logger.exception("unhandled error in a request")
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health():
        if not backend.is_healthy():
            return error_response(503, "engine is not running")
        return {"status": "ok"}

    auth = [Depends(_auth_dependency(config.api_key))]

    @app.get("/v1/models", dependencies=auth)
    async def models():
        created = int(time.time())
        card = dict(object="model", created=created, owned_by="asyncrl", max_model_len=backend.max_model_len)
        data: list[dict[str, Any]] = [dict(id=state.served_name, root=state.served_name, parent=None, **card)]
        data += [dict(id=n, root=n, parent=state.served_name, **card) for n in backend.lora_names()]
        return {"object": "list", "data": data}

    app.include_router(completions.router(state), dependencies=auth)
    app.include_router(tokens.router(state), dependencies=auth)
    return app


def build_backend(config: InferenceConfig) -> Backend:
    from asyncrl.inference.engine import EmbeddedEngine

    return EmbeddedEngine(config)


def run_server(config: InferenceConfig) -> None:
    """Serve `config.model` until interrupted (blocking). backend = "vllm" hands over to vllm_backend."""
    if config.backend == "vllm":
        from asyncrl.inference.vllm.server import run_vllm_server  # imports vllm; only on request

        run_vllm_server(config)
        return
    import uvicorn

    app = create_app(build_backend(config), config)
    level = "debug" if config.log.level == "debug" else "warning"
    logger.info(f"serving {config.model.name} on http://{config.server.host}:{config.server.port}")
    uvicorn.run(
        app,
        host=config.server.host,
        port=config.server.port,
        log_level=level,
        access_log=config.log.level == "debug",
        timeout_keep_alive=60,
    )
