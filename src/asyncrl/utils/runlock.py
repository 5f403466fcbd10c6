"""One `rl` per run dir: `{output_dir}/rl.lock`, flock'd by `rl` and held by every process it starts.

`hold` takes the lock before anything is written into the run dir, and writes the holder's pid into it. The
descriptor is inherited by every child `process.spawn` starts (and theirs, e.g. a started env server), so
the lock stays taken while any of them runs, even after `rl` itself was killed with -9; the kernel drops it
when the last holder exits, so a lock is never stale and needs no clean-up. A second `rl` on the dir is
refused with one line naming the holders.

A trainer, orchestrator or sft started on its own (by hand, as a multi-node run does) `join`s the dir
instead: it shares `rl.lock` with the other components started on their own, so an `rl` on the dir is
refused while one runs and it is refused while an `rl` runs, and holds `{component}.lock` alone, so a second
one of it on the dir is refused. A process that `rl` or a joined component started (INHERITED_FD in its
environment, even where a launcher such as torchrun closed the descriptor itself) joins nothing: its starter
holds the dir. Servers (inference, env servers) write only their logs there and join nothing.

Invariants: a refused `rl` or component writes nothing into the run dir; the lock files themselves are never
deleted (a new holder would lock another inode than a waiting one).
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from asyncrl.core.errors import UserError
from asyncrl.utils.process import INHERITED_FD, pid_alive

LOCK_NAME = "rl.lock"
SETTLE_S = 3.0  # how long a lock that nothing alive holds is waited for before the dir is refused


def hold(root: Path) -> int:
    """Lock run dir `root` for this process and its children (UserError if another rl, its leftovers or a
    component started on its own hold it); returns the descriptor, which stays open until this process exits."""
    path = Path(root).resolve() / LOCK_NAME
    fd = _locked(path, fcntl.LOCK_EX, root, lambda owner: _holders(path, owner))
    _write_pid(fd)
    _pass_on(fd, path)
    return fd


def join(root: Path, component: str) -> None:
    """`component`, started on its own, shares run dir `root` with the others, alone of its kind (module
    docstring). A UserError naming the holder where the dir is taken; nothing to do in a process `rl` or a joined
    component started."""
    if INHERITED_FD in os.environ:
        return
    path = Path(root).resolve() / LOCK_NAME
    fd = _locked(path, fcntl.LOCK_SH, root, lambda owner: _holders(path, owner))
    another = lambda owner: f"another {component} (pid {owner or '?'}) runs on it"  # noqa: E731
    try:
        _write_pid(_locked(path.with_name(f"{component}.lock"), fcntl.LOCK_EX, root, another))
    except UserError:
        os.close(fd)  # the shared lock too: a refused component holds nothing
        raise
    _pass_on(fd, path)


def _locked(path: Path, how: int, root: Path, holders) -> int:
    """A descriptor of `path` flock'd `how`; a UserError naming `holders(pid the file holds)` if it is taken. A lock
    that no live process holds any more is being let go (the kernel drops a dead run's last descriptors a moment
    after its processes are gone): it is waited for, up to SETTLE_S."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + SETTLE_S
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip()
            if time.monotonic() < deadline and _let_go(path, owner):
                time.sleep(0.1)
                continue
            os.close(fd)
            raise UserError(
                f"run dir {root} is in use: {holders(owner)}; stop it or use another --output-dir"
            ) from None


def _let_go(path: Path, owner: str) -> bool:
    """Nothing alive holds `path`'s lock: its writer is gone, and no process shares it or has the file open."""
    gone = not (owner.isdigit() and pid_alive(int(owner)))
    return gone and not _shared_holders(path) and not _opened_by(path) - {os.getpid()}


def _write_pid(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())


def _pass_on(fd: int, path: Path) -> None:
    """Every child `process.spawn` starts gets the descriptor, and knows it was started by the dir's holder."""
    os.set_inheritable(fd, True)
    os.environ[INHERITED_FD] = f"{fd}:{path}"


def _holders(path: Path, owner: str) -> str:
    """`rl (pid 12) runs on it` / `processes started on their own run on it: trainer (pid 7)` / `rl (pid 12) is
    gone, but processes it started still run on it (pids 13, 14)`."""
    if owner.isdigit() and pid_alive(int(owner)):
        return f"rl (pid {owner}) runs on it"
    if shared := _shared_holders(path):
        return "processes started on their own run on it: " + ", ".join(f"{_name(p)} (pid {p})" for p in shared)
    others = ", ".join(str(p) for p in sorted(_opened_by(path))) or "unknown"
    return f"rl (pid {owner or '?'}) is gone, but processes it started still run on it (pids {others})"


def _shared_holders(path: Path) -> list[int]:
    """The pids holding a shared flock on `path` (components that joined the dir), from /proc/locks."""
    try:
        inode, lines = os.stat(path).st_ino, Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    pids = []
    for fields in (line.split() for line in lines):
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[3] == "READ" and fields[5].endswith(f":{inode}"):
            pids.append(int(fields[4]))
    return sorted(set(pids))


def _name(pid: int) -> str:
    """The asyncrl command a process runs (`trainer`, ...), else its program's name."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    for arg in args:
        if arg.startswith("asyncrl.entrypoints."):
            return arg.rsplit(".", 1)[1].replace("_", "-")
    if len(args) > 2 and args[1] == "-m":  # python -m module
        return args[2]
    return Path(args[1] if len(args) > 1 and Path(args[0]).name.startswith("python") else args[0]).name


def _opened_by(path: Path) -> set[int]:
    """The pids of this user's processes that have `path` open."""
    pids = set()
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if os.readlink(fd) == str(path):
                pids.add(int(fd.parent.parent.name))
        except (OSError, ValueError):
            continue
    return pids
