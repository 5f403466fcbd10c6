"""Start our inference server as a subprocess for eval/synthesize/sft tests, and stop it again."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m asyncrl.entrypoints.inference` serving `model_dir` on a free local port."""

    def __init__(self, model_dir: Path, out: Path, timeout: float = 120.0):
        self.port = free_port()
        self.model = str(model_dir)
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log = out / "server.out"
        out.mkdir(parents=True, exist_ok=True)
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
        self._file = self.log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._file, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start in {timeout}s: {self.log.read_text()[-2000:]}")
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._file.close()

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
