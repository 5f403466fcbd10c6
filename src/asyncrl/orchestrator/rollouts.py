"""Collect one step's rollout groups: keep groups in flight, judge each as it finishes, fill the batch.

Up to `ceil(problems * oversampling_factor)` groups are in flight at once. Every finished group gets
its advantages and a verdict (see `filtering.py`); accepted groups fill the step until it has
`batch_size / rollouts_per_example` of them, filtered or failed ones are replaced by new prompts.
When the step is full the groups still in flight are cancelled, so no generation spans a weight
update; accepted groups that finished beyond the need wait in a buffer for the next step, which
takes them only while they stay within the async bound.

With a teacher (`scorer`), each accepted group's scoring starts the moment the group finishes, while the
step's other groups are still generating; `collect` returns once the rollouts are done and `await_scores`
waits for the scores still out (`StepRollouts.teacher_seconds`), so the caller can start the next step's
generation first. A buffered group keeps its scoring going into the next
step; a group dropped as stale has its scoring cancelled. Scores are never checkpointed: a buffered group
restored on resume is scored again by the teacher of the resumed run.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from loguru import logger

from asyncrl.config.orchestrator import AdvantageConfig, BufferConfig, OrchestratorConfig
from asyncrl.orchestrator.envs.mixture import EnvMixture, example_id, group_inputs
from asyncrl.orchestrator.envs.runners import RunGroup
from asyncrl.orchestrator.filtering import Group, judge_group
from asyncrl.orchestrator.samples import Rollout, TeacherScores, TrajectoryConverter

Scorer = Callable[[Group], Awaitable[list[TeacherScores]]]  # a group -> the teacher's scores of each of `Group.samples`
MAX_DRAWS_FACTOR = 8  # stop drawing new prompts for a step after this many times the in-flight target


def step_shape(config: OrchestratorConfig) -> tuple[int, int]:
    """(the groups a step trains on, the groups kept in flight for it: `ceil(problems * oversampling_factor)`,
    within `max_concurrent` rollouts and at least one group)."""
    problems = max(1, config.batch_size // config.rollouts_per_example)
    target = max(problems, math.ceil(problems * config.oversampling_factor))
    if config.max_concurrent is not None:
        target = max(1, min(target, config.max_concurrent // config.rollouts_per_example))
    return problems, target


async def gather_all(aws: list) -> list:
    """The results of `aws` in order; when one fails, the others are cancelled (and awaited) before it raises."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class RolloutFailure(RuntimeError):
    """Rollouts keep failing: nothing can be trained on."""

    def __init__(self, message: str, last_error: str | None):
        super().__init__(message)
        self.last_error = last_error


@dataclass
class StepRollouts:
    groups: list[Group]  # the accepted groups that make the batch
    finished: list[Group] = field(default_factory=list)  # every group that finished this step
    seconds: float = 0.0
    launched: int = 0
    cancelled: int = 0
    reused: int = 0
    stale_dropped: int = 0
    filler: int = 0  # filtered groups used because too few passed the filter
    teacher_seconds: float = 0.0  # waited for teacher scores once the rollouts were done


