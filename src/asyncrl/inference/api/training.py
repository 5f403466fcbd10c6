"""The routes RL training drives, written once for both engines: /update_weights, /reload_weights,
/load_lora_adapter, /unload_lora_adapter (a name not loaded: 404).

Mounted on the embedded app and on vLLM's app alike, against the app's `TrainingEngine`. Changes are
serialized on the app's weights lock, and each route answers once the change is live, with the fingerprints
of what was loaded (`fingerprint`: tensor name -> transport/fingerprint.py's digest; null where the engine
gives none). Everything a
client can get wrong that needs no engine (missing fields, an adapter named like the served model
or with a name that is no model name: not 1-128 characters of [A-Za-z0-9._-], a leading '.' or '..',
an adapter path that is no directory or holds a malformed adapter, one adapter more than
`max_lora_adapters`) is refused here, so both engines answer it identically. With `allowed_weights_root`
set, a dir outside it (symlinks and `..` resolved) is refused with 403.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from fastapi import APIRouter

from asyncrl.inference.api.adapter_dir import check_adapter_dir
from asyncrl.inference.api.deps import Config, Engine, WeightsLock
from asyncrl.inference.api.errors import InvalidRequest
from asyncrl.inference.api.schemas import LoadLoraRequest, UnloadLoraRequest, UpdateWeightsRequest
from asyncrl.inference.api.weight_dir import is_dir

router = APIRouter()
ADAPTER_NAME = re.compile(r"^(?!\.)(?!.*\.\.)[A-Za-z0-9._-]{1,128}$")


@router.post("/update_weights")
async def update_weights(body: UpdateWeightsRequest, engine: Engine, lock: WeightsLock, config: Config):
    check_allowed(body.weight_dir, config.allowed_weights_root, "weight_dir")
    async with lock:
        loaded = await engine.update_weights(body.weight_dir)
    return {"status": "ok", "weight_dir": body.weight_dir, "fingerprint": loaded}


@router.post("/reload_weights")
async def reload_weights(engine: Engine, lock: WeightsLock):
    async with lock:
        await engine.reload_weights()
    return {"status": "ok", "weight_dir": None}


@router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraRequest, engine: Engine, lock: WeightsLock, config: Config):
    check_allowed(body.lora_path, config.allowed_weights_root, "lora_path")
    if (off := engine.lora_off()) is not None:
        raise InvalidRequest(off)
    if body.lora_name == engine.model_name:
        raise InvalidRequest("lora_name must differ from the served model's name", param="lora_name")
    check_adapter_name(body.lora_name)
    if not is_dir(body.lora_path):
        raise InvalidRequest(f"lora_path '{body.lora_path}' is not a directory", param="lora_path")
    await asyncio.to_thread(check_adapter_dir, body.lora_path)
    async with lock:
        check_room(engine.lora_names(), body.lora_name, config.max_lora_adapters)
        loaded = await engine.load_lora_adapter(body.lora_name, body.lora_path)
    return {"status": "ok", "lora_name": body.lora_name, "fingerprint": loaded}


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraRequest, engine: Engine, lock: WeightsLock):
    async with lock:
        if body.lora_name not in engine.lora_names():
            raise InvalidRequest(f"no LoRA adapter '{body.lora_name[:128]}' is loaded", param="lora_name", status=404)
        await engine.unload_lora_adapter(body.lora_name)
    return {"status": "ok", "lora_name": body.lora_name}


def check_allowed(path: str, root: Path | None, param: str) -> None:
    if root is not None and not Path(path).resolve().is_relative_to(Path(root).resolve()):
        raise InvalidRequest(
            f"{param} '{path}' is outside the directory this server loads weights from ({root}; "
            "--allowed-weights-root)",
            param=param,
            status=403,
        )


def check_adapter_name(name: str) -> None:
    """An adapter name is a model name in every request and log line: short, printable, no path."""
    if not ADAPTER_NAME.match(name):
        shown = f"{name[:40]!r}{'...' if len(name) > 40 else ''}"
        raise InvalidRequest(
            f"lora_name {shown} is not an adapter name: use 1-128 characters of A-Z a-z 0-9 . _ -, not starting "
            "with '.' and without '..'",
            param="lora_name",
        )


def check_room(loaded: list[str], name: str, limit: int) -> None:
    """A new adapter name fits under `limit` loaded adapters (replacing a loaded one always does)."""
    if name not in loaded and len(loaded) >= limit:
        raise InvalidRequest(
            f"{len(loaded)} LoRA adapters are loaded, the server's limit: load a new step under a loaded "
            "name (it replaces that adapter) or restart the server with a higher --max-lora-adapters",
            param="lora_name",
            status=409,
        )
