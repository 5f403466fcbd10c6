import math

import pytest

from asyncrl.config.orchestrator import BufferConfig
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
    assert judge_group(g, BufferConfig(), "mean") == "accept"
    assert [r.advantage for r in g.rollouts[:3]] == pytest.approx([1 / 3, -2 / 3, 1 / 3])
    assert g.rollouts[3].advantage == 0.0 and g.num_errors == 1 and len(g.valid) == 3
    assert judge_group(_group([1.0, 0.0], errors={0, 1}), BufferConfig(), "mean") == "failed"


def test_difficulty_filtering_only_when_enabled():
    on = BufferConfig(online_difficulty_filtering=True)
    assert judge_group(_group([1.0, 1.0, 1.0]), on, "mean") == "too_easy"
    assert judge_group(_group([0.0, 0.0]), on, "mean") == "too_hard"
    assert judge_group(_group([0.0, 1.0]), on, "mean") == "accept"
    # Errors do not count towards "all solved": the valid ones decide.
    assert judge_group(_group([1.0, 0.0], errors={1}), on, "mean") == "too_easy"
    assert judge_group(_group([1.0, 1.0]), BufferConfig(), "mean") == "accept"
    custom = BufferConfig(online_difficulty_filtering=True, easy_threshold=0.8, hard_threshold=0.1)
    assert judge_group(_group([0.9, 0.85]), custom, "mean") == "too_easy"
    g = _group([0.05, 0.1])
    assert judge_group(g, custom, "mean") == "too_hard"
    assert all(math.isfinite(r.advantage) for r in g.rollouts)
