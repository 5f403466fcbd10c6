"""`eval`: run environments against a server, for the model it serves or for base + saved weight steps.

Without `--weights-dir` the model the server serves is evaluated once. With it, each target is
loaded into the running server first (`POST /update_weights` with a `weights/step_N` dir,
`POST /reload_weights` for the base model), evaluated on every environment's eval split
(`num_examples` examples x `rollouts_per_example` rollouts), and the server is returned to the base
model at the end. Results: `{output_dir}/eval/rollouts.jsonl` (one row per rollout) and
`summary.json`, rewritten after every target so a long run leaves partial results; a table of
reward by step is printed at the end. Per-target summaries also go to `metrics/eval.jsonl` (and W&B).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger

from asyncrl.config.eval import EvalConfig
from asyncrl.core.errors import UserError
from asyncrl.evaluation.endpoints import resolve
from asyncrl.evaluation.runner import (
    Job,
    RolloutRecord,
    check_server,
    completion_text,
    example_rows,
    first_error,
    load_slots,
    make_runners,
    request_args,
    run_jobs,
    start_hint,
    summarize,
)
from asyncrl.orchestrator.client import InferenceClient
from asyncrl.transport import fingerprint
from asyncrl.transport.files import write_text_atomic
from asyncrl.transport.layout import RunLayout, is_stable, step_dirs
from asyncrl.utils.monitor import MetricsSink


@dataclass
class Target:
    label: str  # "base", "step_10", or "model" without a weights dir
    step: int | None
    path: Path | None  # weights to load; None = the server's base model


def find_targets(config: EvalConfig) -> list[Target]:
    """What to evaluate: the served model, or base + the chosen `step_N` dirs of the weights dir."""
    if config.weights_dir is None:
        return [Target("model", None, None)]
    root = Path(config.weights_dir)
    if not root.is_dir():
        raise UserError(f"--weights-dir {root} does not exist (sft and rl write {{output_dir}}/weights/step_N)")
    found = {s: d for s, d in step_dirs(root).items() if is_stable(d) or any(d.glob("*.safetensors"))}
    if not found:
        raise UserError(
            f"no step_N weight dirs in --weights-dir {root}; sft and rl write them at checkpoint steps "
            "and at the end of training"
        )
    if config.steps:
        missing = [s for s in config.steps if s not in found]
        if missing:
            raise UserError(f"step(s) {missing} not found in {root}; available steps: {sorted(found)}")
    chosen = list(dict.fromkeys(config.steps)) if config.steps else sorted(found)
    base = [Target("base", 0, None)] if config.eval_base else []
    return base + [Target(f"step_{s}", s, found[s]) for s in chosen]


async def _load(admin: InferenceClient, target: Target) -> None:
    loaded = None
    try:
        if target.path is None:
            await admin.reload_weights()
        else:
            loaded = await admin.update_weights(target.path)
    except RuntimeError as e:
        what = f"weights {target.path}" if target.path else "the base model"
        raise UserError(
            f"cannot load {what} into the server at {admin.root}: {e}. --weights-dir needs asyncrl's "
            "`inference` server started with the base model these weights were trained from"
        ) from e
    if target.path is not None and (differs := fingerprint.mismatch(target.path, loaded)):
        raise UserError(f"the server at {admin.root} loaded other weights than {target.path} holds: {differs}")
    logger.info(f"server now serves {target.label}" + (f" ({target.path})" if target.path else ""))


def rollout_row(target: Target, r: RolloutRecord) -> dict[str, Any]:
    return {
        "label": target.label,
        "step": target.step,
        "env": r.env,
        "example_id": r.example_id,
        "rollout": r.rollout,
        "reward": r.reward,
        "metrics": r.metrics,
        "completion_text": completion_text(r.completion),
        "prompt": r.prompt,
        "completion": r.completion,
        "error": r.error,
    }


def _render(lines: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    fmt = lambda line: " | ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(lines[0]), "-+-".join("-" * w for w in widths)] + [fmt(line) for line in lines[1:]])


def _reward(s: dict | None) -> str:
    if s is None or s["reward_mean"] is None:
        return "-"
    return f"{s['reward_mean']:.3f} ± {s['reward_std']:.3f}"


def format_table(results: dict[str, dict[str, dict]]) -> str:
    """Reward (mean ± std) by step and environment, then each step/env's rollout counts and rubric metrics."""
    envs = list(dict.fromkeys(env for per_env in results.values() for env in per_env))
    rewards = [["step", *envs]] + [
        [label, *(_reward(per_env.get(env)) for env in envs)] for label, per_env in results.items()
    ]
    details = [["step", "env", "reward", "rollouts", "errors", "metrics (mean)"]]
    for label, per_env in results.items():
        for env, s in per_env.items():
            metrics = ", ".join(f"{k} {v:.3f}" for k, v in s["metrics"].items())
            details.append([label, env, _reward(s), str(s["rollouts"]), str(s["errors"]), metrics])
    return _render(rewards) + "\n\n" + _render(details)


