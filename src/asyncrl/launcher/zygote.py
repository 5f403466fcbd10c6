"""Warm starts: `rl`'s Python children forked from one process that imported the heavy libraries once.

Each child `rl` starts with its own Python (the embedded inference server, the orchestrator, a one-rank trainer,
the teacher) spent seconds of CPU importing torch, transformers and verifiers before it did anything; three of
them at once on a 2-core machine took most of a short run. The zygote (`python -m asyncrl.launcher.zygote
RUN_DIR`, started by `rl` on a CPU-only machine) imports them in stages (STAGES) and serves spawn requests that
`Zygote.spawn` sends over a Unix socket pair: for each it forks a child that runs the entrypoint module as
`python -m MODULE ARGS` would. Its exits come back as messages; `Forked` is the launcher's handle on such a
child, with the part of `subprocess.Popen`'s interface the launcher uses.

Invariants: a child gets what an exec'd one would have: its argv, environment, command line (`setproctitle`, so
`ps` and `processes_by_role` see `python -m MODULE ...`), stdout + stderr on the descriptor rl passed, stdin
/dev/null, a session of its own, SIGTERM when the zygote dies (and the zygote gets it when rl dies), fresh random
seeds, the thread count OMP_NUM_THREADS asks for, its cwd and PYTHONPATH first on sys.path as `python -m` puts
them, and the garbage collector on (the objects it inherited frozen: `gc.freeze`, never walked). A request is
served once the stage its module needs has loaded (a module no stage names: once all have). The zygote runs no
child code itself and starts no thread. Where the zygote cannot serve (not started, died, a CUDA machine: CUDA
must not be initialised before a fork, ASYNCRL_ZYGOTE=0), `spawn` returns None and rl execs the child as before.

A process that is already warm (every stage's modules imported, no other thread: e.g. an `rl` that a zygote
forked, as the test suite starts its processes with `Zygote.fork`) forks its zygote instead of
exec'ing one: the same serving loop with nothing left to import.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from loguru import logger

from asyncrl.launcher import warm_ranks
from asyncrl.utils.process import INHERITED_FD, PIPED, die_with_parent, inherited_fd, running, spawn

VAR = "ASYNCRL_ZYGOTE"  # 0: exec every child (no warm starts)
FD_VAR = "ASYNCRL_ZYGOTE_FD"  # the zygote's end of the socket pair
READY_TIMEOUT_S = 120.0  # a request waits this long for the zygote's stage, then rl execs the child
MAX_MESSAGE = 1 << 20
FORKED = False  # this process is a zygote's child (set in it): it has imported the stages and computed nothing yet
# (entrypoint modules served once the stage has loaded, the modules it imports); later stages include earlier ones
STAGES = (
    (
        ("asyncrl.entrypoints.inference", "asyncrl.entrypoints.trainer"),
        ("torch", "transformers.modeling_utils", "asyncrl.inference.api.app", "asyncrl.trainer.rl"),
    ),
    (("asyncrl.entrypoints.orchestrator",), ("verifiers.v1", "asyncrl.orchestrator")),
)


# ---- in rl ---------------------------------------------------------------------------------------------------


class Forked:
    """A child the zygote forked: `pid`, `args`, `returncode`, `poll()`, `wait(timeout)`, `stdout` (PIPED)."""

    def __init__(self, pid: int, args: list[str], stdout=None):
        self.pid, self.args, self.stdout, self.returncode = pid, args, stdout, None
        self.cpu_s = 0.0  # its CPU seconds and those of its descendants it reaped, once it exited (as wait4 says)
        self._exited = threading.Event()
        self.orphaned = False  # the zygote died: the kernel made rl (a subreaper) this child's parent

    def exited(self, code: int, cpu_s: float = 0.0) -> None:
        self.returncode, self.cpu_s = code, cpu_s
        self._exited.set()

    def poll(self) -> int | None:
        if self.returncode is None and self.orphaned:
            self._reap()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:  # in slices: the zygote may die meanwhile, and then rl must look itself
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._exited.wait(0.2 if deadline is None else min(0.2, max(0.0, deadline - time.monotonic())))
        return self.returncode

    def _reap(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # not (yet) rl's child: ended when gone or a zombie
            if not running(self.pid):
                self.exited(-signal.SIGTERM)
            return
        if pid:
            self.exited(os.waitstatus_to_exitcode(status))


class Zygote:
    """rl's end: starts the zygote process, sends it spawn requests, hands out `Forked` children."""

    def __init__(self, marker: str, log: Path | None):
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, FD_VAR: str(theirs.fileno())}
        cmd = [sys.executable, "-m", "asyncrl.launcher.zygote", marker]
        if _warm():
            self.proc = _fork_zygote(cmd, log, theirs, self._sock)
        else:
            self.proc = spawn(cmd, log, env, keep_fds=(theirs.fileno(),))
        theirs.close()
        self._children: dict[int, Forked] = {}
        self._early: dict[int, tuple[int, float]] = {}  # exits that came before their spawn's reply was read
        self.reaped_cpu_s = 0.0  # the CPU seconds of every child that exited (and of what it reaped)
        self._replies: dict[int, dict] = {}
        self._changed = threading.Condition()
        self._alive, self._next = True, 0
        threading.Thread(target=self._read, daemon=True, name="zygote").start()

    def spawn(
        self, cmd: list[str], log: Path | None, env: dict[str, str], cores: list[int] | None = None
    ) -> Forked | None:
        """Fork `cmd` (`python -m MODULE ...` with this python; on `cores` if given) if the zygote can; None: exec
        it."""
        read_end, out = _output(log)
        child = self.fork(cmd, env, (out,), cores)
        if child is None and read_end is not None:
            read_end.close()
        elif child is not None:
            child.stdout = read_end
        return child

    def fork(
        self, cmd: list[str], env: dict[str, str], outputs: tuple[int, ...], cores=None, cwd: str | None = None,
        title: str | None = None, lock: bool = True, unbuffered: bool = False,
    ) -> Forked | None:  # fmt: skip
        """Fork `cmd` with stdout on `outputs[0]` and stderr on `outputs[-1]` (descriptors, closed here), in `cwd`
        (None: this process's); None where the zygote cannot (then exec it). `title`: its command line as `ps` shows
        it (default `cmd`); `lock`: it inherits the run lock's descriptor as `spawn` would pass it; `unbuffered`:
        stdout and stderr as `python -u` makes them."""
        if not self._alive or len(cmd) < 3 or cmd[:2] != [sys.executable, "-m"]:
            for fd in outputs:
                os.close(fd)
            return None
        request = {"cores": sorted(cores or ()), "env": env, "cwd": cwd or os.getcwd(), "unbuffered": unbuffered}
        request["title"] = title or " ".join(cmd)
        with self._changed:
            self._next += 1
            reply = self._ask({"id": self._next, **request}, cmd, outputs, lock)
            if reply is None or "pid" not in reply:
                return None
            child = self._children[reply["pid"]] = Forked(reply["pid"], list(cmd))
            if reply["pid"] in self._early:
                child.exited(*self._early.pop(reply["pid"]))
            return child

    def _ask(self, request: dict, cmd: list[str], outputs: tuple[int, ...], lock: bool) -> dict | None:
        """Send one spawn request (holding the lock) and wait for its reply; None if none came."""
        lock = inherited_fd() if lock else ()  # the run lock's descriptor, as `spawn` hands it to an exec'd child
        fds = [*outputs, *lock]
        if lock:
            request["env"] = {**request["env"], INHERITED_FD: os.environ[INHERITED_FD]}
        request |= {"module": cmd[2], "args": cmd[3:], "outputs": len(outputs)}
        ask = request["id"]
        try:
            socket.send_fds(self._sock, [json.dumps(request).encode()], fds)
        except OSError:
            return None
        finally:
            for fd in outputs:
                os.close(fd)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while ask not in self._replies and self._alive and time.monotonic() < deadline:
            self._changed.wait(0.5)
        return self._replies.pop(ask, None)

    def _read(self) -> None:
        while message := _receive(self._sock):
            with self._changed:
                if "exit" in message:
                    self._exit(message["exit"], message["code"], message.get("cpu_s", 0.0))
                else:
                    self._replies[message["id"]] = message
                self._changed.notify_all()
        with self._changed:
            self._alive = False
            for child in self._children.values():
                child.orphaned = True
            self._changed.notify_all()

    def _exit(self, pid: int, code: int, cpu_s: float) -> None:
        self.reaped_cpu_s += cpu_s
        if pid in self._children:
            self._children.pop(pid).exited(code, cpu_s)
        else:
            self._early[pid] = (code, cpu_s)

    def close(self) -> None:
        """Let the zygote go (its children are stopped by then; any left get SIGTERM with it)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # a stuck zygote: rl's stop_descendants ends it
            pass


def start_zygote(marker: str, log: Path, cuda: bool) -> Zygote | None:
    """The run's zygote, or None where warm starts are off (ASYNCRL_ZYGOTE=0) or unsafe (a CUDA machine)."""
    if cuda or os.environ.get(VAR, "1") == "0":
        return None
    return Zygote(marker, log)


