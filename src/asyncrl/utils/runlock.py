"""One `rl` per run dir: `{output_dir}/rl.lock`, flock'd by `rl` and held by every process it starts.

`hold` takes the lock before anything is written into the run dir, and writes the holder's pid into it. The
descriptor is inherited by every child `process.spawn` starts (and theirs, e.g. a started env server), so
the lock stays taken while any of them runs, even after `rl` itself was killed with -9; the kernel drops it
when the last holder exits, so a lock is never stale and needs no clean-up. A second `rl` on the dir is
refused with one line naming the holders.

Invariants: a refused `rl` writes nothing into the run dir; the lock file itself is never deleted (a new
holder would lock another inode than a waiting one).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from asyncrl.core.errors import UserError
from asyncrl.utils.process import INHERITED_FD, pid_alive

LOCK_NAME = "rl.lock"


def hold(root: Path) -> int:
    """Lock run dir `root` for this process and its children (UserError if another rl or its leftovers hold
    it); returns the descriptor, which stays open until this process exits."""
    path = Path(root).resolve() / LOCK_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        said = _holders(path, owner)
        raise UserError(f"run dir {root} is in use: {said}; stop it or use another --output-dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    os.set_inheritable(fd, True)
    os.environ[INHERITED_FD] = f"{fd}:{path}"
    return fd


def _holders(path: Path, owner: str) -> str:
    """`rl (pid 12) runs on it` / `rl (pid 12) is gone, but processes it started run on (pids 13, 14)`."""
    if owner.isdigit() and pid_alive(int(owner)):
        return f"rl (pid {owner}) runs on it"
    others = ", ".join(str(p) for p in sorted(_opened_by(path))) or "unknown"
    return f"rl (pid {owner or '?'}) is gone, but processes it started still run on it (pids {others})"


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
