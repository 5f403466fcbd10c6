"""Shared-prefix rows read from position_ids: segments, logit parents, attention mask, expansion, checks."""

import pytest
import torch

from asyncrl.transport.prefix import attention_mask, check_shared, segments
from asyncrl.transport.row import Row

DOC_ROW = [0, 1, 2, 3, 4, 5, 6, 7, 5, 6, 0, 1, 2, 3]  # the module docstring's example


def test_segments_of_the_docstring_example():
    s = segments(torch.tensor(DOC_ROW))
    assert s.shared and s.num_samples == 3
    assert s.group_ids.tolist() == [0] * 10 + [1] * 4
    assert s.sample_ids.tolist() == [0] * 8 + [1, 1] + [2] * 4
    assert s.fork.tolist() == [0] * 8 + [5, 5] + [0] * 4
    assert s.parents.tolist() == [-1, 0, 1, 2, 3, 4, 5, 6, 4, 8, -1, 10, 11, 12]
    assert s.first.tolist() == [True] * 8 + [False, False] + [True] * 4


def test_continuations_forking_at_different_positions():
    # first sample of 6; continuations forking at 2, 6 (the whole sample) and 4 (a single token)
    s = segments(torch.tensor([0, 1, 2, 3, 4, 5, 2, 3, 4, 6, 7, 4]))
    assert s.sample_ids.tolist() == [0] * 6 + [1, 1, 1] + [2, 2] + [3]
    assert s.fork.tolist() == [0] * 6 + [2, 2, 2] + [6, 6] + [4]
    assert s.parents.tolist() == [-1, 0, 1, 2, 3, 4, 1, 6, 7, 5, 9, 3]
    # a continuation forking at 6 right after the first sample would read as its continuation (see module doc)
    assert not segments(torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])).shared


def test_plain_rows_read_as_before():
    pos = torch.tensor([0, 1, 2, 0, 0, 1, 2, 3])
    s = segments(pos)
    # a new sample wherever the position restarts at 0, as plain packed rows always read
    ids, n = torch.cumsum(pos == 0, 0) - 1, int((pos == 0).sum())
    assert not s.shared and s.num_samples == n and torch.equal(s.sample_ids, ids)
    assert s.parents.tolist() == [-1, 0, 1, -1, -1, 4, 5, 6]
    assert s.fork.tolist() == [0] * 8 and bool(s.first.all())
    mask = attention_mask(pos)
    blocks = torch.block_diag(*(torch.ones(k, k, dtype=torch.bool).tril() for k in (3, 1, 4)))
    assert torch.equal(mask, blocks)


def test_attention_mask_by_hand():
    # group 0: first sample positions 0 1 2, a continuation forking at 1; group 1: a plain sample of 2
    got = attention_mask(torch.tensor([0, 1, 2, 1, 2, 0, 1])).int()
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0],
            [1, 0, 0, 1, 0, 0, 0],  # continuation: the group's first token, then itself
            [1, 0, 0, 1, 1, 0, 0],
            [0, 0, 0, 0, 0, 1, 0],
            [0, 0, 0, 0, 0, 1, 1],
        ]
    )
    assert torch.equal(got, want)


def _row(pos: list[int]) -> Row:
    n = len(pos)
    zeros = torch.zeros(n)
    return Row(torch.arange(100, 100 + n), torch.tensor(pos), zeros.bool(), zeros, zeros, torch.arange(n).float())


def test_expand_copies_the_shared_prefix_in_front_of_each_continuation():
    row = _row([0, 1, 2, 3, 2, 3, 1, 0, 1])
    out = row.expanded()
    ids = [100, 101, 102, 103] + [100, 101, 104, 105] + [100, 106] + [107, 108]
    assert out.input_ids.tolist() == ids
    assert out.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 0, 1]
    assert out.temperatures.tolist() == [0, 1, 2, 3, 0, 1, 4, 5, 0, 6, 7, 8]
    assert not segments(out.position_ids).shared
    assert out.expanded() is out  # a plain row is its own expansion
    # the continuations' tokens keep their attention context: each expanded sample = first[:p] + continuation
    assert segments(out.position_ids).num_samples == segments(row.position_ids).num_samples


def test_check_shared_errors():
    check_shared(torch.tensor(DOC_ROW), torch.tensor(DOC_ROW) >= 6)  # loss only past every fork: fine
    check_shared(torch.tensor([3, 4, 0, 1]), torch.ones(4, dtype=torch.bool))  # plain rows are not checked
    with pytest.raises(ValueError, match="forks past the end"):
        check_shared(torch.tensor([0, 1, 2, 5, 6]), torch.zeros(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="shared prefix holds loss tokens"):
        loss = torch.zeros(6, dtype=torch.bool)
        loss[1] = True
        check_shared(torch.tensor([0, 1, 2, 3, 2, 3]), loss)
    with pytest.raises(ValueError, match="start at position 0"):
        check_shared(torch.tensor([1, 2, 3, 2, 3]), torch.zeros(5, dtype=torch.bool))
