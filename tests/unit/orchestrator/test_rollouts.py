import asyncio
import json
from collections import Counter

import pytest
from orch_fakes import FakeRunner, fake_mixture
from pydantic import ValidationError

from asyncrl.config.orchestrator import AdvantageConfig, BufferConfig, CurriculumConfig
from asyncrl.core.errors import UserError
from asyncrl.orchestrator.curriculum import DifficultyPools
from asyncrl.orchestrator.envs.mixture import EnvMixture
from asyncrl.orchestrator.rollouts import GroupCollector, RolloutFailure
from asyncrl.orchestrator.samples import TrajectoryConverter


def collector(runner, mixture=None, filtering=False, fail_limit=8, n=4):
    return GroupCollector(
        mixture or fake_mixture(),
        runner,
        TrajectoryConverter(),
        n,
        BufferConfig(online_difficulty_filtering=filtering),
        AdvantageConfig(),
        fail_limit,
    )


def collect(c, problems=4, in_flight=4, step=0, policy=0, k=1):
    return asyncio.run(c.collect(step, policy, k, problems, in_flight, {}))


def test_difficulty_filtering_keeps_filling_the_batch():
    # Even example ids are always solved (too easy), odd ones give mixed rewards.
    runner = FakeRunner(reward_fn=lambda slot, row, i: 1.0 if row["example_id"] % 2 == 0 else float(i % 2))
    got = collect(collector(runner, filtering=True), problems=4, in_flight=4)
    assert len(got.groups) == 4 and all(g.verdict == "accept" for g in got.groups)
    assert all(g.example_id % 2 == 1 for g in got.groups)
    assert got.launched > 4 and got.filler == 0
    assert sum(g.verdict == "too_easy" for g in got.finished) == got.launched - 4 - got.cancelled


def test_without_filtering_all_equal_groups_are_kept_with_zero_advantage():
    got = collect(collector(FakeRunner(reward_fn=lambda *a: 1.0)), problems=3, in_flight=3)
    assert len(got.groups) == 3 and got.launched == 3
    assert all(r.advantage == 0.0 for g in got.groups for r in g.rollouts)


def test_oversampling_cancels_stragglers_and_buffers_extras():
    runner = FakeRunner(delay=0.02)
    c = collector(runner)
    got = collect(c, problems=2, in_flight=6)
    assert len(got.groups) == 2 and got.launched == 6
    assert got.cancelled + len(c.buffer) + 2 == 6 and runner.in_flight == 0
    # Buffered groups are reused by the next step while within the bound ...
    buffered = len(c.buffer)
    if buffered:
        nxt = collect(c, problems=2, in_flight=2, step=1, policy=1, k=1)
        assert nxt.reused == min(buffered, 2)
    # ... and dropped once too stale.
    c.buffer = list(got.groups)
    late = collect(c, problems=2, in_flight=2, step=5, policy=5, k=2)
    assert late.reused == 0 and late.stale_dropped == 2 and all(g.policy_step == 5 for g in late.groups)


def test_errored_rollouts_are_masked_not_fatal():
    runner = FakeRunner(error_fn=lambda slot, row, i: "ModelError(boom)" if i == 0 else None)
    got = collect(collector(runner), problems=3, in_flight=3)
    assert len(got.groups) == 3
    for g in got.groups:
        assert g.num_errors == 1 and len(g.valid) == 3 and g.rollouts[0].advantage == 0.0


