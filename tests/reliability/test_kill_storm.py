"""The kill storm, short: the trainer, the inference server and the orchestrator of a real `rl` run that
checkpoints are each killed (SIGKILL) in turn, mid-run, and the run finishes with no one touching it: rl
restarts it from its latest checkpoint each time.

Checks what a user relies on: rl exits 0, having restarted 3 times and said so (its summary line, its record,
`asyncrl status`); every step once in both metrics files, no torn read, no leftovers (`check_run_dir`); and
at no moment two live processes of one role (a process of an attempt outliving it would be one), none after
rl ends. The long version (random kills every ~15 s of the CPU demo, env servers too, held-out reward
against undisturbed runs): `benchmarks/kill_storm.py`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from rl_runs import check_run_dir, rl_args
from waiting import wait_until

from asyncrl.report.status import last_row, status_lines
from asyncrl.transport.layout import RunLayout
from asyncrl.utils import runstate
from asyncrl.utils.process import processes_by_role
from tests import warm

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

# the last kill comes 3 steps after the third attempt's start (at most ~11): the orchestrator runs at most
# max_async_level (1) step ahead, so with 20 steps it still has steps to do then (with 16 it had finished once)
STEPS = 20
VICTIMS = ("trainer", "inference", "orchestrator")
TIMEOUT = 300  # seconds for the whole run
ROLES = {r: f"asyncrl.entrypoints.{r}" for r in ("inference", "orchestrator", "trainer", "env_server")}


class Census:
    """Counts this run's live processes by role every 0.2 s (`processes_by_role`: a fork before its `exec` is
    not counted; an attempt's process that outlived it has rl for a parent and is), keeping the most at once."""

    def __init__(self, out: Path):
        self.out, self.most, self.seen, self._stop = str(out), Counter(), {}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> Counter:
        found = processes_by_role(self.out, ROLES)
        counted = Counter(role for role, _ in found.values())
        if any(counted[r] > self.most[r] for r in counted):
            self.seen = found  # the sample that set a new most: what the assertion shows
        return counted

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.most |= self.now()

    def __enter__(self) -> Census:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


def kill_when_training(proc: subprocess.Popen, layout: RunLayout, victim: str, after: float) -> float:
    """SIGKILL `victim` once the attempt rl started after time `after` trained 3 steps past its start (so a new
    checkpoint exists: deaths with progress between them are not "in a row"); returns the kill's time."""

    def ready() -> bool:
        assert proc.poll() is None, proc.communicate()
        record = runstate.read(layout.pid_file(victim))
        return record.get("started", 0) > after and trained(layout, record["started"]) >= started_at(layout) + 3

    assert wait_until(ready, TIMEOUT, every_s=0.1), f"no attempt trained 3 steps after {after} to kill {victim} in"
    os.kill(runstate.read(layout.pid_file(victim))["pid"], signal.SIGKILL)
    return time.time()


def trained(layout: RunLayout, since: float) -> int:
    """The last step the trainer logged after time `since` (-1: none)."""
    row = last_row(layout.metrics_file("trainer"), kind="train")
    return row["step"] if row is not None and row.get("time", 0.0) > since else -1


def started_at(layout: RunLayout) -> int:
    """The step rl's latest attempt started at."""
    restarts = runstate.read(layout.pid_file("rl")).get("restarts") or [{"from_step": 0}]
    return restarts[-1]["from_step"]


def test_a_kill_storm_ends_in_a_finished_run_with_no_step_lost_or_repeated(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    layout, since = RunLayout(out), time.time()
    # one restart in a row at most: each kill comes after a new checkpoint, so the count starts over each time
    args = rl_args(tiny_model_dir, out, STEPS, "--max-restarts", "1", "--restart-backoff", "1")
    with Census(out) as census:
        proc = warm.popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            for victim in VICTIMS:
                since = kill_when_training(proc, layout, victim, since)
            stdout, stderr = proc.communicate(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    restarts = runstate.read(layout.pid_file("rl"))["restarts"]
    assert [r["component"] for r in restarts] == list(VICTIMS), restarts
    assert all(r["why"].startswith("exit code -9: SIGKILL") for r in restarts), restarts
    assert "[rl] restarted 3 times: trainer 1, inference 1, orchestrator 1" in stdout, stdout[-2000:]
    assert sum(f"{v} died (exit code -9: SIGKILL); restart " in stderr for v in VICTIMS) == 3, stderr[-3000:]
    logs = "".join(p.read_text(errors="replace") for p in layout.logs.glob("*.log"))
    check_run_dir(out, STEPS, stderr + logs)
    assert max(census.most.values()) == 1, (census.most, census.seen)  # no attempt's process outlived it
    assert census.most["trainer"] == census.most["inference"] == census.most["orchestrator"] == 1
    assert wait_until(lambda: not census.now(), 15), census.now()  # nothing outlives rl
    assert any(line.split()[:2] == ["restarts", "3:"] for line in status_lines(out))
