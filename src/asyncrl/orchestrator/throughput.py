"""Rollout throughput (`orchestrator --bench`): a few steps of rollouts against a running server, nothing trained.

No weights are loaded and no batch is written: each step collects a full step's groups as a run would (the
same in-flight target and sampling, no buffer carried between steps), and its rates are printed as a table and
logged (`kind` = "bench", named as a run's step rows name the same numbers), as the trainer's --bench does.
Invariant: the total row leaves out step 0 (it includes connection warm-up) whenever a later step ran.
"""

from __future__ import annotations

from asyncrl.config.orchestrator import BufferConfig, OrchestratorConfig
from asyncrl.orchestrator.envs.mixture import EnvMixture
from asyncrl.orchestrator.envs.runners import RunGroup, sampling_args
from asyncrl.orchestrator.rollouts import GroupCollector, StepRollouts, step_shape
from asyncrl.orchestrator.samples import TrajectoryConverter
from asyncrl.utils.monitor import MetricsSink

DEFAULT_STEPS = 3


async def run_throughput(
    config: OrchestratorConfig, mixture: EnvMixture, run_group: RunGroup, sink: MetricsSink | None = None
) -> list[dict]:
    """Generate `max_steps` (default 3) steps' rollouts; print their throughput and log each step to `sink`.
    Returns the step rows and the total row."""
    problems, in_flight = step_shape(config)
    collector = GroupCollector(
        mixture,
        run_group,
        TrajectoryConverter(config.trajectory_strategy),
        config.rollouts_per_example,
        BufferConfig(),
        config.advantage,
        fail_limit=max(4, 2 * in_flight),
    )
    args, rows = sampling_args(config.sampling), []
    if sink is not None:
        sink.restart_at(0)
    for step in range(config.max_steps or DEFAULT_STEPS):
        collector.buffer.clear()
        rows.append(step_row(step, await collector.collect(step, 0, 0, problems, in_flight, args)))
        if sink is not None:
            sink.log(step, bench_record(rows[-1]))
    rows.append(total_row(rows[1:] or rows))  # step 0 includes connection warm-up
    print_table(config, problems, rows)
    return rows


def step_row(step: int, got: StepRollouts) -> dict:
    """One step's rollouts, seconds and rates (valid rollouts of every finished group), and its errors."""
    valid = [r for g in got.finished for r in g.valid]
    completion = sum(r.completion_len for r in valid)
    total = sum(r.prompt_len + r.completion_len for r in valid)
    return {
        "step": step,
        "rollouts": len(valid),
        "seconds": got.seconds,
        "rollouts_per_s": len(valid) / got.seconds,
        "gen_tokens_per_s": completion / got.seconds,
        "total_tokens_per_s": total / got.seconds,
        "errors": sum(not r.ok for g in got.finished for r in g.rollouts),
    }


def total_row(timed: list[dict]) -> dict:
    """The rows' totals, their rates weighted by their seconds."""
    secs = sum(r["seconds"] for r in timed)
    rollouts = sum(r["rollouts"] for r in timed)
    return {
        "step": "total",
        "rollouts": rollouts,
        "seconds": secs,
        "errors": sum(r["errors"] for r in timed),
        "rollouts_per_s": rollouts / secs,
        "gen_tokens_per_s": sum(r["gen_tokens_per_s"] * r["seconds"] for r in timed) / secs,
        "total_tokens_per_s": sum(r["total_tokens_per_s"] * r["seconds"] for r in timed) / secs,
    }


def bench_record(row: dict) -> dict:
    """A bench step's metrics row (`kind` = "bench"), named as a run's step rows name the same numbers."""
    return {
        "kind": "bench",
        "rollouts": row["rollouts"],
        "errors": row["errors"],
        "time/rollouts": row["seconds"],
        "perf/rollouts_per_s": row["rollouts_per_s"],
        "perf/gen_tokens_per_s": row["gen_tokens_per_s"],
        "perf/total_tokens_per_s": row["total_tokens_per_s"],
    }


def print_table(config: OrchestratorConfig, problems: int, rows: list[dict]) -> None:
    """The setup in one line, then a line per step and the total."""
    print(
        f"orchestrator bench: {problems} prompts x {config.rollouts_per_example} rollouts per step, "
        f"max_tokens={config.sampling.max_tokens}, server {config.client.url}"
    )
    print(
        f"{'step':>5} {'rollouts':>9} {'seconds':>8} {'rollouts/s':>11} "
        f"{'gen tok/s':>10} {'total tok/s':>12} {'errors':>7}"
    )
    for r in rows:
        print(
            f"{r['step']:>5} {r['rollouts']:>9} {r['seconds']:>8.2f} {r['rollouts_per_s']:>11.2f} "
            f"{r['gen_tokens_per_s']:>10.1f} {r['total_tokens_per_s']:>12.1f} {r['errors']:>7}"
        )
    if len(rows) > 2:
        print("(total: steps 1 and later; step 0 includes connection warm-up)")
