"""Pack training samples into micro-batches for the trainer's data-parallel ranks.

Samples are concatenated into rows of at most `seq_len` tokens by first-fit-decreasing bin packing;
position ids restart at 0 at each sample (the trainer reads sample boundaries from them). Rows are
spread over ranks to balance tokens, and every rank gets the same number of micro-batches: ranks
short of rows get all-masked dummy rows (loss_mask False, advantage 0), or FSDP would hang.
A sample longer than `seq_len` is cut to `seq_len` tokens and counted, never packed over-long.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.orchestrator.samples import TokenSample
from asyncrl.transport.batch import MicroBatch


@dataclass
class PackItem:
    """A sample ready to pack: tokens plus the per-sample scalars broadcast to its tokens."""

    sample: TokenSample
    advantage: float
    temperature: float


@dataclass
class PackStats:
    num_samples: int = 0
    num_tokens: int = 0
    num_loss_tokens: int = 0
    num_truncated: int = 0
    num_rows: int = 0
    num_dummies: int = 0


def truncate(item: PackItem, seq_len: int) -> tuple[PackItem, bool]:
    s = item.sample
    if len(s) <= seq_len:
        return item, False
    cut = TokenSample(s.input_ids[:seq_len], s.loss_mask[:seq_len], s.logprobs[:seq_len])
    return PackItem(cut, item.advantage, item.temperature), True


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices grouped into bins whose length sums stay <= capacity (every length must fit)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        if lengths[i] > capacity:
            raise ValueError(f"item of length {lengths[i]} does not fit in capacity {capacity}")
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def make_row(items: list[PackItem]) -> MicroBatch:
    """One packed micro-batch row from samples (in order)."""
    ids, pos, mask, adv, lps, temps = [], [], [], [], [], []
    for it in items:
        n = len(it.sample)
        ids += it.sample.input_ids
        pos += range(n)
        mask += it.sample.loss_mask
        adv += [it.advantage] * n
        lps += [lp if m else 0.0 for lp, m in zip(it.sample.logprobs, it.sample.loss_mask)]
        temps += [it.temperature] * n
    return {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "position_ids": torch.tensor(pos, dtype=torch.long),
        "loss_mask": torch.tensor(mask, dtype=torch.bool),
        "advantages": torch.tensor(adv, dtype=torch.float32),
        "inference_logprobs": torch.tensor(lps, dtype=torch.float32),
        "temperatures": torch.tensor(temps, dtype=torch.float32),
    }


def dummy_row(template: MicroBatch | None, temperature: float = 1.0) -> MicroBatch:
    """A row that contributes nothing to the loss (the template's tokens, everything masked)."""
    if template is None:
        template = make_row([PackItem(TokenSample([0], [False], [0.0]), 0.0, temperature)])
    return {
        "input_ids": template["input_ids"].clone(),
        "position_ids": template["position_ids"].clone(),
        "loss_mask": torch.zeros_like(template["loss_mask"]),
        "advantages": torch.zeros_like(template["advantages"]),
        "inference_logprobs": torch.zeros_like(template["inference_logprobs"]),
        "temperatures": template["temperatures"].clone(),
    }


def pack(items: list[PackItem], seq_len: int, num_ranks: int = 1) -> tuple[list[list[MicroBatch]], PackStats]:
    """Micro-batches per rank (equal counts, at least one each) and packing statistics."""
    stats = PackStats(num_samples=len(items))
    cut_items = []
    for it in items:
        cut, was_cut = truncate(it, seq_len)
        stats.num_truncated += was_cut
        cut_items.append(cut)
    bins = first_fit_decreasing([len(it.sample) for it in cut_items], seq_len)
    rows = [make_row([cut_items[i] for i in b]) for b in bins]
    stats.num_rows = len(rows)
    stats.num_tokens = sum(len(it.sample) for it in cut_items)
    stats.num_loss_tokens = sum(sum(it.sample.loss_mask) for it in cut_items)

    per_rank: list[list[MicroBatch]] = [[] for _ in range(num_ranks)]
    tokens = [0] * num_ranks
    per_rank_count = max(1, -(-len(rows) // num_ranks))
    # Largest rows first, each to the least-loaded rank that still has a free slot.
    for row in sorted(rows, key=lambda r: -len(r["input_ids"])):
        rank = min((r for r in range(num_ranks) if len(per_rank[r]) < per_rank_count), key=lambda r: tokens[r])
        per_rank[rank].append(row)
        tokens[rank] += len(row["input_ids"])
    template = min(rows, key=lambda r: len(r["input_ids"])) if rows else None  # cheapest dummy
    temperature = items[0].temperature if items else 1.0
    for mbs in per_rank:
        while len(mbs) < per_rank_count:
            mbs.append(dummy_row(template, temperature))
            stats.num_dummies += 1
    return per_rank, stats
