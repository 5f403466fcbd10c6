import random

import pytest
import torch

from asyncrl.orchestrator.packing import PackItem, first_fit_decreasing, pack
from asyncrl.orchestrator.samples import TokenSample
from asyncrl.transport.batch import check_micro_batch


def _sample(n_prompt: int, n_completion: int, base: int) -> TokenSample:
    ids = [base + i for i in range(n_prompt + n_completion)]
    return TokenSample(
        ids,
        [False] * n_prompt + [True] * n_completion,
        [0.0] * n_prompt + [-0.1 * (i + 1) for i in range(n_completion)],
    )


def _split_row(mb):
    """Recover the samples of one row from position ids restarting at 0."""
    starts = (mb["position_ids"] == 0).nonzero().flatten().tolist() + [len(mb["position_ids"])]
    return [slice(a, b) for a, b in zip(starts, starts[1:])]


def test_ffd_respects_capacity_and_places_everything():
    rng = random.Random(0)
    lengths = [rng.randint(1, 64) for _ in range(200)]
    bins = first_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(200))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert len(bins) <= -(-sum(lengths) // 64) * 11 // 9 + 1  # FFD's bound: 11/9 OPT + 1
    with pytest.raises(ValueError):
        first_fit_decreasing([65], 64)


def test_rows_keep_sample_boundaries_masks_and_values():
    samples = [_sample(3, 4, 100 * k) for k in range(1, 6)] + [_sample(10, 2, 1000)]
    items = [PackItem(s, advantage=0.1 * k, temperature=0.7) for k, s in enumerate(samples)]
    per_rank, stats = pack(items, seq_len=16, num_ranks=1)
    rows = per_rank[0]
    assert stats.num_samples == 6 and stats.num_truncated == 0 and stats.num_dummies == 0
    assert stats.num_tokens == sum(len(s) for s in samples) == sum(len(r["input_ids"]) for r in rows)
    seen = []
    for mb in rows:
        check_micro_batch(mb)
        assert len(mb["input_ids"]) <= 16
        assert mb["loss_mask"].dtype == torch.bool and mb["input_ids"].dtype == torch.long
        assert (mb["inference_logprobs"][~mb["loss_mask"]] == 0).all()
        assert mb["temperatures"] == pytest.approx(0.7)
        for sl in _split_row(mb):
            ids = mb["input_ids"][sl].tolist()
            k = next(i for i, s in enumerate(samples) if s.input_ids == ids)
            seen.append(k)
            assert mb["position_ids"][sl].tolist() == list(range(len(ids)))
            assert mb["loss_mask"][sl].tolist() == samples[k].loss_mask
            assert mb["inference_logprobs"][sl].tolist() == pytest.approx(samples[k].logprobs)
            assert mb["advantages"][sl] == pytest.approx(0.1 * k)
    assert sorted(seen) == list(range(6))


def test_overlong_samples_are_truncated_and_counted():
    items = [PackItem(_sample(5, 30, 0), 1.0, 1.0), PackItem(_sample(2, 2, 500), -1.0, 1.0)]
    per_rank, stats = pack(items, seq_len=16, num_ranks=1)
    assert stats.num_truncated == 1
    lengths = sorted(len(mb["input_ids"]) for mb in per_rank[0])
    assert max(lengths) <= 16 and sum(lengths) == 16 + 4
    first = next(mb for mb in per_rank[0] if mb["input_ids"][0] == 0)
    assert first["input_ids"][:16].tolist() == list(range(16))


@pytest.mark.parametrize("num_samples,num_ranks", [(1, 2), (5, 2), (7, 4), (16, 3), (2, 8)])
def test_equal_micro_batch_counts_with_masked_dummies(num_samples, num_ranks):
    rng = random.Random(num_samples)
    items = [PackItem(_sample(rng.randint(1, 6), rng.randint(1, 9), 50 * i), 0.5, 1.0) for i in range(num_samples)]
    per_rank, stats = pack(items, seq_len=16, num_ranks=num_ranks)
    counts = {len(mbs) for mbs in per_rank}
    assert len(counts) == 1 and counts.pop() >= 1
    real = [mb for mbs in per_rank for mb in mbs if mb["loss_mask"].any()]
    dummies = [mb for mbs in per_rank for mb in mbs if not mb["loss_mask"].any()]
    assert len(real) == stats.num_rows and len(dummies) == stats.num_dummies
    for mb in dummies:
        check_micro_batch(mb)
        assert (mb["advantages"] == 0).all() and (mb["inference_logprobs"] == 0).all()
    assert sum(mb["loss_mask"].sum().item() for mb in real) == stats.num_loss_tokens


def test_rows_are_balanced_across_ranks():
    items = [PackItem(_sample(4, 12, 100 * i), 1.0, 1.0) for i in range(8)]  # 8 rows of 16
    per_rank, _ = pack(items, seq_len=16, num_ranks=4)
    assert [sum(len(mb["input_ids"]) for mb in mbs) for mbs in per_rank] == [32, 32, 32, 32]


def test_empty_batch_still_gives_every_rank_a_dummy():
    per_rank, stats = pack([], seq_len=16, num_ranks=2)
    assert [len(m) for m in per_rank] == [1, 1] and stats.num_dummies == 2
    assert not any(mb["loss_mask"].any() for mbs in per_rank for mb in mbs)
