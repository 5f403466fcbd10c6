"""`inference --backend vllm`: vLLM's own OpenAI server, in this process, plus asyncrl's RL endpoints.

vLLM already answers chat/completions (with `return_token_ids`, `prompt_token_ids` and logprobs),
`/tokenize`, `/health` and, with `--enable-scale-out` (always set here), `/inference/v1/generate`.
On top of its app this module adds:

- `POST /update_weights {"weight_dir"}`: checks the dir against the base checkpoint (tensor names and
  shapes, from safetensors headers only), then reloads the weights in place in every worker
  (vLLM's `reload_weights` plus a fix for tied weights, vllm_worker.py, via `collective_rpc`) and
  drops the prefix cache;
- `POST /reload_weights {}`: the same from the base model (`model.name`);
- `POST /load_lora_adapter {lora_name, lora_path}`: vLLM's adapter loading (needs `--enable-lora`);
  a name already loaded is replaced in place (a new RL step) and the prefix cache dropped;
- `POST /v1/chat/completions/tokens`: a chat request whose prompt is exactly `tokens`.

When `api_key` is set, every route but `/health` needs it. Nothing outside this module imports vllm.
"""

import asyncio
import copy
import json
import os
import secrets
from pathlib import Path
from typing import Any

from loguru import logger

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.api.backend import InvalidRequest
from asyncrl.inference.weight_dir import check_weight_dir, checkpoint_shapes
from asyncrl.utils.errors import UserError

UNGUARDED_PATHS = ("/health",)
WORKER_EXTENSION = "asyncrl.inference.vllm.worker.WeightReloadExtension"


# --- config -> vLLM flags -------------------------------------------------------------------------


def build_vllm_argv(config: InferenceConfig) -> list[str]:
    """vLLM server flags equivalent to `config`; `config.vllm_args` come last so they win."""
    m = config.model
    argv = [
        "--model", m.name,
        "--served-model-name", m.name,
        "--dtype", m.dtype,
        "--host", config.server.host,
        "--port", str(config.server.port),
        "--gpu-memory-utilization", str(config.gpu_memory_utilization),
        "--data-parallel-size", str(config.data_parallel_size),
        "--tensor-parallel-size", str(config.tensor_parallel_size),
        "--enable-scale-out",  # registers /inference/v1/generate (token in, token out)
        "--worker-extension-cls", WORKER_EXTENSION,
        # Logprobs of the distribution actually sampled (logits / temperature), what the RL loss's
        # importance ratios need; vLLM's default is the raw, unscaled ones.
        "--logprobs-mode", "processed_logprobs",
    ]  # fmt: skip
    if m.max_model_len is not None:
        argv += ["--max-model-len", str(m.max_model_len)]
    if m.enforce_eager:
        argv.append("--enforce-eager")
    if m.trust_remote_code:
        argv.append("--trust-remote-code")
    if m.enable_auto_tool_choice:
        argv.append("--enable-auto-tool-choice")
    if m.tool_call_parser:
        argv += ["--tool-call-parser", m.tool_call_parser]
    if m.reasoning_parser:
        argv += ["--reasoning-parser", m.reasoning_parser]
    if config.seed is not None:
        argv += ["--seed", str(config.seed)]
    return argv + list(config.vllm_args)


def parse_vllm_args(argv: list[str], passthrough: list[str] = ()):
    """vLLM's own serve parser, so every vLLM flag (and its defaults) is available."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="inference --backend vllm"))
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed what was wrong
        raise UserError(f"vLLM rejected its flags (reason above); pass-through flags were {list(passthrough)}") from e
    validate_parsed_serve_args(args)
    return args


def check_cpu_head_dim(model: str, trust_remote_code: bool) -> None:
    """vLLM's CPU attention supports a few head sizes only; an other one dies at the first request."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from transformers import AutoConfig
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    try:
        cfg = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code).get_text_config()
    except Exception:  # unreadable here: vLLM reports it with more context
        return
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise UserError(f"{model} has head_dim {head_dim}; vLLM on CPU supports {supported} (use --backend embedded)")


# --- weight dirs ----------------------------------------------------------------------------------


def local_checkpoint_dir(name: str) -> Path | None:
    """The local directory holding `name`'s weights (a dir, or a hub id already in the HF cache)."""
    if Path(name).is_dir():
        return Path(name)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True, allow_patterns=["*.safetensors", "*.json"]))
    except Exception:
        return None


# --- routes ---------------------------------------------------------------------------------------


def _error(message: str, status: int = 400, param: str | None = None, err_type: str | None = None):
    from fastapi.responses import JSONResponse

    err_type = err_type or {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}.get(
        status, "InternalServerError"
    )
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


