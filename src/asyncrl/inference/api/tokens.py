"""Routes beyond OpenAI's API that RL training needs, for any Backend:

- POST /tokenize, /detokenize                  (vLLM-compatible)
- POST /v1/chat/completions/tokens             (chat request + the exact prompt ids in `tokens`)
- POST /inference/v1/generate                  (token ids in, token ids + logprobs `token_id:<id>` out)
- POST /update_weights, /reload_weights, /load_lora_adapter
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request

from asyncrl.inference.api.app import ServerState
from asyncrl.inference.api.backend import InvalidRequest
from asyncrl.inference.api.chat import render_chat
from asyncrl.inference.api.completions import TokenText, chat_logprobs, collect, serve_chat, usage
from asyncrl.inference.api.schemas import (
    ChatCompletionTokensRequest,
    DetokenizeRequest,
    GenerateRequest,
    LoadLoraRequest,
    TokenizeRequest,
    UpdateWeightsRequest,
    check_token_ids,
    resolve_max_tokens,
)


def router(state: ServerState) -> APIRouter:
    api = APIRouter()
    weights_lock = asyncio.Lock()

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        state.resolve_model(body.model)
        tok = state.backend.tokenizer
        if body.messages is not None:
            ids = render_chat(
                tok,
                body.messages,
                body.tools,
                body.add_generation_prompt,
                body.continue_final_message,
                body.chat_template_kwargs,
            )
            if body.add_special_tokens:
                ids = tok.build_inputs_with_special_tokens(ids)
        else:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tok.encode(body.prompt, add_special_tokens=add)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": state.backend.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = tok.convert_ids_to_tokens(ids)
        return out

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        state.resolve_model(body.model)
        check_token_ids(body.tokens, state.backend.vocab_size, "tokens")
        return {"prompt": state.backend.tokenizer.decode(body.tokens)}

    @api.post("/v1/chat/completions/tokens")
    async def chat_completions_tokens(body: ChatCompletionTokensRequest, request: Request):
        return await serve_chat(state, request, body, list(body.tokens))

    @api.post("/inference/v1/generate")
    async def generate(body: GenerateRequest, request: Request):
        lora = state.resolve_model(body.model)
        sp = body.sampling_params
        backend = state.backend
        check_token_ids(body.token_ids, backend.vocab_size, "token_ids")
        sp.check_vocab(backend.vocab_size, "sampling_params.")
        max_tokens = resolve_max_tokens(sp.max_tokens, len(body.token_ids), backend.max_model_len)
        params = sp.to_params(max_tokens, sp.logprobs)
        results = await collect(request, backend.generate(body.token_ids, params, lora), params.n)
        text = TokenText(backend.tokenizer)
        choices = []
        for i, r in enumerate(results):
            choices.append(
                {
                    "index": i,
                    "token_ids": r.token_ids,
                    "text": r.text,
                    "finish_reason": r.finish_reason,
                    "stop_reason": r.stop_reason,
                    "logprobs": chat_logprobs(text, r.token_ids, r.logprobs, r.top, as_ids=True)
                    if params.logprobs is not None
                    else None,
                }
            )
        return {
            "request_id": f"gen-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": body.model or state.served_name,
            "choices": choices,
            "prompt_token_ids": body.token_ids,
            "usage": usage(len(body.token_ids), sum(len(r.token_ids) for r in results)),
        }

    @api.post("/update_weights")
    async def update_weights(body: UpdateWeightsRequest):
        async with weights_lock:
            await state.backend.update_weights(body.weight_dir)
        return {"status": "ok", "weight_dir": body.weight_dir}

    @api.post("/reload_weights")
    async def reload_weights():
        async with weights_lock:
            await state.backend.reload_weights()
        return {"status": "ok"}

    @api.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraRequest):
        if body.lora_name == state.served_name:
            raise InvalidRequest("lora_name must differ from the served model's name", param="lora_name")
        async with weights_lock:
            await state.backend.load_lora_adapter(body.lora_name, body.lora_path)
        return {"status": "ok", "lora_name": body.lora_name}

    return api
