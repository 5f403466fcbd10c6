"""Start and stop an `inference --backend vllm` server in the vLLM environment, as a child process.

vLLM lives in its own virtualenv (`.venv-vllm`, made by scripts/install_vllm.sh; see that script
for why), so anything running in the main environment (tests, benchmarks, the `rl` launcher) starts
the server through that env's interpreter and talks to it over HTTP only. Never imports vllm.
"""

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[3]
INSTALL_HINT = "run scripts/install_vllm.sh (or set ASYNCRL_VLLM_PYTHON to a python that has vllm)"


def vllm_python() -> Path | None:
    """The interpreter of the vLLM env: $ASYNCRL_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python."""
    configured = os.environ.get("ASYNCRL_VLLM_PYTHON")
    candidate = Path(configured) if configured else REPO_ROOT / ".venv-vllm" / "bin" / "python"
    return candidate if candidate.is_file() and os.access(candidate, os.X_OK) else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """A running vLLM server child; `stop()` ends it and the engine processes it spawned."""

    def __init__(self, proc: subprocess.Popen, base_url: str, log_path: Path):
        self.proc = proc
        self.base_url = base_url  # e.g. http://127.0.0.1:PORT (OpenAI clients want base_url + "/v1")
        self.log_path = log_path

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: reaches EngineCore and workers
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> "VLLMServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_vllm_server(
    model_dir: str | Path,
    log_path: str | Path,
    args: list[str] = (),
    port: int | None = None,
    startup_timeout: float = 300.0,
    kv_cache_gib: int = 1,
) -> VLLMServer:
    """Start `inference --backend vllm --model.name model_dir [args]` and wait until /health answers.

    `args` are more `inference` flags (e.g. `--model.dtype float32`, `--api-key K`, raw vLLM flags).
    Raises RuntimeError with the log's tail if the server dies or does not come up in time.
    """
    if any(a.split("=")[0] in ("--server.port", "--server.host", "--model.name") for a in args):
        raise ValueError("pass the model and port as arguments, not in `args` (the health check needs them)")
    python = vllm_python()
    if python is None:
        raise RuntimeError(f"no vLLM environment: {INSTALL_HINT}")
    port = port or free_port()
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(python), "-m", "asyncrl.entrypoints.inference", "--backend", "vllm",
        "--model.name", str(model_dir), "--server.host", "127.0.0.1", "--server.port", str(port),
        "--output-dir", str(log_path.parent), "--no-log.file", *args,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = VLLMServer(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {proc.returncode}:\n{_tail(log_path)}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.stop()
    raise RuntimeError(f"vLLM server not healthy after {startup_timeout:.0f}s:\n{_tail(log_path)}")


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
