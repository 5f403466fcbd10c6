"""The app factory of the embedded server, and `install_api`, which mounts asyncrl's API on any app.

`install_api(app, engine, config, routers)` is the one way the API gets onto an app, ours or vLLM's:
per-app state (deps.py), the one error body (errors.py), bearer auth (auth.py), then the routers.
`create_app` builds the embedded server's app with every router; starting and stopping the app
starts and stops its engine. Never imports torch or vllm.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.api import completions, template_sandbox, tokens, training
from asyncrl.inference.api.auth import install_auth
from asyncrl.inference.api.backend import Backend, TrainingEngine
from asyncrl.inference.api.deps import BackendDep, install_state
from asyncrl.inference.api.errors import error_response, install_error_handlers
from asyncrl.inference.api.limits import install_limits

router = APIRouter()


@router.get("/health")
async def health(backend: BackendDep):
    if not backend.is_healthy():
        return error_response(503, "engine is not running")
    return {"status": "ok"}


@router.get("/v1/models")
async def models(backend: BackendDep):
    card = dict(object="model", created=int(time.time()), owned_by="asyncrl", max_model_len=backend.max_model_len)
    base = backend.model_name
    data: list[dict[str, Any]] = [dict(id=base, root=base, parent=None, **card)]
    data += [dict(id=n, root=n, parent=base, **card) for n in backend.lora_names()]
    return {"object": "list", "data": data}


def install_api(app: FastAPI, engine: TrainingEngine, config: InferenceConfig, routers: Iterable[APIRouter]) -> None:
    """Serve `routers` on `app` against `engine`, with the one error body, the request limits (limits.py) and
    bearer auth (outermost: a request without the key is refused before its body is read)."""
    install_state(app, engine, config)
    install_error_handlers(app)
    install_limits(app, config.server)
    install_auth(app, config.api_key)
    for r in routers:
        app.include_router(r)


def create_app(backend: Backend, config: InferenceConfig) -> FastAPI:
    """The embedded server's app serving `backend`."""
    app = FastAPI(title="asyncrl inference", lifespan=_lifespan)
    install_api(app, backend, config, [router, completions.router, tokens.router, training.router])
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    backend: Backend = app.state.asyncrl_engine
    trusted = app.state.asyncrl_config.trust_request_chat_template
    if trusted:
        await asyncio.to_thread(template_sandbox.pool().start)
    await backend.start()
    try:
        yield
    finally:
        await backend.shutdown()
        if trusted:
            template_sandbox.pool().close()
