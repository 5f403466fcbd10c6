"""`serve(config, layout)`: the one place the engine is chosen; serves until interrupted.

`backend = "embedded"` runs the embedded engine behind the API's app under uvicorn; `"vllm"` hands
over to vLLM's server with the API mounted on it (vllm/server.py). Imports neither torch nor vllm
until an engine is chosen.

The embedded server first tells glibc's malloc (`keep_freed_memory`) to keep what the process frees for reuse:
by default it returns freed memory at the heap's top to the kernel and serves every block over 128 KiB from a
fresh mmap, so the engine's step-sized tensors (activations, KV buffers as they grow and move) came back as new
zeroed pages, tens of thousands of page faults per burst of requests. The heap then stays near its peak size.
Once the engine and app are built, `gc.freeze()` moves every object so far (torch, transformers, the model) out
of the collector's reach: the full collections a burst of requests sets off no longer walk them, holding the GIL.
"""

from __future__ import annotations

import ctypes
import gc

from loguru import logger

from asyncrl.config.inference import InferenceConfig
from asyncrl.transport.layout import RunLayout


def serve(config: InferenceConfig, layout: RunLayout) -> None:
    """Serve `config.model` with the configured engine until interrupted (blocking); `layout`: the process's run
    (vLLM from another environment writes its config there)."""
    logger.info(f"engine: {config.backend} ({config.backend_why})")
    warn_if_open(config)
    if config.backend == "vllm":
        from asyncrl.inference.vllm.server import run_vllm_server

        run_vllm_server(config, layout)
    else:
        _serve_embedded(config)


LOOPBACK = ("127.0.0.1", "localhost", "::1")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 * 1024 * 1024  # the largest glibc accepts on 64-bit; bigger blocks are still mmapped
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes a C int: free memory at the heap's top is kept up to 2 GiB


def warn_if_open(config: InferenceConfig) -> None:
    """A server others can reach, with no key: anyone there can make it load any dir it can read. Say so."""
    if config.api_key or config.server.host in LOOPBACK:
        return
    where = f"only dirs under {config.allowed_weights_root}" if config.allowed_weights_root else "any dir it can read"
    logger.warning(
        f"no --api-key and bound to {config.server.host}: anyone who reaches port {config.server.port} can "
        f"generate and make this server load {where} (/update_weights, /load_lora_adapter); pass --api-key KEY, "
        "--server.host 127.0.0.1 or --allowed-weights-root DIR"
    )


def _serve_embedded(config: InferenceConfig) -> None:
    import uvicorn

    from asyncrl.inference.api.app import create_app
    from asyncrl.inference.api.http_server import uvicorn_options
    from asyncrl.inference.engine import EmbeddedEngine

    keep_freed_memory()
    app = create_app(EmbeddedEngine(config), config)
    gc.freeze()  # the model, torch and every module: never traversed by the collections a burst of requests sets off
    debug = config.log.level == "debug"
    logger.info(f"serving {config.model.name} on http://{config.server.host}:{config.server.port}")
    uvicorn.run(
        app,
        host=config.server.host,
        port=config.server.port,
        log_level="debug" if debug else "warning",
        access_log=debug,
        **uvicorn_options(config.server),  # deadlines, header size (api/http_server.py)
    )


def keep_freed_memory() -> bool:
    """glibc: trim the heap only past `TRIM_THRESHOLD`, serve blocks up to `MMAP_THRESHOLD` from it (module docstring).
    False where the C library is not glibc (nothing changes)."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
