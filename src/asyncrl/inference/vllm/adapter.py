"""`VLLMEngine`: the API's `TrainingEngine` over vLLM's engine client (weights and LoRA adapters).

- `update_weights(dir)`: checks the dir against the base checkpoint (tensor names and shapes, from
  safetensors headers only), then reloads the weights in place in every worker (vLLM's
  `reload_weights` plus the tied-weights fix of worker.py, via `collective_rpc`);
- `reload_weights()`: the same from the base model (`model.name`);
- `load_lora_adapter(name, path)`: vLLM's adapter loading (needs `--enable-lora`); a name already
  loaded is replaced in place (a new RL step); answers the fingerprints of what each worker then holds
  (worker.py reads its LoRA manager's copy back); `unload_lora_adapter(name)`: vLLM's unloading.

Every change drops the prefix cache (running requests are recomputed), so no KV computed with the
old weights survives. The API's weights lock serializes calls. Imports vllm: vLLM env only.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from loguru import logger
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

from asyncrl.inference.api.errors import InvalidRequest
from asyncrl.inference.api.weight_dir import Header, check_weight_dir, checkpoint_header


class VLLMEngine:
    """Built once vLLM's app state exists (`engine_client`, `openai_serving_models`)."""

    def __init__(self, app_state, model_name: str):
        self.engine = app_state.engine_client
        self.models = app_state.openai_serving_models
        self.model_name = model_name
        self.expected = _base_header(model_name)

    async def update_weights(self, weight_dir: str) -> dict[str, str] | None:
        await asyncio.to_thread(check_weight_dir, weight_dir, self.expected)
        return await self._load(str(Path(weight_dir).resolve()), fingerprints=True)

    async def reload_weights(self) -> None:
        await self._load(self.model_name)

    async def _load(self, path: str, fingerprints: bool = False) -> dict[str, str] | None:
        kwargs = {"weights_path": path, "fingerprints": fingerprints}
        per_worker = await self.engine.collective_rpc("asyncrl_load_weights", kwargs=kwargs)
        await self.engine.reset_prefix_cache(reset_running_requests=True)
        logger.info(f"serving weights from {path}")
        return per_worker[0] if per_worker else None

    def lora_names(self) -> list[str]:
        return list(self.models.lora_requests)

    def lora_off(self) -> str | None:
        if self.engine.vllm_config.lora_config is None:
            return "LoRA is off: start the server with the vLLM flag --enable-lora"
        return None

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, str] | None:
        replacing = lora_name in self.models.lora_requests  # a new step of the same adapter
        request = LoadLoRAAdapterRequest(lora_name=lora_name, lora_path=lora_path, load_inplace=replacing)
        result = await self.models.load_lora_adapter(request)
        if isinstance(result, ErrorResponse):
            raise InvalidRequest(result.error.message, param=result.error.param, status=result.error.code)
        if replacing:  # cached KV blocks of this adapter were computed with its old weights
            await self.engine.reset_prefix_cache(reset_running_requests=True)
        return await self._adapter_fingerprints(lora_name, lora_path)

    async def _adapter_fingerprints(self, lora_name: str, lora_path: str) -> dict[str, str]:
        """What the workers hold of the adapter, per tensor of its files (worker.py); a worker that differs wins."""
        kwargs = {"lora_id": self.models.lora_requests[lora_name].lora_int_id, "lora_path": lora_path}
        start = time.perf_counter()
        per_worker = await self.engine.collective_rpc("asyncrl_adapter_fingerprints", kwargs=kwargs)
        took_ms = (time.perf_counter() - start) * 1e3
        logger.info(f"adapter {lora_name}: the workers' copies read back in {took_ms:.0f} ms")
        first = per_worker[0]
        return next((w for w in per_worker if w != first), first)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        result = await self.models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=lora_name))
        if isinstance(result, ErrorResponse):
            raise InvalidRequest(result.error.message, param=result.error.param, status=result.error.code)


def _base_header(model_name: str) -> Header | None:
    """Tensor dtypes and shapes of the base checkpoint, which weight dirs must match (None: not on local disk)."""
    base_dir = local_checkpoint_dir(model_name)
    expected = checkpoint_header(base_dir, param="model.name", confine=False) if base_dir else None
    if expected is None:
        logger.warning(f"base checkpoint of {model_name} not found locally: weight dirs are not shape-checked")
    return expected


def local_checkpoint_dir(name: str) -> Path | None:
    """The local directory holding `name`'s weights (a dir, or a hub id already in the HF cache)."""
    if Path(name).is_dir():
        return Path(name)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True, allow_patterns=["*.safetensors", "*.json"]))
    except Exception:
        return None
