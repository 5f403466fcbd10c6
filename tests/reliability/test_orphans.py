"""Orphans: whatever ends `rl` (SIGKILL, SIGHUP of a closed terminal), nothing it started outlives it, and a
run dir that a live `rl` or its leftovers still use is refused to a second `rl`.

One run dir, two `rl` runs in turn (CI time): the first, with its episodes in a started env server (a
grandchild), is killed with -9 after a second `rl` on its dir was refused; every process of its tree must be
gone within seconds; then a new `rl` on that dir starts, and SIGHUP stops it like SIGTERM (exit 130, nothing
left). The processes are the ones found below `rl` (by /proc) before the signal, so a pid is never guessed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rl_runs import rl_args, steps_in

from asyncrl.transport.layout import RunLayout
from asyncrl.utils import runstate
from asyncrl.utils.process import process_tree
from tests import warm

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

SERVED = ("--orchestrator.env", '[{"id": "reverse-text", "server": {}}]')  # an env server: a grandchild of rl
GONE_WITHIN_S = 10.0


def start_until_step(args: list[str], out: Path, step: int = 0, timeout: float = 300) -> subprocess.Popen:
    """`rl` started and running: its own orchestrator (not an earlier one in `out`) has logged `step`. Its
    console goes to files next to `out` (a pipe would stay open as long as any orphan holds it)."""
    console = out.parent / f"console-{time.monotonic_ns()}"
    proc = warm.popen(args, stdout=open(f"{console}.out", "w"), stderr=open(f"{console}.err", "w"))
    proc.console = console
    layout = RunLayout(out)
    metrics, record = layout.metrics_file("orchestrator"), layout.pid_file("orchestrator")
    deadline = time.monotonic() + timeout
    while not (ours(record, proc.pid) and metrics.exists() and step in steps_in(metrics)):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            pytest.fail(f"rl never logged step {step} (exit {proc.returncode}):\n{said(proc)}")
        time.sleep(0.2)
    return proc


def ours(record: Path, rl: int) -> bool:
    """Whether the process that `record` names was started by `rl` (an earlier run's record names another)."""
    pid = runstate.read(record).get("pid")
    return pid is not None and pid in {p for p, _ in process_tree(rl)}


def alive(pid: int) -> bool:
    """Running (an exited process that nobody reaped yet, state Z, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def left_after(pids: list[int], within: float = GONE_WITHIN_S) -> list[int]:
    """Those of `pids` still running once `within` s have passed (or none, as soon as all are gone)."""
    deadline = time.monotonic() + within
    while (running := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return running


def files_in(root: Path) -> dict[Path, tuple[int, int]]:
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*") if p.is_file()}


def commands(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            out.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
        except OSError:
            pass
    return out


def said(proc: subprocess.Popen) -> str:
    """The end of what `rl` printed: stdout, then stderr."""
    return "\n".join(Path(f"{proc.console}.{s}").read_text()[-2000:] for s in ("out", "err"))


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_kill_9_leaves_nothing_a_live_dir_is_refused_and_sighup_stops_cleanly(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    first = start_until_step(rl_args(tiny_model_dir, out, 200, *SERVED), out)
    second, first_tree, tree = None, [], []
    try:
        first_tree = [pid for pid, _ in process_tree(first.pid) if pid != first.pid]
        assert len(first_tree) >= 4, commands(first_tree)  # server, orchestrator, its env server, trainer

        # a second rl on the live dir: one line, non-zero, nothing written
        before = files_in(out)
        refused = warm.run(rl_args(tiny_model_dir, out, 2), capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0, refused.stdout[-2000:] + refused.stderr[-2000:]
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-2000:]
        assert "in use" in refused.stderr and str(first.pid) in refused.stderr, refused.stderr
        now = files_in(out)  # the live run writes steps on; the refused one added no log, rewrote no record or config
        own = lambda files: {p: s for p, s in files.items() if p.parent.name in ("logs", "configs")}  # noqa: E731
        settled = {p: s for p, s in own(before).items() if p.parent.name == "configs" or p.suffix == ".pid"}
        assert set(own(now)) == set(own(before)) and all(now[p] == s for p, s in settled.items()), own(now)

        # a trainer started on its own on the live dir, with the run's own config: refused alike, the run's
        # metrics untouched (it used to drop the live run's rows and rewrite trainer_world.json)
        trainer_rows = out / "metrics" / "trainer.jsonl"
        metrics = trainer_rows.read_text() if trainer_rows.exists() else ""
        trainer = [sys.executable, "-m", "asyncrl.entrypoints.trainer", "@", str(out / "configs" / "trainer.toml")]
        refused = warm.run(trainer, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-2000:]
        assert f"in use: rl (pid {first.pid}) runs on it" in refused.stderr, refused.stderr
        assert not metrics or trainer_rows.read_text().startswith(metrics)

        # kill -9 of rl: everything it started goes with it
        first.kill()
        first.wait()
        assert not (left := left_after(first_tree)), commands(left)

        # the dir is free again: a new rl on it runs, and SIGHUP (a closed terminal) stops it like SIGTERM
        second = start_until_step(rl_args(tiny_model_dir, out, 200), out, step=1)
        tree = [pid for pid, _ in process_tree(second.pid) if pid != second.pid]
        second.send_signal(signal.SIGHUP)
        second.wait(timeout=60)
        assert second.returncode == 130, said(second)
        stderr = Path(f"{second.console}.err").read_text()
        assert "interrupted" in stderr and "Traceback" not in stderr, said(second)
        assert not (left := left_after(tree + [second.pid], within=5.0)), commands(left)
    finally:
        for proc in (first, second):
            if proc is not None:
                stop(proc)
        for pid in [*first_tree, *tree]:  # what an rl that fails this test left: not for the next test
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
