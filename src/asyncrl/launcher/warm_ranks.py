"""Warm ranks: a torchrun (`python -m torch.distributed.run`) that a zygote forked forks its local ranks too.

torchrun's agent execs each local rank as `python -u -m MODULE ARGS`, and each rank (`asyncrl.entrypoints.*`) then
spends seconds of CPU importing torch, transformers and the trainer before it does anything (~5 CPU s a rank on
two cores: most of a short two-rank run). An agent that a zygote forked has all of that imported already, so it
forks a zygote of its own for free (`asyncrl.launcher.zygote`) and `fork_local_ranks` has torchrun's process
handler fork `-m` ranks from it. Everything else is torchrun's own: rendezvous, restarts, the ranks' environment
and output files, how it signals, waits for and reports its ranks.

Invariants: a forked rank gets what torchrun's exec would give it: its command line (with `-u`) as its title,
unbuffered stdout and stderr, its own session, the environment torchrun made, and not the run lock's descriptor
(torchrun's Popen closes it, so an exec'd rank joins nothing). A rank run from a script path, and every
rank of a torchrun no zygote forked (a user's shell's), is exec'd by torchrun as before. This module imports
neither torch nor the zygote: the zygote hands its own instance in.

`torchrun --nproc-per-node N -m asyncrl.launcher.warm_ranks [fail]` runs this module as each rank: it prints, as
one JSON line, what kind of process the rank is (`report`); with `fail`, rank 1 exits 3 and the others wait for
torchrun's signal.
"""

from __future__ import annotations

import os
import sys

TORCHRUN = "torch.distributed.run"  # the module whose agent forks its ranks when a zygote forked it


def fork_local_ranks(zygote) -> None:
    """Have torchrun's process handler fork `python -u -m MODULE` ranks from `zygote` (a
    `asyncrl.launcher.zygote.Zygote`); any other command, or one the zygote cannot take, is exec'd as upstream does."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    handler = subprocess_handler.SubprocessHandler
    upstream = handler._popen

    def _popen(self, args: tuple, env: dict[str, str]):
        cmd = forkable(args)
        child = None
        if cmd is not None:
            outputs = (_copy(self._stdout, 1), _copy(self._stderr, 2))
            child = zygote.fork(cmd, env, outputs, title=" ".join(args), lock=False, unbuffered=True)
        return upstream(self, args, env) if child is None else child

    handler._popen = _popen


def forkable(args: tuple) -> list[str] | None:
    """`python -m MODULE ARGS` for torchrun's `(python, -u, -m, MODULE, ARGS)` with this Python; else None."""
    args = tuple(str(a) for a in args)
    if args[:3] != (sys.executable, "-u", "-m") or len(args) < 4:
        return None
    return [sys.executable, "-m", *args[3:]]


def _copy(stream, default_fd: int) -> int:
    """A descriptor for the child's output: a copy of torchrun's redirect file's, or of this process's own."""
    return os.dup(stream.fileno() if stream is not None else default_fd)


def report() -> dict:
    """What kind of process this rank is: forked or exec'd, its command line and its parent's, its session,
    its stdout's layers, whether it holds the run lock's descriptor."""
    from asyncrl.utils.process import inherited_fd

    zygote = sys.modules.get("asyncrl.launcher.zygote")
    return {
        "rank": int(os.environ.get("RANK", "-1")),
        "pid": os.getpid(),
        "forked": bool(zygote and zygote.FORKED),
        "cmdline": _cmdline("self"),
        "parent": _cmdline(str(os.getppid())),
        "session_leader": os.getsid(0) == os.getpid(),
        "stdout": [type(sys.stdout).__name__, type(sys.stdout.buffer).__name__],
        "lock": bool(inherited_fd()),
    }


def _cmdline(pid: str) -> str:
    with open(f"/proc/{pid}/cmdline") as f:
        return f.read().replace("\0", " ").strip()


if __name__ == "__main__":
    import json
    import signal

    print(json.dumps(report()))
    if sys.argv[1:] == ["fail"]:
        if os.environ.get("RANK") == "1":
            sys.exit(3)
        signal.pause()
