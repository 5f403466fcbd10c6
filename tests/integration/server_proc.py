"""Start our inference server for tests, and stop it again.

- `ServerProcess`: the `inference` entrypoint as a subprocess, for the eval/synthesize/sft tests;
- `start_server`: any backend in `BACKENDS` with the contract's options (api key, hermes tools, qwen3
  reasoning), the embedded one in this process; used by the contract and the hostile-input suites;
- `serve_in_thread`: an ASGI app on a free local port, in a thread of this process;
- `client`: an HTTP client for a `start_server` server, with its key.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from asyncrl.inference.vllm.launch import INSTALL_HINT, start_vllm_server, vllm_python
from asyncrl.utils.process import free_port, stop_group
from tests import warm

BACKENDS = [
    pytest.param("embedded", id="embedded"),
    pytest.param(
        "vllm",
        id="vllm",
        marks=[pytest.mark.vllm, pytest.mark.skipif(vllm_python() is None, reason=f"no vLLM env: {INSTALL_HINT}")],
    ),
]
API_KEY = "contract-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class ServerProcess:
    """`python -m asyncrl.entrypoints.inference` serving `model_dir` on a free local port."""

    def __init__(self, model_dir: Path, out: Path, timeout: float = 120.0):
        self.port = free_port()
        self.model = str(model_dir)
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log = out / "server.out"
        cmd = [
            sys.executable,
            "-m",
            "asyncrl.entrypoints.inference",
            "--model.name",
            self.model,
            "--server.port",
            str(self.port),
            "--server.host",
            "127.0.0.1",
            "--output-dir",
            str(out),
            "--max-batch-size",
            "32",
            "--log.level",
            "warning",
            "--model.enable-auto-tool-choice",
            "--model.tool-call-parser",
            "hermes",
        ]
        self.proc = warm.serve(cmd, f"http://127.0.0.1:{self.port}/health", self.log, timeout, poll=0.3)

    def stop(self) -> None:
        stop_group(self.proc, 20)

    def run_client(self, cmd: list[str], out: Path, *args: str) -> subprocess.CompletedProcess:
        """Run an `eval`/`synthesize`-style command against this server, writing to `out`."""
        own = ["--model.name", self.model, "--client.base-url", self.url, "--output-dir", str(out)]
        return warm.run([*cmd, *own, *args], capture_output=True, text=True, timeout=400)

    def chat(self, content: str, max_tokens: int = 16) -> httpx.Response:
        return httpx.post(
            f"{self.url}/chat/completions",
            timeout=60,
            json={
                "model": self.model,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
            },
        )


@dataclass
class RunningServer:
    backend: str
    base_url: str
    model: str
    stop: Callable[[], None]
    engine: object | None = None  # the in-process engine, when there is one (lets tests look inside)


def start_server(backend: str, model_dir: Path, **overrides) -> RunningServer:
    """Start `backend` serving `model_dir` with the contract's options; returns when it answers."""
    model = {
        "name": str(model_dir),
        "enable_auto_tool_choice": True,
        "tool_call_parser": "hermes",
        "reasoning_parser": "qwen3",
        "max_model_len": 512,
    }
    if backend == "embedded":
        from asyncrl.config.inference import InferenceConfig
        from asyncrl.inference.api.app import create_app
        from asyncrl.inference.engine import EmbeddedEngine

        # num_threads: keep this test process's torch thread count as it is (the engine is in-process)
        config = InferenceConfig(
            model=model, api_key=API_KEY, max_batch_size=16, num_threads=_torch_threads(), **overrides
        )
        from asyncrl.inference.api.http_server import uvicorn_options

        engine = EmbeddedEngine(config)
        url, stop = serve_in_thread(create_app(engine, config), 60, **uvicorn_options(config.server))
        return RunningServer(backend, url, str(model_dir), stop, engine)
    if backend == "vllm":
        flags = [
            "--model.dtype",
            "float32",
            "--model.enforce-eager",
            "--api-key",
            API_KEY,
            "--model.enable-auto-tool-choice",
            "--model.tool-call-parser",
            "hermes",
            "--model.reasoning-parser",
            "qwen3",
            "--model.max-model-len",
            "512",
            "--enable-lora",
            "--max-lora-rank",
            "8",
        ]
        flags += [a for k, v in overrides.items() for a in (f"--{k.replace('_', '-')}", str(v))]
        srv = start_vllm_server(model_dir, model_dir.parent / "vllm-inference.log", flags)
        return RunningServer(backend, srv.base_url, str(model_dir), srv.stop)
    raise ValueError(f"unknown backend {backend}")


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def serve_in_thread(app, timeout: float, **uvicorn_kwargs) -> tuple[str, Callable[[], None]]:
    """Serve `app` on 127.0.0.1 from a daemon thread; its base URL and a stop function, once it answers."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **uvicorn_kwargs))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("embedded server did not start")
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(30)

    return f"http://127.0.0.1:{port}", stop


def client(server: RunningServer) -> httpx.Client:
    """A client of `server` that sends its API key."""
    return httpx.Client(base_url=server.base_url, headers=AUTH, timeout=120)
