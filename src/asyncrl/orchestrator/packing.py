"""Pack training samples into micro-batches (`transport.row.Row`s) for the trainer's data-parallel ranks.

Samples are concatenated into rows of at most `seq_len` tokens by first-fit-decreasing bin packing;
position ids restart at 0 at each sample (the trainer reads sample boundaries from them). Rows are
spread over ranks to balance tokens, and every rank gets the same number of micro-batches: ranks
short of rows get all-masked dummy rows (loss_mask False, advantage 0), or FSDP would hang.
A sample longer than `seq_len` is cut to `seq_len` tokens and counted, never packed over-long.

Shared prefixes (`share=True`, items carrying a `group`): the samples of one rollout group usually
start with the same prompt. Their shared prefix P is the longest common prefix of their input ids, cut
before the first token any of them trains on, so shared tokens never carry loss. A group with P >= 1 and
at least two samples longer than P becomes a unit in the `transport.prefix` row format: one such sample
in full, then each other one from position P on (positions P, P+1, ...), which the trainer reads as
`first[:P] + continuation`. Invariants:
- a unit is packed whole into one row (so a group never spans ranks), unless it is longer than
  `seq_len`: then its samples are split greedily into several units, each repeating the prefix;
- samples no longer than P (nothing after the prefix), truncated samples, and groups with nothing to
  share are packed plain, exactly as without sharing;
- every token keeps its own sample's loss mask, logprob, advantage (the sample's, or its own per-token one
  with distillation) and temperature; samples share only
  with samples of the same temperature;
- `share=False` (or no groups) gives exactly the rows of a plain packing.

With forward-KL distillation (items carrying `teacher_targets`), every row of the step also gets `teacher_ids` and
`teacher_targets` of shape (L, K), K the most tokens any position lists: each token's listed ids and target
mass, zero-padded (mass 0 contributes nothing).

With an MoE's routing records (every sample carrying `routes`), every row also gets `routed_experts` (L, layers,
top_k) uint8: each token's row of its own sample's record (a continuation's shared prefix is the first sample's).
A row with a sample lacking its record gets none (the trainer with router_replay then refuses the batch).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from asyncrl.orchestrator.samples import TokenSample
from asyncrl.transport.routes import as_tensor
from asyncrl.transport.row import Row


@dataclass
class PackItem:
    """A sample ready to pack: tokens plus the per-sample scalars broadcast to its tokens."""

    sample: TokenSample
    advantage: float
    temperature: float
    group: Hashable | None = None  # samples of one rollout group may share their prompt (None: never)
    token_advantages: list[float] | None = None  # one per token (distillation); None: `advantage` on every token
    teacher_targets: list[dict[int, float]] | None = None  # one per token (forward_kl): {id: target mass}
    policy_step: int = 0  # the policy that produced every completion token of it (its group's stamp)

    def advantages(self, start: int = 0) -> list[float]:
        """The advantages of the sample's tokens from `start` on."""
        if self.token_advantages is None:
            return [self.advantage] * (len(self.sample) - start)
        return self.token_advantages[start:]


@dataclass
class PackStats:
    num_samples: int = 0
    num_tokens: int = 0  # tokens in the rows: what the trainer computes
    num_tokens_unshared: int = 0  # tokens the same samples take packed without shared prefixes
    num_loss_tokens: int = 0
    num_truncated: int = 0
    num_rows: int = 0
    num_dummies: int = 0


@dataclass
class Unit:
    """Samples packed next to each other: the first in full, the others from position `shared` on."""

    items: list[PackItem]
    shared: int = 0

    def __len__(self) -> int:
        return sum(len(it.sample) for it in self.items) - self.shared * (len(self.items) - 1)

    def pieces(self) -> list[tuple[PackItem, int]]:
        """(item, first position written) per sample, in row order."""
        return [(it, self.shared if k else 0) for k, it in enumerate(self.items)]