def test_exceptions_from_the_runner_fail_the_group_only():
    calls = Counter()

    async def flaky(slot, inputs, args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("env bug")
        return await FakeRunner()(slot, inputs, args)

    got = collect(collector(flaky), problems=2, in_flight=2)
    assert len(got.groups) == 2 and sum(g.verdict == "failed" for g in got.finished) == 1


def test_everything_failing_stops_with_the_cause():
    runner = FakeRunner(error_fn=lambda *a: "ModelError(APIConnectionError: Connection refused)")
    with pytest.raises(RolloutFailure, match="Connection refused"):
        collect(collector(runner, fail_limit=5), problems=2, in_flight=2)


def test_env_ratios_drive_prompt_sampling():
    mixture = fake_mixture(names=("a", "b"), ratios=[3.0, 1.0], n_rows=1000)
    counts = Counter(mixture.draw()[0].name for _ in range(4000))
    assert 0.72 < counts["a"] / 4000 < 0.78
    # Deterministic and resumable: a fresh mixture with the saved state continues identically.
    state = mixture.state()
    nxt = [(s.name, r["example_id"]) for s, r in (mixture.draw() for _ in range(50))]
    again = fake_mixture(names=("a", "b"), ratios=[3.0, 1.0], n_rows=1000)
    again.load_state(state)
    assert [(s.name, r["example_id"]) for s, r in (again.draw() for _ in range(50))] == nxt


def test_each_env_walks_its_prompts_without_repeats_per_epoch():
    mixture = fake_mixture(n_rows=10)
    ids = [mixture.draw()[1]["example_id"] for _ in range(20)]
    assert sorted(ids[:10]) == list(range(10)) and sorted(ids[10:]) == list(range(10))
    assert ids[:10] != ids[10:]  # reshuffled per epoch


# ---------------------------------------------------------------- curriculum (difficulty pools)


def curriculum_mixture(n_rows: int = 40, **cfg) -> EnvMixture:
    mixture = fake_mixture(n_rows=n_rows)
    slot = mixture.slots[0]
    slot.curriculum = DifficultyPools("a", CurriculumConfig(**cfg), [r["example_id"] for r in slot.rows])
    return mixture


def test_curriculum_draws_tasks_by_their_pool():
    """Tasks 0-9 always solved, 10-19 never, 20-39 half the time: once seen, each half-solved one (normal,
    weight 1) is drawn five times as often as each of the others (easy/hard, weight 0.2)."""
    runner = FakeRunner(
        reward_fn=lambda slot, row, i: (
            1.0 if row["example_id"] < 10 else 0.0 if row["example_id"] < 20 else float(i % 2)
        )
    )
    mixture = curriculum_mixture()
    c = collector(runner, mixture)
    for step in range(40):
        collect(c, problems=4, in_flight=4, step=step, policy=step)
    metrics = mixture.metrics()
    assert metrics["curriculum/a/unseen"] == 0.0
    assert metrics == pytest.approx(
        {"curriculum/a/hard": 0.25, "curriculum/a/normal": 0.5, "curriculum/a/easy": 0.25, "curriculum/a/unseen": 0.0}
    )
    drawn = Counter(mixture.draw()[1]["example_id"] for _ in range(3000))
    normal = sum(drawn[i] for i in range(20, 40)) / 3000
    assert 0.80 < normal < 0.87  # 20 x 1.0 / (20 x 1.0 + 20 x 0.2) = 0.83; uniform draws would give 0.5
    assert drawn[0] > 0 and drawn[10] > 0  # easy and hard still drawn, less often


def test_curriculum_resumes_its_draws_and_observations():
    mixture = curriculum_mixture()
    for task in range(0, 40, 3):
        mixture.observe("a", task, 1.0 if task % 2 else 0.5)
    [mixture.draw() for _ in range(7)]
    state = json.loads(json.dumps(mixture.state()))  # what the checkpoint stores
    nxt = [r["example_id"] for _, r in (mixture.draw() for _ in range(50))]
    again = curriculum_mixture()
    again.load_state(state)
    assert [r["example_id"] for _, r in (again.draw() for _ in range(50))] == nxt
    assert again.metrics() == mixture.metrics()


def test_curriculum_pools_and_their_errors():
    pools = DifficultyPools("a", CurriculumConfig(), [0, 1, 2])
    assert [pools.pool(m)[0] for m in (0.0, 0.25, 0.26, 0.75, 0.9, 1.0, 1.5)] == [
        "hard",
        "hard",
        "normal",
        "normal",
        "easy",
        "easy",
        "easy",
    ]
    only_normal = DifficultyPools("a", CurriculumConfig(pools={"all": {"threshold": 1.0, "weight": 0.0}}), [0, 1])
    only_normal.observe(0, 1.0)
    assert only_normal.next_index(0) == 1  # the unseen one (weight 1); task 0's pool has weight 0
    only_normal.observe(1, 0.0)
    with pytest.raises(UserError, match="every task is in a curriculum pool of weight 0"):
        only_normal.next_index(0)
    with pytest.raises(UserError, match="distinct ids"):
        DifficultyPools("a", CurriculumConfig(), [3, 3])
    with pytest.raises(ValidationError):
        CurriculumConfig(pools={})
    with pytest.raises(ValidationError):
        CurriculumConfig(pools={"x": {"threshold": 1.0, "weight": -1}})


def test_failed_groups_are_not_observations():
    mixture = curriculum_mixture(n_rows=4)
    c = collector(FakeRunner(error_fn=lambda *a: "boom"), mixture, fail_limit=100)
    with pytest.raises(RolloutFailure):
        collect(c, problems=2, in_flight=2)
    assert mixture.metrics()["curriculum/a/unseen"] == 1.0
