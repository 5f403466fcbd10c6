import math

import pytest

from asyncrl.config.orchestrator import AdvantageConfig, BufferConfig
from asyncrl.orchestrator.advantage import compute_advantages
from asyncrl.orchestrator.filtering import Group, judge_group
from asyncrl.orchestrator.samples import Rollout


def test_mean_advantage_is_reward_minus_group_mean():
    assert compute_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    adv = compute_advantages([0.2, 0.4, 0.9])
    assert sum(adv) == pytest.approx(0.0)
    assert adv[2] == pytest.approx(0.9 - 0.5)


def test_mean_std_normalises():
    adv = compute_advantages([1.0, 0.0, 0.0, 1.0], "mean_std")
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-4)
    assert compute_advantages([0.5, 0.5], "mean_std") == [0.0, 0.0]  # std 0: no blow-up


def test_rloo_uses_the_others_mean():
    r = [1.0, 0.0, 0.5]
    adv = compute_advantages(r, "rloo")
    assert adv[0] == pytest.approx(1.0 - 0.25)
    assert adv[1] == pytest.approx(0.0 - 0.75)
    assert adv[2] == pytest.approx(0.5 - 0.5)


def test_opo_weights_baseline_by_length():
    adv = compute_advantages([1.0, 0.0], "opo", lengths=[3, 1])
    assert adv == pytest.approx([1.0 - 0.75, -0.75])
    with pytest.raises(ValueError):
        compute_advantages([1.0, 0.0], "opo")


def test_single_and_empty_groups():
    assert compute_advantages([0.7]) == [0.0]
    assert compute_advantages([]) == []
    with pytest.raises(ValueError):
        compute_advantages([1.0, 0.0], "nope")  # type: ignore[arg-type]


def _group(rewards, errors=()):
    rs = [
        Rollout(env="e", example_id=0, reward=r, completion_len=2, error=("boom" if i in errors else None))
        for i, r in enumerate(rewards)
    ]
    return Group(env="e", example_id=0, policy_step=0, rollouts=rs)


def test_errored_rollouts_are_masked_and_the_rest_keep_their_advantages():
    g = _group([1.0, 0.0, 1.0, 0.0], errors={3})
    assert judge_group(g, BufferConfig(), AdvantageConfig()) == "accept"
    assert [r.advantage for r in g.rollouts[:3]] == pytest.approx([1 / 3, -2 / 3, 1 / 3])
    assert g.rollouts[3].advantage == 0.0 and g.num_errors == 1 and len(g.valid) == 3
    assert judge_group(_group([1.0, 0.0], errors={0, 1}), BufferConfig(), AdvantageConfig()) == "failed"


def test_difficulty_filtering_only_when_enabled():
    on = BufferConfig(online_difficulty_filtering=True)
    assert judge_group(_group([1.0, 1.0, 1.0]), on, AdvantageConfig()) == "too_easy"
    assert judge_group(_group([0.0, 0.0]), on, AdvantageConfig()) == "too_hard"
    assert judge_group(_group([0.0, 1.0]), on, AdvantageConfig()) == "accept"
    # Errors do not count towards "all solved": the valid ones decide.
    assert judge_group(_group([1.0, 0.0], errors={1}), on, AdvantageConfig()) == "too_easy"
    assert judge_group(_group([1.0, 1.0]), BufferConfig(), AdvantageConfig()) == "accept"
    custom = BufferConfig(online_difficulty_filtering=True, easy_threshold=0.8, hard_threshold=0.1)
    assert judge_group(_group([0.9, 0.85]), custom, AdvantageConfig()) == "too_easy"
    g = _group([0.05, 0.1])
    assert judge_group(g, custom, AdvantageConfig()) == "too_hard"
    assert all(math.isfinite(r.advantage) for r in g.rollouts)


def test_length_penalty_shapes_rewards_within_the_group():
    # mean reward 0.5, longest 10: r' = r - 0.5 * 0.5 * l / 10 = [0.75, 0.875, -0.25, -0.125]
    adv = compute_advantages([1.0, 1.0, 0.0, 0.0], "mean", lengths=[10, 5, 10, 5], length_penalty=0.5)
    assert adv == pytest.approx([0.4375, 0.5625, -0.5625, -0.4375])
    # a group that earned nothing is not pushed toward short answers
    assert compute_advantages([0.0, 0.0], "mean", lengths=[10, 1], length_penalty=0.5) == [0.0, 0.0]
    with pytest.raises(ValueError, match="length"):
        compute_advantages([1.0, 0.0], "mean", length_penalty=0.5)


def test_judge_group_applies_the_length_penalty():
    g = _group([1.0, 1.0])
    g.rollouts[0].completion_len, g.rollouts[1].completion_len = 10, 5
    judge_group(g, BufferConfig(), AdvantageConfig(length_penalty=1.0))
    assert g.rollouts[1].advantage > 0 > g.rollouts[0].advantage
