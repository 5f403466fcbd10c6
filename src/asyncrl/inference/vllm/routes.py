"""Token routes on vLLM's app beside its own: /v1/chat/completions/tokens and /inference/v1/generate.

- /v1/chat/completions/tokens: vLLM's chat handler, with the rendered prompt replaced by the
  request's `tokens` (text-only chats);
- /inference/v1/generate: vLLM's, but an over-long max_tokens is refused with the API's own context
  check (vLLM would silently shorten it), as is an empty `trace_decode_token_ids` (vLLM: a 500), and
  logprob tokens are named `token_id:N`.

Their errors are vLLM's `ErrorResponse`s, already in the one error body. Imports vllm: vLLM env only.
"""

import copy
from typing import Annotated, ClassVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest, GenerateResponseBase
from vllm.entrypoints.serve.engine.protocol import ErrorResponse

from asyncrl.inference.api.errors import InvalidRequest
from asyncrl.inference.api.schemas import resolve_max_tokens
from asyncrl.inference.vllm.shims import with_token_strings

router = APIRouter()


class ChatTokensRequest(ChatCompletionRequest):
    field_names: ClassVar[set[str] | None] = None  # vLLM caches field names per class
    tokens: list[int] = Field(min_length=1, description="the exact prompt token ids")


def tokens_chat_handler(chat):
    """A copy of vLLM's chat handler whose rendered prompt is replaced by the request's `tokens`."""
    handler = copy.copy(chat)

    async def render_chat_request(request):
        rendered = await chat.render_chat_request(request)
        if isinstance(rendered, ErrorResponse):
            return rendered
        conversation, engine_inputs = rendered
        if len(engine_inputs) != 1 or engine_inputs[0].get("type") != "token":
            raise InvalidRequest("/v1/chat/completions/tokens supports text-only chats", param="tokens")
        engine_input = {k: v for k, v in engine_inputs[0].items() if k not in ("prompt", "prompt_token_offsets")}
        engine_input["prompt_token_ids"] = list(request.tokens)
        return conversation, [engine_input]

    handler.render_chat_request = render_chat_request
    return handler


def _tokens_chat(request: Request):
    return request.app.state.asyncrl_tokens_chat  # tokens_chat_handler(vLLM's), made at startup


def _serving_tokens(request: Request):
    return request.app.state.serving_tokens


def _max_model_len(request: Request) -> int:
    return request.app.state.engine_client.model_config.max_model_len


@router.post("/v1/chat/completions/tokens")
async def chat_completions_tokens(
    request: ChatTokensRequest, raw_request: Request, handler: Annotated[object, Depends(_tokens_chat)]
):
    return _answer(await handler.create_chat_completion(request, raw_request))


@router.post("/inference/v1/generate")
async def generate(
    request: GenerateRequest,
    raw_request: Request,
    serving: Annotated[object, Depends(_serving_tokens)],
    max_model_len: Annotated[int, Depends(_max_model_len)],
):
    sp = request.sampling_params
    if sp.trace_decode_token_ids is not None and not sp.trace_decode_token_ids:  # vLLM: an AssertionError, 500
        raise InvalidRequest("trace_decode_token_ids must be a non-empty list", param="trace_decode_token_ids")
    if sp.max_tokens is not None:
        resolve_max_tokens(sp.max_tokens, len(request.token_ids), max_model_len)
    return _answer(await serving.serve_tokens(request, raw_request), transform=with_token_strings)


def _answer(result, transform=lambda body: body):
    if isinstance(result, ErrorResponse):
        return JSONResponse(result.model_dump(), status_code=result.error.code)
    if isinstance(result, (ChatCompletionResponse, GenerateResponseBase)):
        return JSONResponse(transform(result.model_dump()))
    return StreamingResponse(result, media_type="text/event-stream")