def truncate(item: PackItem, seq_len: int) -> tuple[PackItem, bool]:
    s = item.sample
    if len(s) <= seq_len:
        return item, False
    routes = s.routes[:seq_len] if s.routes is not None else None
    cut = TokenSample(s.input_ids[:seq_len], s.loss_mask[:seq_len], s.logprobs[:seq_len], routes=routes)
    per_token = item.token_advantages[:seq_len] if item.token_advantages is not None else None
    targets = item.teacher_targets[:seq_len] if item.teacher_targets is not None else None
    return PackItem(cut, item.advantage, item.temperature, item.group, per_token, targets), True


def shared_prefix(samples: list[TokenSample]) -> int:
    """Length of the samples' longest common prefix of input ids that holds no loss token of any of them."""
    first = samples[0]
    for i in range(min(len(s) for s in samples)):
        if any(s.input_ids[i] != first.input_ids[i] or s.loss_mask[i] for s in samples):
            return i
    return min(len(s) for s in samples)


def split_units(items: list[PackItem], shared: int, seq_len: int) -> list[Unit]:
    """Items sharing `shared` prefix tokens, greedily in order, into units of at most `seq_len` tokens.

    A sample of `seq_len` tokens (e.g. a truncated one) never fits next to another, so it goes alone: plain."""
    units: list[Unit] = []
    for it in items:
        if units and len(units[-1]) + len(it.sample) - shared <= seq_len:
            units[-1].items.append(it)
        else:
            units.append(Unit([it], shared))
    return units


def group_units(items: list[PackItem], seq_len: int) -> list[Unit]:
    """One group's samples as units: those going past the shared prefix share it, the rest go plain."""
    p = shared_prefix([it.sample for it in items])
    forks = [it for it in items if len(it.sample) > p]
    if p == 0 or len(forks) < 2:
        return [Unit([it]) for it in items]
    return [Unit([it]) for it in items if len(it.sample) <= p] + split_units(forks, p, seq_len)


def make_units(items: list[PackItem], seq_len: int, share: bool) -> list[Unit]:
    """Plain one-sample units, or with `share`, each group's samples sharing their common prompt."""
    if not share:
        return [Unit([it]) for it in items]
    units: list[Unit] = []
    groups: dict[tuple, list[PackItem]] = {}
    for it in items:
        if it.group is None:
            units.append(Unit([it]))
        else:
            groups.setdefault((it.group, it.temperature), []).append(it)
    for members in groups.values():
        units += group_units(members, seq_len)
    return units


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


def make_row(items: list[PackItem], width: int = 0) -> Row:
    """One packed row from samples (in order), each written in full."""
    return pieces_row([(it, 0) for it in items], width)


def units_row(units: list[Unit], width: int = 0) -> Row:
    """One packed row from units (in order)."""
    return pieces_row([piece for u in units for piece in u.pieces()], width)


def pieces_row(pieces: list[tuple[PackItem, int]], width: int = 0) -> Row:
    """A row of samples each written from its given first position on (0: in full); with `width` > 0 also the
    teacher's targets, `width` per token."""
    ids, pos, mask, adv, lps, temps = [], [], [], [], [], []
    for it, start in pieces:
        s = it.sample
        n = len(s) - start
        ids += s.input_ids[start:]
        pos += range(start, len(s))
        mask += s.loss_mask[start:]
        adv += it.advantages(start)
        lps += [lp if m else 0.0 for lp, m in zip(s.logprobs[start:], s.loss_mask[start:])]
        temps += [it.temperature] * n
    return Row(
        input_ids=torch.tensor(ids, dtype=torch.long),
        position_ids=torch.tensor(pos, dtype=torch.long),
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        advantages=torch.tensor(adv, dtype=torch.float32),
        inference_logprobs=torch.tensor(lps, dtype=torch.float32),
        temperatures=torch.tensor(temps, dtype=torch.float32),
        **(targets_fields(pieces, width) if width else {}),
        **routes_field(pieces),
    )


