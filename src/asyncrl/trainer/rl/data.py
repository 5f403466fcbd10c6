"""Where the RL trainer's micro-batches come from: the orchestrator's batch files, or fake data for --bench.

Both give each rank a list of packed rows (`transport.row.Row`); `prepare` turns one row into
device tensors plus the sample index and logit parent of every token (`transport.prefix.segments`), and
`micro_batches` groups up to `data.micro_batch_size` rows into one forward pass (`RowBatch`), rows of
similar length together when `plan_forwards` finds that pads less than it costs in extra passes.

Invariants of a `RowBatch`: rows are stacked into [rows, longest row], a shorter row padded by a
pseudo-sample with its own positions (0, 1, ...) and no loss, so attention keeps every sample to itself;
sample ids are unique over the whole batch. Where attention cannot isolate samples of stacked rows
(flash attention reads sample boundaries from single rows only), the rows are concatenated into one
row instead. Either way the loss sums over the same loss-mask tokens as one row at a time.

Shared-prefix rows (continuations that reuse the first sample's prompt, see `transport.prefix`): every
continuation is a sample of its own, and when any row of a batch is shared the batch also carries
`parents` (the token whose logits score each token, row-local; -1: none) and a [rows, 1, L, L] bool
`attention_mask` (concatenated rows: block-diagonal). Batches of plain rows carry neither, and the
forward pass is exactly the plain one. Attention that takes no such mask gets `Row.expanded` rows instead.

Forward-KL distillation rows also carry `teacher_ids` / `teacher_targets` ([rows, length, K]; padding and rows
without them: mass 0); a batch without them carries None and its loss has no cross-entropy term.
An MoE's routing records (`routed_experts`, [rows, length, layers, top_k]) are joined like the token fields when
every row has one (padding: expert 0); with router_replay the source requires them, checked against the model.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from loguru import logger

from asyncrl.config.base import FakeDataConfig
from asyncrl.core.errors import UserError
from asyncrl.trainer.loss import LossInputs
from asyncrl.transport.batch import read_batch, read_meta, wait_for_batch
from asyncrl.transport.layout import RunLayout
from asyncrl.transport.prefix import attention_mask, check_shared, segments
from asyncrl.transport.routes import RoutingShape
from asyncrl.transport.row import ROUTES, TEACHER_FIELDS, TOKEN_FIELDS, Row


@dataclass(kw_only=True)
class PackedRow(Row):
    """A `Row` on the trainer's device with the sample structure its position ids imply (`transport.prefix`)."""

    sample_ids: torch.Tensor
    num_samples: int
    sample_lengths: torch.Tensor  # CPU, for FLOP counting: tokens computed per sample (a continuation's own)
    parents: torch.Tensor  # row-local index of the token whose logits score each token; -1: none
    shared: bool  # some sample continues another's prefix (needs parents and a mask in the forward)


def prepare(row: Row, device: torch.device) -> PackedRow:
    row.check()
    seg = segments(row.position_ids)
    check_shared(row.position_ids, row.loss_mask, seg)
    # approximate FLOPs: a continuation's attention to its shared prefix (length x fork) is not counted
    lengths = torch.bincount(seg.sample_ids, minlength=seg.num_samples)
    return PackedRow(
        **vars(row.to(device)),
        sample_ids=seg.sample_ids.to(device),
        num_samples=seg.num_samples,
        sample_lengths=lengths,
        parents=seg.parents.to(device),
        shared=seg.shared,
    )