def _warm() -> bool:
    """A zygote forked this process, it runs no other thread and has every stage's modules: a fork of it is a ready
    zygote. (Any other process, e.g. one that has run torch's thread pool, forks none: it execs the zygote.)"""
    stages = all(name in sys.modules for _, names in STAGES for name in names)
    return FORKED and threading.active_count() == 1 and stages


def _fork_zygote(cmd: list[str], log: Path, theirs: socket.socket, ours: socket.socket) -> Forked:
    """The zygote as a fork of this warm process: what `spawn` would make of `cmd`, with nothing left to import.
    Its handle reaps it itself (it is this process's child, not the zygote's)."""
    out, parent = _output(log)[1], os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            os.setsid()
            die_with_parent(parent)
            _descriptors([out], {})
            logger.remove()  # this process's sinks (its log file): the children start as an exec'd zygote's do
            logger.add(sys.stderr)
            if "setproctitle" in sys.modules:
                sys.modules["setproctitle"].setproctitle(" ".join(cmd))
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            serve(theirs)
        finally:
            os._exit(0)
    os.close(out)
    zygote = Forked(pid, cmd)
    zygote.orphaned = True  # poll() reaps it with waitpid: it is this process's own child
    return zygote


def _output(log: Path | None) -> tuple:
    """(the read end for rl when `log` is PIPED else None, the descriptor the child writes its output to)."""
    if log is PIPED:
        r, w = os.pipe()
        return os.fdopen(r, "rb"), w
    if log is None:
        return None, os.dup(1)
    log.parent.mkdir(parents=True, exist_ok=True)
    return None, os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def _receive(sock: socket.socket) -> dict | None:
    try:
        data = sock.recv(MAX_MESSAGE)
    except OSError:
        return None
    return json.loads(data) if data else None


