"""`serve(config)`: the one place the engine is chosen; serves until interrupted.

`backend = "embedded"` runs the embedded engine behind the API's app under uvicorn; `"vllm"` hands
over to vLLM's server with the API mounted on it (vllm/server.py). Imports neither torch nor vllm
until an engine is chosen.
"""

from __future__ import annotations

from loguru import logger

from asyncrl.config.inference import InferenceConfig


def serve(config: InferenceConfig) -> None:
    """Serve `config.model` with the configured engine until interrupted (blocking)."""
    logger.info(f"engine: {config.backend} ({config.backend_why})")
    if config.backend == "vllm":
        from asyncrl.inference.vllm.server import run_vllm_server

        run_vllm_server(config)
    else:
        _serve_embedded(config)


def _serve_embedded(config: InferenceConfig) -> None:
    import uvicorn

    from asyncrl.inference.api.app import create_app
    from asyncrl.inference.engine import EmbeddedEngine

    app = create_app(EmbeddedEngine(config), config)
    debug = config.log.level == "debug"
    logger.info(f"serving {config.model.name} on http://{config.server.host}:{config.server.port}")
    uvicorn.run(
        app,
        host=config.server.host,
        port=config.server.port,
        log_level="debug" if debug else "warning",
        access_log=debug,
        timeout_keep_alive=60,
    )
