"""Fail points for the chaos tests: a real `kill -9` at an exact phase of a step.

`ASYNCRL_FAILPOINT=<point>:<step>[:<rank>]` makes the process that reaches `point` at `step` (on trainer
rank `rank`; any rank if omitted) SIGKILL itself there, after saying so in its log. Unset, a point costs
one environment lookup. The points, each where a torn file could be left behind:

    trainer.step             a training step's batch read, before its forward passes
    trainer.weights          a weight dir's files written under its temporary name, not yet renamed
    trainer.checkpoint       every checkpoint shard written, progress.json and the STABLE marker not yet
    orchestrator.batch       a batch's rank files written under its temporary name, meta.json not yet
    orchestrator.checkpoint  progress.json written under the temporary name, buffer.json not yet
"""

from __future__ import annotations

import os
import signal

from asyncrl.core.errors import UserError

VAR = "ASYNCRL_FAILPOINT"
POINTS = ("trainer.step", "trainer.weights", "trainer.checkpoint", "orchestrator.batch", "orchestrator.checkpoint")


def reached(point: str, step: int | None) -> None:
    """SIGKILL this process if `ASYNCRL_FAILPOINT` names `point` at `step` (and this process's rank)."""
    spec = os.environ.get(VAR)
    if not spec:
        return
    name, at, *rank = parse(spec)
    if name == point and str(step) == at and (not rank or rank[0] == os.environ.get("RANK", "0")):
        from loguru import logger

        logger.warning(f"failpoint {point} at step {step} (pid {os.getpid()}): SIGKILL")  # into this rank's log
        os.kill(os.getpid(), signal.SIGKILL)


def parse(spec: str) -> list[str]:
    """`<point>:<step>[:<rank>]` as its parts; a one-line error for anything else (it would never fire)."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or parts[0] not in POINTS or not all(p.isdigit() for p in parts[1:]):
        raise UserError(f"{VAR}={spec!r}: expected <point>:<step>[:<rank>] with point one of {', '.join(POINTS)}")
    return parts