async def _evaluate(config: EvalConfig, layout: RunLayout) -> dict[str, Any]:
    slots = load_slots(config.envs(), eval_split=True)
    targets = find_targets(config)
    await check_server(config.client, config.model.name, config.server_wait)
    runners = make_runners(config.client, config.model.name, slots, layout.logs)
    args = request_args(config.sampling)
    out = Path(config.output_dir) / "eval"
    out.mkdir(parents=True, exist_ok=True)
    admin = InferenceClient(config.client) if config.weights_dir is not None else None
    sink = MetricsSink(layout, "eval", config.wandb, config.model_dump(mode="json"))
    summary, rows = new_summary(config, [s.name for s in slots]), []
    results = summary["results"]
    try:
        for target in targets:
            records = await _run_target(config, target, admin, slots, runners.run_group, args)
            results[target.label] = summarize(records)
            rows += [rollout_row(target, r) for r in records]
            write_text_atomic(out / "rollouts.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
            write_text_atomic(out / "summary.json", json.dumps(summary, indent=1))
            _report_target(sink, target, results[target.label])
    finally:
        await _close(admin, runners, sink)
    print(format_table(results), flush=True)
    logger.info(f"wrote {len(rows)} rollouts to {out / 'rollouts.jsonl'} and the summary to {out / 'summary.json'}")
    return summary


def new_summary(config: EvalConfig, envs: list[str]) -> dict[str, Any]:
    """summary.json before any target: the setup, and `results` (label -> env -> summary) to fill."""
    return {
        "model": config.model.name,
        "base_url": config.client.url,
        "environments": envs,
        "num_examples": config.num_examples,
        "rollouts_per_example": config.rollouts_per_example,
        "weights_dir": str(config.weights_dir) if config.weights_dir else None,
        "results": {},
    }


async def _run_target(
    config: EvalConfig, target: Target, admin: InferenceClient | None, slots: list, run_group: Any, args: dict
) -> list[RolloutRecord]:
    """Every rollout of one target on every slot (loaded into the server first with a weights dir); a target
    none of whose rollouts succeeded is a UserError."""
    if admin is not None:
        await _load(admin, target)
    n = config.rollouts_per_example
    jobs = [Job(slot, ex_id, row, n) for slot in slots for ex_id, row in example_rows(slot, config.num_examples)]
    records = await run_jobs(jobs, run_group, args, config.max_concurrent)
    if all(not r.ok for r in records):
        raise UserError(
            f"every rollout of {target.label} failed; first error: {first_error(records)} "
            f"(is the server at {config.client.url} still up? {start_hint(config.client.url)})"
        )
    return records


def _report_target(sink: MetricsSink, target: Target, per_env: dict[str, dict]) -> None:
    """One log line per environment, and the target's row in metrics/eval.jsonl (and W&B)."""
    for env, s in per_env.items():
        logger.info(f"{target.label} | {env} | reward {_reward(s)} | {s['rollouts']} rollouts, {s['errors']} errors")
    metrics = {
        f"eval/{env}/{k}": v
        for env, s in per_env.items()
        for k, v in [
            ("reward_mean", s["reward_mean"]),
            ("reward_std", s["reward_std"]),
            ("errors", s["errors"]),
            *s["metrics"].items(),
        ]
    }
    sink.log(target.step or 0, {"label": target.label, **metrics})


async def _close(admin: InferenceClient | None, runners: Any, sink: MetricsSink) -> None:
    """Return the server to the base model (after a weights dir), close the clients and the sink."""
    if admin is not None:
        try:
            await admin.reload_weights()
        except Exception as e:  # the server may be gone; the results are already on disk
            logger.warning(f"could not return the server to the base model: {e}")
        await admin.close()
    await runners.close()
    sink.close()


def run_eval(config: EvalConfig, layout: RunLayout) -> dict[str, Any]:
    """Evaluate and return the summary (also written to {output_dir}/eval/summary.json); `--model.name`
    resolves through the endpoints registry first (evaluation.endpoints)."""
    return asyncio.run(_evaluate(resolve(config), layout))
