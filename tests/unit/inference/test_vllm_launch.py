"""Finding vLLM's interpreter: the environment variables first, then this interpreter where vllm is installed."""

import sys
from pathlib import Path

from asyncrl.utils import vllm_env
from asyncrl.utils.vllm_env import vllm_python


def _venv(root: Path) -> Path:
    python = root / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    return python


def test_search_order(tmp_path, monkeypatch):
    for var in ("ASYNCRL_VLLM_PYTHON", "ASYNCRL_VLLM_VENV"):
        monkeypatch.delenv(var, raising=False)
    installed = {"vllm": False}
    monkeypatch.setattr(vllm_env.importlib.util, "find_spec", lambda name: object() if installed[name] else None)
    assert vllm_python() is None
    installed["vllm"] = True
    assert vllm_python() == Path(sys.executable)
    named = _venv(tmp_path / "custom")
    monkeypatch.setenv("ASYNCRL_VLLM_VENV", str(tmp_path / "custom"))
    assert vllm_python() == named
    monkeypatch.setenv("ASYNCRL_VLLM_PYTHON", sys.executable)
    assert vllm_python() == Path(sys.executable)
    monkeypatch.setenv("ASYNCRL_VLLM_PYTHON", str(tmp_path / "missing"))
    assert vllm_python() is None  # a configured interpreter that is not there is not silently replaced
