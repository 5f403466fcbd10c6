import random

import pytest
import torch
from orch_fakes import fake_output

from asyncrl.orchestrator.packing import PackItem, first_fit_decreasing, pack, shared_prefix
from asyncrl.orchestrator.samples import TokenSample, TrajectoryConverter
from asyncrl.transport.prefix import check_shared, segments


def _sample(n_prompt: int, n_completion: int, base: int) -> TokenSample:
    ids = [base + i for i in range(n_prompt + n_completion)]
    return TokenSample(
        ids,
        [False] * n_prompt + [True] * n_completion,
        [0.0] * n_prompt + [-0.1 * (i + 1) for i in range(n_completion)],
    )


def _split_row(mb):
    """Recover the samples of one row from position ids restarting at 0."""
    starts = (mb.position_ids == 0).nonzero().flatten().tolist() + [len(mb.position_ids)]
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
    assert stats.num_tokens == sum(len(s) for s in samples) == sum(len(r.input_ids) for r in rows)
    seen = []
    for mb in rows:
        mb.check()
        assert len(mb.input_ids) <= 16
        assert mb.loss_mask.dtype == torch.bool and mb.input_ids.dtype == torch.long
        assert (mb.inference_logprobs[~mb.loss_mask] == 0).all()
        assert mb.temperatures == pytest.approx(0.7)
        for sl in _split_row(mb):
            ids = mb.input_ids[sl].tolist()
            k = next(i for i, s in enumerate(samples) if s.input_ids == ids)
            seen.append(k)
            assert mb.position_ids[sl].tolist() == list(range(len(ids)))
            assert mb.loss_mask[sl].tolist() == samples[k].loss_mask
            assert mb.inference_logprobs[sl].tolist() == pytest.approx(samples[k].logprobs)
            assert mb.advantages[sl] == pytest.approx(0.1 * k)
    assert sorted(seen) == list(range(6))


def test_overlong_samples_are_truncated_and_counted():
    items = [PackItem(_sample(5, 30, 0), 1.0, 1.0), PackItem(_sample(2, 2, 500), -1.0, 1.0)]
    per_rank, stats = pack(items, seq_len=16, num_ranks=1)
    assert stats.num_truncated == 1
    lengths = sorted(len(mb.input_ids) for mb in per_rank[0])
    assert max(lengths) <= 16 and sum(lengths) == 16 + 4
    first = next(mb for mb in per_rank[0] if mb.input_ids[0] == 0)
    assert first.input_ids[:16].tolist() == list(range(16))


@pytest.mark.parametrize("num_samples,num_ranks", [(1, 2), (5, 2), (7, 4), (16, 3), (2, 8)])
def test_equal_micro_batch_counts_with_masked_dummies(num_samples, num_ranks):
    rng = random.Random(num_samples)
    items = [PackItem(_sample(rng.randint(1, 6), rng.randint(1, 9), 50 * i), 0.5, 1.0) for i in range(num_samples)]
    per_rank, stats = pack(items, seq_len=16, num_ranks=num_ranks)
    counts = {len(mbs) for mbs in per_rank}
    assert len(counts) == 1 and counts.pop() >= 1
    real = [mb for mbs in per_rank for mb in mbs if mb.loss_mask.any()]
    dummies = [mb for mbs in per_rank for mb in mbs if not mb.loss_mask.any()]
    assert len(real) == stats.num_rows and len(dummies) == stats.num_dummies
    for mb in dummies:
        mb.check()
        assert (mb.advantages == 0).all() and (mb.inference_logprobs == 0).all()
    assert sum(mb.loss_mask.sum().item() for mb in real) == stats.num_loss_tokens


def test_rows_are_balanced_across_ranks():
    items = [PackItem(_sample(4, 12, 100 * i), 1.0, 1.0) for i in range(8)]  # 8 rows of 16
    per_rank, _ = pack(items, seq_len=16, num_ranks=4)
    assert [sum(len(mb.input_ids) for mb in mbs) for mbs in per_rank] == [32, 32, 32, 32]


def test_empty_batch_still_gives_every_rank_a_dummy():
    per_rank, stats = pack([], seq_len=16, num_ranks=2)
    assert [len(m) for m in per_rank] == [1, 1] and stats.num_dummies == 2
    assert not any(mb.loss_mask.any() for mbs in per_rank for mb in mbs)


