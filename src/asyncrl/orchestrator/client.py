"""HTTP control calls to the inference server: wait for health, load weights, return to the base model.

Rollout requests themselves go through verifiers' token client (see `envs.py`); this is the admin
side: `GET /health`, `POST /update_weights {"weight_dir": ...}`, `POST /reload_weights {}`, all at
the server root (the OpenAI API lives under `/v1`).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
from loguru import logger

from asyncrl.config.orchestrator import ClientConfig
from asyncrl.core.errors import UserError


def server_root(url: str) -> str:
    """`http://host:port/v1` -> `http://host:port` (the admin endpoints live at the root)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def start_hint(url: str) -> str:
    return (
        f"start one with `inference @ infer.toml` (or `inference --model.name <model> --server.port <port>`) "
        f"or point the orchestrator at a running one with --client.base-url (now {url})"
    )


class InferenceClient:
    """Async admin client for one inference server."""

    def __init__(self, config: ClientConfig):
        self.url = config.url
        self.root = server_root(config.url)
        headers = {}
        self.api_key_var = config.api_key_var
        api_key = os.environ.get(config.api_key_var)
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.AsyncClient(base_url=self.root, headers=headers, timeout=config.timeout)

    async def close(self) -> None:
        await self._http.aclose()

    async def is_healthy(self) -> bool:
        try:
            response = await self._http.get("/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def wait_healthy(self, timeout: float = 600.0, poll: float = 0.1) -> None:
        """Block until `/health` answers 200; a UserError naming the URL after `timeout` seconds."""
        start = time.monotonic()
        logged = False
        while not await self.is_healthy():
            waited = time.monotonic() - start
            if waited > timeout:
                raise UserError(
                    f"inference server at {self.root} not reachable after {timeout:.0f}s; {start_hint(self.url)}"
                )
            if not logged and waited > 2.0:
                logger.info(f"waiting for the inference server at {self.root} ...")
                logged = True
            await asyncio.sleep(poll)

    async def check_key(self) -> None:
        """A UserError when the server refuses our API key (/health answers without one; `/v1/models` does not)."""
        try:
            response = await self._http.get("/v1/models", timeout=10.0)
        except httpx.HTTPError:
            return  # reachable a moment ago: the requests themselves will tell
        if response.status_code in (401, 403):
            held = "is empty" if not os.environ.get(self.api_key_var) else "holds a key the server refuses"
            raise UserError(
                f"inference server at {self.root} refused the API key ({response.status_code}): ${self.api_key_var} "
                f"{held}; export the server's --api-key there, or name another variable with --client.api-key-var"
            )

    async def tokenize(self, model: str, text: str) -> dict:
        """The server's /tokenize answer for `text` (its `tokens`, and whatever else it says)."""
        try:
            response = await self._http.post("/tokenize", json={"model": model, "prompt": text})
        except httpx.HTTPError as e:
            raise RuntimeError(f"POST {self.root}/tokenize failed: {e!r}; {start_hint(self.url)}") from e
        if response.status_code != 200:
            raise UserError(
                f"inference server at {self.root} answered /tokenize with {response.status_code} "
                f"({response.text[:200]}); distillation checks the teacher's tokenizer against it there"
            )
        return response.json()

    async def update_weights(self, weight_dir: str | Path) -> None:
        """Make the server load the HF weights in `weight_dir` (its prefix cache is reset too)."""
        await self._post("/update_weights", {"weight_dir": str(Path(weight_dir).resolve())})

    async def load_lora_adapter(self, name: str, adapter_dir: str | Path) -> None:
        """Make the server load (or replace) the LoRA adapter `name` from the PEFT dir `adapter_dir`."""
        await self._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(Path(adapter_dir).resolve())})

    async def reload_weights(self) -> None:
        """Make the server go back to the base model's weights."""
        await self._post("/reload_weights", {})

    async def _post(self, path: str, body: dict) -> None:
        try:
            response = await self._http.post(path, json=body)
        except httpx.HTTPError as e:
            raise RuntimeError(f"POST {self.root}{path} failed: {e!r}; {start_hint(self.url)}") from e
        if response.status_code != 200:
            raise RuntimeError(f"POST {self.root}{path} answered {response.status_code}: {response.text[:500]}")
