"""The run-dir lock between `rl` and components started on their own (`utils.runlock`): each side refuses the
other in one line naming the holder, components of different kinds share a dir, two of one kind do not, and a
process `rl` or a joined component started joins nothing."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.core.errors import UserError
from asyncrl.utils import runlock
from asyncrl.utils.process import INHERITED_FD


def holding(tmp_path: Path, run: Path, call: str) -> subprocess.Popen:
    """A process that runs `runlock.<call>` on `run`, says so in a file, and keeps what it took."""
    ready = tmp_path / f"ready.{time.monotonic_ns()}"
    code = (
        "import os, sys, time; from asyncrl.utils import runlock; "
        f"runlock.{call}; open({str(ready)!r}, 'w').close(); time.sleep(60)"
    )
    env = {k: v for k, v in os.environ.items() if k != INHERITED_FD}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the holder did not start"
        time.sleep(0.02)
    return proc


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(INHERITED_FD, raising=False)  # this test process is nobody's child
    yield
    os.environ.pop(INHERITED_FD, None)


def stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_a_component_on_its_own_and_rl_refuse_each_other(tmp_path, clean_env):
    run = tmp_path / "run"
    trainer = holding(tmp_path, run, f"join({str(run)!r}, 'trainer')")
    try:
        with pytest.raises(
            UserError, match=rf"in use: processes started on their own run on it: .* \(pid {trainer.pid}\)"
        ):
            runlock.hold(run)  # rl
        with pytest.raises(UserError, match=rf"in use: another trainer \(pid {trainer.pid}\) runs on it"):
            runlock.join(run, "trainer")
        orchestrator = holding(tmp_path, run, f"join({str(run)!r}, 'orchestrator')")  # another kind
        stop(orchestrator)
    finally:
        stop(trainer)
    rl = holding(tmp_path, run, f"hold({str(run)!r})")
    try:
        for component in ("trainer", "orchestrator"):
            with pytest.raises(UserError, match=rf"run dir .* is in use: rl \(pid {rl.pid}\) runs on it; stop it"):
                runlock.join(run, component)
    finally:
        stop(rl)


def test_what_rl_or_a_joined_component_started_joins_nothing(tmp_path, clean_env, monkeypatch):
    run = tmp_path / "run"
    rl = holding(tmp_path, run, f"hold({str(run)!r})")
    try:
        monkeypatch.setenv(INHERITED_FD, f"7:{run / runlock.LOCK_NAME}")  # as torchrun's ranks under rl have it
        runlock.join(run, "trainer")  # no error: its starter holds the dir
        assert not (run / "trainer.lock").exists()
    finally:
        stop(rl)


def test_a_lock_that_nothing_alive_holds_is_waited_for_then_refused(tmp_path, clean_env, monkeypatch):
    """A dead run's last descriptor can outlive every process by a moment (here: in flight in a socket, as the
    kernel may hold one); `hold` waits for it up to SETTLE_S, then names no pid."""
    import socket
    import threading

    run = tmp_path / "run"
    fd = runlock.hold(run)
    os.environ.pop(INHERITED_FD)
    a, b = socket.socketpair(socket.AF_UNIX)
    socket.send_fds(a, [b"x"], [fd])
    os.close(fd)  # the lock now lives only in the message in flight
    (run / runlock.LOCK_NAME).write_text("999999999\n")  # a pid that is nobody's
    threading.Timer(0.5, lambda: (a.close(), b.close())).start()  # the message is dropped: the lock goes
    start = time.monotonic()
    assert runlock.hold(run) and 0.4 < time.monotonic() - start < runlock.SETTLE_S
    os.environ.pop(INHERITED_FD)

    other = tmp_path / "other"
    fd = runlock.hold(other)
    os.environ.pop(INHERITED_FD)
    c, d = socket.socketpair(socket.AF_UNIX)
    socket.send_fds(c, [b"x"], [fd])
    os.close(fd)
    (other / runlock.LOCK_NAME).write_text("999999999\n")
    monkeypatch.setattr(runlock, "SETTLE_S", 0.5)
    with pytest.raises(UserError, match=r"rl \(pid 999999999\) is gone, but .* \(pids unknown\)"):
        runlock.hold(other)
    c.close(), d.close()
