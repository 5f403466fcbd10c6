"""SFT rows and micro-batches: an ordered sample stream with an exact position, packed into rows.

A step takes samples from a `SampleStream` in (shuffled) order; without packing a row is one
sample, with packing consecutive samples share a row of at most `seq_len` tokens (position ids
restart per sample, which the model turns into a block-diagonal mask). A micro-batch stacks rows.
A sample that does not fit starts the next row, or stays unconsumed for the next step, so the
stream position after a step is exactly the first unseen sample.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from loguru import logger

from asyncrl.core.errors import UserError
from asyncrl.trainer.sft.data import SFTSample

# ---- ordered stream with an exact position -------------------------------------------------------


class SampleStream:
    """Samples in per-epoch shuffled order; (epoch, index) is the next unseen sample.

    `get(i)` returns the sample at dataset index i, or None to skip it (nothing to train on).
    `max_epochs` None repeats the data forever.
    """

    def __init__(
        self, size: int, get: Callable[[int], SFTSample | None], shuffle: bool, seed: int, max_epochs: int | None
    ):
        self.size, self.get, self.shuffle, self.seed, self.max_epochs = size, get, shuffle, seed, max_epochs
        self.epoch, self.index = 0, 0
        self.skipped = 0
        self._order: list[int] | None = None
        self._order_epoch = -1
        self._peeked: tuple[int, int, SFTSample] | None = None

    def _dataset_index(self) -> int:
        if not self.shuffle:
            return self.index
        if self._order_epoch != self.epoch:
            self._order = list(range(self.size))
            random.Random(f"sft:{self.seed}:{self.epoch}").shuffle(self._order)
            self._order_epoch = self.epoch
        return self._order[self.index]

    def _roll(self) -> None:
        if self.index >= self.size:
            self.epoch, self.index = self.epoch + 1, 0

    def peek(self) -> SFTSample | None:
        """The next sample without consuming it; None when the data is exhausted."""
        skipped_in_a_row = 0
        while True:
            self._roll()
            if self.max_epochs is not None and self.epoch >= self.max_epochs:
                return None
            if self._peeked is not None and self._peeked[:2] == (self.epoch, self.index):
                return self._peeked[2]
            sample = self.get(self._dataset_index())
            if sample is not None:
                self._peeked = (self.epoch, self.index, sample)
                return sample
            self.skipped += 1
            skipped_in_a_row += 1
            if skipped_in_a_row > self.size:
                raise UserError("no sample of the dataset has a token to train on (check data.loss_roles)")
            self.index += 1

    def advance(self) -> None:
        self.index += 1
        self._roll()

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "size": self.size}

    def load_state(self, state: dict) -> None:
        if state.get("size") != self.size:
            logger.warning(
                f"the dataset had {state.get('size')} rows when checkpointed and has {self.size} now; "
                f"continuing at epoch {state['epoch']}, index {min(state['index'], self.size)}"
            )
        self.epoch, self.index = int(state["epoch"]), min(int(state["index"]), self.size)
        self._peeked = None


def take_rows(stream: SampleStream, num_rows: int, seq_len: int, pack: bool) -> list[list[SFTSample]]:
    """Up to `num_rows` rows for one step (fewer only when the data ends), consuming exactly what they hold."""
    rows: list[list[SFTSample]] = []
    current: list[SFTSample] = []
    used = 0
    while True:
        sample = stream.peek()
        if sample is None:
            break
        if current and (not pack or used + len(sample) > seq_len):
            rows.append(current)
            current, used = [], 0
            if len(rows) == num_rows:
                break
        current.append(sample)
        used += len(sample)
        stream.advance()
    if current:
        rows.append(current)
    return rows


# ---- micro-batches -------------------------------------------------------------------------------


@dataclass
class SFTMicroBatch:
    """One forward pass: rows stacked into [rows, longest row], each row holding packed samples.

    Position ids restart at every sample, which HF attention turns into a block-diagonal mask (so a
    row costs O(seq_len^2) attention, not the square of the whole micro-batch). Rows are right-padded
    with a pad pseudo-sample that has its own positions and no loss.
    """

    input_ids: torch.Tensor  # [rows, length]
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    sample_lengths: torch.Tensor  # CPU, real samples only, for FLOP counting
    num_samples: int

    def to(self, device: torch.device) -> SFTMicroBatch:
        return SFTMicroBatch(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.loss_mask.to(device),
            self.sample_lengths,
            self.num_samples,
        )


def make_micro_batch(rows: list[list[SFTSample]], pad_id: int) -> SFTMicroBatch:
    """Stack rows (empty rows are dropped); no real row at all gives a 1-token dummy with no loss,
    which keeps every rank running the same number of forward/backward passes."""
    rows = [row for row in rows if row]
    if not rows:
        one = torch.zeros(1, 1, dtype=torch.long)
        return SFTMicroBatch(one + pad_id, one.clone(), one.bool(), torch.zeros(0, dtype=torch.long), 0)
    length = max(sum(len(s) for s in row) for row in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), length), dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.bool)
    for r, row in enumerate(rows):
        at = 0
        for s in row:
            ids[r, at : at + len(s)] = torch.tensor(s.input_ids)
            pos[r, at : at + len(s)] = torch.arange(len(s))
            mask[r, at : at + len(s)] = torch.tensor(s.loss_mask)
            at += len(s)
        pos[r, at:] = torch.arange(length - at)
    mask &= pos != 0  # a sample's first token has no prefix in its own sample: never a target
    lengths = torch.tensor([len(s) for row in rows for s in row])
    return SFTMicroBatch(ids, pos, mask, lengths, len(lengths))


def split_for_rank(
    rows: list[list[SFTSample]], batch_size: int, micro_batch_size: int, rank: int, world_size: int
) -> list[list[list[SFTSample]]]:
    """This rank's micro-batches (lists of rows): rows round-robin over ranks, every rank gets the same count."""
    mine = rows[rank::world_size]
    per_rank = batch_size // world_size
    mine += [[] for _ in range(per_rank - len(mine))]
    return [mine[i : i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]
