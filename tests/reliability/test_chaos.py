"""Chaos: `kill -9` one process of a real `rl` run at one phase of a step, resume from the latest checkpoint.

Each case kills one process (a fail point, `core/failpoint.py`, for an exact phase; a plain SIGKILL from
outside for "while generating"), then checks what a user relies on: `rl` names the dead process and stops
everything; `rl --ckpt.resume-step -1` resumes at the latest step both trainer and orchestrator saved and
goes on; every step 0..N-1 is in both metrics files exactly once; no reader ever met a torn file (it would
have failed the resumed run with its one-line error); no half-written dir is left behind.

Most of a case's cost is starting `rl` (its three processes' imports), so the cases that run one trainer
process share one run dir, as a chain (the `chain` fixture, run once, by the first of them): `rl` starts with
the first case's fault; each resume (`--ckpt.resume-step -1`) carries the next case's fault; a last resume
without one finishes the run. A case's fault comes `at` steps past the step its run starts at (a checkpoint
step, so even, as a fresh run's 0 is): it meets the phase it would in a fresh run. Each case's test checks
its link: `rl`'s exit and message, its fail point's log line, the step its resume starts at, that the resume
started there and ended as planned (the next case's fault, or done); and every test checks the whole run's
files. A link that never ran (an earlier one went wrong) fails its test naming that one. The torchrun case
needs two trainer ranks for the whole run: it runs alone, fresh, on an 8-step run.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import pytest
from rl_runs import check_run_dir, rl_args, steps_in

from asyncrl.core import failpoint
from asyncrl.transport.layout import RunLayout
from asyncrl.utils import runstate
from tests import warm

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

STEPS = 8  # the lone case's run; rl_runs checkpoints every 2 steps
# The chain's run: each resume starts at most 4 steps past the one before (2 after a checkpoint fault, 6 after an
# outside kill, the orchestrator racing on), so the last case's starts at most 22 in and kills 4 later: 6 to spare.
CHAIN_STEPS = 32
TIMEOUT = 300  # seconds an rl start may take


class Case(NamedTuple):
    victim: str
    point: str | None  # a fail point; None: an outside SIGKILL while the victim is generating
    at: int  # steps past the run's start: the fail point's step, or the orchestrator step the kill waits for
    rank: int | None = None  # the trainer rank the fail point fires on (None: any)
    extra: tuple[str, ...] = ()  # rl flags, for the whole run

    def fault(self, start: int) -> str | None:
        """`ASYNCRL_FAILPOINT` for a run starting at step `start` (None: an outside kill)."""
        if self.point is None:
            return None
        return f"{self.point}:{start + self.at}" + ("" if self.rank is None else f":{self.rank}")


CASES = {
    "trainer-mid-step": Case("trainer", "trainer.step", 5),
    "trainer-publishing-weights": Case("trainer", "trainer.weights", 6),
    "trainer-writing-checkpoint": Case("trainer", "trainer.checkpoint", 4),
    "trainer-rank1-under-torchrun": Case("trainer", "trainer.step", 5, 1, ("--trainer-cpu-processes", "2")),
    "orchestrator-writing-batch": Case("orchestrator", "orchestrator.batch", 5),
    "orchestrator-writing-checkpoint": Case("orchestrator", "orchestrator.checkpoint", 4),
    "orchestrator-generating": Case("orchestrator", None, 4),
    "inference-generating": Case("inference", None, 4),
}
CHAIN = [name for name, case in CASES.items() if not case.extra]  # in this order, on one run dir
FINISH = "finish"  # the chain's last resume, without a fault


class Run(NamedTuple):
    """One `rl` start: how it ended, and the lines it added to the run's logs."""

    returncode: int
    stdout: str
    stderr: str
    said: str


class Link(NamedTuple):
    """A chained case: the step its run started at, the run, the latest resumable step after it."""

    start: int
    run: Run | None = None
    resumable: int | None = None
    missing: str = ""  # why it never ran


def kill_when(proc: subprocess.Popen, out: Path, name: str, after_step: int, since: float) -> None:
    """SIGKILL process `name` of the run once this run's orchestrator logged step `after_step` (it is generating
    the next ones then: the orchestrator runs ahead of the trainer). A record of `name` started after `since`
    is this run's, and rl drops the rows of the steps it redoes before it starts any process."""
    layout = RunLayout(out)
    record, metrics = layout.pid_file(name), layout.metrics_file("orchestrator")
    deadline = time.monotonic() + TIMEOUT
    while runstate.read(record).get("started", 0) < since or after_step not in logged(metrics):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"step {after_step} never came"
        time.sleep(0.1)
    os.kill(runstate.read(record)["pid"], signal.SIGKILL)


def logged(metrics: Path) -> list[int]:
    return steps_in(metrics) if metrics.exists() else []