async def _json_body(request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


class WeightUpdater:
    """Serialises weight swaps; the engine applies them between two scheduler steps."""

    def __init__(self, engine_client, base_model: str):
        self.engine = engine_client
        self.base_model = base_model
        base_dir = local_checkpoint_dir(base_model)
        self.expected = checkpoint_shapes(base_dir, param="model.name") if base_dir else None
        if self.expected is None:
            logger.warning(f"base checkpoint of {base_model} not found locally: weight dirs are not shape-checked")
        self.lock = asyncio.Lock()
        self.weight_dir: str | None = None

    async def load(self, weight_dir: str | None) -> None:
        """Load `weight_dir` (None: the base model) into every worker, then drop the prefix cache."""
        if weight_dir is not None:
            check_weight_dir(weight_dir, self.expected)
        path = str(Path(weight_dir).resolve()) if weight_dir is not None else self.base_model
        async with self.lock:
            await self.engine.collective_rpc("asyncrl_load_weights", kwargs={"weights_path": path})
            # Running requests are preempted and recomputed with the new weights: no stale KV survives.
            await self.engine.reset_prefix_cache(reset_running_requests=True)
            self.weight_dir = weight_dir
        logger.info(f"serving weights from {path}")


def _tokens_chat_handler(chat):
    """A copy of vLLM's chat handler whose rendered prompt is replaced by the request's `tokens`."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

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


def _chat_tokens_request_class():
    from typing import ClassVar

    from pydantic import Field
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    class ChatTokensRequest(ChatCompletionRequest):
        field_names: ClassVar[set[str] | None] = None  # vLLM caches field names per class
        tokens: list[int] = Field(min_length=1, description="the exact prompt token ids")

    return ChatTokensRequest


def _with_token_strings(body: dict[str, Any]) -> dict[str, Any]:
    """Add `token: "token_id:N"` next to each `token_id` in generate logprobs (older clients read it)."""
    for choice in body.get("choices") or []:
        for entry in (choice.get("logprobs") or {}).get("content") or []:
            for item in [entry, *(entry.get("top_logprobs") or [])]:
                if "token_id" in item and "token" not in item:
                    item["token"] = f"token_id:{item['token_id']}"
    return body


def _drop_null_assistant_fields(body: bytes) -> bytes:
    """Remove null-valued fields (e.g. `tool_calls: null`) from assistant messages of a chat body."""
    try:
        data = json.loads(body)
    except ValueError:
        return body  # vLLM reports it
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list):
        return body
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "assistant":
            for key in [k for k, v in m.items() if v is None and k != "content"]:
                del m[key]
    return json.dumps(data).encode()


class NullAssistantFieldsMiddleware:
    """verifiers sends earlier assistant turns back as `{"content": null, "tool_calls": null, ...}` when
    a turn was all reasoning; vLLM's schema rejects that combination (OpenAI's accepts it), so such
    null fields are dropped from chat bodies before vLLM parses them."""

    PATHS = ("/tokenize", "/v1/chat/completions", "/v1/chat/completions/tokens")

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope["path"] not in self.PATHS:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # disconnected while sending the body
                return await self.app(scope, receive, send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = _drop_null_assistant_fields(b"".join(chunks))
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # later messages (disconnects) come from the client
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def attach_asyncrl_routes(app, config: InferenceConfig) -> None:
    """Add asyncrl's endpoints and api-key guard to vLLM's app; ours replace vLLM's on the same path."""
    from fastapi import APIRouter, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from fastapi.routing import APIRoute
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest, GenerateResponseBase
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    ChatTokensRequest = _chat_tokens_request_class()
    router = APIRouter()

    def answer(result, transform=lambda body: body):
        if isinstance(result, ErrorResponse):
            return JSONResponse(result.model_dump(), status_code=result.error.code)
        if isinstance(result, (ChatCompletionResponse, GenerateResponseBase)):
            return JSONResponse(transform(result.model_dump()))
        return StreamingResponse(result, media_type="text/event-stream")

    @router.post("/update_weights")
    async def update_weights(request: Request):
        body = await _json_body(request)
        weight_dir = body.get("weight_dir")
        if not isinstance(weight_dir, str) or not weight_dir:
            raise InvalidRequest("'weight_dir' (a directory path) is required", param="weight_dir")
        await request.app.state.asyncrl_weights.load(weight_dir)
        return {"status": "ok", "weight_dir": weight_dir}

    @router.post("/reload_weights")
    async def reload_weights(request: Request):
        await request.app.state.asyncrl_weights.load(None)
        return {"status": "ok", "weight_dir": None}

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await _json_body(request)
        for key in ("lora_name", "lora_path"):
            if not isinstance(body.get(key), str) or not body[key]:
                raise InvalidRequest(f"'{key}' (a string) is required", param=key)
        if request.app.state.engine_client.vllm_config.lora_config is None:
            raise InvalidRequest("LoRA is off: start the server with the vLLM flag --enable-lora")
        if not Path(body["lora_path"]).is_dir():
            raise InvalidRequest(f"lora_path '{body['lora_path']}' is not a directory", param="lora_path")
        models = request.app.state.openai_serving_models
        replacing = body["lora_name"] in models.lora_requests  # a new step of the same adapter
        lora = LoadLoRAAdapterRequest(lora_name=body["lora_name"], lora_path=body["lora_path"], load_inplace=replacing)
        result = await models.load_lora_adapter(lora)
        if isinstance(result, ErrorResponse):
            return JSONResponse(result.model_dump(), status_code=result.error.code)
        if replacing:  # cached KV blocks of this adapter were computed with its old weights
            await request.app.state.engine_client.reset_prefix_cache(reset_running_requests=True)
        return {"status": "ok", "lora_name": body["lora_name"]}

    @router.post("/v1/chat/completions/tokens")
    async def chat_completions_tokens(request: ChatTokensRequest, raw_request: Request):
        return answer(await raw_request.app.state.asyncrl_tokens_chat.create_chat_completion(request, raw_request))

    @router.post("/inference/v1/generate")
    async def generate(request: GenerateRequest, raw_request: Request):
        # vLLM silently shortens an over-long max_tokens here (its chat route refuses it): refuse too.
        max_len = raw_request.app.state.engine_client.model_config.max_model_len
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and len(request.token_ids) + max_tokens > max_len:
            raise InvalidRequest(
                f"prompt ({len(request.token_ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len {max_len}",
                param="max_tokens",
            )
        result = await raw_request.app.state.serving_tokens.serve_tokens(request, raw_request)
        return answer(result, transform=_with_token_strings)

    ours = {(r.path, m) for r in router.routes for m in r.methods}
    app.router.routes[:] = [
        r for r in app.router.routes if not (isinstance(r, APIRoute) and any((r.path, m) in ours for m in r.methods))
    ]
    app.include_router(router)

    app.middleware_stack = None  # vLLM built its stack already; rebuilt lazily with ours in it
    app.add_middleware(NullAssistantFieldsMiddleware)

    @app.exception_handler(InvalidRequest)
    async def _invalid(_: Request, exc: InvalidRequest):
        return _error(exc.message, exc.status, exc.param)

    if config.api_key:
        expected = f"Bearer {config.api_key}".encode()

        @app.middleware("http")
        async def _require_key(request: Request, call_next):
            if request.url.path not in UNGUARDED_PATHS and request.method != "OPTIONS":
                if not secrets.compare_digest(request.headers.get("authorization", "").encode(), expected):
                    return _error("missing or wrong API key (send 'Authorization: Bearer <key>')", 401)
            return await call_next(request)


