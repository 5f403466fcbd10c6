"""Chaos: `kill -9` one process of a real `rl` run at one phase of a step, resume from the latest checkpoint.

Each case kills one process (a fail point, `core/failpoint.py`, for an exact phase; a plain SIGKILL from
outside for "while generating"), then checks what a user relies on: `rl` names the dead process and stops
everything; `rl --ckpt.resume-step -1` resumes at the latest step both trainer and orchestrator saved and
finishes; every step 0..N-1 is in both metrics files exactly once; no reader ever met a torn file (it would
have failed the resumed run with its one-line error); no half-written dir is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from rl_runs import rl_args, steps_in

from asyncrl.transport.layout import RunLayout, is_stable

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

STEPS = 8  # rl_runs checkpoints every 2 steps
TORN = ("corrupt", "torn", "partial", "Traceback")  # what a reader that met a half-written file would say


def pid_of(out: Path, name: str) -> int:
    return json.loads(RunLayout(out).pid_file(name).read_text())["pid"]


def kill_when(proc: subprocess.Popen, out: Path, name: str, after_step: int, timeout: float = 300) -> None:
    """SIGKILL process `name` of the run once the orchestrator has logged step `after_step` (it is generating
    the next ones then: the orchestrator runs ahead of the trainer)."""
    metrics = RunLayout(out).metrics_file("orchestrator")
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and after_step in steps_in(metrics)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"step {after_step} never came"
        time.sleep(0.1)
    os.kill(pid_of(out, name), signal.SIGKILL)


def stop(proc: subprocess.Popen) -> None:
    """A test that gives up stops rl as a user would (Ctrl-C: rl stops its children), then for good."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


# (victim, fail point or None for an outside kill while generating, extra rl flags)
CASES = {
    "trainer-mid-step": ("trainer", "trainer.step:5", ()),
    "trainer-publishing-weights": ("trainer", "trainer.weights:6", ()),
    "trainer-writing-checkpoint": ("trainer", "trainer.checkpoint:4", ()),
    "trainer-rank1-under-torchrun": ("trainer", "trainer.step:5:1", ("--trainer-cpu-processes", "2")),
    "orchestrator-writing-batch": ("orchestrator", "orchestrator.batch:5", ()),
    "orchestrator-writing-checkpoint": ("orchestrator", "orchestrator.checkpoint:4", ()),
    "orchestrator-generating": ("orchestrator", None, ()),
    "inference-generating": ("inference", None, ()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kill_then_resume_loses_and_repeats_no_step(tiny_model_dir, tmp_path, case):
    victim, point, extra = CASES[case]
    out = tmp_path / "run"
    env = dict(os.environ, **({"ASYNCRL_FAILPOINT": point} if point else {}))
    proc = subprocess.Popen(rl_args(tiny_model_dir, out, STEPS, *extra), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        if point is None:
            kill_when(proc, out, victim, after_step=4)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        stop(proc)
    assert proc.returncode == 2, stdout[-2000:] + stderr[-2000:]
    assert f"{victim} died" in stderr, stderr[-2000:]
    said = "".join(p.read_text() for p in RunLayout(out).logs.glob("*.log"))
    assert point is None or f"failpoint {point.split(':')[0]} at step" in said, said[-2000:]

    before = {p: p.stat().st_size for p in RunLayout(out).logs.glob("*.log")}  # the resumed run's lines come after
    start = RunLayout(out).resumable_steps()[-1]
    assert 0 < start < STEPS
    resumed = subprocess.run(rl_args(tiny_model_dir, out, STEPS, *extra, "--ckpt.resume-step", "-1"),
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"[rl] done: {STEPS - start} steps in" in resumed.stdout
    layout = RunLayout(out)
    assert steps_in(layout.metrics_file("trainer")) == list(range(STEPS))  # none lost, none twice
    assert steps_in(layout.metrics_file("orchestrator")) == list(range(STEPS))
    assert is_stable(layout.weights_dir(STEPS))
    logs = resumed.stderr + "".join(p.read_text()[before.get(p, 0) :] for p in layout.logs.glob("*.log"))
    assert not [line for line in logs.splitlines() if any(w in line for w in TORN) and "skipping" not in line]
    left = [p for root in (layout.rollouts, layout.broadcast, layout.weights) for p in root.glob(".tmp_*")]
    assert not left + list(layout.checkpoints.glob("*/.tmp_*"))
