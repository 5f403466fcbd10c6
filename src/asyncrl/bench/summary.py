"""The numbers of a benchmark run, from the per-step metrics rows: what the table and bench.json show.

One job: turn `metrics/{orchestrator,trainer}.jsonl` rows (or any framework's per-step timings) into
s/step, generation, training and weight-update times, and the overlap ratio; render them as a table.
Pure functions, no I/O but `read_rows`.

Where each number comes from (steps before `warmup` are left out of every median and mean):
- s/step: the gap between consecutive trainer rows' `time` stamps (the pace of the whole loop);
- generation: the orchestrator's `time/rollouts`; training: the trainer's `step_time_s`
  (forward, backward and optimizer step; waiting for the batch is `wait_s`, not training);
- weight update: the trainer's `publish_s` (writing `broadcast/step_n`) plus the orchestrator's
  `time/update_weights` (the server loading them);
- tokens/step: the orchestrator's `batch/tokens`, the tokens the trainer computes each step (a group's
  shared prompt counts once; `batch/tokens_unshared` is the count without sharing);
- overlap: median s/step / max(median generation, median training); 1.0 means generation and
  training fully overlap, 1 + min/max means they run one after the other.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def read_rows(path: str | Path, since: float = 0.0, kind: str | None = "train") -> list[dict]:
    """The rows of a metrics file logged at or after `since` (unix time), of `kind` where rows have one."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("time", 0.0) >= since and (kind is None or row.get("kind", kind) == kind):
            rows.append(row)
    return rows


def stats(values: list[float]) -> dict[str, float | None]:
    """Median and mean (None for no values)."""
    if not values:
        return {"median": None, "mean": None}
    return {"median": float(statistics.median(values)), "mean": float(statistics.fmean(values))}


def _by_step(rows: list[dict]) -> dict[int, dict]:
    return {int(r["step"]): r for r in rows if "step" in r}


def _column(rows: dict[int, dict], key: str, steps: list[int]) -> list[float]:
    return [float(rows[s][key]) for s in steps if s in rows and rows[s].get(key) is not None]


def step_seconds(trainer: dict[int, dict]) -> dict[int, float]:
    """Step n's wall time: trainer row n's time stamp minus row n-1's."""
    return {s: trainer[s]["time"] - trainer[s - 1]["time"] for s in trainer if s - 1 in trainer}


def measured_steps(steps: list[int], warmup: int) -> list[int]:
    """Steps that count: from `warmup` on, but never fewer than the last one that has a predecessor."""
    skip = min(warmup, max(len(steps) - 2, 0))
    return sorted(steps)[skip:]


def summarize(orchestrator_rows: list[dict], trainer_rows: list[dict], warmup: int) -> dict[str, Any]:
    """s/step, generation, training, weight update (medians and means) and overlap of one run."""
    orch, trainer = _by_step(orchestrator_rows), _by_step(trainer_rows)
    steps = measured_steps(list(trainer), warmup)
    per_step = step_seconds(trainer)
    step = stats([per_step[s] for s in steps if s in per_step])
    gen = stats(_column(orch, "time/rollouts", steps))
    train = stats(_column(trainer, "step_time_s", steps))
    publish = stats(_column(trainer, "publish_s", steps))
    load = stats(_column(orch, "time/update_weights", steps))
    update = {k: _add(publish[k], load[k]) for k in ("median", "mean")}
    return {
        "steps": len(trainer),
        "warmup_steps": len(trainer) - len(steps),
        "measured_steps": [min(steps), max(steps)] if steps else None,
        "step_s": step,
        "generation_s": gen,
        "training_s": train,
        "weight_update_s": update,
        "publish_s": publish,
        "load_s": load,
        "train_tokens": stats(_column(orch, "batch/tokens", steps)),
        "trainer_wait_s": stats(_column(trainer, "wait_s", steps)),
        "orchestrator_wait_s": stats(_column(orch, "time/wait_weights", steps)),
        "overlap": overlap(step["median"], gen["median"], train["median"]),
        "reward": reward_trend([orch[s] for s in sorted(orch)]),
    }


def _add(a: float | None, b: float | None) -> float | None:
    return None if a is None and b is None else (a or 0.0) + (b or 0.0)


def overlap(step: float | None, generation: float | None, training: float | None) -> float | None:
    """step / max(generation, training): 1.0 = full overlap."""
    longest = max((x for x in (generation, training) if x is not None), default=None)
    return None if step is None or not longest else step / longest


def reward_trend(rows: list[dict], key: str = "reward/mean") -> dict[str, float | None]:
    """Mean reward of the first and of the last fifth of the steps."""
    rewards = [float(r[key]) for r in rows if r.get(key) is not None]
    fifth = max(1, len(rewards) // 5)
    first, last = rewards[:fifth], rewards[-fifth:]
    return {"first": stats(first)["mean"], "last": stats(last)["mean"]}


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(title: str, s: dict[str, Any]) -> str:
    """The bench table: one line per time (median, mean), then overlap and reward."""
    span = s.get("measured_steps")
    lines = [
        title,
        f"  medians over steps {span[0]}-{span[1]} ({s['warmup_steps']} warm-up steps left out)" if span else "",
        f"  {'':<16} {'median':>8} {'mean':>8}",
    ]
    rows = [
        ("s/step", "step_s"),
        ("generation", "generation_s"),
        ("training", "training_s"),
        ("weight update", "weight_update_s"),
        ("  publish", "publish_s"),
        ("  load", "load_s"),
    ]
    for label, key in rows:
        if key in s:
            lines.append(f"  {label:<16} {_fmt(s[key]['median']):>8} {_fmt(s[key]['mean']):>8}")
    tokens = s.get("train_tokens") or {}
    if tokens.get("median") is not None:
        lines.append(f"  {'tokens/step':<16} {tokens['median']:>8.0f} {tokens['mean']:>8.0f}   (trained, per step)")
    lines.append(f"  {'overlap':<16} {_fmt(s.get('overlap'), 2):>8}   (s/step / max(generation, training))")
    reward = s.get("reward") or {}
    if reward.get("first") is not None:
        lines.append(
            f"  {'train reward':<16} {_fmt(reward['first'])} (first fifth) -> {_fmt(reward['last'])} (last fifth)"
        )
    return "\n".join(line for line in lines if line)


def format_heldout(before: dict | None, after: dict | None) -> str:
    """`held-out exact match (N words): greedy A -> B, sampled (T=1, k per word) C -> D`."""
    if before is None or after is None:
        return "held-out exact match: not measured"
    return (
        f"held-out exact match ({before['words']} words): greedy {before['greedy']:.3f} -> {after['greedy']:.3f}, "
        f"sampled (T=1, {before['samples_per_word']} per word) {before['sampled']:.3f} -> {after['sampled']:.3f}"
    )