def routes_field(pieces: list[tuple[PackItem, int]]) -> dict[str, torch.Tensor]:
    """`routed_experts` of a row's pieces (each from its first position on), or {} unless every piece has one."""
    if any(it.sample.routes is None for it, _ in pieces):
        return {}
    return {"routed_experts": torch.cat([as_tensor(it.sample.routes[start:]) for it, start in pieces])}


def targets_fields(pieces: list[tuple[PackItem, int]], width: int) -> dict[str, torch.Tensor]:
    """`teacher_ids` and `teacher_targets` (L, width) of a row's pieces, zero where a token has none."""
    per_token = [d for it, start in pieces for d in (it.teacher_targets or [{}] * len(it.sample))[start:]]
    ids = torch.zeros(len(per_token), width, dtype=torch.long)
    targets = torch.zeros(len(per_token), width, dtype=torch.float32)
    for t, d in enumerate(per_token):
        if d:
            ids[t, : len(d)] = torch.tensor(list(d.keys()), dtype=torch.long)
            targets[t, : len(d)] = torch.tensor(list(d.values()), dtype=torch.float32)
    return {"teacher_ids": ids, "teacher_targets": targets}


def dummy_row(template: Row | None, temperature: float = 1.0) -> Row:
    """A row that contributes nothing to the loss (the template's tokens, everything masked)."""
    if template is None:
        template = make_row([PackItem(TokenSample([0], [False], [0.0]), 0.0, temperature)])
    return template.masked()


def pack(
    items: list[PackItem], seq_len: int, num_ranks: int = 1, share: bool = False
) -> tuple[list[list[Row]], PackStats]:
    """Micro-batches per rank (equal counts, at least one each) and packing statistics.

    With `share`, the samples of each `PackItem.group` write their common prompt once (module docstring).
    """
    stats = PackStats(num_samples=len(items))
    cut_items = []
    for it in items:
        cut, was_cut = truncate(it, seq_len)
        stats.num_truncated += was_cut
        cut_items.append(cut)
    units = make_units(cut_items, seq_len, share)
    bins = first_fit_decreasing([len(u) for u in units], seq_len)
    width = targets_width(cut_items)
    rows = [units_row([units[i] for i in b], width) for b in bins]
    stats.num_rows = len(rows)
    stats.num_tokens = sum(len(u) for u in units)
    stats.num_tokens_unshared = sum(len(it.sample) for it in cut_items)
    stats.num_loss_tokens = sum(sum(it.sample.loss_mask) for it in cut_items)
    per_rank = spread(rows, num_ranks)
    template = min(rows, key=lambda r: r.input_ids.numel()) if rows else None  # cheapest dummy
    temperature = items[0].temperature if items else 1.0
    for mbs in per_rank:
        while len(mbs) < slots_per_rank(len(rows), num_ranks):
            mbs.append(dummy_row(template, temperature))
            stats.num_dummies += 1
    return per_rank, stats


def targets_width(items: list[PackItem]) -> int:
    """The most tokens a position lists among the items' teacher targets (at least 1 when any item has them), or 0."""
    lists = [it.teacher_targets for it in items if it.teacher_targets is not None]
    return max((len(d) for targets in lists for d in targets), default=1) if lists else 0


def slots_per_rank(num_rows: int, num_ranks: int) -> int:
    """Micro-batches every rank gets: ceil(rows / ranks), at least one."""
    return max(1, -(-num_rows // num_ranks))


def spread(rows: list[Row], num_ranks: int) -> list[list[Row]]:
    """Rows over ranks, largest first, each to the least-loaded rank with a free slot (ceil(rows/ranks) each)."""
    per_rank: list[list[Row]] = [[] for _ in range(num_ranks)]
    tokens = [0] * num_ranks
    per_rank_count = slots_per_rank(len(rows), num_ranks)
    for row in sorted(rows, key=lambda r: -r.input_ids.numel()):
        rank = min((r for r in range(num_ranks) if len(per_rank[r]) < per_rank_count), key=lambda r: tokens[r])
        per_rank[rank].append(row)
        tokens[rank] += row.input_ids.numel()
    return per_rank
