"""PRIME-RL's first checks, run for real through their CPU twins (configs/debug/cpu/) on a tiny local model.

`trainer @ configs/debug/cpu/trainer/debug.toml` trains on fake batches alone; `inference @ .../inference/
debug.toml` serves while `orchestrator @ .../orchestrator/debug.toml` writes two steps of batches (no
trainer needed at async level 2) and `eval @ .../eval/single_env.toml` scores against the same server.
Only the model path, ports and output dirs are overridden.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.utils.process import free_port, stop_group
from tests import warm

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TWINS = REPO / "configs" / "debug" / "cpu"


def entrypoint(name: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", f"asyncrl.entrypoints.{name}", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_trainer_debug_twin(tiny_model_dir, tmp_path):
    done = entrypoint(
        "trainer",
        "@",
        str(TWINS / "trainer/debug.toml"),
        "--model.name",
        str(tiny_model_dir),
        "--output-dir",
        str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens/s" in done.stdout + done.stderr


def test_inference_orchestrator_and_eval_debug_twins(tiny_model_dir, tmp_path):
    port = free_port()
    server = warm.serve(
        [
            sys.executable,
            "-m",
            "asyncrl.entrypoints.inference",
            "@",
            str(TWINS / "inference/debug.toml"),
            "--model.name",
            str(tiny_model_dir),
            "--server.port",
            str(port),
            "--output-dir",
            str(tmp_path / "server"),
        ],
        f"http://127.0.0.1:{port}/health",
        tmp_path / "server.out",
        120,
        poll=0.3,
    )
    try:
        model = ["--model.name", str(tiny_model_dir), "--client.port", str(port)]
        orch = entrypoint(
            "orchestrator", "@", str(TWINS / "orchestrator/debug.toml"), *model, "--output-dir", str(tmp_path / "run")
        )
        assert orch.returncode == 0, orch.stderr[-3000:]
        assert sorted(p.name for p in (tmp_path / "run" / "rollouts").iterdir()) == ["step_0", "step_1"]
        ev = entrypoint("eval", "@", str(TWINS / "eval/single_env.toml"), *model, "--output-dir", str(tmp_path / "ev"))
        assert ev.returncode == 0, ev.stderr[-3000:]
    finally:
        stop_group(server, 20)
