"""Live progress of a long loop: a rich bar on a terminal, the loop's own log lines elsewhere.

`with Bar(label, total, done) as bar:` then `bar.update(done, reward=..., ...)` after each unit of work (a
step, an example group) shows done/total, elapsed time, ETA and the fields; `bar.waiting(what)` names what the
loop waits for (server start, model load, a step's rollouts) until the next update, and logs it once.

The bar is drawn when stderr is a terminal and CI is not set (`ASYNCRL_PROGRESS=bar` forces it, e.g. to
measure its cost; `=plain` turns it off). It stays under the log lines, which print above it, and is redrawn
by the loop's own thread on each update (no drawing thread competing with training for the CPU). Elsewhere
nothing is drawn: the loops log one line per step (or per tenth of the examples) already, and `waiting`
logs its line, so a long wait is never silent.

Invariant: the bar only draws; logs, metrics files and exit codes are the same with and without it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from loguru import logger


def bar_wanted() -> bool:
    mode = os.environ.get("ASYNCRL_PROGRESS", "auto")
    if mode in ("bar", "plain"):
        return mode == "bar"
    return sys.stderr.isatty() and not os.environ.get("CI")


def fields_text(fields: dict[str, Any]) -> str:
    """`reward 0.512  off-policy 1  tok/s 3,679`: floats by size, thousands separated; None left out."""
    parts = []
    for name, value in fields.items():
        if isinstance(value, float):
            size = abs(value)
            value = f"{value:,.0f}" if size >= 100 else f"{value:.3f}" if size >= 0.01 or not size else f"{value:.2e}"
        if value is not None:
            parts.append(f"{name} {value}")
    return "  ".join(parts)


class Bar:
    def __init__(self, label: str, total: int | None, done: int = 0, enabled: bool = True):
        self.label, self.total, self.done = label, total, done
        self.enabled = enabled and bar_wanted()  # rank > 0 passes enabled=False
        self._progress = None

    def __enter__(self) -> Bar:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("[bold]{task.description}"),
                BarColumn(bar_width=20),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(compact=True),
                TextColumn("{task.fields[info]}"),
                console=Console(stderr=True),
                auto_refresh=False,  # no drawing thread: redrawn on each update (steps are seconds apart)
            )
            self._task = self._progress.add_task(self.label, total=self.total, completed=self.done, info="")
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def update(self, done: int, **fields: Any) -> None:
        self.done = done
        if self._progress is not None:
            self._progress.update(self._task, completed=done, description=self.label, info=fields_text(fields))
            self._progress.refresh()

    def waiting(self, what: str) -> None:
        """Say what the loop waits for: in the bar until the next update, and once in the log."""
        logger.info(f"waiting for {what}")
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done, description=f"{self.label}: waiting for {what}")
            self._progress.refresh()