# ---------------------------------------------------------------- shared prefixes


def _group_items(gid: int, prompt: list[int], completions: list[list[int]], advantages=None, temperature=1.0):
    """A rollout group: one sample per completion, all after the same prompt."""
    items = []
    for k, c in enumerate(completions):
        sample = TokenSample(
            prompt + c, [False] * len(prompt) + [True] * len(c), [0.0] * len(prompt) + [-0.01 * t for t in c]
        )
        adv = advantages[k] if advantages else 0.1 * k - 0.3
        items.append(PackItem(sample, adv, temperature, group=gid))
    return items


def _random_groups(rng: random.Random, num_groups: int, max_prompt: int = 20, max_completion: int = 12):
    items = []
    for g in range(num_groups):
        prompt = [1000 * (g + 1)] + [rng.randint(0, 50) for _ in range(rng.randint(0, max_prompt - 1))]
        completions = [
            [rng.randint(0, 3) for _ in range(rng.randint(1, max_completion))] for _ in range(rng.randint(1, 8))
        ]
        items += _group_items(g, prompt, completions)
    return items


def _samples(rows) -> list[tuple]:
    """Every sample of the rows (expanded to unshared form) with its per-token fields, sorted.

    Advantages count on loss tokens only: a shared prompt token carries the group's first sample's advantage."""
    out = []
    for mb in rows:
        plain = mb.expanded()
        for sl in _split_row(plain):
            loss = plain.loss_mask[sl]
            out.append(
                (
                    tuple(plain.input_ids[sl].tolist()),
                    tuple(loss.tolist()),
                    tuple(plain.inference_logprobs[sl].tolist()),
                    tuple(plain.temperatures[sl].tolist()),
                    tuple((plain.advantages[sl] * loss).tolist()),
                )
            )
    return sorted(out)


def _real_rows(per_rank):
    return [mb for mbs in per_rank for mb in mbs if mb.loss_mask.any()]


def _check_rows(per_rank, seq_len):
    assert len({len(mbs) for mbs in per_rank}) == 1
    for mbs in per_rank:
        for mb in mbs:
            mb.check()
            check_shared(mb.position_ids, mb.loss_mask)
            assert len(mb.input_ids) <= seq_len
            assert (mb.inference_logprobs[~mb.loss_mask] == 0).all()


@pytest.mark.parametrize("seed,seq_len,num_ranks", [(0, 64, 1), (1, 64, 3), (2, 32, 2), (3, 128, 4), (4, 24, 1)])
def test_shared_rows_expand_to_exactly_the_plain_samples(seed, seq_len, num_ranks):
    items = _random_groups(random.Random(seed), num_groups=12)
    shared, stats = pack(items, seq_len, num_ranks, share=True)
    plain, plain_stats = pack(items, seq_len, num_ranks, share=False)
    _check_rows(shared, seq_len)
    assert _samples(_real_rows(shared)) == _samples(_real_rows(plain))
    # every sample is its own segment: no continuation starts at the previous position + 1 (or at 0)
    assert sum(segments(mb.position_ids).num_samples for mb in _real_rows(shared)) == len(items)
    assert stats.num_tokens == sum(len(mb.input_ids) for mb in _real_rows(shared))
    assert stats.num_tokens_unshared == plain_stats.num_tokens == plain_stats.num_tokens_unshared
    assert stats.num_tokens < stats.num_tokens_unshared
    assert stats.num_loss_tokens == plain_stats.num_loss_tokens and stats.num_samples == len(items)
    assert any(segments(mb.position_ids).shared for mb in _real_rows(shared))


def test_a_group_is_its_prompt_once_then_each_continuation():
    prompt = [7, 8, 9, 10]
    items = _group_items(0, prompt, [[1, 2], [3], [1, 5, 6]], advantages=[0.5, -1.0, 0.25], temperature=0.7)
    (rows,), stats = pack(items, seq_len=32, num_ranks=1, share=True)
    (mb,) = rows
    assert mb.input_ids.tolist() == [7, 8, 9, 10, 1, 2, 3, 1, 5, 6]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 4, 4, 5, 6]
    assert mb.loss_mask.tolist() == [False] * 4 + [True] * 6
    assert mb.advantages.tolist() == [0.5] * 6 + [-1.0] + [0.25] * 3
    assert mb.temperatures.tolist() == pytest.approx([0.7] * 10)
    assert (stats.num_tokens, stats.num_tokens_unshared) == (10, 18)


