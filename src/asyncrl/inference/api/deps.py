"""Per-app state the routes get through `Depends`: the engine, the config and the weights lock.

`install_state` puts them on `app.state` once per app (ours or vLLM's; names prefixed `asyncrl_` so
they never clash with vLLM's); routes read them per request, as parameters annotated `Engine`,
`BackendDep`, `Config` or `WeightsLock`, and never close over them. The getters are `async def` so
FastAPI runs them on the event loop (a plain `def` dependency costs a worker-thread hop per request).
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import Depends, FastAPI, Request

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.api.backend import Backend, TrainingEngine


def install_state(app: FastAPI, engine: TrainingEngine, config: InferenceConfig) -> None:
    app.state.asyncrl_engine = engine
    app.state.asyncrl_config = config
    app.state.asyncrl_weights_lock = asyncio.Lock()  # one weight or adapter change at a time


async def get_engine(request: Request) -> TrainingEngine:
    return request.app.state.asyncrl_engine


async def get_backend(request: Request) -> Backend:
    """The engine, for the routes only an engine that implements the whole `Backend` serves."""
    return request.app.state.asyncrl_engine


async def get_config(request: Request) -> InferenceConfig:
    return request.app.state.asyncrl_config


async def get_weights_lock(request: Request) -> asyncio.Lock:
    return request.app.state.asyncrl_weights_lock


Engine = Annotated[TrainingEngine, Depends(get_engine)]
BackendDep = Annotated[Backend, Depends(get_backend)]
Config = Annotated[InferenceConfig, Depends(get_config)]
WeightsLock = Annotated[asyncio.Lock, Depends(get_weights_lock)]
