"""Warm starts for the processes the tests start themselves: `python -m asyncrl.entrypoints.X ...` forked from one
zygote per test worker (`asyncrl.launcher.zygote`, the one `rl` forks its children from) instead of exec'd, each
paying seconds of CPU to import torch, transformers and verifiers anew. A forked `rl` is warm, so it forks its own
zygote too, and its children are forked as in any run.

`popen` and `run` take the part of `subprocess.Popen` / `subprocess.run`'s interface the tests use. A command that
is not `python -m asyncrl...` or `python -m torch.distributed.run` with this Python (`forkable`), or any command
when ASYNCRL_TEST_WARM=0, is exec'd as before. So is every command of a session without slow tests (`use_for`,
from tests/conftest.py): its few short commands would wait for the zygote's imports (seconds) where an exec'd one
is done sooner; a session with slow tests starts the zygote as it collects, so it has loaded by the time the
first test asks.

Invariants: a forked process gets what an exec'd one would (the zygote's invariants: argv, environment, command
line, its own session, fresh seeds, thread count), plus the cwd it was asked for, stdout and stderr on the pipes
or files asked for, and it dies with the test worker (the zygote dies with it, and its children with the zygote).
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from asyncrl.launcher.zygote import Forked, Zygote
from asyncrl.utils.process import stop_group, wait_for_http

VAR = "ASYNCRL_TEST_WARM"  # 0: exec every process the tests start (as a user's shell would)
PIPE, STDOUT = subprocess.PIPE, subprocess.STDOUT


_started: list[Zygote] = []
_wanted = [True]  # use_for: this session has slow tests


def use_for(items) -> None:
    """Fork the processes of a session whose `items` (the collected tests) include slow ones, and start the zygote
    now; exec those of any other session."""
    _wanted[0] = any("slow" in item.keywords for item in items)
    if _wanted[0]:
        zygote()


@functools.cache
def zygote() -> Zygote | None:
    """This test worker's zygote, started on first use; None when warm starts are off."""
    if os.environ.get(VAR, "1") == "0" or not _wanted[0]:
        return None
    log = Path(tempfile.gettempdir()) / f"asyncrl-test-zygote-{os.getpid()}.log"
    _started.append(Zygote(f"tests-{os.getpid()}", log))
    atexit.register(_started[0].close)
    return _started[0]


def forked_cpu_s() -> float:
    """The CPU seconds of every process forked here that has exited (with what each reaped): what
    RUSAGE_CHILDREN counts of the exec'd ones."""
    return sum(z.reaped_cpu_s for z in _started)


class Warm:
    """A forked process with `subprocess.Popen`'s interface as the tests use it (pid, args, returncode, stdout,
    stderr, poll, wait, communicate, send_signal, terminate, kill)."""

    def __init__(self, child: Forked, stdout, stderr, text: bool):
        self._child, self.pid, self.args = child, child.pid, child.args
        self.stdout = _reader(stdout, text)
        self.stderr = _reader(stderr, text)
        self._read: dict[str, object] = {}
        self._readers: list[threading.Thread] = []

    @property
    def returncode(self) -> int | None:
        return self._child.returncode

    def poll(self) -> int | None:
        return self._child.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._child.wait(timeout)

    def communicate(self, timeout: float | None = None) -> tuple:
        """Read stdout and stderr to their end and wait for the exit, as Popen's does (TimeoutExpired on time)."""
        if not self._readers:
            for name in ("stdout", "stderr"):
                if (stream := getattr(self, name)) is not None:
                    self._readers.append(threading.Thread(target=self._drain, args=(name, stream), daemon=True))
                    self._readers[-1].start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._read.get("stdout"), self._read.get("stderr")

    def _drain(self, name: str, stream) -> None:
        self._read[name] = stream.read()
        stream.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _reader(fd: int | None, text: bool):
    if fd is None:
        return None
    return open(fd, encoding="utf-8", errors="replace") if text else open(fd, "rb")  # noqa: SIM115


def forkable(cmd: list[str]) -> bool:
    """`python -m asyncrl...` or `python -m torch.distributed.run` with this Python (torchrun's agent then execs its
    ranks as it would anyway: the fork saves the agent's own torch import, 1.7-2 CPU s)."""
    module = cmd[2] if len(cmd) > 2 and cmd[:2] == [sys.executable, "-m"] else ""
    return module.startswith("asyncrl.") or module == "torch.distributed.run"


def popen(cmd: list[str], env: dict | None = None, stdout=None, stderr=None, text: bool = False, cwd=None,
          start_new_session: bool = False):  # fmt: skip
    """`subprocess.Popen(cmd, env=..., stdout=..., stderr=..., text=..., cwd=...)`, forked where it can be (a forked
    process always has a session of its own); stdout / stderr: None (this process's), PIPE, a file opened for
    writing, or stderr STDOUT."""
    z = zygote()
    if z is None or not forkable(cmd):
        return subprocess.Popen(
            cmd, env=env, stdout=stdout, stderr=stderr, text=text, cwd=cwd, start_new_session=start_new_session
        )
    out_read, out = _stream(stdout, 1)
    err_read, err = (None, os.dup(out)) if stderr == STDOUT else _stream(stderr, 2)
    child = z.fork(list(cmd), dict(os.environ if env is None else env), (out, err), cwd=str(cwd or os.getcwd()))
    if child is None:  # the zygote is gone: exec it
        for fd in (out_read, err_read):
            if fd is not None:
                os.close(fd)
        return subprocess.Popen(
            cmd, env=env, stdout=stdout, stderr=stderr, text=text, cwd=cwd, start_new_session=start_new_session
        )
    return Warm(child, out_read, err_read, text)


def _stream(how, default_fd: int) -> tuple[int | None, int]:
    """(the read end for this process if PIPE, the descriptor the child writes to: a copy, the caller keeps its)."""
    if how == PIPE:
        return os.pipe()
    if how == subprocess.DEVNULL:
        return None, os.open(os.devnull, os.O_WRONLY)
    if how is None:
        return None, os.dup(default_fd)
    return None, os.dup(how if isinstance(how, int) else how.fileno())


def run(cmd: list[str], env: dict | None = None, capture_output: bool = False, text: bool = False,
        timeout: float | None = None, cwd=None, stdout=None, stderr=None) -> subprocess.CompletedProcess:  # fmt: skip
    """`subprocess.run` with the same arguments, forked where it can be; on a timeout the process is killed."""
    if capture_output:
        stdout, stderr = PIPE, PIPE
    proc = popen(cmd, env=env, stdout=stdout, stderr=stderr, text=text, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def spawn(cmd: list[str], log: Path, env: dict | None = None):
    """`asyncrl.utils.process.spawn(cmd, log, env)`: output appended to `log`, forked where it can be."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as sink:
        return popen(cmd, env=env, stdout=sink, stderr=STDOUT, start_new_session=True)


def serve(cmd: list[str], url: str, log: Path, timeout: float, env: dict | None = None, poll: float = 0.5):
    """`asyncrl.utils.process.serve`: `spawn` a server and wait until `url` answers (stopped if it never does)."""
    proc = spawn(cmd, log, env)
    try:
        wait_for_http(url, timeout, [proc], log, poll)
    except BaseException:
        stop_group(proc)
        raise
    return proc
