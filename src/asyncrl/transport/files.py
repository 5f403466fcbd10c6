"""The file primitives every wire relies on: publish a directory atomically, mark one complete, wait for one.

`write_text_atomic` does the same for one file.
`publish_dir` and `mark_stable` are the only writers of the STABLE marker (`transport.layout` names it and
is its only reader): the marker goes in last, via a temporary name, so a reader that sees it sees whole files.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from asyncrl.core.errors import raise_if_full
from asyncrl.transport.layout import STABLE


def publish_dir(final: Path, write: Callable[[Path], None], marker: bool = True) -> Path:
    """Fill `final` atomically: `write(tmp_dir)` writes the files, then rename, then (optionally) a STABLE marker.

    A reader never sees a partial dir: it appears whole under its final name, replacing any old one.
    A write that failed on a full disk is raised as ENOSPC naming the dir.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp_{final.name}_{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException as e:
        try:
            raise_if_full(final.parent, e)  # before the clean-up frees the bytes that ran out
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if marker:
        mark_stable(final)
    return final


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temp file in the same folder and rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    tmp.write_text(text)
    os.replace(tmp, path)


def mark_stable(path: Path) -> None:
    """Declare the dir `path` complete: its STABLE marker appears at once (written under a temp name)."""
    tmp = path / f".{STABLE}.tmp"
    tmp.write_text("")
    os.replace(tmp, path / STABLE)


def wait_for(
    ready: Callable[[], bool],
    what: str,
    timeout: float | None = None,
    poll: float = 0.005,
    should_stop: Callable[[], bool] | None = None,
) -> None:
    """Poll `ready()`; TimeoutError naming `what` after `timeout` s, InterruptedError when `should_stop()`."""
    start = time.monotonic()
    while not ready():
        if timeout is not None and time.monotonic() - start > timeout:
            raise TimeoutError(f"no {what} after {timeout:.0f}s")
        if should_stop is not None and should_stop():
            raise InterruptedError(f"stopped while waiting for {what}")
        time.sleep(poll)