@dataclass(kw_only=True)
class RowBatch(Row):
    """One forward/backward: packed rows' `Row` fields as [rows, length] tensors (teacher fields [rows, length,
    K], only when some row has forward-KL targets), sample ids unique over the batch."""

    sample_ids: torch.Tensor
    num_samples: int
    parents: torch.Tensor | None = None  # [rows, length], only when some row is shared
    attention_mask: torch.Tensor | None = None  # [rows, 1, length, length] bool, True: attend; likewise
    sample_starts: list[int] | None = None  # stacked rows: row i's samples are ids sample_starts[i]..[i+1]-1

    def rows(self, a: int, b: int, teacher: bool = True) -> RowBatch:
        """Stacked rows a..b-1 as a batch of their own (views; sample ids from 0), without forward-KL
        targets unless `teacher`."""
        s0, s1 = self.sample_starts[a], self.sample_starts[b]
        cut = {f: getattr(self, f) for f in ("parents", "attention_mask", ROUTES, *(TEACHER_FIELDS if teacher else ()))}
        return RowBatch(
            **{f: getattr(self, f)[a:b] for f in TOKEN_FIELDS},
            sample_ids=self.sample_ids[a:b] - s0,
            num_samples=s1 - s0,
            **{f: None if t is None else t[a:b] for f, t in cut.items()},
            sample_starts=[s - s0 for s in self.sample_starts[a : b + 1]],
        )

    def loss_inputs(self, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None = None) -> LossInputs:
        """The loss's per-token view: every row's tokens one after another."""
        return LossInputs(
            logprobs.flatten(),
            self.inference_logprobs.flatten(),
            self.advantages.flatten(),
            self.loss_mask.flatten(),
            self.sample_ids.flatten(),
            self.num_samples,
            None if ref_logprobs is None else ref_logprobs.flatten(),
        )


def pad_row(row: PackedRow, length: int) -> PackedRow:
    """`row` grown to `length` tokens by a pseudo-sample with its own positions and no loss."""
    k = length - row.input_ids.numel()
    if k == 0:
        return row
    tail = {
        "input_ids": torch.zeros(k, dtype=torch.long),
        "position_ids": torch.arange(k),
        "loss_mask": torch.zeros(k, dtype=torch.bool),
        "advantages": torch.zeros(k),
        "inference_logprobs": torch.zeros(k),
        "temperatures": torch.ones(k),
        "sample_ids": torch.full((k,), row.num_samples),
        "parents": torch.arange(length - k - 1, length - 1).index_fill(0, torch.tensor([0]), -1),
    }
    if row.teacher_ids is not None:
        tail |= {f: torch.zeros(k, getattr(row, f).shape[1], dtype=getattr(row, f).dtype) for f in TEACHER_FIELDS}
    if row.routed_experts is not None:  # padding replays expert 0 (it carries no loss)
        tail[ROUTES] = torch.zeros(k, *row.routed_experts.shape[1:], dtype=torch.uint8)
    grown = {f: torch.cat([getattr(row, f), t.to(row.input_ids.device)]) for f, t in tail.items()}
    return replace(row, **grown, num_samples=row.num_samples + 1)


def stack_rows(rows: list[PackedRow], stack: bool = True) -> RowBatch:
    """Rows as one forward pass: stacked (padded to the longest), or concatenated into a single row."""
    if stack:
        length = max(r.input_ids.numel() for r in rows)
        rows = [pad_row(r, length) for r in rows]
    join = torch.stack if stack else (lambda ts: torch.cat(ts)[None])
    starts = torch.tensor([0] + [r.num_samples for r in rows]).cumsum(0).tolist()
    out = {f: join([getattr(r, f) for r in rows]) for f in TOKEN_FIELDS}
    sample_ids = join([r.sample_ids + s for r, s in zip(rows, starts)])
    routes = {ROUTES: join([r.routed_experts for r in rows])} if all(r.routed_experts is not None for r in rows) else {}
    batch = RowBatch(**out, sample_ids=sample_ids, num_samples=starts[-1], **_teacher_fields(rows, join), **routes)
    batch.sample_starts = starts if stack else None
    return _with_sharing(batch, rows, stack) if any(r.shared for r in rows) else batch


