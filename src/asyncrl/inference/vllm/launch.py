"""Start and stop an `inference --backend vllm` server as a child process.

Tests, benchmarks and the `rl` launcher start the server with the interpreter `utils.vllm_env` names (this
one where vllm is installed in .venv) and talk to it over HTTP only. Never imports vllm (re-exports
`vllm_python` and `INSTALL_HINT`).
"""

import os
import subprocess
from pathlib import Path

from asyncrl.utils.process import free_port, serve, stop_group
from asyncrl.utils.vllm_env import INSTALL_HINT, vllm_python


class VLLMServer:
    """A running vLLM server child; `stop()` ends it and the engine processes it spawned."""

    def __init__(self, proc: subprocess.Popen, base_url: str, log_path: Path):
        self.proc = proc
        self.base_url = base_url  # e.g. http://127.0.0.1:PORT (OpenAI clients want base_url + "/v1")
        self.log_path = log_path

    def stop(self, timeout: float = 30.0) -> None:
        stop_group(self.proc, timeout)  # its own process group: reaches EngineCore and workers

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
    cmd = [
        str(python), "-m", "asyncrl.entrypoints.inference", "--backend", "vllm",
        "--model.name", str(model_dir), "--server.host", "127.0.0.1", "--server.port", str(port),
        "--output-dir", str(log_path.parent), "--no-log.file", *args,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))}
    url = f"http://127.0.0.1:{port}"
    try:
        proc = serve(cmd, f"{url}/health", log_path, startup_timeout, env, poll=1.0)
    except TimeoutError as e:
        raise RuntimeError(f"vLLM server not healthy: {e}") from None
    return VLLMServer(proc, url, log_path)
