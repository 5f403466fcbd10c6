"""The report's curves: which plots exist, and each run's points for them (step, wall time, value, smoothed).

Reads only `metrics/*.jsonl` and `logs/*.pid` of a run dir. Invariants: a step logged twice (a crashed
attempt, then a resumed one) counts once, the last row wins; unreadable lines (one being written) are
skipped. Wall time is honest: each metrics row carries `time` (unix seconds, written as its step was
logged), and a point's wall time is that minus the run's start (the earliest `started` in `logs/*.pid` or
first metrics row); a run whose rows have no `time` has no wall-time axis, never a guessed one.
Smoothing is a debiased EMA, the same here (PNGs, the time-to-accuracy table) and in report.js (the page),
of train curves only (`smoothed`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from asyncrl.transport.layout import RunLayout

SMOOTHING = 0.8  # the default EMA weight: RL rewards at these batch sizes are noisy; 0.8 still follows a trend


@dataclass(frozen=True)
class Plot:
    title: str
    source: str  # metrics file (orchestrator / trainer / sft), `kind` rows after ':' (orchestrator:eval)
    keys: Callable[[set[str]], list[str]]  # the metric keys to draw, from the keys the rows have


@dataclass(frozen=True)
class Curve:
    key: str
    steps: list[int]
    wall: list[float] | None  # seconds since the run started; None: the rows have no time
    values: list[float]


def named(*keys: str) -> Callable[[set[str]], list[str]]:
    return lambda have: [k for k in keys if k in have]


def prefixed(prefix: str, suffix: str = "") -> Callable[[set[str]], list[str]]:
    return lambda have: sorted(k for k in have if k.startswith(prefix) and k.endswith(suffix))


def per_env(have: set[str]) -> list[str]:
    """Each environment's mean reward, when there are several (one is the same curve as reward/mean)."""
    envs = [k for k in prefixed("reward/", "/mean")(have) if k != "reward/mean"]
    return envs if len(envs) > 1 else []


def masked_fractions(have: set[str]) -> list[str]:
    """Every `*_frac` the loss logged: masked_frac first, then each side of each mask, clip and truncation."""
    fracs = sorted(k for k in have if k.endswith("_frac") and "/" not in k and k != "masked_frac")
    return named("masked_frac")(have) + fracs


STEP_TIMES = ("time/step", "time/rollouts", "time/teacher_s", "time/wait_weights", "time/update_weights")
PLOTS = [
    Plot("reward", "orchestrator:train", lambda have: named("reward/mean")(have) + per_env(have)),
    Plot("rubric metrics", "orchestrator:train", prefixed("metrics/")),
    Plot("eval reward by step", "orchestrator:eval", prefixed("eval/reward/")),
    Plot("off-policy level (steps behind)", "orchestrator:train", named("off_policy/level")),
    Plot(
        "distillation: KL to the teacher (sampler_lp - teacher_lp)", "orchestrator:train", named("distill/teacher_kl")
    ),
    Plot("orchestrator step time (s)", "orchestrator:train", named(*STEP_TIMES, "time/pack_write")),
    Plot("generation tokens/s", "orchestrator:train", named("perf/gen_tokens_per_s")),
    Plot("completion length", "orchestrator:train", named("completion_len/mean", "completion_len/max")),
    Plot("staleness of trained samples (steps behind)", "trainer", named("off_policy/mean", "off_policy/max")),
    Plot("trainer loss", "trainer", named("loss")),
    Plot("entropy", "trainer", named("entropy")),
    Plot("grad norm", "trainer", named("grad_norm")),
    Plot(
        "KL to the sampler (mismatch_kl) and to the start weights (ref_kl)", "trainer", named("mismatch_kl", "ref_kl")
    ),
    Plot("forward-KL distillation: KL(teacher's top-k ‖ student)", "trainer", named("teacher_kl")),
    Plot("importance ratio π/μ (quantiles, max)", "trainer", prefixed("importance_ratio/")),
    Plot("masked / clipped / truncated fraction, by side", "trainer", masked_fractions),
    Plot("MoE router load (tokens per expert / mean, layers averaged; idle experts)", "trainer", prefixed("moe/")),
    Plot("trainer step time (s)", "trainer", named("step_time_s", "wait_s", "publish_s")),
    Plot("trainer tokens/s", "trainer", named("tokens_per_s")),
    Plot("eval reward by weights step (eval)", "eval", prefixed("eval/", "/reward_mean")),
    Plot("SFT loss", "sft", named("loss")),
    Plot("SFT grad norm", "sft", named("grad_norm")),
    Plot("SFT tokens/s", "sft", named("tokens_per_s")),
    Plot("SFT MoE router load (tokens per expert / mean, layers averaged; idle experts)", "sft", prefixed("moe/")),
]


