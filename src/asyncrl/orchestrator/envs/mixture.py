"""Several environments sampled per prompt by their ratios, each with a resumable prompt order.

An `EnvSlot` is one loaded environment with its rows (a classic dataset's rows, a v1 taskset's tasks) and
its position: a shuffled order per epoch, a curriculum's draws, or a stream taken in order. `EnvMixture`
draws the environment of each prompt by ratio. Invariants: every draw is reproducible from (seed, draw
count, environment, epoch) and the curricula's observations, all of which `state()` carries, so a resumed
run draws what it would have.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from loguru import logger

from asyncrl.config.orchestrator import EnvConfig
from asyncrl.core.errors import UserError
from asyncrl.orchestrator.curriculum import DifficultyPools
from asyncrl.orchestrator.envs.loading import check_installed, load_env
from asyncrl.orchestrator.envs.v1 import is_v1_env, load_tasks, task_id


@dataclass
class EnvSlot:
    """One environment of the mixture, with its prompt order and position for resumable sampling."""

    name: str
    env: Any
    ratio: float
    rows: list[dict] = field(default_factory=list)
    config: EnvConfig | None = None  # what it was loaded from (its `server`: where its episodes run)
    curriculum: DifficultyPools | None = None  # draws by recent reward instead of shuffled epochs
    stream: Callable[[], Iterator[Any]] | None = None  # a taskset with more tasks than rows: taken in order
    source: Iterator[Any] | None = None  # the stream's iterator, `cursor` tasks in
    epoch: int = 0
    cursor: int = 0
    order: list[int] = field(default_factory=list)

    def next_row(self, seed: int) -> dict:
        if self.curriculum is not None:
            return self.rows[self.curriculum.next_index(seed)]
        if self.stream is not None:
            return self.next_streamed()
        if not self.order or self.cursor >= len(self.order):
            if self.order:
                self.epoch += 1
            self.cursor = 0
            self.order = shuffled(len(self.rows), f"{seed}:{self.name}:{self.epoch}")
        row = self.rows[self.order[self.cursor]]
        self.cursor += 1
        return row

    def next_streamed(self) -> Any:
        """The stream's next task (past the end of a stream that does end: from its start again)."""
        if self.source is None:
            self.source = itertools.islice(self.stream(), self.cursor, None)  # resumed: skip what was taken
        task = next(self.source, None)
        if task is None:
            self.epoch, self.cursor, self.source = self.epoch + 1, 0, self.stream()
            task = next(self.source)
        self.cursor += 1
        return task


def shuffled(n: int, seed: str) -> list[int]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


class EnvMixture:
    """Several environments sampled per prompt by their ratios (equal when unset)."""

    def __init__(self, slots: list[EnvSlot], seed: int = 0):
        if not slots:
            raise UserError("at least one environment is needed")
        names = [s.name for s in slots]
        if len(set(names)) != len(names):
            raise UserError(f"environment names must be unique, got {names}; give duplicates a distinct `name`")
        self.slots = slots
        self.by_name = {s.name: s for s in slots}
        self.seed = seed
        self.problems = 0  # prompts drawn so far (the next draw's index)

    @classmethod
    def load(cls, configs: list[EnvConfig], seq_len: int | None, seed: int = 0, eval_split: bool = False) -> EnvMixture:
        check_installed([c.id for c in configs])
        slots = []
        for cfg in configs:
            env = load_env(cfg, eval_split)
            if cfg.server is not None and not is_v1_env(env):
                raise UserError(
                    f"environment '{cfg.id}' is a classic one: only verifiers v1 environments run in an "
                    "env server; drop its `server`"
                )
            endless = False
            if is_v1_env(env):  # its tasks are its prompts; a held-out split is its `split` arg (or own args)
                rows, endless = load_tasks(env, cfg.id)
            else:
                if seq_len is not None and hasattr(env, "set_max_seq_len"):
                    env.set_max_seq_len(seq_len)
                rows = (env.get_eval_dataset() if eval_split else env.get_dataset()).to_list()
            if not rows:
                raise UserError(f"environment '{cfg.id}' has an empty {'eval ' if eval_split else ''}dataset")
            name = cfg.name or cfg.id
            slots.append(EnvSlot(name=name, env=env, ratio=cfg.ratio or 1.0, rows=rows, config=cfg))
            if endless and not eval_split:
                slots[-1].stream = env.taskset.__iter__  # a fresh pass over the taskset per call
            if cfg.curriculum is not None and not eval_split:
                if endless:
                    raise UserError(
                        f"environment '{cfg.id}' generates tasks without end: a curriculum needs a "
                        "finite taskset; drop `curriculum`"
                    )
                ids = [example_id(row, i) for i, row in enumerate(rows)]
                slots[-1].curriculum = DifficultyPools(name, cfg.curriculum, ids)
            logger.info(f"loaded environment {slots[-1].name} ({type(env).__name__}, {len(rows)} prompts)")
        return cls(slots, seed)

    def draw(self) -> tuple[EnvSlot, dict]:
        """The next prompt: an environment chosen by ratio, then its next row."""
        rng = random.Random(f"{self.seed}:draw:{self.problems}")
        self.problems += 1
        slot = rng.choices(self.slots, weights=[s.ratio for s in self.slots])[0]
        return slot, slot.next_row(self.seed)

    def observe(self, env: str, task: int, mean_reward: float) -> None:
        """A finished group's mean reward on task `task` of environment `env` (for its curriculum, if any)."""
        slot = self.by_name.get(env)
        if slot is not None and slot.curriculum is not None:
            slot.curriculum.observe(task, mean_reward)

    def metrics(self) -> dict[str, float]:
        return {k: v for s in self.slots if s.curriculum is not None for k, v in s.curriculum.metrics().items()}

    def state(self) -> dict:
        envs = {s.name: {"epoch": s.epoch, "cursor": s.cursor, "size": len(s.rows)} for s in self.slots}
        for s in self.slots:
            if s.curriculum is not None:
                envs[s.name]["curriculum"] = s.curriculum.state()
        return {"problems": self.problems, "envs": envs}

    def load_state(self, state: dict) -> None:
        self.problems = int(state.get("problems", 0))
        for name, st in (state.get("envs") or {}).items():
            slot = self.by_name.get(name)
            if slot is None:
                logger.warning(f"checkpoint has sampling state for unknown environment {name!r}; ignored")
                continue
            if st.get("size") != len(slot.rows):
                logger.warning(f"environment {name!r} changed size since the checkpoint; restarting its order")
                continue
            slot.epoch, slot.cursor, slot.source = int(st["epoch"]), int(st["cursor"]), None
            if slot.curriculum is not None:
                slot.curriculum.load_state(st.get("curriculum") or {})
            slot.order = shuffled(len(slot.rows), f"{self.seed}:{slot.name}:{slot.epoch}")


def example_id(row: Any, default: int = -1) -> int:
    """A classic row's `example_id`, a v1 task's `data.idx` (`default` when it has none)."""
    return int(row.get("example_id", default)) if isinstance(row, dict) else task_id(row, default)


def group_inputs(row: Any, n: int) -> list[Any]:
    """The group's n inputs: copies of a classic row; a v1 task itself, n times."""
    return [dict(row) if isinstance(row, dict) else row for _ in range(n)]
