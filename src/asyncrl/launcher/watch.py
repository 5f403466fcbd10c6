"""Watch one run for the signs of collapse and say so once, naming the knobs that help.

Signs, over windows of WINDOW steps (the orchestrator's training rows; the trainer's rows for entropy):
- reward falling from its best: the last window's mean reward is below REWARD_DROP x the best window's
  (once the best window earned at least MIN_BEST);
- completions running away: the last window's mean completion length is GROWTH x the first window's or more;
- entropy running away: the trainer's last-window mean entropy is GROWTH x its first window's or more;
- no learning signal: every rollout of each of the last STUCK steps earned one reward (its std 0), below the best
  step's mean: every advantage is 0, so those steps give the trainer nothing that could pull the policy back (on
  tool-calc such runs stayed at reward 0; docs/learning.md, table 4c). Seen within STUCK steps, not a window.
`rl` logs one warning line per run the first time any sign shows; the run itself goes on.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from asyncrl.launcher.tailer import JsonlTail

WINDOW = 10
REWARD_DROP = 0.8
MIN_BEST = 0.05
GROWTH = 1.5
STUCK = 3
# What the learning benchmark measured (docs/learning.md, tables 1 and 2): at 3x the demo's lr 2 of 36 grpo runs and
# 4 of 12 dppo runs collapsed; at 1x none of 132 (every objective, k = 0, 1, 2). dppo's ratio is unclipped inside
# its band. Table 4c (tool-calc, k = 0 to 8): at its lr 7 of 40 collapsed (3 stuck at reward 0), at half 3 of 40;
# ref_kl 0.1 at its lr: 0 of 18 stuck (3 of 18 without), 3 of 18 milder collapses, less held-out gain.
KNOBS = (
    "lower trainer.optim.lr (in docs/learning.md 3x the lr collapsed 6 of 48 runs, 1x none of 132; on tool-calc "
    "its lr collapsed 7 of 40, half of it 3 of 40); keep the "
    "clipped default trainer.loss.type = 'grpo' (dppo collapsed 4 of 12 at 3x the lr); trainer.loss.ref_kl > 0 "
    "pulls toward the start weights (on tool-calc 0.1 left 0 of 18 runs stuck at reward 0, against 3 of 18, but "
    "learned less than half the lr)"
)


def _window_means(values: list[float]) -> list[float]:
    return [statistics.fmean(values[i : i + WINDOW]) for i in range(len(values) - WINDOW + 1)]


def _growth(values: list[float]) -> float | None:
    """Last window's mean over the first window's (None until there are two disjoint windows)."""
    if len(values) < 2 * WINDOW:
        return None
    first = statistics.fmean(values[:WINDOW])
    return statistics.fmean(values[-WINDOW:]) / first if first > 0 else None


def no_signal(rewards: list[float], stds: Sequence[float]) -> str | None:
    """The sign when each of the last STUCK steps had one reward for all its rollouts, below the best step's."""
    last, tail = rewards[-STUCK:], stds[-STUCK:]
    if len(tail) < STUCK or any(s != 0 for s in tail) or max(last) >= max(rewards):
        return None
    return (f"every rollout of the last {STUCK} steps earned the same reward ({last[-1]:.3f}; the best step's mean was "
            f"{max(rewards):.3f}), so every advantage is 0 and the trainer gets no signal to recover from")  # fmt: skip


def signs_of_collapse(
    rewards: list[float], lengths: list[float], entropy: list[float], stds: Sequence[float] = ()
) -> list[str]:
    """What looks like collapse in these per-step series (empty: nothing); `stds`: each step's reward std."""
    signs = [stuck] if (stuck := no_signal(rewards, stds)) else []
    windows = _window_means(rewards)
    if len(rewards) >= 2 * WINDOW and (best := max(windows)) >= MIN_BEST and windows[-1] < REWARD_DROP * best:
        signs.append(f"reward fell from its best {WINDOW}-step mean {best:.3f} to {windows[-1]:.3f}")
    if (g := _growth(lengths)) is not None and g >= GROWTH:
        signs.append(f"completions are {g:.1f}x as long as in the first {WINDOW} steps")
    if (g := _growth(entropy)) is not None and g >= GROWTH:
        signs.append(f"entropy is {g:.1f}x its first-{WINDOW}-step mean")
    return signs


class CollapseWatch:
    def __init__(self, trainer_metrics: Path, label: str | None = None):
        self.trainer, self.label = JsonlTail(trainer_metrics), label
        self.rewards: list[float] = []
        self.lengths: list[float] = []
        self.entropy: list[float] = []
        self.stds: list[float] = []  # per step, NaN where the row has none (so that step is never one reward)
        self.step = -1
        self.warned = False

    def observe(self, row: dict) -> None:
        """One orchestrator training row."""
        self.step = row.get("step", self.step)
        self.rewards.append(row["reward/mean"])
        if "completion_len/mean" in row:
            self.lengths.append(row["completion_len/mean"])
        self.stds.append(row.get("reward/std", math.nan))

    def check(self) -> str | None:
        """The warning line, the first time the run shows signs of collapse; else None."""
        if self.warned:
            return None
        self.entropy += [r["entropy"] for r in self.trainer.new_rows() if "entropy" in r]
        signs = signs_of_collapse(self.rewards, self.lengths, self.entropy, self.stds)
        if not signs:
            return None
        self.warned = True
        who = f"rl {self.label}" if self.label else "rl"
        return f"[{who}] step {self.step}: signs of collapse: {'; '.join(signs)}. To keep the run stable: {KNOBS}"