class GroupCollector:
    def __init__(
        self,
        mixture: EnvMixture,
        run_group: RunGroup,
        converter: TrajectoryConverter,
        rollouts_per_example: int,
        buffer: BufferConfig,
        advantage: AdvantageConfig,
        fail_limit: int,
        scorer: Scorer | None = None,
    ):
        self.mixture = mixture
        self.run_group = run_group
        self.converter = converter
        self.n = rollouts_per_example
        self.buffer_config = buffer
        self.advantage = advantage
        self.fail_limit = max(fail_limit, 1)
        self.buffer: list[Group] = []
        self.scorer = scorer
        self._scoring: dict[int, tuple[Group, asyncio.Task]] = {}  # id(group) -> its scoring, while wanted
        self.consecutive_failures = 0
        self.last_error: str | None = None

    async def _run_one(self, step_policy: int, args: dict) -> Group:
        slot, row = self.mixture.draw()
        group = Group(env=slot.name, example_id=example_id(row), policy_step=step_policy)
        try:
            outputs = await self.run_group(slot, group_inputs(row, self.n), args)
            group.rollouts = [self.converter.convert(o, slot.name) for o in outputs]
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an environment bug or a broken server must not kill the run
            error = f"{type(e).__name__}: {e}"
            group.rollouts = [
                Rollout(env=slot.name, example_id=group.example_id, reward=0.0, error=error) for _ in range(self.n)
            ]
        judge_group(group, self.buffer_config, self.advantage, distilled=self.scorer is not None)
        if group.verdict != "failed":
            rewards = [r.reward for r in group.valid]
            self.mixture.observe(slot.name, group.example_id, sum(rewards) / len(rewards))
        return group

    def _score(self, group: Group) -> None:
        """Start scoring `group` with the teacher, unless that is under way already (or there is no teacher)."""
        if self.scorer is not None and id(group) not in self._scoring:
            self._scoring[id(group)] = (group, asyncio.create_task(self.scorer(group)))

    def _drop_scoring(self, groups: list[Group]) -> None:
        for group in groups:
            entry = self._scoring.pop(id(group), None)
            if entry is not None:
                entry[1].cancel()
                if entry[1].done() and not entry[1].cancelled():
                    entry[1].exception()  # retrieved: a stale group's failed scoring is of no consequence

    async def _scores(self, groups: list[Group]) -> list[list[TeacherScores]]:
        """The teacher's scores of `groups`, in order (scoring any not started yet)."""
        for group in groups:
            self._score(group)
        tasks = [self._scoring[id(g)][1] for g in groups]
        try:
            return await gather_all(tasks)
        finally:
            for g in groups:
                self._scoring.pop(id(g), None)

    async def close(self) -> None:
        """Cancel scoring still under way (buffered groups at the end of a run, or after a failure)."""
        tasks = [task for _, task in self._scoring.values()]
        self._scoring.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _note(self, group: Group) -> None:
        errors = [r.error for r in group.rollouts if r.error]
        if errors:
            self.last_error = errors[-1]
        if group.verdict == "failed":
            self.consecutive_failures += 1
            if self.consecutive_failures >= self.fail_limit:
                raise RolloutFailure(
                    f"{self.consecutive_failures} rollout groups in a row failed completely; "
                    f"last error: {self.last_error}",
                    self.last_error,
                )
        else:
            self.consecutive_failures = 0

    async def collect(
        self, step: int, policy_step: int, max_async_level: int, problems: int, in_flight: int, args: dict
    ) -> StepRollouts:
        start = time.perf_counter()
        usable = [g for g in self.buffer if step - g.policy_step <= max_async_level]
        result = StepRollouts(
            groups=usable[:problems], reused=min(len(usable), problems), stale_dropped=len(self.buffer) - len(usable)
        )
        self._drop_scoring([g for g in self.buffer if step - g.policy_step > max_async_level])
        self.buffer = usable[problems:]
        for group in result.groups + self.buffer:
            self._score(group)
        filtered: list[Group] = []
        tasks: set[asyncio.Task] = set()
        max_draws = MAX_DRAWS_FACTOR * in_flight
        try:
            while len(result.groups) < problems:
                while len(result.groups) + len(tasks) < in_flight and result.launched < max_draws:
                    tasks.add(asyncio.create_task(self._run_one(policy_step, args)))
                    result.launched += 1
                if not tasks:
                    break
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    group = task.result()
                    result.finished.append(group)
                    self._note(group)
                    if group.verdict == "accept":
                        (result.groups if len(result.groups) < problems else self.buffer).append(group)
                        self._score(group)
                    elif group.verdict != "failed":
                        filtered.append(group)
        finally:
            result.cancelled = len(tasks)
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        if len(result.groups) < problems:
            result.filler = min(problems - len(result.groups), len(filtered))
            result.groups += filtered[: result.filler]
            logger.warning(
                f"step {step}: only {len(result.groups) - result.filler}/{problems} groups passed "
                f"after {result.launched} "
                f"draws; filled with {result.filler} filtered (zero-advantage) groups"
            )
        if not result.groups:
            raise RolloutFailure(
                f"step {step}: no usable rollout group after {result.launched} tries; last error: {self.last_error}",
                self.last_error,
            )
        result.seconds = time.perf_counter() - start
        return result

    async def await_scores(self, result: StepRollouts) -> None:
        """Put the teacher's scores on the samples of `result`'s groups (`TokenSample.teacher`; no-op without a
        teacher); the wait is `result.teacher_seconds`. The caller may generate the next step meanwhile: the
        scoring is under way."""
        if self.scorer is None:
            return
        done = time.perf_counter()
        for group, scores in zip(result.groups, await self._scores(result.groups)):
            for sample, score in zip(group.samples, scores, strict=True):
                sample.teacher = score
        result.teacher_seconds = time.perf_counter() - done