def test_groups_never_split_across_ranks_and_ranks_get_equal_counts():
    items = _random_groups(random.Random(7), num_groups=10, max_prompt=10, max_completion=6)
    per_rank, stats = pack(items, seq_len=64, num_ranks=3, share=True)
    _check_rows(per_rank, 64)
    assert stats.num_dummies == sum(len(mbs) for mbs in per_rank) - stats.num_rows
    rank_of: dict[int, set[int]] = {}
    for rank, mbs in enumerate(per_rank):
        for mb in _real_rows([mbs]):
            for tok in mb.input_ids.tolist():
                if tok >= 1000:  # each group's prompt starts with its own marker token
                    rank_of.setdefault(tok // 1000 - 1, set()).add(rank)
    assert len(rank_of) == 10 and all(len(ranks) == 1 for ranks in rank_of.values())


def test_a_group_longer_than_seq_len_splits_into_units_repeating_the_prompt():
    prompt = list(range(100, 110))
    items = _group_items(0, prompt, [[k] * 6 for k in range(6)])  # one unit would be 10 + 6 * 6 = 46
    per_rank, stats = pack(items, seq_len=32, num_ranks=1, share=True)
    _check_rows(per_rank, 32)
    rows = _real_rows(per_rank)
    assert len(rows) == 2 and stats.num_tokens == 2 * (10 + 3 * 6)
    for mb in rows:
        assert mb.input_ids[:10].tolist() == prompt
        assert mb.position_ids.tolist() == list(range(16)) + list(range(10, 16)) * 2
    assert _samples(rows) == _samples(_real_rows(pack(items, 32, 1)[0]))


def test_overlong_samples_are_truncated_and_packed_plain_while_the_rest_share():
    prompt = [5, 6, 7, 8]
    items = _group_items(0, prompt, [[1] * 40, [2, 2], [3, 3, 3]])
    per_rank, stats = pack(items, seq_len=16, num_ranks=1, share=True)
    _check_rows(per_rank, 16)
    assert stats.num_truncated == 1 and stats.num_tokens == 16 + 4 + 2 + 3
    cut = next(mb for mb in per_rank[0] if len(mb.input_ids) == 16)
    assert cut.position_ids.tolist() == list(range(16)) and cut.input_ids[4:].tolist() == [1] * 12
    assert _samples(per_rank[0]) == _samples(pack(items, 16, 1)[0][0])


def test_nothing_is_shared_when_samples_differ_at_the_first_token():
    items = [
        PackItem(TokenSample([1, 2, 3, 4], [False, False, True, True], [0.0, 0.0, -1.0, -1.0]), 1.0, 1.0, 0),
        PackItem(TokenSample([9, 2, 3, 4], [False, False, True, True], [0.0, 0.0, -1.0, -1.0]), 1.0, 1.0, 0),
    ]
    shared, stats = pack(items, 16, 1, share=True)
    assert stats.num_tokens == stats.num_tokens_unshared == 8
    assert not segments(shared[0][0].position_ids).shared


def test_a_common_prefix_is_cut_before_any_samples_loss_token():
    # identical ids, but sample 2 trains on token 3: only tokens 0-2 may be shared
    a = TokenSample([1, 2, 3, 4, 5, 6], [False] * 4 + [True] * 2, [0.0] * 4 + [-1.0] * 2)
    b = TokenSample([1, 2, 3, 4, 5, 7], [False] * 3 + [True] * 3, [0.0] * 3 + [-1.0] * 3)
    items = [PackItem(a, 1.0, 1.0, 0), PackItem(b, -1.0, 1.0, 0)]
    assert shared_prefix([a, b]) == 3
    (rows,), stats = pack(items, 16, 1, share=True)
    assert rows[0].position_ids.tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 5]
    check_shared(rows[0].position_ids, rows[0].loss_mask)
    assert _samples(rows) == _samples(pack(items, 16, 1)[0][0])