def _teacher_fields(rows: list[PackedRow], join: Callable) -> dict[str, torch.Tensor]:
    """The rows' forward-KL targets joined like the other fields (a row without them, or narrower: mass 0), or {}."""
    width = max((r.teacher_ids.shape[1] for r in rows if r.teacher_ids is not None), default=0)
    if not width:
        return {}

    def widened(row: PackedRow, f: str) -> torch.Tensor:
        n, dtype = row.input_ids.numel(), torch.long if f == "teacher_ids" else torch.float32
        have = getattr(row, f) if row.teacher_ids is not None else row.input_ids.new_zeros(n, 0, dtype=dtype)
        return torch.cat([have, have.new_zeros(n, width - have.shape[1])], dim=1)

    return {f: join([widened(r, f) for r in rows]) for f in TEACHER_FIELDS}


def _with_sharing(batch: RowBatch, rows: list[PackedRow], stack: bool) -> RowBatch:
    """`batch` plus the parents and attention mask its shared rows need (rows already padded if stacked)."""
    masks = [attention_mask(r.position_ids) for r in rows]
    if stack:
        batch.parents = torch.stack([r.parents for r in rows])
        batch.attention_mask = torch.stack(masks)[:, None]
        return batch
    starts = torch.tensor([0] + [r.input_ids.numel() for r in rows]).cumsum(0).tolist()
    batch.parents = torch.cat([torch.where(r.parents >= 0, r.parents + s, -1) for r, s in zip(rows, starts)])[None]
    batch.attention_mask = torch.block_diag(*masks)[None, None]
    return batch


def plan_forwards(
    lengths: list[int], size: int, row_cost: Callable[[int], float], overhead: float, max_tokens: int | None = None
) -> list[int]:
    """How many rows each forward pass takes, for rows sorted longest first and stacked (each forward
    padded to its first row): consecutive runs of at most `size` rows and `max_tokens` padded tokens (a
    longer row alone) minimizing the total cost, a forward of k rows of length L costing k * row_cost(L) +
    overhead. Rows of very different lengths then go to different forwards instead of padding short rows
    to the longest."""
    n = len(lengths)
    best, cut = [0.0] + [math.inf] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j - 1, max(0, j - size) - 1, -1):  # ever more rows, padded to an ever longer first
            if i < j - 1 and max_tokens is not None and (j - i) * lengths[i] > max_tokens:
                break
            cost = best[i] + (j - i) * row_cost(lengths[i]) + overhead
            if cost <= best[j]:  # ties go to the larger forward
                best[j], cut[j] = cost, i
    sizes, j = [], n
    while j > 0:
        sizes.append(j - cut[j])
        j = cut[j]
    return sizes[::-1]


def fixed_sizes(n: int, size: int) -> list[int]:
    """`n` rows `size` at a time (the last run may hold fewer)."""
    return [min(size, n - i) for i in range(0, n, size)]


def concatenated_sizes(lengths: list[int], size: int, max_tokens: int | None = None) -> list[int]:
    """Rows per forward for rows concatenated into one (no padding), in order: at most `size` rows and
    `max_tokens` tokens each (a longer row alone)."""
    sizes, count, total = [], 0, 0
    for n in lengths:
        if count and (count == size or (max_tokens is not None and total + n > max_tokens)):
            sizes.append(count)
            count, total = 0, 0
        count, total = count + 1, total + n
    return sizes + [count] if count else sizes


