"""Start our inference server as a subprocess for eval/synthesize/sft tests, and stop it again."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from asyncrl.utils.process import free_port, serve, stop_group


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
        self.proc = serve(cmd, f"http://127.0.0.1:{self.port}/health", self.log, timeout, poll=0.3)

    def stop(self) -> None:
        stop_group(self.proc, 20)

    def run_client(self, cmd: list[str], out: Path, *args: str) -> subprocess.CompletedProcess:
        """Run an `eval`/`synthesize`-style command against this server, writing to `out`."""
        own = ["--model.name", self.model, "--client.base-url", self.url, "--output-dir", str(out)]
        return subprocess.run([*cmd, *own, *args], capture_output=True, text=True, timeout=400)

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
