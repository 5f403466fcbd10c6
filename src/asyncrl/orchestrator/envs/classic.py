"""Classic (verifiers < 0.4) environments: verifiers' OpenAI client for our server, and running a group.

A classic environment runs through verifiers' own `run_group` with its token client
(`openai_chat_completions_token`), so single-turn, multi-turn and tool environments run unmodified and every
turn comes back with the engine's token ids and sampling logprobs; `eval`/`synthesize` use the plain chat
client, which works against any OpenAI-compatible server. verifiers' classic client modules are imported only
when a client is made.
"""

from __future__ import annotations

import os
from typing import Any

from loguru import logger

from asyncrl.config.orchestrator import ClientConfig

TOKEN_CLIENT = "openai_chat_completions_token"
PLAIN_CLIENT = "openai_chat_completions"  # no token ids: `eval`/`synthesize` against any OpenAI-compatible server


def make_vf_client(cfg: ClientConfig, client_type: str = TOKEN_CLIENT) -> Any:
    """Verifiers' token client for our server, over one aiohttp connection pool.

    `eval`/`synthesize` pass client_type=PLAIN_CLIENT: no token ids, any OpenAI-compatible server.
    aiohttp, not verifiers' default httpx pool: httpcore scans every open connection on each request it
    starts or ends, which with one connection per rollout in flight (128 in the bench job) took most of the
    orchestrator's CPU and made it, not the server, the bottleneck of generation. With
    `cfg.merge_requests`, the rollouts of a group go out as one request (`coalesce.MergingTransport`).
    """
    from openai import AsyncOpenAI, DefaultAioHttpClient, DefaultAsyncHttpxClient
    from verifiers.clients import OpenAIChatCompletionsClient, OpenAIChatCompletionsTokenClient

    from asyncrl.orchestrator.envs.coalesce import MergingTransport  # its HTTP stack: only where a client is made

    classes = {TOKEN_CLIENT: OpenAIChatCompletionsTokenClient, PLAIN_CLIENT: OpenAIChatCompletionsClient}
    try:
        http = DefaultAioHttpClient(timeout=cfg.timeout)
    except RuntimeError as e:  # an openai build without its aiohttp transport: keep httpx's pool
        logger.warning(f"rollouts go through httpx's connection pool, slower with many in flight ({e})")
        http = DefaultAsyncHttpxClient(timeout=cfg.timeout)
    if cfg.merge_requests:
        http._transport = MergingTransport(http._transport)  # the client's one transport (no proxy mounts here)
    key = os.environ.get(cfg.api_key_var) or "EMPTY"
    client = AsyncOpenAI(api_key=key, base_url=cfg.url, max_retries=2, timeout=cfg.timeout, http_client=http)
    return classes[client_type](client)


async def run_classic_group(slot: Any, client: Any, model: str, inputs: list[dict], args: dict) -> list[dict]:
    """A classic slot's group through verifiers' `run_group`: its env's own sampling args under ours; its
    rollouts' first calls merge as one group (`coalesce.one_group`) where the client merges."""
    from asyncrl.orchestrator.envs.coalesce import one_group

    env = slot.env
    extra_body = {**(env.sampling_args.get("extra_body") or {}), **args.get("extra_body", {})}
    merged = {**env.sampling_args, **args, "extra_body": extra_body}
    with one_group(len(inputs)):
        return await env.run_group(inputs, client, model, merged, state_columns=["trajectory"])
