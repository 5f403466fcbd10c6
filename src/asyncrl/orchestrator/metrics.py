"""Orchestrator metrics: per-step statistics of rollout groups, and where they are written.

`step_record` builds a train step's row, the one place its fields are named. Each record goes to
`{output_dir}/metrics/orchestrator.jsonl` (one JSON object per line, with `kind` = "train" or "eval"), to
loguru as one console line, and to W&B when configured. Each step's
best and worst rollout (prompt, completion, reward) go to `{output_dir}/samples.jsonl` for the report.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger

from asyncrl.orchestrator.ckpt import Progress
from asyncrl.orchestrator.filtering import Group
from asyncrl.orchestrator.packing import PackItem, PackStats
from asyncrl.orchestrator.rollouts import StepRollouts
from asyncrl.orchestrator.samples import Rollout, TokenSample
from asyncrl.utils.monitor import MetricsSink


@dataclass
class StepFacts:
    """What a train step's row is made of besides its rollouts and the run's progress."""

    step: int
    policy_step: int
    stats: PackStats
    micro_batches: int  # per rank
    env: dict[str, float]  # the mixture's own (its curricula)
    fallbacks: int  # trajectories that fell back to branching, so far
    distill: dict[str, float]  # `distill_record`'s, or {} without a teacher
    wait_weights: float
    update_weights: float
    pack_write: float
    seconds: float  # the step's latency: start to batch written


def step_record(got: StepRollouts, facts: StepFacts, thresholds: tuple[float, float], p: Progress) -> dict[str, Any]:
    """A train step's metrics row (`kind` = "train"); `thresholds`: the buffer's (easy, hard)."""
    used = [r for g in got.groups for r in g.valid]
    return {
        "kind": "train",
        "step": facts.step,
        **rollout_metrics(used),
        **facts.env,
        **group_metrics(got.groups, got.finished, *thresholds),
        "policy/step": facts.policy_step,
        "off_policy/level": facts.step - min(g.policy_step for g in got.groups),
        **batch_metrics(facts.stats, facts.micro_batches),
        **collect_metrics(got),
        "trajectory/prefix_fallbacks_total": facts.fallbacks,
        **rate_metrics(got),
        "time/wait_weights": facts.wait_weights,
        "time/update_weights": facts.update_weights,
        "time/rollouts": got.seconds,
        **facts.distill,
        "time/pack_write": facts.pack_write,
        "time/step": facts.seconds,
        "progress/total_tokens": p.total_tokens,
        "progress/total_samples": p.total_samples,
        "progress/total_problems": p.total_problems,
    }


def batch_metrics(stats: PackStats, micro_batches: int) -> dict[str, float]:
    """The packed batch: samples, tokens (and how much prefix sharing saved), loss tokens, micro-batches."""
    return {
        "batch/samples": stats.num_samples,
        "batch/tokens": stats.num_tokens,
        "batch/tokens_unshared": stats.num_tokens_unshared,
        "batch/shared_frac": 1 - stats.num_tokens / max(stats.num_tokens_unshared, 1),
        "batch/loss_tokens": stats.num_loss_tokens,
        "batch/truncated_samples": stats.num_truncated,
        "batch/micro_batches": micro_batches,
        "batch/dummy_micro_batches": stats.num_dummies,
    }


def collect_metrics(got: StepRollouts) -> dict[str, float]:
    """How the step's groups were collected: launched, cancelled, reused from the buffer, dropped, filler."""
    return {
        "groups/launched": got.launched,
        "groups/cancelled": got.cancelled,
        "groups/reused": got.reused,
        "groups/stale_dropped": got.stale_dropped,
        "groups/filler": got.filler,
    }


def rate_metrics(got: StepRollouts) -> dict[str, float]:
    """Generation throughput over the step's rollout time: every finished group's valid rollouts count."""
    seconds = max(got.seconds, 1e-9)
    valid = [r for g in got.finished for r in g.valid]
    return {
        "perf/gen_tokens_per_s": sum(r.completion_len for r in valid) / seconds,
        "perf/rollouts_per_s": len(valid) / seconds,
    }


def distill_record(got: StepRollouts, items: list[PackItem]) -> dict[str, float]:
    """A distilled step's teacher metrics (`distill_metrics`), the wait for its scores, and its effective
    rollouts: those with a token that moves the policy (by the reward or the teacher)."""
    record = distill_metrics([it.sample for it in items])
    record["time/teacher_s"] = got.teacher_seconds
    record["batch/effective_rollouts"] = float(
        sum(any(abs(a) > 1e-8 for a in it.token_advantages or []) for it in items)
    )
    return record


def _mean(values: list[float]) -> float:
    return float(statistics.fmean(values)) if values else 0.0


