"""A direct episode's model turn: render the prompt, sample from `/inference/v1/generate`, parse the reply.

`GroupSampler.sample(turn, ctx)` gives what verifiers' training client (`TrainClient.get_response`) gives for
the same turn, a verifiers `Response`, at the cost of a request instead of an episode framework:

- the prompt is rendered on the event loop (no worker-thread hop), each distinct prompt once (a group's
  episodes share their first prompt; `RENDER_CACHE` recent renders are kept), a later turn bridged onto
  the previous one's tokens exactly as the training client bridges it;
- concurrent turns with the same rendered prompt and sampling (a group's first turns) go out as ONE request
  with n = k, sent when the event loop has run every task ready at that moment; the server samples the k
  choices independently (the embedded engine and vLLM do) and prefills the prompt once;
- the request goes over one aiohttp pool (no OpenAI SDK request building), its answer parsed with the
  `renderers` package's own response and logprob parsers and `renderer.parse_response`, the reply turned
  into a `Response` by verifiers' own `response_from_generate`.

Invariants:
- The body sent is the training client's (`renderers.client.generate`'s): the model, the prompt ids, the
  sampling params with the renderer's stop ids, `logprobs = 1`, `skip_special_tokens = False` unless set,
  `routed_experts_prompt_start` on a bridged turn, `cache_salt`; plus `n` when k > 1.
- Seeded sampling is never merged (k seeded requests give k equal samples, one seeded n = k request k
  different ones), nor is anything when `merge` is off.
- A failed request (HTTP error, connection error, a short or malformed answer) fails every turn that
  joined it with a `ProviderError` carrying the server's status, as the training client's would.
- A request whose every turn was cancelled is cancelled (its connection closed, so the server stops it).

Private parts used, so that the rules stay the libraries' own (tripwire in tests/unit/orchestrator/test_v1_direct.py;
remove when the libraries make them public): verifiers 0.4.0 `clients.train._is_valid_incremental_tail` (which
turns are bridged), renderers 0.1.12 `client._parse_completion_logprobs` (the answer's logprobs, checked).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from asyncrl.orchestrator.envs.http import tls_context

RENDER_CACHE = 512  # distinct rendered prompts kept (a step's groups' first turns)


@dataclass
class _Batch:
    """Turns with the same prompt and sampling, about to go out as one request."""

    body: dict
    waiters: list[asyncio.Future] = field(default_factory=list)


class GroupSampler:
    """Model turns of direct episodes against one server (`client`: verifiers' TrainClientConfig)."""

    def __init__(self, client: Any, timeout: float | None = None, merge: bool = True) -> None:
        base = str(client.base_url).rstrip("/").removesuffix("/v1")
        self.url, self.models_url = f"{base}/inference/v1/generate", f"{base}/v1/models"
        key = os.environ.get(client.api_key_var) if client.api_key_var else None
        self.headers = {"Authorization": f"Bearer {key or 'EMPTY'}", "Content-Type": "application/json"}
        self.client, self.timeout, self.merge = client, timeout, merge
        self.renderers: dict[str, Any] = {}
        self.rendered: OrderedDict[tuple, Any] = OrderedDict()
        self.open: dict[tuple, _Batch] = {}
        self.limits: dict[str, asyncio.Future] = {}  # model -> its max_model_len (None: unknown)
        self._session: aiohttp.ClientSession | None = None
        self.sent = 0  # requests that went out
        self.turns = 0  # turns they answered

    async def sample(self, turn: Any, ctx: Any) -> Any:
        """The engine's answer to `turn` (a verifiers PendingTurn) as a verifiers Response."""
        from verifiers.v1.clients.train import response_from_generate, serialize_completion, tool_to_wire

        model = ctx.model
        params = ctx.sampling.model_dump(exclude_none=True)
        kwargs, salt = params.pop("chat_template_kwargs", None), params.pop("cache_salt", None)
        renderer = self.renderer(model, kwargs)
        tools = [tool_to_wire(t) for t in turn.tools] if turn.tools else None
        prompt_ids, attribution, bridged = self.render(renderer, turn, tools, params)
        await self.check_length(model, len(prompt_ids))
        body = request_body(model, prompt_ids, params, renderer.get_stop_token_ids(), salt)
        data, choice = await self.generate(body)
        result = parse_choice(renderer, data, choice, prompt_ids, attribution, tools)
        response = response_from_generate(result, model, bridged, None)
        response.raw = serialize_completion(response, model)
        return response

    def renderer(self, model: str, chat_template_kwargs: dict | None) -> Any:
        """One renderer per chat-template kwargs (the training client's pool key), built on first use."""
        key = json.dumps(chat_template_kwargs, sort_keys=True) if chat_template_kwargs else ""
        if key not in self.renderers:
            from renderers import create_renderer
            from renderers.base import load_tokenizer

            name = self.client.renderer_model_name or model
            tokenizer = load_tokenizer(name)
            self.renderers[key] = create_renderer(
                tokenizer, self.client.renderer, chat_template_kwargs=chat_template_kwargs
            )
        return self.renderers[key]

    def render(self, renderer: Any, turn: Any, tools: list | None, params: dict) -> tuple[list[int], Any, Any]:
        """(prompt ids, their attribution, the bridged turn or None), as the training client renders them."""
        from verifiers.v1.clients.train import _is_valid_incremental_tail
        from verifiers.v1.dialects.chat import message_to_wire

        tail = [message_to_wire(m) for m in turn.tail]
        previous = turn.previous_renderer_token_ids() if _is_valid_incremental_tail(tail) else None
        if previous is not None:
            bridged = renderer.bridge_to_next_turn(*previous, tail, tools=tools)
            if bridged is not None:
                params["routed_experts_prompt_start"] = max(turn.path_len - 1, 0)
                return bridged.token_ids, bridged, turn
        rendered = self.render_whole(renderer, turn.prompt, tools)
        return rendered.token_ids, rendered, None

    def render_whole(self, renderer: Any, prompt: list, tools: list | None) -> Any:
        """`renderer.render` of the whole prompt, each distinct one once (among the last RENDER_CACHE)."""
        from verifiers.v1 import graph
        from verifiers.v1.dialects.chat import message_to_wire

        key = (id(renderer), *(graph.message_hash(m) for m in prompt), json.dumps(tools, sort_keys=True))
        cached = self.rendered.get(key)
        if cached is None:
            wire = [message_to_wire(m) for m in prompt]
            cached = renderer.render(wire, tools=tools, add_generation_prompt=True)
            self.rendered[key] = cached
            if len(self.rendered) > RENDER_CACHE:
                self.rendered.popitem(last=False)
        return cached

    async def check_length(self, model: str, prompt_len: int) -> None:
        """The training client's pre-flight: a prompt longer than the server's max_model_len is a 400."""
        from verifiers.v1.errors import ProviderError

        if model not in self.limits:  # one lookup per model, every turn waiting on it (they resume together)
            self.limits[model] = asyncio.ensure_future(self.max_model_len(model))
        limit = await asyncio.shield(self.limits[model])
        if limit is not None and prompt_len > limit:
            raise ProviderError(
                f"Prompt is {prompt_len} tokens, which exceeds the model's max_model_len of {limit}", status_code=400
            )

    async def max_model_len(self, model: str) -> int | None:
        """The server's `max_model_len` for `model` from /v1/models; None when it does not say."""
        try:
            async with self.session().get(self.models_url, headers=self.headers) as reply:
                cards = (await reply.json()).get("data") or []
        except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
            return None
        lens = [c.get("max_model_len") for c in cards if isinstance(c, dict) and c.get("id") == model]
        return lens[0] if lens and isinstance(lens[0], int) else None

    async def generate(self, body: dict) -> tuple[dict, dict]:
        """(the answer, this turn's choice): the request goes out with the others like it on this loop tick."""
        waiter = asyncio.get_running_loop().create_future()
        sp = body["sampling_params"]
        if not self.merge or sp.get("seed") is not None:
            self.send(_Batch(body, [waiter]))
            return await waiter
        key = (body["model"], tuple(body["token_ids"]), json.dumps(sp, sort_keys=True), body.get("cache_salt"))
        batch = self.open.get(key)
        if batch is None:
            batch = self.open[key] = _Batch(body)
            asyncio.get_running_loop().call_soon(self.flush, key)
        batch.waiters.append(waiter)
        return await waiter

    def flush(self, key: tuple) -> None:
        batch = self.open.pop(key, None)
        if batch is not None:
            self.send(batch)

    def send(self, batch: _Batch) -> None:
        """Post the batch; once every turn waiting on it is cancelled (a group dropped), so is the request."""
        task = asyncio.ensure_future(self.post(batch))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

        def gone(_: asyncio.Future) -> None:
            if all(w.cancelled() for w in batch.waiters):
                task.cancel()

        for waiter in batch.waiters:
            waiter.add_done_callback(gone)

    async def post(self, batch: _Batch) -> None:
        """Send one request for the batch's turns; each waiter gets its own choice, or the failure."""
        from verifiers.v1.errors import ProviderError

        k = len(batch.waiters)
        body = batch.body if k == 1 else {**batch.body, "sampling_params": {**batch.body["sampling_params"], "n": k}}
        self.sent, self.turns = self.sent + 1, self.turns + k
        try:
            data = await self.post_json(body)
            choices = data.get("choices") if isinstance(data, dict) else None
            if not isinstance(choices, list) or len(choices) < k:
                raise ProviderError(
                    f"the server answered {k} samples with {len(choices or [])} choices", status_code=502
                )
            outcomes: list[Any] = [(data, choice) for choice in choices[:k]]
        except Exception as e:  # every turn of the request sees the failure
            outcomes = [e] * k
        for waiter, outcome in zip(batch.waiters, outcomes):
            if waiter.done():
                continue
            if isinstance(outcome, Exception):
                waiter.set_exception(outcome)
            else:
                waiter.set_result(outcome)

    async def post_json(self, body: dict) -> dict:
        from renderers.client import parse_generate_response
        from verifiers.v1.errors import ProviderError

        try:
            async with self.session().post(self.url, data=json.dumps(body), headers=self.headers) as reply:
                raw = await reply.read()
                status = reply.status
        except (TimeoutError, aiohttp.ClientError) as e:
            raise ProviderError(f"the inference server could not be reached: {type(e).__name__}: {e}") from e
        if status >= 400:
            raise ProviderError(f"Error code: {status} - {raw.decode(errors='replace')[:2000]}", status_code=status)
        try:
            return parse_generate_response(raw)
        except ValueError as e:
            raise ProviderError(f"the server's answer is not JSON: {e}", status_code=502) from e

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=self.timeout)
            connector = aiohttp.TCPConnector(limit=0, ssl=tls_context())  # the training client's TLS trust
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar()
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def request_body(model: str, prompt_ids: list[int], params: dict, stop_ids: Any, salt: Any) -> dict:
    """`/inference/v1/generate`'s body as `renderers.client.generate` builds it."""
    sp = {**params, "stop_token_ids": stop_ids, "logprobs": 1}
    sp.setdefault("skip_special_tokens", False)
    body = {"model": model, "token_ids": list(prompt_ids), "sampling_params": sp}
    if salt is not None:
        body["cache_salt"] = salt
    return body