def test_samples_with_nothing_after_the_prompt_go_plain():
    items = _group_items(0, [4, 5, 6], [[], [1], [2, 2], []])
    per_rank, stats = pack(items, 32, 1, share=True)
    _check_rows(per_rank, 32)
    assert stats.num_tokens == 3 + 1 + 2 + 3 + 3
    assert _samples(per_rank[0]) == _samples(pack(items, 32, 1)[0][0])


def test_only_samples_of_one_temperature_share():
    items = _group_items(0, [4, 5, 6], [[1], [2]], temperature=1.0) + _group_items(0, [4, 5, 6], [[3]], temperature=0.5)
    per_rank, stats = pack(items, 32, 1, share=True)
    assert stats.num_tokens == 5 + 4
    assert _samples(per_rank[0]) == _samples(pack(items, 32, 1)[0][0])


def test_without_share_the_rows_are_the_plain_packing():
    items = _random_groups(random.Random(3), num_groups=6)
    ungrouped = [PackItem(it.sample, it.advantage, it.temperature) for it in items]
    for a, b in [
        (pack(items, 64, 2), pack(ungrouped, 64, 2)),
        (pack(ungrouped, 64, 2, share=True), pack(items, 64, 2)),
    ]:
        assert a[1] == b[1] and a[1].num_tokens == a[1].num_tokens_unshared
        for mbs_a, mbs_b in zip(a[0], b[0], strict=True):
            for x, y in zip(mbs_a, mbs_b, strict=True):
                wire_x, wire_y = x.to_wire(), y.to_wire()
                assert wire_x.keys() == wire_y.keys() and all(torch.equal(wire_x[k], wire_y[k]) for k in wire_x)
                assert not segments(x.position_ids).shared


def _converted(strategy: str, turns_per_rollout: list[list[tuple[list[int], list[int]]]]) -> list[PackItem]:
    converter = TrajectoryConverter(strategy)
    items = []
    for k, turns in enumerate(turns_per_rollout):
        rollout = converter.convert(fake_output(0, float(k), turns), "env")
        items += [PackItem(s, 0.5 - k, 1.0, group=0) for s in rollout.samples]
    return items


def _two_turns(first_completion: list[int], second_completion: list[int]):
    prompt = [1, 2, 3, 4, 5]
    return [(prompt, first_completion), (prompt + first_completion + [90, 91], second_completion)]


@pytest.mark.parametrize("strategy,num_samples", [("interleaved", 3), ("branching", 6)])
def test_multi_turn_groups_share_their_first_prompt(strategy, num_samples):
    items = _converted(strategy, [_two_turns([10, 11], [20]), _two_turns([12], [21, 22]), _two_turns([10, 13], [23])])
    assert len(items) == num_samples
    assert shared_prefix([it.sample for it in items]) == 5
    per_rank, stats = pack(items, 64, 1, share=True)
    _check_rows(per_rank, 64)
    (mb,) = per_rank[0]
    assert set(segments(mb.position_ids).fork.tolist()) == {0, 5}
    assert stats.num_tokens == stats.num_tokens_unshared - 5 * (num_samples - 1)
    assert _samples(per_rank[0]) == _samples(pack(items, 64, 1)[0][0])


def test_bench_job_shape_trains_at_least_four_times_fewer_tokens(tmp_path):
    from asyncrl.config import bench as job
    from asyncrl.utils.tiny_model import build_tokenizer

    tok = build_tokenizer(tmp_path)
    rng = random.Random(0)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    items = []
    for g in range(job.PROMPTS):
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(job.MIN_LEN, job.MAX_LEN)))
        messages = [{"role": "system", "content": job.SYSTEM_PROMPT}, {"role": "user", "content": word}]
        prompt = list(
            tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        )
        completions = [tok.encode(word[::-1]) + [end]] * job.ROLLOUTS  # the answer the warmed model learns
        items += _group_items(g, prompt, completions)
    per_rank, stats = pack(items, job.SEQ_LEN, 1, share=True)
    _check_rows(per_rank, job.SEQ_LEN)
    print(f"bench shape: {stats.num_tokens} tokens/step shared, {stats.num_tokens_unshared} unshared")
    assert stats.num_tokens_unshared >= 4 * stats.num_tokens
