"""`rl` with `[[runs]]` on CPU: two LoRA runs (own env, lr, orchestrator) on one trainer and one server.

From the demo's warmed tiny model: run `rev` on reverse-text and run `echo` on echo-twice (partial credit),
with different learning rates. Each run must train every step at its own lr on its own env's rewards, with the
server answering from its latest adapter; the adapters must differ; a checkpoint of one run must resume it alone
(the other's files untouched); and killing one run's orchestrator must leave the other training to its end, with
`rl` saying which run did not finish.

That each run learns as it would alone is checked where it can be exact and where it can be measured: a mixed
step's gradients are each run's own (tests/unit/trainer/test_multi_run_step.py), and held-out learning together
against alone is `benchmarks/multi_run.py --e2e` (docs/benchmarks.md, "Multi-run LoRA").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.transport.layout import RunLayout
from asyncrl.utils.process import free_port
from tests import warm
from tests.integration.test_rl import orchestrator_rows

pytestmark = pytest.mark.slow

RL = [sys.executable, "-m", "asyncrl.entrypoints.rl"]
REV = {"name": "rev", "lr": 1e-3, "orchestrator": {"env": [{"id": "reverse-text"}]}}
ECHO = {"name": "echo", "lr": 5e-4, "orchestrator": {"env": [{"id": "echo-twice", "args": {"reward": "similarity"}}]}}


def write_config(
    path: Path, model: Path, out: Path, steps: int, runs: list[dict], ckpt: bool = True, batch: int = 64
) -> Path:
    lines = [
        f'max_steps = {steps}\nseq_len = 128\nmax_async_level = 1\noutput_dir = "{out}"\n',
        f'[model]\nname = "{model}"\n',
        "[trainer.model.lora]\nrank = 16\nalpha = 32\n",
        "[trainer.optim]\nweight_decay = 0.0\n",
        f"[orchestrator]\nbatch_size = {batch}\nrollouts_per_example = 8\nseed = 1\n",
        f"[inference]\nmax_batch_size = {batch}\n",
        "[orchestrator.sampling]\nmax_tokens = 16\n",
        f'[inference.server]\nhost = "127.0.0.1"\nport = {free_port()}\n',
        "[ckpt]\ninterval = 5\n" if ckpt else "",
    ]
    for run in runs:
        env = run["orchestrator"]["env"][0]
        args = "".join(f', args = {{ {k} = "{v}" }}' for k, v in env.get("args", {}).items())
        lines.append(
            f'[[runs]]\nname = "{run["name"]}"\nlr = {run["lr"]}\n'
            + (f"max_steps = {run['max_steps']}\n" if "max_steps" in run else "")
            + f'[runs.orchestrator]\nenv = [{{ id = "{env["id"]}"{args} }}]\n'
        )
    path.write_text("\n".join(lines))
    return path


def rewards(run: RunLayout) -> list[float]:
    return [r["reward/mean"] for r in orchestrator_rows(run.root)]


def status(run: RunLayout) -> dict:
    return json.loads(run.run_status.read_text())


def adapter(run: RunLayout, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run.weights_dir(step) / "adapter" / "adapter_model.safetensors"))


def test_two_runs_learn_side_by_side_and_one_resumes_alone(warm_model, tmp_path):
    out, steps = tmp_path / "out", 10
    cfg = write_config(tmp_path / "rl.toml", warm_model, out, steps, [REV, ECHO])
    proc = warm.run([*RL, "@", str(cfg)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rev, echo = (RunLayout(out / f"run_{n}") for n in ("rev", "echo"))
    assert status(rev)["state"] == status(echo)["state"] == "done"
    for run, lr in ((rev, REV["lr"]), (echo, ECHO["lr"])):
        trained = [json.loads(x) for x in run.metrics_file("trainer").read_text().splitlines()]
        assert [m["step"] for m in trained] == list(range(steps)) and {m["lr"] for m in trained} == {lr}
        rows = orchestrator_rows(run.root)
        assert [r["step"] for r in rows] == list(range(steps))
        assert [r["policy/step"] for r in rows][2:] == [r["step"] - 1 for r in rows][2:]  # its own latest adapter
    a, b = adapter(rev, steps), adapter(echo, steps)  # LoRA B starts at zero: both trained, each its own way
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)
    assert f"[rl rev] step {steps - 1:4d}" in proc.stdout and f"[rl echo] step {steps - 1:4d}" in proc.stdout
    for run in (rev, echo):  # each run: its own logs, config, checkpoints, report
        assert (run.logs / "orchestrator.log").exists() and (run.logs / "trainer.log").exists()
        assert (run.configs / "orchestrator.toml").exists() and (run.root / "report.html").exists()

    # rev alone, from its checkpoint at the last step, two more steps; echo's files stay as they are
    echo_files = {p: p.stat().st_mtime_ns for p in echo.root.rglob("*") if p.is_file()}
    cfg = write_config(tmp_path / "rev.toml", warm_model, out, steps + 2, [REV])
    proc = warm.run([*RL, "@", str(cfg), "--ckpt.resume-step", "-1"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"[rev] run rev started in adapter slot 0 at step {steps}" in (rev.logs / "trainer.log").read_text()
    assert status(rev) == {**status(rev), "state": "done", "step": steps + 2}
    assert len(rewards(rev)) == steps + 2 and (rev.weights_dir(steps + 2) / "adapter").is_dir()
    assert {p: p.stat().st_mtime_ns for p in echo.root.rglob("*") if p.is_file()} == echo_files


def test_killing_one_runs_orchestrator_leaves_the_other_training(warm_model, tmp_path):
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "rl.toml", warm_model, out, 14, [REV, {**ECHO, "max_steps": 40}], ckpt=False)
    log = tmp_path / "rl.out"
    proc = warm.popen([*RL, "@", str(cfg)], stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)
    rev, echo = (RunLayout(out / f"run_{n}") for n in ("rev", "echo"))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(rewards(echo) if echo.metrics_file("orchestrator").exists() else []) < 3:
        time.sleep(0.2)
    record = json.loads((echo.logs / "orchestrator.pid").read_text())
    os.kill(record["pid"], signal.SIGKILL)
    proc.wait(timeout=600)
    said = log.read_text()

    assert proc.returncode == 2, said[-4000:]
    assert status(rev)["state"] == "done" and status(rev)["step"] == 14 and len(rewards(rev)) == 14
    assert status(echo) == {**status(echo), "state": "stopped", "error": "its orchestrator died (exit code -9)"}
    assert "run echo: its orchestrator died (exit code -9)" in said
    assert "1 of 2 runs did not finish: echo stopped" in said
