"""Child processes and local servers: spawn, stop, find a free port, wait for an HTTP URL, tail a log.

Every child is spawned in its own session, so it leads its own process group: stopping the group
reaches whatever the child started (torchrun workers, vLLM engine cores) even after the child itself
has exited. Every child also dies with its parent, however the parent ends (SIGKILL included): the
kernel sends it SIGTERM when the thread that spawned it exits (PR_SET_PDEATHSIG; so spawn only from a
thread that lives as long as the child should), and one whose parent was gone before that was set ends at
once. A process that holds its run dir's lock (`runlock`) hands it to every child it spawns. A child's
stdout and stderr are appended to its log file (or inherited when it has none, or sent through a pipe
that `copy_lines` copies), and its stdin is closed. Waiting for a server fails early, with the end
of its log, when the process dies, and names the URL it waited for when it times out; `serve` does both
and never leaves a server that did not come up running.
"""

from __future__ import annotations

import ctypes
import functools
import os
import random
import signal
import socket
import ssl
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


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, exited but not yet reaped, is not; unlike `pid_alive`)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


PORTS_FROM = 10_000  # free_port's picks: from here up to the kernel's ephemeral range


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing uses right now, below the kernel's ephemeral range: a server may
    take seconds to bind it, and meanwhile the kernel hands ephemeral ports to outgoing connections (one that
    got it made the server's bind fail: address already in use). Random, so concurrent callers rarely pick
    one port; where the range leaves no room, the kernel's pick."""
    low = _ephemeral_low()
    for _ in range(100 if low - PORTS_FROM > 1000 else 0):
        port = _random.randrange(PORTS_FROM, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use (or lingering): another
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_random = random.SystemRandom()


PIPED = Path("|")  # `spawn`'s log: stdout + stderr to a pipe (`proc.stdout`), e.g. for `copy_lines`
INHERITED_FD = "ASYNCRL_INHERITED_FD"  # `fd:path` of a descriptor every spawned child gets too (`runlock`'s)
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process when its parent's thread exits; if the parent (pid
    `parent`) is gone already, send it now. A no-op where prctl is missing (not Linux)."""
    prctl = getattr(_libc, "prctl", None)
    if prctl is None:
        return
    prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def reap_orphans() -> bool:
    """Make this process the one that orphaned descendants are reparented to (not init), so it can find and
    stop them (`stop_descendants`). False where that is not possible."""
    prctl = getattr(_libc, "prctl", None)
    return prctl is not None and prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def spawn(
    cmd: Sequence[str], log: Path | None, env: dict[str, str] | None = None, keep_fds: tuple[int, ...] = ()
) -> subprocess.Popen:
    """Start `cmd` in a new session, to die with this process; stdout + stderr are appended to `log`
    (None: inherited; PIPED: a pipe); `keep_fds`: descriptors it gets too."""
    if log is None or log is PIPED:
        out, err = (None, None) if log is None else (subprocess.PIPE, subprocess.STDOUT)
        return _popen(cmd, env, out, err, keep_fds)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as sink:  # the child holds its own copy of the descriptor
        return _popen(cmd, env, sink, subprocess.STDOUT, keep_fds)


def _popen(cmd: Sequence[str], env: dict[str, str] | None, out, err, keep_fds: tuple[int, ...]) -> subprocess.Popen:
    parent, fds = os.getpid(), inherited_fd()
    if fds and env is not None:
        env = {**env, INHERITED_FD: os.environ[INHERITED_FD]}
    return subprocess.Popen(
        cmd,
        env=env,
        stdout=out,
        stderr=err,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        pass_fds=fds + keep_fds,
        preexec_fn=lambda: die_with_parent(parent),  # in the child, between fork and exec
    )


def inherited_fd() -> tuple[int, ...]:
    """The descriptor INHERITED_FD names, if this process has it open still (and on that file)."""
    fd, _, path = os.environ.get(INHERITED_FD, "").partition(":")
    try:
        mine, named = os.fstat(int(fd)), os.stat(path)
    except (ValueError, OSError):
        return ()
    return (int(fd),) if (mine.st_dev, mine.st_ino) == (named.st_dev, named.st_ino) else ()


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
        return httpx.get(url, timeout=timeout, verify=_tls()).status_code == 200
    except httpx.HTTPError:
        return False


@functools.cache
def _tls() -> ssl.SSLContext:
    """httpx's default (verifying) TLS context, built once: httpx builds one per call otherwise, loading the CA
    bundle each time (~25 ms of CPU, paid every poll of `wait_for_http`)."""
    return httpx.create_ssl_context()


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


def processes_by_role(marker: str, roles: dict[str, str]) -> dict[int, tuple[str, int]]:
    """{pid: (role, parent pid)} of the live processes whose command line has `marker` in an argument (e.g. a
    run's output dir) and a role's module as one (`{"trainer": "asyncrl.entrypoints.trainer"}`; arguments split at
    spaces too: a forked child's command line is one string, `launcher.zygote`). A process whose
    parent has its role is left out: between `fork` and `exec` a child shows its parent's command line."""
    found: dict[int, tuple[str, int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            argv = (stat.parent / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split()
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        named = [role for role, module in roles.items() if module in argv]
        if named and any(marker in a for a in argv):
            found[int(stat.parent.name)] = (named[0], parent)
    return {pid: (role, parent) for pid, (role, parent) in found.items() if found.get(parent, ("",))[0] != role}


def stop_descendants(grace: float = 10.0, spare: tuple[int, ...] = ()) -> list[int]:
    """SIGTERM every process below this one (orphans reparented to it by `reap_orphans` included) but those in
    `spare` (their descendants are not spared), SIGKILL those left after `grace` s, and reap those that are its
    children now. Returns the ones that were running."""
    me = os.getpid()
    mine = lambda: [(p, s) for p, s in process_tree(me) if p != me and p not in spare]  # noqa: E731
    running = [p for p, state in mine() if state != "Z"]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in running:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5.0)
        while (left := [p for p, s in mine() if s != "Z"]) and time.monotonic() < deadline:
            _reap(p for p, _ in mine())
            time.sleep(0.05)
        if not left:
            break
    _reap(p for p, _ in mine())
    return running


def _reap(pids) -> None:
    for p in pids:
        try:
            os.waitpid(p, os.WNOHANG)
        except ChildProcessError:  # not our child (a grandchild its own parent reaps)
            pass


def resume_stopped(pid: int) -> None:
    """SIGCONT every stopped process in `pid`'s tree, so that a stop signal sent next is acted on."""
    for p, state in process_tree(pid):
        if state in ("T", "t"):
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass


TELLING = (" ERROR ", " CRITICAL ", " WARNING ", "error:", "Error:", "Traceback", "Killed")


def telling_tail(path: Path, lines: int = 12, prefix: str = "", start: int = 0) -> str:
    """The end of a log for a death report: its last error and warning lines first (a progress bar or a
    flood of INFO can hide them), then the last `lines` lines; of what comes after byte `start` only (what
    this attempt wrote to a log that earlier ones appended to; all of it if the file is shorter now)."""
    if not path.exists():
        return tail(path, lines, prefix)
    text = _lines_since(path, start)
    last = text[-lines:]
    telling = [line for line in text[:-lines] if any(t in line for t in TELLING)][-5:]
    shown = [*telling, "..."] if telling else []
    return "\n".join(prefix + line for line in shown + last) or f"{prefix}(empty)"


def last_error_line(path: Path, start: int = 0) -> str | None:
    """The last error line (ERROR, CRITICAL, `...Error:`) a log got after byte `start`, stripped; None: none."""
    if not path.exists():
        return None
    errors = [line.strip() for line in _lines_since(path, start) if any(t in line for t in ERRORS)]
    return errors[-1] if errors else None


ERRORS = (" ERROR ", " CRITICAL ", "Error:", "error:")


def _lines_since(path: Path, start: int) -> list[str]:
    with open(path, "rb") as f:
        f.seek(start if start <= path.stat().st_size else 0)
        return f.read().decode(errors="replace").rstrip().splitlines()


def exit_words(code: int) -> str:
    """`exit code 1`, or for a signal `exit code -9: SIGKILL` (Popen's returncode of a process a signal ended)."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"exit code {code}: {signal.Signals(-code).name}"
    except ValueError:
        return f"exit code {code}"


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
