"""Loguru setup: console plus the run's `logs/<component>.log`, called once per entrypoint (see entrypoints/_entry)."""

from __future__ import annotations

import logging
import os
import sys

from loguru import logger

from asyncrl.transport.layout import RunLayout
from asyncrl.utils import runstate

_FORMAT = "<green>{time:HH:mm:ss}</green> <level>{level: <7}</level> <cyan>[{extra[component]}]</cyan> {message}"


def setup_logger(
    component: str, layout: RunLayout | None, level: str = "info", to_file: bool = True, console: bool = True
):
    """Route loguru to stderr and to the run's `logs/{component}.log`; returns the log file path."""
    logger.remove()
    logger.configure(extra={"component": component})
    if console:  # whatever sys.stderr is when a line is written: a live progress bar prints log lines above itself
        logger.add(_to_stderr, level=level.upper(), format=_FORMAT, colorize=sys.stderr.isatty())
    path = None
    if to_file and layout is not None:
        path = layout.log_file(component)
        path.parent.mkdir(parents=True, exist_ok=True)
        logger.add(path, level=level.upper(), format=_FORMAT, colorize=False, enqueue=False)
        runstate.register(component, layout)
    return path


def _to_stderr(message: str) -> None:
    sys.stderr.write(message)


def setup_rank_logger(component: str, layout: RunLayout, level: str = "info", to_file: bool = True):
    """For torchrun'd entrypoints: every rank logs to its own file (`<component>_rank<R>.log` past rank 0),
    only rank 0 prints to the console."""
    rank = int(os.environ.get("RANK", "0"))
    name = component if rank == 0 else f"{component}_rank{rank}"
    return setup_logger(name, layout, level, to_file, console=rank == 0)


class _ToLoguru(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        level = record.levelname if record.levelname in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL") else "INFO"
        logger.opt(exception=record.exc_info).log(level, f"[{record.name}] {record.getMessage()}")


def forward_stdlib(name: str, level: int = logging.INFO) -> None:
    """Send a library's standard-library log records (e.g. verifiers') to loguru's console and file."""
    lib = logging.getLogger(name)
    lib.setLevel(level)
    lib.addHandler(_ToLoguru())
    lib.propagate = False
