"""Online evaluation: rollouts on the eval environments' eval splits with the current policy.

Runs every `[orchestrator.eval] interval` steps (and before step 0 with `eval_base`), between two
steps' generations, so the server holds exactly one policy throughout. Metrics are prefixed `eval/`.
"""

from __future__ import annotations

import asyncio
import time

from asyncrl.orchestrator.envs.mixture import EnvMixture, group_inputs
from asyncrl.orchestrator.envs.runners import RunGroup
from asyncrl.orchestrator.metrics import rollout_metrics
from asyncrl.orchestrator.samples import Rollout, TrajectoryConverter


async def evaluate_policy(
    mixture: EnvMixture,
    run_group: RunGroup,
    converter: TrajectoryConverter,
    num_examples: int,
    rollouts_per_example: int,
    args: dict,
    max_groups_in_flight: int,
) -> dict[str, float]:
    """Roll out every eval example with the policy the server holds now; `eval/`-prefixed metrics."""
    start = time.perf_counter()
    sem = asyncio.Semaphore(max(1, max_groups_in_flight))

    async def one(slot, row) -> list[Rollout]:
        async with sem:
            try:
                outputs = await run_group(slot, group_inputs(row, rollouts_per_example), args)
            except Exception as e:
                return [Rollout(env=slot.name, example_id=-1, reward=0.0, error=f"{type(e).__name__}: {e}")]
        return [converter.convert(o, slot.name) for o in outputs]

    jobs = []
    for slot in mixture.slots:
        rows = slot.rows if num_examples < 0 else slot.rows[:num_examples]
        jobs += [one(slot, row) for row in rows]
    rollouts = [r for rs in await asyncio.gather(*jobs) for r in rs]
    valid = [r for r in rollouts if r.ok]
    seconds = time.perf_counter() - start
    out = rollout_metrics(valid, prefix="eval/")
    out["eval/rollouts"] = float(len(rollouts))
    out["eval/errors"] = float(len(rollouts) - len(valid))
    out["eval/seconds"] = seconds
    return out
