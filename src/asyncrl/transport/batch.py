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

and, with forward-KL distillation only, two (L, K) fields: teacher_ids (int64; the teacher's listed tokens at
each position, zero-padded) and teacher_targets (float32 >= 0; their target mass, the distillation weight times
the teacher's renormalized probability; 0 on padding and on tokens without a teacher signal).

A row may also share prefixes: samples of one group that start with the same prompt carry it once, each
later sample (a continuation) written as only its own tokens with positions going on from where it forks
(neither +1 nor a restart at 0). `transport.prefix` reads groups, samples, logit parents and the attention
mask from position_ids alone; a row without continuations is a plain packed row.

Every rank gets the same number of micro-batches (padding with all-masked dummies), or FSDP hangs.
The step dir is written under a temporary name and renamed into place, so a reader never sees a
partial batch: its existence means it is complete.

The reader checks what it loads before anything uses it (`read_batch`, `read_meta`): a file that is not
this format (wrong types, shapes or dtypes, the wrong step, no micro-batches, token ids outside the model's
vocabulary, non-finite sampler logprobs, temperatures that are not positive, an invalid shared prefix) is a
UserError naming the file and the first thing wrong in it, never a traceback from deep inside the trainer.
The checks are a few reductions per field: cheap next to one forward pass.
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
from asyncrl.transport.prefix import check_shared

MicroBatch = dict[str, torch.Tensor]
FIELDS = ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "temperatures")
INTEGER_FIELDS = ("input_ids", "position_ids")
FLOAT_FIELDS = ("advantages", "inference_logprobs", "temperatures")
TEACHER_FIELDS = ("teacher_ids", "teacher_targets")  # optional, both or neither: (L, K)


def masked_copy(row: MicroBatch) -> MicroBatch:
    """`row` with nothing to train on (loss mask, advantages, logprobs and teacher targets zeroed): a filler."""
    keep = ("input_ids", "position_ids", "temperatures", "teacher_ids")
    return {k: v.clone() if k in keep else torch.zeros_like(v) for k, v in row.items()}


def check_micro_batch(mb: MicroBatch) -> None:
    missing = [k for k in FIELDS if k not in mb]
    if missing:
        raise ValueError(f"micro-batch lacks fields {missing}")
    lengths = {k: mb[k].shape for k in FIELDS}
    if len({tuple(s) for s in lengths.values()}) != 1 or mb["input_ids"].dim() != 1:
        raise ValueError(f"micro-batch fields must be 1-D tensors of one length, got {lengths}")
    if (problem := _teacher_shape_problem(mb)) is not None:
        raise ValueError(f"micro-batch {problem}")


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


def read_batch(layout: RunLayout, step: int, rank: int, vocab_size: int | None = None) -> list[MicroBatch]:
    """Rank `rank`'s micro-batches of step `step` (the batch must exist: see `wait_for_batch`), checked
    (`batch_problem`; token ids against `vocab_size` when given): a UserError naming the file otherwise."""
    path = layout.batch_dir(step) / f"rank_{rank}.pt"
    try:
        data = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:  # batches appear whole: a disk fault
        raise UserError(
            f"rollout batch {path} is unreadable ({type(e).__name__}: {e}); delete {path.parent} and restart "
            "the orchestrator from its last checkpoint so it writes the step again"
        ) from None
    if (problem := batch_problem(data, step, vocab_size)) is not None:
        raise UserError(f"rollout batch {path} is malformed: {problem}; {_rewrite_hint(path.parent)}")
    return data["micro_batches"]


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


def batch_problem(data: object, step: int, vocab_size: int | None = None) -> str | None:
    """What is wrong with a loaded `rank_{r}.pt` of step `step`, or None: a dict of this step with a
    non-empty list of micro-batches, each passing `micro_batch_problem`."""
    if not isinstance(data, dict):
        return f"it holds a {type(data).__name__}, not a dict of step and micro_batches"
    if data.get("step") != step:
        return f"it says step {data.get('step')!r}, but it is step {step}'s file"
    mbs = data.get("micro_batches")
    if not isinstance(mbs, list):
        return f"micro_batches is a {type(mbs).__name__}, not a list"
    if not mbs:
        return "it holds no micro-batches (every rank needs at least one, all-masked if need be)"
    for i, mb in enumerate(mbs):
        if (problem := micro_batch_problem(mb, vocab_size)) is not None:
            return f"micro-batch {i}: {problem}"
    return None


