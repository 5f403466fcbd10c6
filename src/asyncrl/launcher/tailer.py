"""Follow a run's `metrics/orchestrator.jsonl` while it grows: one console line per training step, then a summary.

Only whole lines are read (a row still being written waits for the next poll); eval rows, rows without
a reward and lines that are not JSON are skipped. Each step is counted once. Rows of steps before this
run's first (an earlier run in the same output dir) are not this run's; a file rewritten shorter (a process
dropping the steps it redoes) is read again from its start.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from loguru import logger


class JsonlTail:
    """The whole JSON lines appended to a file since the last read (read again from the start if it shrank)."""

    def __init__(self, path: Path):
        self.path, self.pos = path, 0

    def new_rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        rows = []
        if self.path.stat().st_size < self.pos:
            self.pos = 0
        with open(self.path) as f:
            f.seek(self.pos)
            for line in f:
                if not line.endswith("\n"):
                    break
                self.pos += len(line.encode())
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return rows


class StepWatch(Protocol):
    """What the tailer tells each step (`watch.CollapseWatch` is one; watch.py imports JsonlTail from here)."""

    def observe(self, row: dict) -> None: ...

    def check(self) -> str | None: ...


class StepTailer:
    def __init__(self, path: Path, start_step: int, label: str | None = None, watch: StepWatch | None = None):
        self.path, self.label = path, label  # label: a multi-run run's name, on each of its lines
        self.tail = JsonlTail(path)
        self.next_step = start_step  # steps arrive in order; one already counted is not counted again
        self.rewards: list[tuple[int, float]] = []
        self.watch = watch  # told every step; warns once when the run shows signs of collapse

    def poll(self) -> dict | None:
        """Print a line for every training step logged since the last poll; the last one, or None."""
        last = None
        for row in self.tail.new_rows():
            if row.get("kind", "train") == "train" and "reward/mean" in row and row.get("step", -1) >= self.next_step:
                self.next_step = row["step"] + 1
                self.rewards.append((row["step"], row["reward/mean"]))
                print(step_line(row, self.label), flush=True)
                if self.watch is not None:
                    self.watch.observe(row)
                last = row
        if last is not None and self.watch is not None and (warning := self.watch.check()):
            logger.warning(warning)
        return last

    def summary(self, elapsed: float, weights: Path) -> str:
        if not self.rewards:
            return f"[rl] done in {elapsed:.0f}s (no reward logged)"
        fifth = max(1, len(self.rewards) // 5)
        return (
            f"[rl] done: {len(self.rewards)} steps in {elapsed:.0f}s; reward {_mean(self.rewards[:fifth]):.3f} "
            f"(first steps) -> {_mean(self.rewards[-fifth:]):.3f} (last steps); weights in {weights}"
        )


def step_line(row: dict, label: str | None = None) -> str:
    """`[rl] step N  reward R  <env> exact_match ...  off-policy L` for one training row (`[rl NAME]`: a run's)."""
    matches = [(k, v) for k, v in row.items() if k.startswith("metrics/") and k.endswith("exact_match")]
    extras = "".join(f"  {k.rsplit('/', 1)[-1]} {v:.3f}" for k, v in matches)
    level = row.get("off_policy/level", "?")
    who = f"rl {label}" if label else "rl"
    return f"[{who}] step {row['step']:>4}  reward {row['reward/mean']:.3f}{extras}  off-policy {level}"


def _mean(rewards: list[tuple[int, float]]) -> float:
    return sum(r for _, r in rewards) / len(rewards)
