"""An MoE's routing record from the engine's answer to the packed row: one row per token, nothing shifted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.orchestrator.envs.v1 import branch_turn
from asyncrl.orchestrator.packing import PackItem, pack
from asyncrl.orchestrator.samples import TrajectoryConverter, TrajectoryError, _step_tokens
from asyncrl.transport.row import Row


def record(tokens: list[int]) -> np.ndarray:
    """A record whose every row names its token (token % 8 in each layer and slot): alignment is checkable."""
    return np.array([[[t % 8, (t + 1) % 8]] * 2 for t in tokens], dtype=np.uint8)


def item(prompt: list[int], completion: list[int], group: int | None = None) -> PackItem:
    ids = prompt + completion
    step = {"prompt_ids": prompt, "completion_ids": completion, "completion_mask": [1] * len(completion)}
    step |= {"completion_logprobs": [-1.0] * len(completion), "is_truncated": False, "routed_experts": record(ids)}
    converted = TrajectoryConverter().convert({"reward": 1.0, "trajectory": [{"tokens": step}]}, "env")
    return PackItem(converted.samples[0], 1.0, 1.0, group)


def assert_aligned(r: Row) -> None:
    assert r.routed_experts is not None and r.routed_experts.dtype == torch.uint8
    assert torch.equal(r.routed_experts[:, 0, 0].long(), r.input_ids % 8)


@pytest.mark.parametrize("share", [False, True])
def test_packed_rows_carry_each_tokens_record(share):
    prompt = [11, 12, 13, 14]
    items = [item(prompt, [20 + i, 30 + i, 40 + i], group=0) for i in range(3)] + [item([5, 6], [7, 9, 10])]
    per_rank, stats = pack(items, seq_len=32, share=share)
    rows = [r for mbs in per_rank for r in mbs]
    for r in rows:
        r.check()
        assert_aligned(r)
    assert stats.num_tokens == (18 if share else 26)  # shared: the group's prompt written once


def test_a_truncated_sample_keeps_the_record_of_its_kept_tokens():
    (rows,), stats = pack([item([1, 2, 3], list(range(40, 60)))], seq_len=10)
    assert stats.num_truncated == 1 and rows[0].routed_experts.shape == (10, 2, 2)
    assert_aligned(rows[0])


def test_a_row_with_a_sample_without_its_record_carries_none():
    plain = item([1, 2], [3, 4])
    plain.sample.routes = None
    (rows,), _ = pack([item([1, 2], [5, 6]), plain], seq_len=32)
    assert rows[0].routed_experts is None


def test_a_turn_whose_record_does_not_cover_its_tokens_is_an_error():
    tokens = {"prompt_ids": [1, 2], "completion_ids": [3], "completion_logprobs": [-1.0], "routed_experts": record([1])}
    with pytest.raises(TrajectoryError, match="turn has 3 tokens but a routing record of 1"):
        _step_tokens({"tokens": tokens})


def test_a_v1_branch_hands_its_record_to_the_turn():
    class Branch:
        token_ids, sampled_mask, logprobs = [1, 2, 3], [0, 1, 1], [0.0, -1.0, -2.0]
        routed_experts = record([1, 2, 3])

    turn = _step_tokens(branch_turn(Branch()))
    assert turn["routed_experts"] is Branch.routed_experts and turn["prompt_ids"] == [1]
