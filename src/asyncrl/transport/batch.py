"""Rollout batches: the orchestrator writes step n's packed micro-batches, the trainer reads them.

On disk (under the run's output dir)::

    rollouts/step_{n}/rank_{r}.pt     one file per trainer data-parallel rank
    rollouts/step_{n}/meta.json       {"step", "num_ranks", "micro_batches_per_rank", ...}

Each `rank_{r}.pt` is `torch.save({"step": n, "micro_batches": [mb, ...]})` where every micro-batch is a
dict of 1-D tensors of one equal length L (one packed row of up to seq_len tokens):

    input_ids (int64), position_ids (int64; restart at 0 at each sample, which marks boundaries; a
        group's samples may share their prompt: see `transport.prefix` for continuations),
    loss_mask (bool; True on completion tokens the model produced), advantages (float32; per token),
    inference_logprobs (float32; logprob of the token under the sampler, 0 where loss_mask is False),
    temperatures (float32; sampling temperature of the sample each token belongs to)

A row may also share prefixes: samples of one group that start with the same prompt carry it once, each
later sample (a continuation) written as only its own tokens with positions going on from where it forks
(neither +1 nor a restart at 0). `transport.prefix` reads groups, samples, logit parents and the attention
mask from position_ids alone; a row without continuations is a plain packed row.

Every rank gets the same number of micro-batches (padding with all-masked dummies), or FSDP hangs.
The step dir is written under a temporary name and renamed into place, so a reader never sees a
partial batch: its existence means it is complete.
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

MicroBatch = dict[str, torch.Tensor]
FIELDS = ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "temperatures")


def check_micro_batch(mb: MicroBatch) -> None:
    missing = [k for k in FIELDS if k not in mb]
    if missing:
        raise ValueError(f"micro-batch lacks fields {missing}")
    lengths = {k: mb[k].shape for k in FIELDS}
    if len({tuple(s) for s in lengths.values()}) != 1 or mb["input_ids"].dim() != 1:
        raise ValueError(f"micro-batch fields must be 1-D tensors of one length, got {lengths}")


def write_batch(layout: RunLayout, step: int, per_rank: list[list[MicroBatch]], meta: dict | None = None) -> Path:
    """Atomically write step `step`'s batch: `per_rank[r]` is rank r's list of micro-batches."""
    counts = {len(mbs) for mbs in per_rank}
    if len(counts) != 1:
        raise ValueError(f"every rank needs the same number of micro-batches, got {[len(m) for m in per_rank]}")
    for mbs in per_rank:
        for mb in mbs:
            check_micro_batch(mb)
    info = {"step": step, "num_ranks": len(per_rank), "micro_batches_per_rank": counts.pop(), **(meta or {})}

    def write(tmp: Path) -> None:
        for rank, mbs in enumerate(per_rank):
            torch.save({"step": step, "micro_batches": mbs}, tmp / f"rank_{rank}.pt")
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


def read_batch(layout: RunLayout, step: int, rank: int) -> list[MicroBatch]:
    """Rank `rank`'s micro-batches of step `step` (the batch must exist: see `wait_for_batch`)."""
    path = layout.batch_dir(step) / f"rank_{rank}.pt"
    try:
        data = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:  # batches appear whole: a disk fault
        raise UserError(
            f"rollout batch {path} is unreadable ({type(e).__name__}: {e}); delete {path.parent} and restart "
            "the orchestrator from its last checkpoint so it writes the step again"
        ) from None
    if data.get("step") != step:
        raise ValueError(f"batch file for step {step} says step {data.get('step')}")
    return data["micro_batches"]


def read_meta(layout: RunLayout, step: int) -> dict:
    return json.loads((layout.batch_dir(step) / "meta.json").read_text())