def stop(proc: subprocess.Popen) -> None:
    """A test that gives up stops rl as a user would (Ctrl-C: rl stops its children), then for good."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def rl(model: Path, out: Path, steps: int, start: int, case: Case | None, extra: tuple[str, ...] = ()) -> Run:
    """Run `rl` on `out` to its end: fresh at `start` 0, else `--ckpt.resume-step -1` (the latest resumable
    step: `start`); with `case`'s fault, `case.at` steps past `start` (None: none)."""
    logs = RunLayout(out).logs
    before = {p: p.stat().st_size for p in logs.glob("*.log")}
    env = {k: v for k, v in os.environ.items() if k != failpoint.VAR}
    if case is not None and (fault := case.fault(start)) is not None:
        env[failpoint.VAR] = fault
    resume = ("--ckpt.resume-step", "-1") if start else ()
    since = time.time()
    proc = warm.popen(rl_args(model, out, steps, *extra, *resume), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        if case is not None and case.point is None:
            kill_when(proc, out, case.victim, start + case.at, since)
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    finally:
        stop(proc)
    said = "".join(p.read_bytes()[before.get(p, 0) :].decode(errors="replace") for p in logs.glob("*.log"))
    return Run(proc.returncode, stdout, stderr, said)


class Chain:
    """The chained cases on one run dir, run on first use (`-k` the lone case alone and it never runs)."""

    def __init__(self, model: Path, out: Path) -> None:
        self.model, self.out = model, out

    @functools.cached_property
    def links(self) -> dict[str, Link]:
        """Each chained case's link, then (FINISH) the last resume's; after a link that went wrong, none runs."""
        links, start, broke = {}, 0, ""
        for name in [*CHAIN, FINISH]:
            if broke:
                links[name] = Link(start, missing=broke)
                continue
            try:
                run = rl(self.model, self.out, CHAIN_STEPS, start, CASES.get(name))
                resumable = RunLayout(self.out).resumable_steps()
            except Exception as e:  # a kill that never came, a run that hung
                broke = f"the chain broke at {name}: {type(e).__name__}: {e}"[:3000]
                links[name] = Link(start, missing=broke)
                continue
            links[name] = Link(start, run, resumable[-1] if resumable else None)
            if name != FINISH and (run.returncode != 2 or not resumable):
                broke = f"the chain broke at {name}: exit code {run.returncode}, resumable steps {resumable}"
            start = resumable[-1] if resumable else start
        return links


@pytest.fixture(scope="module")
def chain(tiny_model_dir, tmp_path_factory) -> Chain:
    return Chain(tiny_model_dir, tmp_path_factory.mktemp("chaos_chain") / "run")


def check_death(name: str, run: Run, start: int) -> None:
    """Run `run`, started at `start`, died of case `name`'s fault and `rl` said so."""
    case = CASES[name]
    assert run.returncode == 2, f"{name}: " + run.stdout[-2000:] + run.stderr[-2000:]
    assert f"{case.victim} died" in run.stderr, f"{name}: " + run.stderr[-2000:]
    said = f"failpoint {case.point} at step {start + case.at}"
    assert case.point is None or said in run.said, f"{name}: no '{said}' in its logs: " + run.said[-2000:]


def check_resumed(run: Run, start: int, steps: int, then: str | None) -> None:
    """`run` resumed at `start` and went on to the end (`then` None) or to case `then`'s fault."""
    assert f"resumed from checkpoint step_{start} " in run.said, run.said[-3000:]
    if then is not None:
        return check_death(then, run, start)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"[rl] done: {steps - start} steps in" in run.stdout, run.stdout[-3000:]


def check_alone(model: Path, out: Path, name: str) -> None:
    """The lone case: a fresh run with its fault, then its resume to the end."""
    case = CASES[name]
    check_death(name, rl(model, out, STEPS, 0, case, case.extra), 0)
    start = RunLayout(out).resumable_steps()[-1]
    assert 0 < start < STEPS
    check_resumed(resumed := rl(model, out, STEPS, start, None, case.extra), start, STEPS, None)
    check_run_dir(out, STEPS, resumed.stderr + resumed.said)


@pytest.mark.parametrize("case", list(CASES))
def test_kill_then_resume_loses_and_repeats_no_step(tiny_model_dir, tmp_path, chain, case):
    if case not in CHAIN:
        return check_alone(tiny_model_dir, tmp_path / "run", case)
    links = chain.links  # the first chained test runs the chain
    link, then = links[case], [*CHAIN, FINISH][CHAIN.index(case) + 1]
    if link.run is None:
        pytest.fail(f"{case} never ran: {link.missing}")
    check_death(case, link.run, link.start)
    assert link.resumable is not None and 0 < link.resumable < CHAIN_STEPS, link.resumable
    if (resumed := links[then].run) is None:
        pytest.fail(f"the resume after {case} never ran: {links[then].missing}")
    check_resumed(resumed, link.resumable, CHAIN_STEPS, None if then == FINISH else then)
    if links[FINISH].run is None:
        pytest.fail(f"the run never finished: {links[FINISH].missing}")
    resumes = [lk.run for lk in links.values() if lk.start and lk.run]
    check_run_dir(chain.out, CHAIN_STEPS, "".join(r.stderr + r.said for r in resumes))