def smoothed(plot: Plot) -> bool:
    """Train curves are smoothed; eval ones are not (each point is already a mean over a held-out set)."""
    return not (plot.source == "eval" or plot.source.endswith(":eval"))


def rows_by_step(path: Path, kind: str | None) -> list[dict]:
    """A metrics file's rows (of `kind`), one per step (the last one logged), by step; unreadable lines skipped."""
    if not path.exists():
        return []
    by_step: dict[int, dict] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line being written
            continue
        if (
            isinstance(row, dict)
            and isinstance(row.get("step"), int)
            and (kind is None or row.get("kind", kind) == kind)
        ):
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def is_number(v) -> bool:
    """An int or a finite float (not a bool, not NaN or inf): what a curve can draw."""
    kind = type(v)
    return kind is int or (kind is float and math.isfinite(v))


class RunCurves:
    """One run dir's rows, read once per metrics source; its curves per plot."""

    def __init__(self, run: Path):
        self.run, self.layout = run, RunLayout(run)
        self._rows: dict[str, list[dict]] = {}  # each source read once
        self._have: dict[str, set[str]] = {}
        self._timed: dict[str, bool] = {}
        self.start = self._start()

    def rows(self, source: str) -> list[dict]:
        if source not in self._rows:
            name, _, kind = source.partition(":")
            self._rows[source] = rows_by_step(self.layout.metrics_file(name), kind or None)
        return self._rows[source]

    def have(self, source: str) -> set[str]:
        """The metric keys of a source's rows (numbers only; step and time are axes)."""
        if source not in self._have:
            keys = {k for r in self.rows(source) for k, v in r.items() if type(v) in (int, float)}
            self._have[source] = keys - {"step", "time"}
        return self._have[source]

    def _start(self) -> float | None:
        """The earliest `started` of its pid records or first `time` of its metrics files (a run resumed by a
        new `rl` has a newer rl.pid than its first rows)."""
        started = [r.get("started") for r in map(_json, self.layout.logs.glob("*.pid")) if r]
        started += [_first_time(p) for p in self.layout.metrics.glob("*.jsonl")]
        return min((t for t in started if is_number(t)), default=None)

    def curves(self, plot: Plot) -> list[Curve]:
        out = [self.curve(plot.source, key) for key in plot.keys(self.have(plot.source))]
        return [c for c in out if c.steps]

    def curve(self, source: str, key: str) -> Curve:
        points = [r for r in self.rows(source) if is_number(r.get(key))]
        wall = None
        if self.start is not None and self.timed(source):
            wall = [r["time"] - self.start for r in points]
        return Curve(key, [r["step"] for r in points], wall, [float(r[key]) for r in points])

    def timed(self, source: str) -> bool:
        """Every row of the source has its wall-clock `time`."""
        if source not in self._timed:
            self._timed[source] = all(is_number(r.get("time")) for r in self.rows(source))
        return self._timed[source]


def _json(path: Path) -> dict | None:
    try:
        row = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return row if isinstance(row, dict) else None


def _first_time(path: Path) -> float | None:
    with open(path, errors="replace") as f:
        for line in f:
            try:
                t = json.loads(line).get("time")
            except (ValueError, AttributeError):
                continue
            return t if is_number(t) else None
    return None


def ema(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Debiased exponential moving average: the first point is itself, not pulled toward 0."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc = weight * acc + (1 - weight) * v
        out.append(acc / (1 - weight ** (i + 1)) if weight else v)
    return out