def split_to(sizes: list[int], count: int) -> list[int]:
    """`sizes` with the largest run halved until there are `count` runs (ranks must run as many forwards)."""
    sizes = list(sizes)
    while len(sizes) < count:
        i = max(range(len(sizes)), key=lambda k: sizes[k])
        if sizes[i] < 2:
            raise ValueError(f"cannot split {sum(sizes)} rows into {count} forward passes")
        sizes[i : i + 1] = [sizes[i] - sizes[i] // 2, sizes[i] // 2]
    return sizes


def micro_batches(
    rows: list[PackedRow], size: int, stack: bool = True, sizes: list[int] | None = None
) -> list[RowBatch]:
    """Forward passes over `rows`, longest first: `sizes[i]` rows in the i-th (see `plan_forwards`), or
    `size` rows each (the last may hold fewer)."""
    rows = sorted(rows, key=lambda r: -r.input_ids.numel())  # stable: the orchestrator's order already is
    if sizes is None:
        sizes = fixed_sizes(len(rows), size)
    starts = [0, *itertools.accumulate(sizes)]
    return [stack_rows(rows[a:b], stack) for a, b in zip(starts, starts[1:])]


@dataclass
class Part:
    """Rows a..b-1 of a mixed-run forward pass are run `run`'s (an index into the round's runs); `teacher`:
    some of them carry forward-KL targets."""

    run: int
    a: int
    b: int
    teacher: bool


def mixed_micro_batches(
    rows: list[list[PackedRow]], size: int, stack: bool = True, sizes: list[int] | None = None
) -> list[tuple[RowBatch, list[Part]]]:
    """Forward passes over several runs' rows (`rows[i]`: run i's): longest first over all runs, as
    `micro_batches` plans one run's, each pass's rows grouped by run so a run's rows are one slice of it.
    Rows that cannot be stacked (concatenated into one row) are not mixed: each pass holds one run's rows."""
    if not stack:
        return [
            (mb, [Part(i, 0, 1, mb.teacher_ids is not None)])
            for i, own in enumerate(rows)
            for mb in micro_batches(own, size, stack)
        ]
    tagged = sorted(((r, i) for i, own in enumerate(rows) for r in own), key=lambda t: -t[0].input_ids.numel())
    if sizes is None:
        sizes = fixed_sizes(len(tagged), size)
    starts, out = [0, *itertools.accumulate(sizes)], []
    for a, b in zip(starts, starts[1:]):
        group = sorted(tagged[a:b], key=lambda t: t[1])  # stable: longest first within each run
        parts, at = [], 0
        for run, members in itertools.groupby(group, key=lambda t: t[1]):
            members = [r for r, _ in members]
            parts.append(Part(run, at, at + len(members), any(r.teacher_ids is not None for r in members)))
            at += len(members)
        out.append((stack_rows([r for r, _ in group]), parts))
    return out


def deal_rows(rows: list[Row], ranks: int, rank: int) -> list[Row]:
    """`rank`'s share of a batch packed for another rank count: its rows (the packer's all-masked fillers
    dropped) dealt round-robin, longest first; a rank short of rows gets all-masked copies of the shortest
    (every rank must run as many forward passes)."""
    real = sorted((r for r in rows if r.loss_mask.any()), key=lambda r: -r.input_ids.numel()) or rows[:1]
    mine, slots = real[rank::ranks], max(1, -(-len(real) // ranks))
    shortest = min(real, key=lambda r: r.input_ids.numel())
    return mine + [shortest.masked() for _ in range(slots - len(mine))]


def check_seq_len(rows: list[Row], seq_len: int | None, step: int) -> list[Row]:
    """`rows` unchanged when none is longer than `trainer.data.seq_len` (None: no limit), else a UserError."""
    longest = max((r.input_ids.numel() for r in rows), default=0)
    if seq_len is not None and longest > seq_len:
        raise UserError(
            f"step {step}: a packed row of {longest} tokens is longer than trainer.data.seq_len ({seq_len}); rows "
            "are packed to the orchestrator's seq_len (fake data: data.fake.seq_len x samples_per_row): give both "
            "the same length (rl: set seq_len once, at the top level)"
        )
    return rows


class RolloutSource:
    """Step n's micro-batches for this rank, from the run's `rollouts/step_n` (blocks until written); each
    file checked as it is read (`transport.batch.read_batch`, token ids against `vocab_size` when given), and
    the batch's policy stamps against `max_async_level` (`stamps`: the step's staleness, for its metrics)."""

    def __init__(
        self,
        layout: RunLayout,
        rank: int,
        world_size: int,
        timeout: float | None,
        vocab_size: int | None = None,
        max_async_level: int | None = None,
    ) -> None:
        self.layout, self.rank, self.world_size, self.timeout = layout, rank, world_size, timeout
        self.vocab_size, self.max_async_level = vocab_size, max_async_level
        self.routing: RoutingShape | None = None  # router_replay: every row must carry a record for this model
        self.stamps: dict[str, float] = {}
        self._told = False

    def get(self, step: int) -> list[Row]:
        try:
            wait_for_batch(self.layout, step, timeout=self.timeout)
        except TimeoutError as e:
            raise UserError(f"{e}; is the orchestrator running with the same output_dir?") from e
        meta = read_meta(self.layout, step)
        self.stamps = check_stamps(meta, step, self.max_async_level)
        packed_for = meta.get("num_ranks", 1)
        if packed_for == self.world_size:
            return read_batch(self.layout, step, self.rank, self.vocab_size, self.routing)
        if not self._told:
            self._told = True
            logger.info(
                f"rollout batch of step {step} was packed for {packed_for} trainer rank(s), this trainer runs "
                f"{self.world_size}: dealing its rows out again (the orchestrator learns the world size from "
                "trainer_world.json, or set its num_train_workers)"
            )
        rows = [mb for r in range(packed_for) for mb in read_batch(self.layout, step, r, self.vocab_size, self.routing)]
        return deal_rows(rows, self.world_size, self.rank)


def check_stamps(meta: dict, step: int, max_async_level: int | None) -> dict[str, float]:
    """The staleness of step `step`'s samples from its batch's policy stamps (`off_policy/mean`, `off_policy/max`:
    steps between the policy that produced a sample and the one it trains); a UserError when one is older than
    `max_async_level` allows. A batch without stamps (written before them) gives none."""
    lags = meta.get("staleness")
    if not isinstance(lags, dict) or not lags:
        return {}
    counts = {int(lag): int(n) for lag, n in lags.items()}
    oldest = max(counts)
    if max_async_level is not None and oldest > max_async_level:
        raise UserError(
            f"rollout batch of step {step} holds {counts[oldest]} samples of policy step {step - oldest}, {oldest} "
            f"steps behind: more than max_async_level = {max_async_level} allows; give the orchestrator and the "
            "trainer the same max_async_level (rl: set it once, at the top level) and resume"
        )
    mean = sum(lag * n for lag, n in counts.items()) / sum(counts.values())
    return {"off_policy/mean": mean, "off_policy/max": float(oldest)}


class FakeSource:
    """Random rows shaped like real batches: samples_per_row samples of seq_len tokens packed per row."""

    stamps: dict[str, float] = {}  # made-up rows have no policy: no staleness

    def __init__(self, cfg: FakeDataConfig, vocab_size: int, rank: int, world_size: int, seed: int) -> None:
        rows = cfg.batch_size // cfg.samples_per_row
        if rows % world_size:
            raise UserError(
                f"data.fake gives {rows} rows per step (batch_size / samples_per_row), "
                f"not divisible by {world_size} trainer ranks"
            )
        self.cfg, self.vocab, self.rank, self.seed = cfg, vocab_size, rank, seed
        self.rows_per_rank = rows // world_size

    def get(self, step: int) -> list[Row]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + self.rank)
        s, n = self.cfg.seq_len, self.cfg.samples_per_row
        rows = []
        for _ in range(self.rows_per_rank):
            length = s * n
            positions = torch.arange(s).repeat(n)
            loss_mask = positions >= s // 2  # second half of each sample is "completion"
            adv = torch.randn(n, generator=g).repeat_interleave(s)
            rows.append(
                Row(
                    input_ids=torch.randint(0, self.vocab, (length,), generator=g),
                    position_ids=positions,
                    loss_mask=loss_mask,
                    advantages=adv * loss_mask,
                    # about what a random-init model assigns (ratios near 1, so tokens are not masked)
                    inference_logprobs=(-math.log(self.vocab) + 0.1 * torch.randn(length, generator=g)) * loss_mask,
                    temperatures=torch.ones(length),
                )
            )
        return rows
