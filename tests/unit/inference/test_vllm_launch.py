"""Finding the vLLM env: the environment variables first, then `.venv-vllm` beside the running env, then here."""

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
    monkeypatch.setattr(vllm_env.sys, "prefix", str(tmp_path / "envs" / ".venv"))
    monkeypatch.chdir(tmp_path)
    assert vllm_python() is None
    here = _venv(tmp_path / ".venv-vllm")
    assert vllm_python() == here
    beside = _venv(tmp_path / "envs" / ".venv-vllm")
    assert vllm_python() == beside
    named = _venv(tmp_path / "custom")
    monkeypatch.setenv("ASYNCRL_VLLM_VENV", str(tmp_path / "custom"))
    assert vllm_python() == named
    monkeypatch.setenv("ASYNCRL_VLLM_PYTHON", sys.executable)
    assert vllm_python() == Path(sys.executable)
    monkeypatch.setenv("ASYNCRL_VLLM_PYTHON", str(tmp_path / "missing"))
    assert vllm_python() is None  # a configured interpreter that is not there is not silently replaced
