"""The orchestrator process: load the environments, reach the servers, run the step loop or the throughput mode.

`orchestrate` wires one run: the training (and eval) mixtures, the inference server's admin client, the
teacher's client when distilling, and the runners that carry a group's rollouts to the environments (unless a
test passes its own `run_group`). Invariants: the server answers and accepts our key before any rollout; every
client opened here is closed on the way out, whatever ends the run; requests name what the server serves at
the time of each group (the base model, or the run's adapter once loaded).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.orchestrator.client import InferenceClient
from asyncrl.orchestrator.envs.mixture import EnvMixture, EnvSlot
from asyncrl.orchestrator.envs.runners import RunGroup, Runners, runners_for
from asyncrl.orchestrator.loop import Orchestrator
from asyncrl.orchestrator.teacher import TeacherClient, teacher_client
from asyncrl.orchestrator.throughput import run_throughput
from asyncrl.transport.layout import RunLayout
from asyncrl.utils.monitor import MetricsSink


def run_orchestrator(config: OrchestratorConfig, layout: RunLayout) -> None:
    """Entry point: run the orchestrator to completion (the entrypoint has set up logging)."""
    asyncio.run(orchestrate(config, layout))


async def orchestrate(config: OrchestratorConfig, layout: RunLayout, run_group: RunGroup | None = None) -> None:
    """Load environments, connect to the server and run (or bench)."""
    mixture = EnvMixture.load(config.env, config.seq_len, config.seed)
    eval_mixture = load_eval_mixture(config)
    server, teacher, runners = InferenceClient(config.client), make_teacher(config), None
    orchestrator: Orchestrator | None = None
    try:
        await server.wait_healthy(timeout=config.client.health_timeout)
        await server.check_key()
        if run_group is None:
            served = config.model.name if config.bench else (lambda: orchestrator.served_model)
            runners = make_runners(config, layout, mixture.slots + (eval_mixture.slots if eval_mixture else []), served)
            run_group = runners.run_group
        if config.bench:
            await throughput(config, layout, mixture, run_group)
        else:
            orchestrator = Orchestrator(
                config, mixture, run_group, server, layout=layout, eval_mixture=eval_mixture, teacher=teacher
            )
            await orchestrator.run()
    finally:
        await close_all(server, teacher, runners)


def load_eval_mixture(config: OrchestratorConfig) -> EnvMixture | None:
    """The eval environments' eval splits, where online eval is configured (never in the throughput mode)."""
    if config.eval is None or config.bench:
        return None
    return EnvMixture.load(config.eval.env or config.env, config.seq_len, config.seed, eval_split=True)


def make_teacher(config: OrchestratorConfig) -> TeacherClient | None:
    if config.teacher is None or config.bench:
        return None
    return teacher_client(config.teacher, config.seq_len, config.distill, config.client, config.model.name)


def make_runners(
    config: OrchestratorConfig, layout: RunLayout, slots: list[EnvSlot], served: str | Callable[[], str]
) -> Runners:
    """The runners of these slots; `served`: the model name requests carry (or what gives it at each group)."""
    direct = config.episodes == "direct"
    return runners_for(
        slots, config.client, config.model.name, served, renderer=config.renderer, log_dir=layout.logs, direct=direct
    )


async def throughput(config: OrchestratorConfig, layout: RunLayout, mixture: EnvMixture, run_group: RunGroup) -> None:
    sink = MetricsSink(layout, "orchestrator", config.wandb, config.model_dump(mode="json"))
    try:
        await run_throughput(config, mixture, run_group, sink)
    finally:
        sink.close()


async def close_all(server: InferenceClient, teacher: TeacherClient | None, runners: Runners | None) -> None:
    await server.close()
    if teacher is not None:
        await teacher.close()
    if runners is not None:
        await runners.close()
