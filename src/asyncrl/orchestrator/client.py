"""HTTP control calls to the inference server: wait for health, load weights, return to the base model.

Rollout requests themselves go through verifiers' token client (see `envs/classic.py`); this is the admin
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

from asyncrl.config.orchestrator import ClientConfig, EndpointConfig
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


def root_client(config: EndpointConfig) -> httpx.AsyncClient:
    """An HTTP client at the server's root (admin routes; the OpenAI API under /v1), sending the key held by
    `config.api_key_var` as a Bearer token when that variable is set."""
    api_key = os.environ.get(config.api_key_var)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(base_url=server_root(config.url), headers=headers, timeout=config.timeout)


async def is_healthy(http: httpx.AsyncClient) -> bool:
    try:
        response = await http.get("/health", timeout=5.0)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


async def wait_healthy(http: httpx.AsyncClient, what: str, root: str, timeout: float, hint: str, poll: float) -> None:
    """Block until `what` (e.g. "inference server") answers 200 at /health; after `timeout` seconds a UserError
    naming its root URL, then `hint`."""
    start, logged = time.monotonic(), False
    while not await is_healthy(http):
        waited = time.monotonic() - start
        if waited > timeout:
            raise UserError(f"{what} at {root} not reachable after {timeout:.0f}s; {hint}")
        if not logged and waited > 2.0:
            logger.info(f"waiting for the {what} at {root} ...")
            logged = True
        await asyncio.sleep(poll)


def key_refused(what: str, who: str, root: str, status: int, api_key_var: str, option: str) -> UserError:
    """The one line for a server (`what`, called `who` after) that refused our API key (401/403): what
    $api_key_var holds, and `option`, the setting that names another variable."""
    held = "is empty" if not os.environ.get(api_key_var) else f"holds a key the {who} refuses"
    return UserError(
        f"{what} at {root} refused the API key ({status}): ${api_key_var} {held}; export the {who}'s --api-key "
        f"there, or name another variable with {option}"
    )


class InferenceClient:
    """Async admin client for one inference server."""

    def __init__(self, config: ClientConfig):
        self.url = config.url
        self.root = server_root(config.url)
        self.api_key_var = config.api_key_var
        self._http = root_client(config)

    async def close(self) -> None:
        await self._http.aclose()

    async def is_healthy(self) -> bool:
        return await is_healthy(self._http)

    async def wait_healthy(self, timeout: float = 600.0, poll: float = 0.1) -> None:
        """Block until `/health` answers 200; a UserError naming the URL after `timeout` seconds."""
        await wait_healthy(self._http, "inference server", self.root, timeout, start_hint(self.url), poll)

    async def check_key(self) -> None:
        """A UserError when the server refuses our API key (/health answers without one; `/v1/models` does not)."""
        try:
            response = await self._http.get("/v1/models", timeout=10.0)
        except httpx.HTTPError:
            return  # reachable a moment ago: the requests themselves will tell
        if response.status_code in (401, 403):
            status, var = response.status_code, self.api_key_var
            raise key_refused("inference server", "server", self.root, status, var, "--client.api-key-var")

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

    async def update_weights(self, weight_dir: str | Path) -> dict[str, str] | None:
        """Make the server load the HF weights in `weight_dir` (its prefix cache is reset too); the fingerprints
        of what it loaded, when it gives them."""
        answer = await self._post("/update_weights", {"weight_dir": str(Path(weight_dir).resolve())})
        return answer.get("fingerprint")

    async def load_lora_adapter(self, name: str, adapter_dir: str | Path) -> dict[str, str] | None:
        """Make the server load (or replace) the LoRA adapter `name` from the PEFT dir `adapter_dir`; the
        fingerprints of what it loaded, when it gives them."""
        body = {"lora_name": name, "lora_path": str(Path(adapter_dir).resolve())}
        return (await self._post("/load_lora_adapter", body)).get("fingerprint")

    async def reload_weights(self) -> None:
        """Make the server go back to the base model's weights."""
        await self._post("/reload_weights", {})

    async def _post(self, path: str, body: dict) -> dict:
        try:
            response = await self._http.post(path, json=body)
        except httpx.HTTPError as e:
            raise RuntimeError(f"POST {self.root}{path} failed: {e!r}; {start_hint(self.url)}") from e
        if response.status_code != 200:
            raise RuntimeError(f"POST {self.root}{path} answered {response.status_code}: {response.text[:500]}")
        try:
            answer = response.json()
        except ValueError:
            return {}
        return answer if isinstance(answer, dict) else {}
