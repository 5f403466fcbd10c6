"""Where the vLLM environment is: its interpreter, found by file checks only (never imports vllm).

vLLM lives in its own virtualenv (`.venv-vllm`, made by scripts/install_vllm.sh), so config resolution
(`backend = "auto"`), the `rl` launcher and the vLLM server launcher all look it up here. The env is
found from the environment variables or beside the running env, never from this file's location (an
installed wheel has no repo around it).
"""

import os
import sys
from pathlib import Path

INSTALL_HINT = (
    "run scripts/install_vllm.sh (or set ASYNCRL_VLLM_PYTHON to a python that has vllm, "
    "or ASYNCRL_VLLM_VENV to its virtualenv)"
)


def vllm_python() -> Path | None:
    """The vLLM env's interpreter: $ASYNCRL_VLLM_PYTHON, else $ASYNCRL_VLLM_VENV/bin/python, else
    `.venv-vllm/bin/python` beside the running env (sys.prefix), else in the current directory."""
    configured = os.environ.get("ASYNCRL_VLLM_PYTHON")
    if configured:
        return _executable(Path(configured))
    venvs = [os.environ.get("ASYNCRL_VLLM_VENV"), Path(sys.prefix).parent / ".venv-vllm", Path.cwd() / ".venv-vllm"]
    found = (_executable(Path(v) / "bin" / "python") for v in venvs if v)
    return next((p for p in found if p is not None), None)


def _executable(path: Path) -> Path | None:
    return path if path.is_file() and os.access(path, os.X_OK) else None