async def _init_asyncrl_state(app, engine_client, config: InferenceConfig) -> None:
    app.state.asyncrl_weights = await asyncio.to_thread(WeightUpdater, engine_client, config.model.name)
    app.state.asyncrl_tokens_chat = _tokens_chat_handler(app.state.openai_serving_chat)


# --- serving --------------------------------------------------------------------------------------


async def _serve(args, config: InferenceConfig) -> None:
    """vLLM's single-API-server startup (entry.run_server), with our routes added to its app."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config

    listen_address, sock = setup_server(args, reuse_port=False)
    try:
        async with build_async_engine_client(args) as engine_client:
            tasks = await engine_client.get_supported_tasks()
            if "generate" not in tasks:
                raise UserError(f"{config.model.name} cannot generate text (vLLM tasks: {tasks})")
            app = build_app(args, tasks, engine_client.model_config)
            attach_asyncrl_routes(app, config)
            await init_app_state(engine_client, app.state, args, tasks)
            await _init_asyncrl_state(app, engine_client, config)
            uvicorn_kwargs = {}
            if (log_config := get_uvicorn_log_config(args)) is not None:
                uvicorn_kwargs["log_config"] = log_config
            logger.info(f"vLLM server with asyncrl routes on {listen_address}")
            shutdown = await serve_http(
                app,
                sock=sock,
                host=args.host,
                port=args.port,
                log_level=args.uvicorn_log_level,
                access_log=not args.disable_uvicorn_access_log,
                ssl_keyfile=args.ssl_keyfile,
                ssl_certfile=args.ssl_certfile,
            )
        await shutdown
    finally:
        sock.close()


def run_vllm_server(config: InferenceConfig) -> None:
    """Serve `config.model` with vLLM until interrupted (blocks)."""
    try:
        import uvloop
        import vllm  # noqa: F401
    except ImportError as e:
        raise UserError(
            f"--backend vllm needs vLLM ({e}); install it with scripts/install_vllm.sh and run .venv-vllm/bin/inference"
        ) from e
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # what vLLM's own CLI sets
    argv = build_vllm_argv(config)
    args = parse_vllm_args(argv, config.vllm_args)
    check_cpu_head_dim(config.model.name, config.model.trust_remote_code)
    logger.info(f"starting vLLM {vllm.__version__} for {config.model.name}: {json.dumps(argv)}")
    try:
        uvloop.run(_serve(args, config))
    except KeyboardInterrupt:
        logger.info("vLLM server stopped")