# ---- the zygote ----------------------------------------------------------------------------------------------


def serve(sock: socket.socket) -> None:
    """Load the stages, serving each request as soon as its stage has loaded; end when rl closes its end. The
    collector is off while the stages import (their objects all live on: collecting cost ~2 of 7 CPU s)."""
    pending: list[tuple[dict, list[int]]] = []
    loaded: set[str] = set()
    gc.disable()
    for served, modules in STAGES:
        for name in modules:
            _preload(name)
        loaded.update(served)
        pending = _serve_ready(sock, pending, loaded, final=False)
    gc.enable()
    while True:
        pending = _serve_ready(sock, pending, loaded, final=True)
        if not select.select([sock], [], [], 0.2)[0]:
            _reap(sock)
            continue
        got = _take(sock)
        if got is None:
            return
        pending.append(got)


def _serve_ready(sock, pending, loaded, final: bool) -> list:
    """Fork each pending request whose module has loaded (all of them when `final`); take what arrived meanwhile."""
    while select.select([sock], [], [], 0)[0] and (got := _take(sock)) is not None:
        pending.append(got)
    waiting, held = [], [fd for _, fds in pending for fd in fds]
    for request, fds in pending:
        if final or request["module"] in loaded:
            _fork(sock, request, fds, [fd for fd in held if fd not in fds])
            held = [fd for fd in held if fd not in fds]
        else:
            waiting.append((request, fds))
    _reap(sock)
    return waiting


def _take(sock: socket.socket) -> tuple[dict, list[int]] | None:
    try:
        data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
    except OSError:
        return None
    return (json.loads(data), fds) if data else None


def _preload(name: str) -> None:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - a child that needs it imports it itself and says what is wrong
        logger.warning(f"zygote: could not preload {name}: {type(e).__name__}: {e}")


def _fork(sock: socket.socket, request: dict, fds: list[int], others: list[int]) -> None:
    """Fork the child of `request` (its descriptors `fds`; `others`: the other waiting requests', which it closes).
    What the zygote holds is frozen first (`gc.freeze`): the child's collections then never walk it, where each
    full one took ~0.4 CPU s and copied ~160 MB of shared pages on first touch."""
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()
    try:
        pid = os.fork()
    except OSError as e:  # out of memory or processes: rl execs this one
        reply = {"id": request["id"], "error": str(e)}
    else:
        if pid == 0:
            _become(sock, request, fds, others)
        reply = {"id": request["id"], "pid": pid}
    for fd in fds:
        os.close(fd)
    sock.send(json.dumps(reply).encode())