def parse_choice(renderer: Any, data: dict, choice: dict, prompt_ids: list, attribution: Any, tools: Any) -> dict:
    """One choice as `renderers.client.generate`'s result dict (what `response_from_generate` reads)."""
    from renderers.base import ToolCallParseStatus
    from renderers.client import _parse_completion_logprobs

    completion_ids = list(choice.get("token_ids") or [])
    effective = list(data.get("prompt_token_ids") or prompt_ids)
    parsed = renderer.parse_response(completion_ids, prompt_ids=effective, tools=tools)
    finish = choice.get("finish_reason")
    if finish == "stop" and any(tc.status == ToolCallParseStatus.OK for tc in parsed.tool_calls):
        finish = "tool_calls"  # the engine's "stop" with a well-formed tool call: the chat loop goes on
    return {
        "request_id": data.get("request_id") or "",
        "prompt_ids": effective,
        "completion_ids": completion_ids,
        "completion_logprobs": _parse_completion_logprobs(choice, completion_ids),
        "content": parsed.content,
        "reasoning_content": parsed.reasoning_content,
        "tool_calls": parsed.tool_calls,
        "finish_reason": finish,
        "routed_experts": choice.get("routed_experts"),
        "sampling_mask": choice.get("sampling_mask"),
        "prompt_attribution": attribution,
    }
