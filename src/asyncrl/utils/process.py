"""Child processes and local servers: spawn, stop, find a free port, wait for an HTTP URL, tail a log.

Every child is spawned in its own session, so it leads its own process group: stopping the group
reaches whatever the child started (torchrun workers, vLLM engine cores) even after the child itself
has exited. A child's stdout and stderr are appended to its log file (or inherited when it has none, or
sent through a pipe that `copy_lines` copies), and its stdin is closed. Waiting for a server fails early,
with the end of its log, when the process dies, and names the URL it waited for when it times out; `serve`
does both and never leaves a server that did not come up running.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import httpx


class ChildExited(RuntimeError):
    """A child that was expected to stay up exited; the message carries the end of its log."""

    def __init__(self, proc: subprocess.Popen, log: Path | None):
        self.proc, self.returncode = proc, proc.returncode
        super().__init__(f"{_name(proc)} exited with code {proc.returncode}{_log_note(log)}")


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PIPED = Path("|")  # `spawn`'s log: stdout + stderr to a pipe (`proc.stdout`), e.g. for `copy_lines`


def spawn(cmd: Sequence[str], log: Path | None, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `cmd` in a new session; stdout + stderr are appended to `log` (None: inherited; PIPED: a pipe)."""
    if log is None or log is PIPED:
        out, err = (None, None) if log is None else (subprocess.PIPE, subprocess.STDOUT)
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as sink:  # the child holds its own copy of the descriptor
        return subprocess.Popen(
            cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )


def copy_lines(stream: IO[bytes]) -> None:
    """Copy a child's output to this process's current stdout, line by line, until the child closes it."""
    for line in iter(stream.readline, b""):
        sys.stdout.write(line.decode(errors="replace"))
        sys.stdout.flush()


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send `sig` to the child's process group; a group that is already gone is fine."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_groups(procs: Sequence[subprocess.Popen], grace: float = 10.0) -> list[subprocess.Popen]:
    """SIGTERM every group, give them `grace` seconds in all, then SIGKILL every group (leftover workers
    included). Returns the children that ignored SIGTERM."""
    for proc in procs:
        signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    stubborn = [p for p in procs if not _exits_by(p, deadline)]
    for proc in procs:
        signal_group(proc, signal.SIGKILL)
    for proc in stubborn:
        proc.wait()
    return stubborn


def stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """`stop_groups` for one child."""
    stop_groups([proc], grace)


def answers(url: str, timeout: float = 2.0) -> bool:
    """Whether GET `url` answers 200 now."""
    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for_http(
    url: str,
    timeout: float,
    proc: subprocess.Popen | Sequence[subprocess.Popen] | None = None,
    log: Path | None = None,
    poll: float = 0.5,
) -> float:
    """Poll GET `url` until it answers 200; returns the seconds waited.

    ChildExited (with the tail of `log`) as soon as `proc` (or any of several) exits; TimeoutError naming `url`
    after `timeout` s.
    """
    watched = [proc] if isinstance(proc, subprocess.Popen) else list(proc or ())
    start = time.monotonic()
    while not answers(url):
        for p in watched:
            if p.poll() is not None:
                raise ChildExited(p, log)
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f}s{_log_note(log)}")
        time.sleep(poll)
    return time.monotonic() - start


def serve(
    cmd: Sequence[str], url: str, log: Path, timeout: float, env: dict[str, str] | None = None, poll: float = 0.5
) -> subprocess.Popen:
    """`spawn` a server and `wait_for_http` its `url`; if it does not come up, its group is stopped first."""
    proc = spawn(cmd, log, env)
    try:
        wait_for_http(url, timeout, proc, log, poll)
    except BaseException:
        stop_group(proc)
        raise
    return proc


def tail(path: Path, lines: int = 20, prefix: str = "") -> str:
    """The last `lines` lines of a text file, each after `prefix`."""
    if not path.exists():
        return f"{prefix}(no log at {path})"
    text = path.read_text(errors="replace").rstrip().splitlines()
    return "\n".join(prefix + line for line in text[-lines:]) or f"{prefix}(empty)"


def process_tree(pid: int) -> list[tuple[int, str]]:
    """(pid, state) of `pid` and every process below it (from /proc; state T = stopped, D = in the kernel,
    Z = exited); those that are gone are left out. Children in sessions of their own are found too."""
    parents: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        me = int(stat.parent.name)
        states[me] = fields[0]
        parents.setdefault(int(fields[1]), []).append(me)
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in states:
            tree.append((p, states[p]))
        todo += parents.get(p, [])
    return tree


def resume_stopped(pid: int) -> None:
    """SIGCONT every stopped process in `pid`'s tree, so that a stop signal sent next is acted on."""
    for p, state in process_tree(pid):
        if state in ("T", "t"):
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass


TELLING = (" ERROR ", " CRITICAL ", " WARNING ", "error:", "Error:", "Traceback", "Killed")


def telling_tail(path: Path, lines: int = 12, prefix: str = "") -> str:
    """The end of a log for a death report: its last error and warning lines first (a progress bar or a
    flood of INFO can hide them), then the last `lines` lines."""
    if not path.exists():
        return tail(path, lines, prefix)
    text = path.read_text(errors="replace").rstrip().splitlines()
    last = text[-lines:]
    telling = [line for line in text[:-lines] if any(t in line for t in TELLING)][-5:]
    shown = [*telling, "..."] if telling else []
    return "\n".join(prefix + line for line in shown + last) or f"{prefix}(empty)"


def _exits_by(proc: subprocess.Popen, deadline: float) -> bool:
    try:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        return True
    except subprocess.TimeoutExpired:
        return False


def _log_note(log: Path | None) -> str:
    return f"; last lines of {log}:\n{tail(log, 40)}" if log is not None else ""


def _name(proc: subprocess.Popen) -> str:
    args = proc.args if isinstance(proc.args, (list, tuple)) else [proc.args]
    return " ".join(str(a) for a in args[:4]) + (" ..." if len(args) > 4 else "")
