"""Rollout batches: the orchestrator writes step n's packed micro-batches, the trainer reads them.

On disk (under the run's output dir)::

    rollouts/step_{n}/rank_{r}.pt     one file per trainer data-parallel rank
    rollouts/step_{n}/meta.json       {"step", "num_ranks", "micro_batches_per_rank", ...}

Each `rank_{r}.pt` is `torch.save({"step": n, "micro_batches": [row, ...]})`, every micro-batch one packed row
in its wire form (`transport.row.Row.to_wire`: a dict of tensors; the format and its checks are that module's).

Every rank gets the same number of micro-batches (padding with all-masked dummies), or FSDP hangs.
The step dir is written under a temporary name and renamed into place, so a reader never sees a
partial batch: its existence means it is complete.

The reader checks what it loads before anything uses it (`read_batch`, `read_meta`): a file that is not
this format (not a dict of this step's non-empty list of micro-batches, or a row `Row.from_wire` refuses) is a
UserError naming the file and the first thing wrong in it, never a traceback from deep inside the trainer.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path

import torch

from asyncrl.core import failpoint
from asyncrl.core.errors import UserError
from asyncrl.transport.files import publish_dir, wait_for
from asyncrl.transport.layout import RunLayout
from asyncrl.transport.routes import RoutingShape
from asyncrl.transport.row import Row


def write_batch(layout: RunLayout, step: int, per_rank: list[list[Row]], meta: dict | None = None) -> Path:
    """Atomically write step `step`'s batch: `per_rank[r]` is rank r's list of rows (micro-batches)."""
    counts = {len(mbs) for mbs in per_rank}
    if len(counts) != 1:
        raise ValueError(f"every rank needs the same number of micro-batches, got {[len(m) for m in per_rank]}")
    for rows in per_rank:
        for row in rows:
            row.check()
    info = {"step": step, "num_ranks": len(per_rank), "micro_batches_per_rank": counts.pop(), **(meta or {})}

    def write(tmp: Path) -> None:
        for rank, rows in enumerate(per_rank):
            torch.save({"step": step, "micro_batches": [row.to_wire() for row in rows]}, tmp / f"rank_{rank}.pt")
        failpoint.reached("orchestrator.batch", step)
        (tmp / "meta.json").write_text(json.dumps(info))

    # a re-run of the same step (e.g. after resume) replaces it
    return publish_dir(layout.batch_dir(step), write, marker=False)


def wait_for_batch(
    layout: RunLayout,
    step: int,
    timeout: float | None = None,
    poll: float = 0.005,
    should_stop: Callable[[], bool] | None = None,
) -> Path:
    """Block until step `step`'s batch exists; TimeoutError after `timeout` seconds."""
    path = layout.batch_dir(step)
    wait_for(path.exists, f"rollout batch for step {step} at {path}", timeout, poll, should_stop)
    return path


def read_batch(
    layout: RunLayout, step: int, rank: int, vocab_size: int | None = None, routing: RoutingShape | None = None
) -> list[Row]:
    """Rank `rank`'s rows of step `step` (the batch must exist: see `wait_for_batch`), checked (`rows_of`;
    token ids against `vocab_size`, routing records against `routing` when given): a UserError naming the file
    otherwise."""
    path = layout.batch_dir(step) / f"rank_{rank}.pt"
    try:
        data = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:  # batches appear whole: a disk fault
        raise UserError(
            f"rollout batch {path} is unreadable ({type(e).__name__}: {e}); delete {path.parent} and restart "
            "the orchestrator from its last checkpoint so it writes the step again"
        ) from None
    try:
        return rows_of(data, step, vocab_size, routing)
    except ValueError as e:
        raise UserError(f"rollout batch {path} is malformed: {e}; {_rewrite_hint(path.parent)}") from None


def _rewrite_hint(step_dir: Path) -> str:
    return (
        f"was it written by this run's orchestrator for the same model (--model.name, output_dir)? Delete "
        f"{step_dir} and restart the orchestrator from its last checkpoint so it writes the step again"
    )


def read_meta(layout: RunLayout, step: int) -> dict:
    """Step `step`'s meta.json (a dict whose num_ranks, if any, is a positive int); a UserError naming it otherwise."""
    path = layout.batch_dir(step) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(
            f"rollout batch meta {path} is unreadable ({type(e).__name__}: {e}); {_rewrite_hint(path.parent)}"
        ) from None
    ranks = meta.get("num_ranks", 1) if isinstance(meta, dict) else None
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        what = f"num_ranks is {ranks!r}" if isinstance(meta, dict) else f"holds a {type(meta).__name__}"
        raise UserError(
            f"rollout batch meta {path} is malformed: {what}, expected a dict with num_ranks >= 1; "
            + _rewrite_hint(path.parent)
        )
    return meta


def rows_of(data: object, step: int, vocab_size: int | None = None, routing: RoutingShape | None = None) -> list[Row]:
    """The rows of a loaded `rank_{r}.pt` of step `step`: a dict of this step with a non-empty list of
    micro-batches, each one `Row.from_wire` takes; a ValueError saying the first thing wrong otherwise."""
    if not isinstance(data, dict):
        raise ValueError(f"it holds a {type(data).__name__}, not a dict of step and micro_batches")
    if data.get("step") != step:
        raise ValueError(f"it says step {data.get('step')!r}, but it is step {step}'s file")
    wire = data.get("micro_batches")
    if not isinstance(wire, list):
        raise ValueError(f"micro_batches is a {type(wire).__name__}, not a list")
    if not wire:
        raise ValueError("it holds no micro-batches (every rank needs at least one, all-masked if need be)")
    return [_row_of(mb, i, vocab_size, routing) for i, mb in enumerate(wire)]


def _row_of(wire: object, index: int, vocab_size: int | None, routing: RoutingShape | None) -> Row:
    try:
        return Row.from_wire(wire, vocab_size, routing)
    except ValueError as e:
        raise ValueError(f"micro-batch {index}: {e}") from None