def rollout_metrics(rollouts: list[Rollout], prefix: str = "") -> dict[str, float]:
    """Reward, rubric metrics and lengths of valid rollouts (overall and per environment)."""
    out: dict[str, float] = {}
    if not rollouts:
        return out
    rewards = [r.reward for r in rollouts]
    out[f"{prefix}reward/mean"] = _mean(rewards)
    out[f"{prefix}reward/std"] = float(statistics.pstdev(rewards))
    by_env: dict[str, list[Rollout]] = defaultdict(list)
    for r in rollouts:
        by_env[r.env].append(r)
    for env, rs in by_env.items():
        out[f"{prefix}reward/{env}/mean"] = _mean([r.reward for r in rs])
        names = sorted({k for r in rs for k in r.metrics})
        for name in names:
            out[f"{prefix}metrics/{env}/{name}"] = _mean([r.metrics[name] for r in rs if name in r.metrics])
    seq = [sum(len(s) for s in r.samples) for r in rollouts]
    out[f"{prefix}seq_len/mean"] = _mean(seq)
    out[f"{prefix}seq_len/max"] = float(max(seq))
    out[f"{prefix}prompt_len/mean"] = _mean([r.prompt_len for r in rollouts])
    out[f"{prefix}completion_len/mean"] = _mean([r.completion_len for r in rollouts])
    out[f"{prefix}completion_len/max"] = float(max(r.completion_len for r in rollouts))
    out[f"{prefix}num_turns/mean"] = _mean([r.num_turns for r in rollouts])
    out[f"{prefix}truncated/frac"] = _mean([float(r.is_truncated) for r in rollouts])
    out[f"{prefix}context_full/frac"] = _mean([float(r.context_full) for r in rollouts])
    return out


def group_metrics(used: list[Group], finished: list[Group], easy: float, hard: float) -> dict[str, float]:
    """Batch-level statistics: solve-none/solve-all over every finished group, errors, advantages."""
    out: dict[str, float] = {}
    judged = [g for g in finished if g.valid]
    rewards = [[r.reward for r in g.valid] for g in judged]
    out["groups/solve_none"] = _mean([float(all(x <= hard for x in rs)) for rs in rewards])
    out["groups/solve_all"] = _mean([float(all(x >= easy for x in rs)) for rs in rewards])
    out["groups/finished"] = float(len(finished))
    out["groups/filtered"] = float(sum(g.verdict in ("too_easy", "too_hard") for g in finished))
    out["groups/failed"] = float(sum(g.verdict == "failed" for g in finished))
    all_rollouts = [r for g in finished for r in g.rollouts]
    out["rollouts/errors"] = float(sum(not r.ok for r in all_rollouts))
    out["rollouts/error_frac"] = _mean([float(not r.ok) for r in all_rollouts])
    valid = [r for g in used for r in g.valid]
    out["batch/rollouts"] = float(len(valid))
    out["batch/effective_rollouts"] = float(sum(abs(r.advantage) > 1e-8 for r in valid))
    out["advantage/mean_abs"] = _mean([abs(r.advantage) for r in valid])
    return out


def distill_metrics(samples: list[TokenSample]) -> dict[str, float]:
    """Teacher-student agreement over the loss tokens the teacher scored (`TokenSample.teacher`):
    `distill/teacher_kl` = mean of sampler_lp - teacher_lp (the sampled-token estimate of KL(student || teacher)),
    `distill/teacher_lp` = mean teacher logprob."""
    diffs, lps = [], []
    for s in samples:
        lp = s.teacher.logprobs
        for t in range(min(len(lp), len(s))):
            if s.loss_mask[t]:
                diffs.append(s.logprobs[t] - lp[t])
                lps.append(lp[t])
    return {"distill/teacher_kl": _mean(diffs), "distill/teacher_lp": _mean(lps)}


def log_extras(sink: MetricsSink, step: int, rollouts: list[Rollout]) -> None:
    """W&B sample table and reward/advantage/length histograms, every log_extras.interval steps."""
    if sink.extras_due(step, "samples") and rollouts:
        import wandb

        table = wandb.Table(columns=["step", "env", "example_id", "reward", "advantage", "completion"])
        for r in rollouts[:32]:
            table.add_data(step, r.env, r.example_id, r.reward, r.advantage, r.text)
        sink.run.log({"samples": table}, step=step)
    if sink.extras_due(step, "distributions"):
        sink.histograms(
            step,
            {
                "dist/reward": [r.reward for r in rollouts],
                "dist/advantage": [r.advantage for r in rollouts],
                "dist/completion_len": [r.completion_len for r in rollouts],
            },
        )


def log_samples(path: Path, step: int, rollouts: list[Rollout]) -> None:
    """Append the step's best and worst rollout to `path` (one JSON row; a resumed step's row comes later)."""
    if not rollouts:
        return
    best, worst = max(rollouts, key=lambda r: r.reward), min(rollouts, key=lambda r: r.reward)
    row = {"step": step, "best": _sample(best), "worst": _sample(worst)}
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def _sample(r: Rollout) -> dict[str, Any]:
    return {
        "env": r.env,
        "example_id": r.example_id,
        "reward": r.reward,
        "advantage": r.advantage,
        "prompt": r.prompt_text,
        "completion": r.text,
    }


def console_line(r: dict[str, Any]) -> str:
    return (
        f"step {r['step']} | reward {r.get('reward/mean', 0.0):.3f} | policy {r['policy/step']} "
        f"(off-policy {r['off_policy/level']}) | {int(r['batch/samples'])} samples, "
        f"{int(r['batch/micro_batches'])} mbs/rank | seq {r.get('seq_len/mean', 0.0):.0f} | "
        f"{r['perf/gen_tokens_per_s']:.0f} tok/s | wait weights {r['time/wait_weights']:.2f}s, "
        f"rollouts {r['time/rollouts']:.2f}s"
    )


def log_step(sink: MetricsSink, record: dict[str, Any]) -> None:
    logger.info(console_line(record))
    sink.log(record["step"], {k: v for k, v in record.items() if k != "step"})
