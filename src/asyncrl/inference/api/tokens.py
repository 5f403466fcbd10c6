"""Token routes RL clients use beside OpenAI's, for a `Backend`:

- POST /tokenize, /detokenize                  (vLLM-compatible)
- POST /v1/chat/completions/tokens             (chat request + the exact prompt ids in `tokens`)
- POST /inference/v1/generate                  (token ids in, token ids + logprobs `token_id:<id>` out; from an
                                                engine recording MoE routes, each choice's `routed_experts`:
                                                `transport.routes`' wire dict)

On vLLM's app, vLLM serves /tokenize and /detokenize itself and vllm/routes.py the other two.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from asyncrl.inference.api import cpu
from asyncrl.inference.api.backend import Backend
from asyncrl.inference.api.chat import chat_ids, check_fits, request_template_kwargs
from asyncrl.inference.api.completions import (
    ChoiceResult,
    TokenText,
    chat_logprobs,
    collect,
    serve_chat,
    unique_hex,
    usage,
)
from asyncrl.inference.api.deps import BackendDep, Config
from asyncrl.inference.api.schemas import (
    ChatCompletionTokensRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    check_token_ids,
    resolve_max_tokens,
)
from asyncrl.transport import routes

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, backend: BackendDep, config: Config):
    backend.resolve_model(body.model)
    chat = None if body.messages is None else await _chat_ids(backend, body, config.trust_request_chat_template)
    return await cpu.run(lambda: cpu.json_response(_tokenize(backend, body, chat)))


def _tokenize(backend: Backend, body: TokenizeRequest, chat: list[int] | None) -> dict[str, Any]:
    """/tokenize's answer, given a chat's ids (blocking: run through `cpu.run`)."""
    tok, limit = backend.tokenizer, backend.max_model_len  # what cannot fit the context is refused, as chat does
    if chat is None:
        ids = _prompt_ids(tok, body, limit)
    else:
        ids = with_special_tokens(tok, chat) if body.add_special_tokens else chat
    out: dict[str, Any] = {"count": len(ids), "max_model_len": backend.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = tok.convert_ids_to_tokens(ids)
    return out


async def _chat_ids(backend: Backend, body: TokenizeRequest, trust_request_template: bool) -> list[int]:
    args = (body.messages, body.tools, body.add_generation_prompt, body.continue_final_message)
    kwargs = request_template_kwargs(body)
    return await chat_ids(backend.tokenizer, *args, kwargs, trust_request_template, backend.max_model_len)


def with_special_tokens(tok, ids: list[int]) -> list[int]:
    """`ids` between what encoding with special tokens adds around a text (a BOS, ...), read off a one-letter
    encoding: what vLLM gives a chat tokenized with add_special_tokens (transformers 5 tokenizers have no
    `build_inputs_with_special_tokens`)."""
    bare, full = tok.encode("a", add_special_tokens=False), tok.encode("a", add_special_tokens=True)
    for at in range(len(full) - len(bare) + 1):
        if full[at : at + len(bare)] == bare:
            return full[:at] + ids + full[at + len(bare) :]
    return ids


def _prompt_ids(tok, body: TokenizeRequest, max_model_len: int) -> list[int]:
    check_fits(tok, body.prompt, max_model_len, "prompt")
    add = True if body.add_special_tokens is None else body.add_special_tokens
    return tok.encode(body.prompt, add_special_tokens=add)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, backend: BackendDep):
    backend.resolve_model(body.model)
    check_token_ids(body.tokens, backend.vocab_size, "tokens")
    return {"prompt": backend.tokenizer.decode(body.tokens)}


@router.post("/v1/chat/completions/tokens")
async def chat_completions_tokens(
    body: ChatCompletionTokensRequest, request: Request, backend: BackendDep, config: Config
):
    return await serve_chat(backend, config, request, body, list(body.tokens))


@router.post("/inference/v1/generate")
async def generate(body: GenerateRequest, request: Request, backend: BackendDep):
    lora = backend.resolve_model(body.model)
    sp = body.sampling_params
    check_token_ids(body.token_ids, backend.vocab_size, "token_ids")
    sp.check_vocab(backend.vocab_size, "sampling_params.")
    max_tokens = resolve_max_tokens(sp.max_tokens, len(body.token_ids), backend.max_model_len)
    params = sp.to_params(max_tokens, sp.logprobs)
    results = await collect(request, backend.generate(body.token_ids, params, lora, stream=False), params.n)
    # a JSONResponse, not a dict: FastAPI walks a returned dict with jsonable_encoder first (~1 ms per group of 8
    # choices with logprobs, most of the server's CPU per RL step)
    return JSONResponse(
        {
            "request_id": f"gen-{unique_hex()}",
            "created": int(time.time()),
            "model": body.model or backend.model_name,
            "choices": [_generate_choice(backend, i, r, params.logprobs is not None) for i, r in enumerate(results)],
            "prompt_token_ids": body.token_ids,
            "usage": usage(len(body.token_ids), sum(len(r.token_ids) for r in results)),
        }
    )


def _generate_choice(backend: Backend, index: int, r: ChoiceResult, logprobs: bool) -> dict[str, Any]:
    text = TokenText.for_tokenizer(backend.tokenizer)
    return {
        "index": index,
        "token_ids": r.token_ids,
        "text": r.text,
        "finish_reason": r.finish_reason,
        "stop_reason": r.stop_reason,
        "logprobs": chat_logprobs(text, r.token_ids, r.logprobs, r.top, as_ids=True) if logprobs else None,
        **({"routed_experts": routes.encode(r.routed_experts)} if r.routed_experts is not None else {}),
    }