def micro_batch_problem(mb: object, vocab_size: int | None = None) -> str | None:
    """What is wrong with one packed row, or None (the format in this module's docstring)."""
    if not isinstance(mb, dict):
        return f"a {type(mb).__name__}, not a dict of tensors"
    missing = [k for k in FIELDS if k not in mb]
    if missing:
        return f"lacks the fields {missing}"
    not_tensors = [k for k in FIELDS if not isinstance(mb[k], torch.Tensor)]
    if not_tensors:
        return f"{not_tensors} are not tensors"
    shapes = {k: tuple(mb[k].shape) for k in FIELDS}
    if len(set(shapes.values())) != 1 or mb["input_ids"].dim() != 1 or mb["input_ids"].numel() == 0:
        return f"the fields must be non-empty 1-D tensors of one length, got shapes {shapes}"
    return (
        _teacher_shape_problem(mb)
        or _dtype_problem(mb)
        or _value_problem(mb, vocab_size)
        or _teacher_problem(mb, vocab_size)
    )


def _teacher_shape_problem(mb: dict) -> str | None:
    """The teacher fields, when present: both, tensors of shape (L, K >= 1), L the row's length."""
    present = [k for k in TEACHER_FIELDS if k in mb]
    if not present:
        return None
    if len(present) == 1:
        return f"has {present[0]} without {[k for k in TEACHER_FIELDS if k not in mb][0]} (both or neither)"
    if not all(isinstance(mb[k], torch.Tensor) for k in TEACHER_FIELDS):
        return "teacher_ids / teacher_targets are not tensors"
    shapes = {k: tuple(mb[k].shape) for k in TEACHER_FIELDS}
    length = mb["input_ids"].shape[0]
    if len(set(shapes.values())) != 1 or len(shapes["teacher_ids"]) != 2 or shapes["teacher_ids"][0] != length:
        return f"teacher fields must be (L, K) tensors of one shape with L = {length} tokens, got {shapes}"
    if shapes["teacher_ids"][1] < 1:
        return "teacher fields list no token per position (K = 0)"
    return None


def _teacher_problem(mb: MicroBatch, vocab_size: int | None) -> str | None:
    if "teacher_ids" not in mb:
        return None
    ids, targets = mb["teacher_ids"], mb["teacher_targets"]  # dtypes checked by _dtype_problem
    high = vocab_size if vocab_size is not None else torch.iinfo(torch.int64).max
    if (bad := _first((~((ids >= 0) & (ids < high))).any(-1))) is not None:
        return f"teacher_ids[{bad}] = {ids[bad].tolist()} lists a token outside the model's vocabulary"
    if (bad := _first((~(targets.isfinite() & (targets >= 0))).any(-1))) is not None:
        return f"teacher_targets[{bad}] = {targets[bad].tolist()} (target mass must be finite and >= 0)"
    return None


def _dtype_problem(mb: MicroBatch) -> str | None:
    """Integer ids and positions (and teacher_ids), a bool loss mask, float for the rest (teacher_targets too)."""
    integer = [k for k in (*INTEGER_FIELDS, "teacher_ids") if k in mb]
    wrong = [k for k in integer if mb[k].is_floating_point() or mb[k].is_complex() or mb[k].dtype == torch.bool]
    wrong += [k for k in (*FLOAT_FIELDS, "teacher_targets") if k in mb and not mb[k].is_floating_point()]
    wrong += ["loss_mask"] if mb["loss_mask"].dtype != torch.bool else []
    if wrong:
        dtypes = {k: str(mb[k].dtype).removeprefix("torch.") for k in wrong}
        ints = "input_ids, position_ids, teacher_ids"
        return f"wrong dtypes {dtypes} ({ints}: integer; loss_mask: bool; the rest: float)"
    return None


def _value_problem(mb: MicroBatch, vocab_size: int | None) -> str | None:
    ids, pos = mb["input_ids"], mb["position_ids"]
    if vocab_size is not None and (bad := _first(~((ids >= 0) & (ids < vocab_size)))) is not None:
        return f"input_ids[{bad}] = {int(ids[bad])} is outside the model's vocabulary (0..{vocab_size - 1})"
    if (bad := _first(pos < 0)) is not None:
        return f"position_ids[{bad}] = {int(pos[bad])} is negative"
    if (bad := _first(~mb["inference_logprobs"].isfinite())) is not None:
        value = float(mb["inference_logprobs"][bad])
        return f"inference_logprobs[{bad}] = {value} (the sampler's logprob of a token it sampled must be finite)"
    temps = mb["temperatures"]
    if (bad := _first(~(temps.isfinite() & (temps > 0)))) is not None:
        return (
            f"temperatures[{bad}] = {float(temps[bad])} (RL needs finite sampling temperatures > 0: a greedy sample "
            "has no distribution to correct for; give the orchestrator sampling.temperature > 0)"
        )
    try:
        check_shared(pos, mb["loss_mask"])
    except ValueError as e:
        return str(e)
    return None


def _first(bad: torch.Tensor) -> int | None:
    """The index of the first True in a 1-D bool tensor, or None."""
    return int(bad.nonzero()[0, 0]) if bool(bad.any()) else None
