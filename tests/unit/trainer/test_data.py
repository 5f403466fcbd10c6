"""How the trainer consumes packed batches: per-rank reads, sample boundaries, rank-count checks, fake data."""

from dataclasses import replace

import pytest
import torch

from asyncrl.config.base import FakeDataConfig
from asyncrl.core.errors import UserError
from asyncrl.trainer.rl.data import FakeSource, RolloutSource, prepare
from asyncrl.transport.batch import write_batch
from asyncrl.transport.layout import RunLayout
from asyncrl.transport.row import Row


def row(lengths: list[int], fill: int = 0) -> Row:
    n = sum(lengths)
    pos = torch.cat([torch.arange(k) for k in lengths])
    return Row(
        input_ids=torch.full((n,), fill, dtype=torch.int64),
        position_ids=pos,
        loss_mask=pos > 0,
        advantages=torch.ones(n),
        inference_logprobs=torch.zeros(n),
        temperatures=torch.ones(n),
    )


def test_prepare_marks_sample_boundaries():
    r = prepare(row([3, 1, 4]), torch.device("cpu"))
    assert r.num_samples == 3
    assert r.sample_ids.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert r.sample_lengths.tolist() == [3, 1, 4]
    assert r.loss_mask.dtype == torch.bool and r.input_ids.dtype == torch.int64


def test_each_rank_reads_its_own_micro_batches(tmp_path):
    layout = RunLayout(tmp_path)
    write_batch(layout, 3, [[row([2, 2], fill=1), row([4], fill=2)], [row([3], fill=3), row([1, 1], fill=4)]])
    r0 = RolloutSource(layout, 0, 2, timeout=1).get(3)
    r1 = RolloutSource(layout, 1, 2, timeout=1).get(3)
    assert [int(mb.input_ids[0]) for mb in r0] == [1, 2]
    assert [int(mb.input_ids[0]) for mb in r1] == [3, 4]


def test_a_batch_for_another_rank_count_is_read_whole(tmp_path, caplog_loguru):
    write_batch(RunLayout(tmp_path), 0, [[row([2])], [row([3])]])
    assert [len(mb.input_ids) for mb in RolloutSource(RunLayout(tmp_path), 0, 1, timeout=1).get(0)] == [3, 2]
    assert any("packed for 2 trainer rank(s), this trainer runs 1" in m for m in caplog_loguru)


def test_missing_batch_times_out_with_hint(tmp_path):
    with pytest.raises(UserError, match="orchestrator"):
        RolloutSource(RunLayout(tmp_path), 0, 1, timeout=0.1).get(0)


def test_fake_source_shape_and_split():
    cfg = FakeDataConfig(batch_size=8, samples_per_row=2, seq_len=16)
    rows = FakeSource(cfg, vocab_size=100, rank=1, world_size=2, seed=0).get(0)
    assert len(rows) == 2  # 4 micro-batches over 2 ranks
    r = prepare(rows[0], torch.device("cpu"))
    assert r.input_ids.numel() == 32 and r.num_samples == 2 and int(r.input_ids.max()) < 100
    assert torch.equal(rows[0].input_ids, FakeSource(cfg, 100, 1, 2, 0).get(0)[0].input_ids)  # deterministic
    with pytest.raises(UserError, match="not divisible by 3"):
        FakeSource(cfg, 100, 0, 3, 0)


def test_rows_longer_than_trainer_seq_len_are_refused():
    from asyncrl.trainer.rl.data import check_seq_len

    rows = [row([3, 2]), row([4])]
    assert check_seq_len(rows, None, 0) is rows and check_seq_len(rows, 5, 0) is rows
    with pytest.raises(UserError, match=r"step 7: a packed row of 5 tokens is longer than trainer.data.seq_len \(4\)"):
        check_seq_len(rows, 4, 7)


def test_a_batch_packed_for_another_rank_count_is_dealt_out_again():
    from asyncrl.trainer.rl.data import deal_rows

    filler = replace(row([3]), loss_mask=torch.zeros(3, dtype=torch.bool))  # the packer's: dropped
    packed_for_one = [row([9]), row([5]), row([7]), filler]
    ranks = [deal_rows(packed_for_one, 2, r) for r in range(2)]
    assert [[len(mb.input_ids) for mb in mbs] for mbs in ranks] == [[9, 5], [7, 5]]  # as many per rank
    assert not ranks[1][1].loss_mask.any() and not ranks[1][1].advantages.any()  # a masked copy
    assert sum(int(mb.loss_mask.sum()) for mbs in ranks for mb in mbs) == 8 + 4 + 6  # every real token, once
    assert len(deal_rows(packed_for_one, 1, 0)) == 3


def with_targets(mb: Row, width: int, mass: float = 1.0) -> Row:
    n = len(mb.input_ids)
    ids = torch.arange(n * width).view(n, width) % 7
    targets = torch.where(mb.loss_mask[:, None], torch.full((n, width), mass), 0.0)
    return replace(mb, teacher_ids=ids, teacher_targets=targets)


def test_forward_kl_targets_travel_through_stacking_padding_and_concatenation():
    """Rows with targets of widths 2 and 3 and one without: joined at width 3, padding and the missing row mass 0."""
    from asyncrl.trainer.rl.data import micro_batches

    rows = [prepare(mb, torch.device("cpu")) for mb in (with_targets(row([5]), 2), with_targets(row([3]), 3), row([2]))]
    stacked, joined = micro_batches(rows, 3, stack=True)[0], micro_batches(rows, 3, stack=False)[0]
    assert stacked.teacher_ids.shape == (3, 5, 3) and joined.teacher_targets.shape == (1, 10, 3)
    mass = stacked.teacher_targets.sum(-1)
    assert mass.tolist() == [[0, 2, 2, 2, 2], [0, 3, 3, 0, 0], [0, 0, 0, 0, 0]]
    assert joined.teacher_targets.sum().item() == mass.sum().item()
    assert micro_batches([rows[2]], 1)[0].teacher_ids is None  # no targets anywhere: no term


def test_a_filler_copy_has_no_teacher_mass():
    from asyncrl.trainer.rl.data import deal_rows

    dealt = deal_rows([with_targets(row([4]), 2)], 2, 1)
    assert dealt[0].teacher_ids.shape == (4, 2) and not dealt[0].teacher_targets.any()


def test_the_trainer_refuses_a_batch_older_than_its_async_bound_and_logs_its_staleness(tmp_path):
    """Issue 47: each sample's policy stamp (its group's) travels in the batch's meta; a batch holding a sample
    more than max_async_level steps behind is refused in one line, before anything trains on it."""
    layout = RunLayout(tmp_path)
    write_batch(layout, 5, [[row([2, 2])]], {"min_policy_step": 3, "staleness": {"1": 6, "2": 2}})
    source = RolloutSource(layout, 0, 1, timeout=1, max_async_level=2)
    assert len(source.get(5)) == 1
    assert source.stamps == {"off_policy/mean": 1.25, "off_policy/max": 2.0}
    write_batch(layout, 6, [[row([2, 2])]], {"min_policy_step": 3, "staleness": {"0": 7, "3": 1}})
    with pytest.raises(UserError) as refused:
        source.get(6)
    said = str(refused.value)
    assert "\n" not in said
    assert said.startswith("rollout batch of step 6 holds 1 samples of policy step 3, 3 steps behind: more than ")
    assert "max_async_level = 2" in said
    write_batch(layout, 7, [[row([2, 2])]])  # written before stamps: read, no staleness
    assert len(source.get(7)) == 1 and source.stamps == {}
