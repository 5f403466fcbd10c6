"""The collapse watch: which per-step series look like collapse, and one warning per run."""

import json

from asyncrl.launcher.tailer import StepTailer
from asyncrl.launcher.watch import CollapseWatch, signs_of_collapse

STEADY = [0.3 + 0.005 * i for i in range(40)]


def test_a_rising_run_shows_nothing():
    assert signs_of_collapse(STEADY, [10.0] * 40, [0.8] * 40) == []


def test_reward_falling_from_its_best():
    rewards = [0.2] * 10 + [0.5] * 15 + [0.2] * 10
    (sign,) = signs_of_collapse(rewards, [], [])
    assert "reward fell from its best 10-step mean 0.500 to 0.200" in sign
    assert signs_of_collapse([0.01] * 10 + [0.0] * 20, [], []) == []  # nothing was ever earned: no "fall"


def test_length_and_entropy_running_away():
    signs = signs_of_collapse(STEADY, [10.0] * 20 + [16.0] * 10, [0.5] * 20 + [0.9] * 10)
    assert any("completions are 1.6x" in s for s in signs) and any("entropy is 1.8x" in s for s in signs)
    assert signs_of_collapse(STEADY[:15], [10.0] * 5 + [30.0] * 10, []) == []  # too early to tell


def test_steps_with_one_reward_for_every_rollout_are_no_signal_at_once():
    rewards, stds = [0.94, 0.81, 0.55, 0.0, 0.0, 0.0], [0.19, 0.3, 0.45, 0.0, 0.0, 0.0]  # tool-calc lr1-k0x-s2's shape
    (sign,) = signs_of_collapse(rewards, [], [], stds)
    assert "every rollout of the last 3 steps earned the same reward (0.000" in sign and "0.940" in sign
    assert signs_of_collapse(rewards[:-1], [], [], stds[:-1]) == []  # two such steps: not yet
    assert signs_of_collapse([0.5, 1.0, 1.0, 1.0], [], [], [0.4, 0.0, 0.0, 0.0]) == []  # all solved: nothing to learn
    assert signs_of_collapse([0.0] * 5, [], [], [0.0] * 5) == []  # nothing was ever earned: no fall
    assert signs_of_collapse(rewards, [], []) == []  # rows without a std: the sign is not judged


def test_the_watch_reads_each_steps_reward_std(tmp_path):
    watch = CollapseWatch(tmp_path / "trainer.jsonl")
    for i, (r, sd) in enumerate([(0.9, 0.2), (0.0, 0.0), (0.0, 0.0)]):
        watch.observe({"step": i, "reward/mean": r, "reward/std": sd})
        assert watch.check() is None
    watch.observe({"step": 3, "reward/mean": 0.0, "reward/std": 0.0})
    line = watch.check()
    assert line.startswith("[rl] step 3: signs of collapse: every rollout") and "trainer.optim.lr" in line
    assert watch.check() is None  # once per run
    gap = CollapseWatch(tmp_path / "trainer.jsonl")
    for i, row in enumerate([(0.9, 0.2), (0.0, 0.0), (0.0, None), (0.0, 0.0), (0.0, 0.0)]):
        gap.observe({"step": i, "reward/mean": row[0], **({"reward/std": row[1]} if row[1] is not None else {})})
    assert gap.check() is None  # a step without a std breaks the run of one-reward steps


def test_rl_warns_once_naming_the_knobs(tmp_path, capsys):
    orch, trainer = tmp_path / "orchestrator.jsonl", tmp_path / "trainer.jsonl"
    rows = [
        {"kind": "train", "step": i, "reward/mean": r, "completion_len/mean": 8.0}
        for i, r in enumerate([0.2] * 10 + [0.5] * 15 + [0.1] * 15)
    ]
    orch.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer.write_text("".join(json.dumps({"step": i, "entropy": 0.7}) + "\n" for i in range(40)))
    watch = CollapseWatch(trainer)
    tailer = StepTailer(orch, 0, watch=watch)
    from loguru import logger

    seen = []
    handler = logger.add(seen.append, level="WARNING", format="{message}")
    try:
        tailer.poll()
        with open(orch, "a") as f:
            f.write(json.dumps({"kind": "train", "step": 40, "reward/mean": 0.1, "completion_len/mean": 8.0}) + "\n")
        tailer.poll()
    finally:
        logger.remove(handler)
    assert len(seen) == 1
    assert "signs of collapse" in seen[0] and "trainer.optim.lr" in seen[0] and "trainer.loss.type = 'grpo'" in seen[0]
