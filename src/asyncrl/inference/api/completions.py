"""OpenAI routes for a `Backend`: POST /v1/chat/completions and /v1/completions (JSON or SSE), with
vLLM's extras (`return_token_ids` -> choices[].token_ids + prompt_token_ids, `top_k`, `min_p`,
`stop_token_ids`, ...; on /v1/completions `prompt_logprobs`, in vLLM's shape: `prompt_logprobs_json`).
On vLLM's app, vLLM's own routes serve these paths.

`serve_chat`, `collect` and the logprob helpers are shared with the token routes (tokens.py). An error
after a stream has started is reported in-band, as an SSE event carrying the one error body.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from loguru import logger

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.api import cpu
from asyncrl.inference.api.backend import Backend, PromptLogprobs, SamplingParams, SeqDelta
from asyncrl.inference.api.chat import ChatOutputParser, chat_ids, check_fits, request_template_kwargs
from asyncrl.inference.api.deps import BackendDep, Config
from asyncrl.inference.api.errors import InvalidRequest, error_body
from asyncrl.inference.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    check_token_ids,
    finite_logprob,
    resolve_max_tokens,
)

_DISCONNECT_POLL_S = 0.5

router = APIRouter()


@dataclass
class ChoiceResult:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = None
    routed_experts: Any = None  # an MoE's routing record, from the last delta (`SeqDelta.routed_experts`)

    def add(self, d: SeqDelta) -> None:
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.routed_experts is not None:
            self.routed_experts = d.routed_experts
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        if d.top_logprobs:
            self.top += d.top_logprobs
        self.text += d.text
        if d.finish_reason is not None:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason


class TokenText:
    """Display strings of single tokens (for logprobs), cached per id; one per tokenizer (`for_tokenizer`)."""

    _shared: dict[int, TokenText] = {}

    @classmethod
    def for_tokenizer(cls, tokenizer) -> TokenText:
        """The shared instance of `tokenizer`, so its cache outlives one request."""
        text = cls._shared.get(id(tokenizer))
        if text is None or text.tokenizer is not tokenizer:
            text = cls._shared[id(tokenizer)] = cls(tokenizer)
        return text

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return s


def token_str(text: TokenText, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else text(token_id)


def chat_logprobs(text: TokenText, ids: list[int], lps: list[float], top: list, as_ids: bool) -> dict[str, Any]:
    """OpenAI chat `logprobs` object: content[] with token, logprob, bytes, top_logprobs."""
    content = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        s = token_str(text, t, as_ids)
        entry = {"token": s, "logprob": finite_logprob(lp), "bytes": list(s.encode("utf-8")), "top_logprobs": []}
        if top and i < len(top):
            for tid, tlp in top[i]:
                ts = token_str(text, tid, as_ids)
                entry["top_logprobs"].append({"token": ts, "logprob": finite_logprob(tlp), "bytes": list(ts.encode())})
        content.append(entry)
    return {"content": content}


def as_token_ids(body: Any) -> bool:
    """Whether the request asked for `token_id:<id>` strings in place of token texts (vLLM's extra)."""
    return bool(body.model_extra and body.model_extra.get("return_tokens_as_token_ids"))


def unique_hex() -> str:
    """32 random hex digits for a response id. Not `uuid4`: its os.urandom releases the GIL, and under load
    the event loop then waits for the engine thread to hand it back (~50 us a request)."""
    return f"{random.getrandbits(128):032x}"


def usage(prompt_len: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_len, "completion_tokens": completion, "total_tokens": prompt_len + completion}


LINE_BREAKS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event. Unicode line separators a model may emit are escaped in the JSON: readers that
    split lines the way str.splitlines does (httpx's aiter_lines) would otherwise cut the event in two."""
    return f"data: {json.dumps(obj, ensure_ascii=False).translate(LINE_BREAKS)}\n\n"


async def collect(request: Request, stream: AsyncIterator[SeqDelta], n: int) -> list[ChoiceResult]:
    """Drain a backend stream into n choices; a client that disconnects aborts the generation."""
    choices = [ChoiceResult() for _ in range(n)]

    async def drain() -> None:
        async with aclosing(stream) as it:
            async for d in it:
                choices[d.index].add(d)

    task = asyncio.ensure_future(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                task.result()
                break
            if await request.is_disconnected():
                logger.debug("client disconnected; aborting its generation")
                break
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return choices


def _tool_parsing(config: InferenceConfig, body: ChatCompletionRequest) -> bool:
    """Whether to parse tool calls out of this request's output."""
    if not body.tools or body.tool_choice == "none":
        return False
    if body.tool_choice == "required" or isinstance(body.tool_choice, dict):
        raise InvalidRequest("tool_choice 'required' or a named function is not supported; use 'auto'", "tool_choice")
    enabled = config.model.enable_auto_tool_choice
    if body.tool_choice == "auto" and not enabled:
        raise InvalidRequest(
            '"auto" tool choice needs the server started with --model.enable-auto-tool-choice '
            "and --model.tool-call-parser hermes",
            param="tool_choice",
        )
    return enabled


def chat_params(backend: Backend, body: ChatCompletionRequest, prompt_ids: list[int]) -> SamplingParams:
    check_token_ids(prompt_ids, backend.vocab_size, "tokens")
    body.check_vocab(backend.vocab_size)
    max_tokens = resolve_max_tokens(body.requested_max_tokens(), len(prompt_ids), backend.max_model_len)
    return body.to_params(max_tokens, body.logprobs_k())


@dataclass
class _ChatRun:
    """One chat request in flight: what shapes its JSON response or its SSE chunks."""

    body: ChatCompletionRequest
    params: SamplingParams
    prompt_ids: list[int]
    model: str
    reasoning_parser: str | None
    parse_tools: bool
    text: TokenText
    as_ids: bool
    rid: str = field(default_factory=lambda: f"chatcmpl-{unique_hex()}")
    created: int = field(default_factory=lambda: int(time.time()))

    def logprobs(self, ids: list[int], lps: list[float], top: list) -> dict[str, Any] | None:
        if self.params.logprobs is None:
            return None
        return chat_logprobs(self.text, ids, lps, top, self.as_ids)

    def response(self, results: list[ChoiceResult]) -> dict[str, Any]:
        choices = []
        for i, r in enumerate(results):
            message = ChatOutputParser(self.reasoning_parser, self.parse_tools).final(r.text)
            finish = "tool_calls" if message.get("tool_calls") and r.finish_reason == "stop" else r.finish_reason
            choice: dict[str, Any] = {
                "index": i,
                "message": message,
                "logprobs": self.logprobs(r.token_ids, r.logprobs, r.top),
                "finish_reason": finish,
                "stop_reason": r.stop_reason,
            }
            if self.body.return_token_ids:
                choice["token_ids"] = r.token_ids
            choices.append(choice)
        out: dict[str, Any] = {
            "id": self.rid,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(len(self.prompt_ids), sum(len(r.token_ids) for r in results)),
        }
        if self.body.return_token_ids:
            out["prompt_token_ids"] = self.prompt_ids
        return out

    async def sse(self, stream: AsyncIterator[SeqDelta]) -> AsyncIterator[str]:
        parsers = [ChatOutputParser(self.reasoning_parser, self.parse_tools) for _ in range(self.params.n)]
        base = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model}
        n_completion = 0
        try:
            first: dict[str, Any] = dict(base, choices=[
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(self.params.n)
            ])  # fmt: skip
            if self.body.return_token_ids:
                first["prompt_token_ids"] = self.prompt_ids
            yield sse(first)
            async with aclosing(stream) as it:
                async for d in it:
                    n_completion += len(d.token_ids)
                    yield sse(dict(base, choices=[self._chunk_choice(parsers[d.index], d)]))
            if self.body.stream_options and self.body.stream_options.include_usage:
                yield sse(dict(base, choices=[], usage=usage(len(self.prompt_ids), n_completion)))
        except Exception as e:  # noqa: BLE001 - the status line is gone; report in-band
            logger.exception("streaming chat completion failed")
            yield sse(error_body(500, str(e)))
        yield "data: [DONE]\n\n"

    def _chunk_choice(self, parser: ChatOutputParser, d: SeqDelta) -> dict[str, Any]:
        delta: dict[str, Any] = parser.delta(d.text)
        finish = d.finish_reason
        if finish is not None:
            for key, value in parser.finish().items():
                delta[key] = delta.get(key, "") + value if isinstance(value, str) else value
            if delta.get("tool_calls") and finish == "stop":
                finish = "tool_calls"
        choice: dict[str, Any] = {
            "index": d.index,
            "delta": delta,
            "logprobs": self.logprobs(d.token_ids, d.logprobs, d.top_logprobs or []),
            "finish_reason": finish,
        }
        if finish is not None:
            choice["stop_reason"] = d.stop_reason
        if self.body.return_token_ids:
            choice["token_ids"] = d.token_ids
        return choice


async def serve_chat(
    backend: Backend, config: InferenceConfig, request: Request, body: ChatCompletionRequest, prompt_ids: list[int]
):
    """Run a chat request whose prompt is already tokenized; JSON or SSE response."""
    lora = backend.resolve_model(body.model)
    run = _ChatRun(
        body=body,
        params=chat_params(backend, body, prompt_ids),
        prompt_ids=prompt_ids,
        model=body.model or backend.model_name,
        reasoning_parser=config.model.reasoning_parser,
        parse_tools=_tool_parsing(config, body),
        text=TokenText.for_tokenizer(backend.tokenizer),
        as_ids=as_token_ids(body),
    )
    stream = backend.generate(prompt_ids, run.params, lora, stream=bool(body.stream))
    if body.stream:
        return StreamingResponse(run.sse(stream), media_type="text/event-stream")
    return JSONResponse(run.response(await collect(request, stream, run.params.n)))


def _completion_logprobs(text: TokenText, r: ChoiceResult, as_ids: bool) -> dict[str, Any]:
    tokens = [token_str(text, t, as_ids) for t in r.token_ids]
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    top = None
    if r.top:
        top = [{token_str(text, t, as_ids): finite_logprob(lp) for t, lp in row} for row in r.top]
    return {
        "tokens": tokens,
        "token_logprobs": [finite_logprob(x) for x in r.logprobs],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def prompt_logprobs_json(
    text: TokenText, prompt: list[int], scores: PromptLogprobs, as_ids: bool, start: int = 0
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then per token {"<id>": {logprob, rank,
    decoded_token}} holding the prompt's own token first, then the top k (ranks 1..k; a prompt token among
    them keeps its place and takes its top-k entry, as in vLLM). Positions before `start` (the request's
    `logprob_start_len`) are None too."""

    def entry(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": finite_logprob(logprob), "rank": rank, "decoded_token": token_str(text, token_id, as_ids)}

    out: list[dict[str, dict[str, Any]] | None] = [None] * min(max(start, 1), len(prompt))
    for i, token_id in enumerate(prompt[len(out) :], len(out) - 1):
        position = {str(token_id): entry(token_id, scores.logprobs[i], scores.ranks[i])}
        for rank, (top_id, logprob) in enumerate(scores.top[i] if scores.top else [], 1):
            position[str(top_id)] = entry(top_id, logprob, rank)
        out.append(position)
    return out


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, backend: BackendDep, config: Config):
    prompt_ids = await chat_ids(
        backend.tokenizer,
        body.messages,
        body.tools,
        body.add_generation_prompt,
        body.continue_final_message,
        request_template_kwargs(body),
        config.trust_request_chat_template,
        backend.max_model_len,
    )
    return await serve_chat(backend, config, request, body, prompt_ids)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, backend: BackendDep):
    lora = backend.resolve_model(body.model)
    prompts = await cpu.run(_completion_prompts, backend, body)
    streams = await _start_all(backend, body, prompts, lora)
    run = _CompletionRun(body, prompts, body.model or backend.model_name, TokenText.for_tokenizer(backend.tokenizer))
    if body.stream:
        return StreamingResponse(_stream_completions(streams, run), media_type="text/event-stream")
    # a JSONResponse, not a dict: FastAPI would walk a returned dict with jsonable_encoder first, which costs
    # ~10x the json.dumps itself on prompt logprobs with top-k (a teacher's answers: ~100 KB each)
    return JSONResponse(run.response(await asyncio.gather(*[collect(request, s, body.n) for s in streams])))


def _completion_prompts(backend: Backend, body: CompletionRequest) -> list[list[int]]:
    """The token ids of each prompt (text is encoded), checked non-empty and within the vocabulary (blocking:
    run through `cpu.run`)."""
    prompts = []
    for p in body.prompts():
        if isinstance(p, str):
            check_fits(backend.tokenizer, p, backend.max_model_len, "prompt")
        ids = backend.tokenizer.encode(p, add_special_tokens=body.add_special_tokens) if isinstance(p, str) else p
        if not ids:
            raise InvalidRequest("prompt is empty", param="prompt")
        check_token_ids(ids, backend.vocab_size, "prompt")
        prompts.append(ids)
    body.check_vocab(backend.vocab_size)
    return prompts


async def _start_all(
    backend: Backend, body: CompletionRequest, prompts: list[list[int]], lora: str | None
) -> list[AsyncIterator[SeqDelta]]:
    """One generation per prompt; if one is refused, the ones already started are aborted."""
    params = [body.to_params(resolve_max_tokens(body.max_tokens, len(ids), backend.max_model_len), body.logprobs)
              for ids in prompts]  # fmt: skip
    streams = []
    try:
        for ids, p in zip(prompts, params):
            streams.append(backend.generate(ids, p, lora, stream=bool(body.stream)))
    except Exception:
        for s in streams:
            await s.aclose()
        raise
    return streams


@dataclass
class _CompletionRun:
    """One /v1/completions request in flight: what shapes its JSON response or its SSE chunks."""

    body: CompletionRequest
    prompts: list[list[int]]
    model: str
    text: TokenText
    rid: str = field(default_factory=lambda: f"cmpl-{unique_hex()}")
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def as_ids(self) -> bool:
        return as_token_ids(self.body)

    def logprobs(self, r: ChoiceResult) -> dict[str, Any] | None:
        return _completion_logprobs(self.text, r, self.as_ids) if self.body.logprobs is not None else None

    def response(self, results: list[list[ChoiceResult]]) -> dict[str, Any]:
        n, choices = self.body.n, []
        for p_idx, (ids, rs) in enumerate(zip(self.prompts, results)):
            for i, r in enumerate(rs):
                choice: dict[str, Any] = {
                    "index": p_idx * n + i,
                    "text": r.text,
                    "logprobs": self.logprobs(r),
                    "finish_reason": r.finish_reason,
                    "stop_reason": r.stop_reason,
                }
                if self.body.return_token_ids:
                    choice["token_ids"] = r.token_ids
                    choice["prompt_token_ids"] = ids
                if self.body.prompt_logprobs is not None:
                    scores = r.prompt_logprobs
                    start = self.body.logprob_start_len or 0
                    choice["prompt_logprobs"] = scores and prompt_logprobs_json(
                        self.text, ids, scores, self.as_ids, start
                    )
                choices.append(choice)
        completion_tokens = sum(len(r.token_ids) for rs in results for r in rs)
        return {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(sum(len(ids) for ids in self.prompts), completion_tokens),
        }


async def _stream_completions(streams: list[AsyncIterator[SeqDelta]], run: _CompletionRun) -> AsyncIterator[str]:
    """SSE chunks of all prompts' generations as they come (choice index: prompt * n + sequence)."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(queue, i, s)) for i, s in enumerate(streams)]
    live, n_completion = len(tasks), 0
    base = {"id": run.rid, "object": "text_completion", "created": run.created, "model": run.model}
    try:
        while live:
            p_idx, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, Exception):
                yield sse(error_body(500, str(item)))
            else:
                n_completion += len(item.token_ids)
                yield sse(dict(base, choices=[_completion_chunk(run, p_idx, item)]))
        if run.body.stream_options and run.body.stream_options.include_usage:
            yield sse(dict(base, choices=[], usage=usage(sum(len(p) for p in run.prompts), n_completion)))
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()


async def _pump(queue: asyncio.Queue, p_idx: int, stream: AsyncIterator[SeqDelta]) -> None:
    """Forward one prompt's deltas to `queue` as (p_idx, delta), then an exception if any, then None."""
    try:
        async with aclosing(stream) as it:
            async for d in it:
                await queue.put((p_idx, d))
    except Exception as e:  # noqa: BLE001
        await queue.put((p_idx, e))
    finally:
        await queue.put((p_idx, None))


def _completion_chunk(run: _CompletionRun, p_idx: int, d: SeqDelta) -> dict[str, Any]:
    r = ChoiceResult()
    r.add(d)
    choice: dict[str, Any] = {
        "index": p_idx * run.body.n + d.index,
        "text": d.text,
        "logprobs": run.logprobs(r),
        "finish_reason": d.finish_reason,
    }
    if run.body.return_token_ids:
        choice["token_ids"] = d.token_ids
        if d.finish_reason is not None:
            choice["prompt_token_ids"] = run.prompts[p_idx]
    return choice
