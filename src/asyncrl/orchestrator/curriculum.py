"""A task curriculum for one environment: sample its tasks by how the policy did on them lately.

`[[orchestrator.env]] curriculum = {}` (difficulty pools): every task whose group has finished keeps its
latest mean group reward, which puts it in the first pool (by threshold, inclusive) that covers it; a
task is drawn with replacement with its pool's weight, a task not yet seen with weight 1. The default
pools favour tasks the policy solves sometimes (the ones whose groups have signal): hard (mean <= 0.25)
0.2, normal (<= 0.75) 1.0, easy (above) 0.2; weight 0 leaves a pool out.

Invariants: draws are reproducible from (seed, environment, draw count) and the observed means, which
the orchestrator's checkpoint carries (`state`/`load_state`), so a resumed run draws what it would have;
a failed group (no reward) is not an observation.
"""

from __future__ import annotations

import bisect
import itertools
import random

from asyncrl.config.orchestrator import CurriculumConfig
from asyncrl.core.errors import UserError

UNSEEN_WEIGHT = 1.0


class DifficultyPools:
    """Weighted draws over `ids` (the environment's task ids, in row order)."""

    def __init__(self, name: str, cfg: CurriculumConfig, ids: list[int]):
        if len(set(ids)) != len(ids):
            raise UserError(
                f"environment '{name}': a curriculum needs tasks with distinct ids (its tasks' `idx`); drop "
                "`curriculum` or give each task its own idx"
            )
        self.name = name
        self.pools = sorted(cfg.pools.items(), key=lambda item: item[1].threshold)
        self.ids = ids
        self.row_of = {task: i for i, task in enumerate(ids)}
        self.latest: dict[int, float] = {}
        self.weights = [UNSEEN_WEIGHT] * len(ids)
        self.draws = 0

    def pool(self, mean: float) -> tuple[str, float]:
        """The pool a task with this mean reward is in, and its weight (above every threshold: the last)."""
        for name, pool in self.pools:
            if mean <= pool.threshold:
                return name, pool.weight
        return self.pools[-1][0], self.pools[-1][1].weight

    def next_index(self, seed: int) -> int:
        """The row index of the next task."""
        total = list(itertools.accumulate(self.weights))
        if total[-1] <= 0:
            raise UserError(
                f"environment '{self.name}': every task is in a curriculum pool of weight 0; give a pool that "
                "holds tasks a weight above 0"
            )
        rng = random.Random(f"{seed}:{self.name}:curriculum:{self.draws}")
        self.draws += 1
        return bisect.bisect_right(total, rng.random() * total[-1])

    def observe(self, task: int, mean_reward: float) -> None:
        row = self.row_of.get(task)
        if row is None:
            return
        self.latest[task] = mean_reward
        self.weights[row] = self.pool(mean_reward)[1]

    def metrics(self) -> dict[str, float]:
        """Share of the environment's tasks in each pool (and not yet seen), as `curriculum/<env>/<pool>`."""
        counts = {name: 0 for name, _ in self.pools}
        for mean in self.latest.values():
            counts[self.pool(mean)[0]] += 1
        n = max(len(self.ids), 1)
        out = {f"curriculum/{self.name}/{name}": count / n for name, count in counts.items()}
        out[f"curriculum/{self.name}/unseen"] = (len(self.ids) - len(self.latest)) / n
        return out

    def state(self) -> dict:
        return {"draws": self.draws, "latest": {str(k): v for k, v in self.latest.items()}}

    def load_state(self, state: dict) -> None:
        self.draws = int(state.get("draws", 0))
        self.latest, self.weights = {}, [UNSEEN_WEIGHT] * len(self.ids)
        for task, mean in (state.get("latest") or {}).items():
            self.observe(int(task), float(mean))
