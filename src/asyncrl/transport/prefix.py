"""Shared-prefix rows: how a packed row says "these samples share their first tokens", read from position_ids.

A packed row (see `transport.row`) is a run of groups; a group starts where position_ids is 0. A group
is its first sample (positions 0, 1, ..., L-1) followed by any number of continuations: a continuation
starts where the positions neither go on by +1 nor restart at 0. A continuation whose first position is
p stands for the sample `first[:p] + continuation`: it shares the first sample's tokens before position p.

    positions  0 1 2 3 4 5 6 7 | 5 6 | 0 1 2 3      one row: a group of 3 samples, then a plain sample
    group      0 0 0 0 0 0 0 0   0 0   1 1 1 1
    segment    0 0 0 0 0 0 0 0   1 1   2 2 2 2      = the sample ids the loss uses
    fork       0 0 0 0 0 0 0 0   5 5   0 0 0 0      first position of a continuation (0: none)
    parent    -1 0 1 2 3 4 5 6   4 8  -1 10 11 12   token whose logits score this one (-1: none)

A plain packed row (every sample on its own, positions restarting at 0) is the special case of groups of
one sample each, so rows without sharing read exactly as before.

A continuation is told apart from the segment before it only by a break in the positions, so a writer must
not place a continuation forking at p right after a segment ending at position p - 1; and a group with
continuations starts at position 0 (its first sample's tokens are read as positions 0, 1, ...).

Invariants: a token attends the tokens of its own segment up to itself, plus, in a continuation forking at
p, the group's first p tokens. Shared tokens (the first sample's positions below any fork of its group)
carry no loss (the orchestrator shares prompt tokens only), so every sample's loss tokens, logits and
gradients are those of its unshared form `first[:p] + continuation`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowSegments:
    """Per-token structure of one packed row (all tensors (T,) int64 on the positions' device)."""

    sample_ids: torch.Tensor  # segment index in [0, num_samples)
    num_samples: int
    group_ids: torch.Tensor  # group index (a new group where position_ids is 0)
    parents: torch.Tensor  # index of the token whose logits predict this one; -1 at a group's first token
    fork: torch.Tensor  # first position of the token's continuation (0 in a group's first sample)
    first: torch.Tensor  # bool: the token is in its group's first sample
    shared: bool  # any segment continues a group's first segment


def segments(position_ids: torch.Tensor) -> RowSegments:
    """Groups, segments and logit parents of a packed row, from its position ids alone."""
    pos = position_ids.long()
    n = pos.numel()
    idx = torch.arange(n, device=pos.device)
    prev = torch.cat([pos.new_full((1,), -1), pos[:-1]])
    group_start = (pos == 0) | (idx == 0)
    seg_start = group_start | (pos != prev + 1)
    group_ids = torch.cumsum(group_start.long(), 0) - 1
    sample_ids = torch.cumsum(seg_start.long(), 0) - 1
    first_of_group = idx[group_start][group_ids]
    first = _in_first_segment(sample_ids, group_ids)
    fork = pos[seg_start][sample_ids] * (~first).long()
    parents = idx - 1
    branch_start = seg_start & ~group_start
    parents[branch_start] = first_of_group[branch_start] + pos[branch_start] - 1
    parents[group_start] = -1
    num = int(sample_ids[-1]) + 1 if n else 0
    return RowSegments(sample_ids, num, group_ids, parents, fork, first, bool(branch_start.any()))


def _in_first_segment(sample_ids: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """True on tokens of their group's first segment."""
    first_segment_of_group = torch.zeros(int(group_ids.max()) + 1 if group_ids.numel() else 0, dtype=torch.long)
    first_segment_of_group = first_segment_of_group.to(sample_ids.device).scatter_reduce(
        0, group_ids, sample_ids, reduce="amin", include_self=False
    )
    return sample_ids == first_segment_of_group[group_ids]


def check_shared(position_ids: torch.Tensor, loss_mask: torch.Tensor, s: RowSegments | None = None) -> None:
    """ValueError unless every continuation forks inside its group's first sample, no shared token has loss,
    and the row starts at position 0. `s`: the row's `segments`, when the caller has them already."""
    s = s or segments(position_ids)
    if not s.shared:
        return
    pos = position_ids.long()
    if int(pos[0]) != 0:
        raise ValueError("a row with shared prefixes must start at position 0 (position_ids)")
    length = torch.zeros_like(s.fork).index_add(0, s.group_ids, s.first.long())
    if bool((s.fork > length[s.group_ids]).any()):
        raise ValueError("a continuation forks past the end of its group's first sample (position_ids)")
    max_fork = torch.zeros_like(s.fork).scatter_reduce(0, s.group_ids, s.fork, reduce="amax")
    if bool((loss_mask.bool() & s.first & (pos < max_fork[s.group_ids])).any()):
        raise ValueError("a shared prefix holds loss tokens; only prompt tokens may be shared")


def attention_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(T, T) bool, True where query token q may attend key token k (see the module's invariants)."""
    s = segments(position_ids)
    pos = position_ids.long()
    idx = torch.arange(pos.numel(), device=pos.device)
    causal = idx[None, :] <= idx[:, None]
    same_segment = s.sample_ids[None, :] == s.sample_ids[:, None]
    from_prefix = (s.group_ids[None, :] == s.group_ids[:, None]) & s.first[None, :] & (pos[None, :] < s.fork[:, None])
    return causal & (same_segment | from_prefix)


def unshare(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """How to write the row with no sharing, or None when it has no continuation: the token indices in order,
    each continuation's shared tokens copied in front of it, and the positions of the written row."""
    s = segments(position_ids)
    if not s.shared:
        return None
    idx = torch.arange(s.sample_ids.numel(), device=s.sample_ids.device)
    order = []
    for seg in range(s.num_samples):
        tokens = idx[s.sample_ids == seg]
        p = int(s.fork[tokens[0]])
        if p:
            tokens = torch.cat([idx[(s.group_ids == s.group_ids[tokens[0]]) & s.first][:p], tokens])
        order.append(tokens)
    return torch.cat(order), torch.cat([torch.arange(t.numel(), device=idx.device) for t in order])