def _reap(sock: socket.socket) -> None:
    """Tell rl about each child that exited (Popen's convention: -N for a signal) and the CPU it used."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code, cpu_s = os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime
        sock.send(json.dumps({"exit": pid, "code": code, "cpu_s": round(cpu_s, 3)}).encode())


def _become(sock: socket.socket, request: dict, fds: list[int], others: list[int]) -> None:
    """In the forked child: take on the request's process state, then run its module as `python -m` does."""
    try:
        gc.enable()  # as in any process (the zygote forks with it off while it imports)
        sock.close()
        for fd in others:  # another child's output: held here, its reader would never see it end
            os.close(fd)
        if request.get("cores"):  # before any thread starts: each inherits it
            os.sched_setaffinity(0, request["cores"])
        os.setsid()
        die_with_parent(os.getppid())
        _descriptors(fds, request["env"], request.get("outputs", 1))
        os.chdir(request.get("cwd") or ".")
        _search_path(os.environ.get("PYTHONPATH", ""), request["env"].get("PYTHONPATH", ""))
        _process_state(request)
        zygote = importlib.import_module("asyncrl.launcher.zygote")  # this file may run as __main__
        zygote.FORKED = True
        import runpy

        sys.argv = [request["module"], *request["args"]]
        ranks = zygote._ranks_zygote(request["module"])
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        finally:
            if ranks is not None:
                ranks.close()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else _said(e.code))
    except BaseException:  # noqa: BLE001 - what an uncaught exception does in any Python process
        import traceback

        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _search_path(ours: str, theirs: str) -> None:
    """sys.path as `python -m` starts it in this (the child's) cwd with the child's PYTHONPATH `theirs`: the cwd, then
    those entries, then the rest. The zygote's first entries (the directory it started in, its PYTHONPATH `ours`)
    are replaced; where sys.path does not start with them as Python made them, it is left as it is."""
    start = sys.path[0] if sys.path else ""
    head = [start, *_entries(ours, start)]
    if sys.path[: len(head)] == head:
        cwd = os.getcwd()
        sys.path[: len(head)] = [cwd, *_entries(theirs, cwd)]


def _entries(pythonpath: str, base: str) -> list[str]:
    """PYTHONPATH's entries as Python puts them on sys.path: absolute, from `base`; empty ones left out."""
    return [os.path.join(base, p) for p in pythonpath.split(os.pathsep) if p]


def _ranks_zygote(module: str) -> Zygote | None:
    """For a torchrun forked here (warm: nothing started yet): a zygote its local ranks are forked from
    (`warm_ranks`); None for any other module."""
    if module != warm_ranks.TORCHRUN or not _warm():
        return None
    ranks = Zygote(f"torchrun-{os.getpid()}", None)
    warm_ranks.fork_local_ranks(ranks)
    return ranks


def _said(message) -> int:
    print(message, file=sys.stderr)
    return 1


def _descriptors(fds: list[int], env: dict[str, str], outputs: int = 1) -> None:
    """stdout on the first passed descriptor, stderr on the last of its `outputs`, stdin /dev/null, the inherited
    lock descriptor at its number."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(fds[0], 1)
    os.dup2(fds[outputs - 1], 2)
    lock = int(env[INHERITED_FD].split(":")[0]) if INHERITED_FD in env and len(fds) > outputs else None
    if lock is not None:
        os.dup2(fds[outputs], lock)
    for fd in fds:
        if fd > 2 and fd != lock:
            os.close(fd)


def _process_state(request: dict) -> None:
    """Environment, command line, signals, random seeds and thread count as a fresh process has them."""
    os.environ.clear()
    os.environ.update(request["env"])
    if "setproctitle" in sys.modules:  # imported by main(), before anything changed the environment
        sys.modules["setproctitle"].setproctitle(request["title"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules and (threads := os.environ.get("OMP_NUM_THREADS", "")).isdigit() and int(threads):
        sys.modules["torch"].set_num_threads(int(threads))
    if os.environ.get("PYTHONUNBUFFERED") or request.get("unbuffered"):
        _unbuffered()


def _unbuffered() -> None:
    """stdout and stderr as `python -u` makes them: every write reaches the descriptor at once. (The streams
    replaced stay as `sys.__stdout__` / `sys.__stderr__`, empty.)"""
    import io

    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "w", closefd=False)
        setattr(sys, name, io.TextIOWrapper(raw, encoding=old.encoding, errors=old.errors, write_through=True))


def main() -> None:
    try:  # first: it finds the memory a new command line can take while argv and the environment are intact
        import setproctitle

        setproctitle.getproctitle()  # its set-up runs at the first call, not at import
    except ImportError:
        logger.warning("zygote: no setproctitle; its children show the zygote's command line")
    sock = socket.socket(fileno=int(os.environ.pop(FD_VAR)))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rl, which stops the children itself
    try:
        serve(sock)
    except (BrokenPipeError, ConnectionResetError):  # rl has gone
        pass
    os._exit(0)


if __name__ == "__main__":
    main()
