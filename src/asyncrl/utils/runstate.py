"""Each process's record in its run, for `asyncrl status`: `{output_dir}/logs/<component>.pid` (JSON).

Written (atomically) when the process sets up its log file, with pid, host, command and start time, and
completed by `run_guarded` when the entrypoint ends, with the exit code and the error if there was one.
A record without `exit` whose pid is gone on this host means the process was killed (SIGKILL, OOM).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from asyncrl.transport.files import write_text_atomic
from asyncrl.transport.layout import RunLayout
from asyncrl.utils.process import pid_alive

_record: Path | None = None  # this process's record, once registered
STOPPED = 143  # 128 + SIGTERM: what a process stopped on purpose (e.g. rl's server at the end) exits with


def register(component: str, layout: RunLayout) -> None:
    global _record
    _record = layout.pid_file(component)
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "argv": sys.argv}
    write_text_atomic(_record, json.dumps(info))


def finish(code: int, error: str | None = None) -> None:
    """Complete this process's record (no-op if it never registered)."""
    if _record is not None:
        close(_record, code, error)


def update(**fields) -> None:
    """Add `fields` to this process's record (no-op if it never registered), e.g. rl's restarts."""
    info = read(_record) if _record is not None else {}
    if info:
        write_text_atomic(_record, json.dumps({**info, **fields}))


def close(path: Path, code: int, error: str | None = None) -> None:
    """Write the end into a record that has none yet (a launcher closes those of the children it stopped)."""
    info = read(path)
    if info and "exit" not in info:
        try:
            write_text_atomic(path, json.dumps({**info, "ended": time.time(), "exit": code, "error": error}))
        except OSError:  # a full disk: the record stays open; `asyncrl status` reports the process as killed
            pass


def read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


EXITS = {0: "finished", 130: "interrupted", STOPPED: "stopped"}


def state(info: dict) -> str:
    """running / finished / stopped / interrupted / failed (exit N) / killed / on another host."""
    if "exit" in info:
        return EXITS.get(info["exit"], f"failed (exit {info['exit']})")
    if info.get("host") != socket.gethostname():
        return f"started on {info.get('host')} (cannot check from here)"
    return f"running (pid {info['pid']})" if pid_alive(info["pid"]) else "killed (no exit recorded)"
