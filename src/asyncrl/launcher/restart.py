"""Auto-restart: whether `rl` restarts a run one of whose processes died, from which step, after how long.

A restart is the documented resume, done by rl: the next attempt is the same run with `ckpt.resume_step` set
to the latest step both trainer and orchestrator saved below `max_steps` (none: from step 0), started by the
same code as the first. A run that stalled (no step for `stall_timeout`: a hung process) is restarted the same
way. Env servers are not this module's: the orchestrator restarts those in place.

Invariants: only a single run that checkpoints is restarted (a multi-run's lost orchestrator ends that run
alone; anything else stops it all, as a run without [ckpt] always stops); a process that exited 2 is never
restarted (its error is its input's: a config, a model, a full disk; a restart would meet it again); restarts
in a row from the same step (no new checkpoint between them: a process that dies again at once) are at most
`max_restarts`, and the wait before each doubles; every restart is one WARNING line and an entry of rl's
record (`logs/rl.pid`, `restarts`), which `asyncrl status` and the report show.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from loguru import logger

from asyncrl.config.rl import RLConfig
from asyncrl.core.errors import UserError
from asyncrl.transport.layout import RunLayout
from asyncrl.utils import runstate

MAX_WAIT_S = 600.0  # the doubled wait's ceiling


class ComponentDied(UserError):
    """A process `rl` started died (`name`, Popen's `code` for it), or the run stalled (`name` "stall", `code`
    None: no step for `stall_timeout`); `why` in one line (exit code or signal and its log's last error line,
    or how long and what looks hung)."""

    def __init__(self, message: str, name: str, code: int | None, why: str):
        super().__init__(message)
        self.name, self.code, self.why = name, code, why

    @property
    def line(self) -> str:
        return f"the run stalled ({self.why})" if self.code is None else f"{self.name} died ({self.why})"


@dataclass
class Restarts:
    """The restarts of one `rl` run: `next_config` decides each, waits, records it, and gives the next config."""

    config: RLConfig
    layout: RunLayout
    done: list[dict] = field(default_factory=list)
    in_a_row: int = 0  # restarts since the start step last moved on

    def next_config(self, died: ComponentDied, started_at: int) -> RLConfig:
        """The config to start the run again with after `died` ended an attempt that started at step
        `started_at`, once its wait is over; `died` itself (the reason on a last line) when it is not restarted."""
        step = self._resume_step()
        self.in_a_row = 1 if step > started_at else self.in_a_row + 1
        refusal = self._refusal(died)
        if refusal is not None:
            raise UserError(f"{died}\n{refusal}" if refusal else str(died))
        wait = min(self.config.restart_backoff * 2 ** (self.in_a_row - 1), MAX_WAIT_S)
        logger.warning(
            f"{died.line}; restart {self.in_a_row} of {self.config.max_restarts} in a row: the run starts again "
            f"from step {step} in {wait:.0f}s"
        )
        self._record(died, step)
        time.sleep(wait)
        runstate.update(attempt=time.time())  # `asyncrl status`: records started before it are an earlier attempt's
        return self._resumed(step)

    def _refusal(self, died: ComponentDied) -> str | None:
        """Why `died` is not restarted ("": say nothing more), or None: restart it."""
        cfg = self.config
        if cfg.max_restarts == 0:
            return ""
        if cfg.runs:
            return "rl does not restart a multi-run: resume it with --ckpt.resume-step -1"
        if cfg.trainer.ckpt is None:
            return "rl restarts only a run that checkpoints: add --ckpt (and --ckpt.interval N) to have it restart"
        if died.code == 2:
            return (
                f"not restarted: {died.name} exited 2, an error in what it was given (config, model, disk) that a "
                "restart would meet again; fix it, then resume with --ckpt.resume-step -1"
            )
        if self.in_a_row > cfg.max_restarts:
            return (
                f"not restarted: {self.in_a_row} deaths in a row with no new checkpoint between them (max_restarts "
                f"{cfg.max_restarts}); fix the cause, then resume with --ckpt.resume-step -1"
            )
        return None

    def _resume_step(self) -> int:
        steps = [s for s in self.layout.resumable_steps() if s < (self.config.trainer.max_steps or s + 1)]
        return steps[-1] if steps else 0

    def _resumed(self, step: int) -> RLConfig:
        config = self.config.model_copy(deep=True)
        for ckpt in (config.trainer.ckpt, config.orchestrator.ckpt):
            if ckpt is not None:
                ckpt.resume_step = step if step else None  # the step, not -1: one at max_steps is skipped
        return config

    def _record(self, died: ComponentDied, step: int) -> None:
        self.done.append({"time": time.time(), "component": died.name, "why": died.why, "from_step": step})
        runstate.update(restarts=self.done, max_restarts=self.config.max_restarts)

    def summary(self) -> str | None:
        """`[rl] restarted 3 times: trainer 2, inference 1`, or None without restarts."""
        if not self.done:
            return None
        names = [d["component"] for d in self.done]
        counts = ", ".join(f"{n} {names.count(n)}" for n in dict.fromkeys(names))
        return f"[rl] restarted {len(self.done)} time{'s' * (len(self.done) > 1)}: {counts}"
