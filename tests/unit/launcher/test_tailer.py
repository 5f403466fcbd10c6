"""The `rl` console: one line per training step from the orchestrator's metrics, then a summary."""

import json

from asyncrl.launcher.tailer import StepTailer


def test_one_line_per_whole_training_row_then_summary(tmp_path, capsys):
    path = tmp_path / "metrics" / "orchestrator.jsonl"
    tailer = StepTailer(path, 0)
    tailer.poll()  # no file yet
    path.parent.mkdir()
    rows = [
        {"step": 0, "reward/mean": 0.25, "off_policy/level": 0, "metrics/a/exact_match": 0.5},
        {"kind": "eval", "step": 0, "reward/mean": 0.9},
        {"step": 1, "reward/mean": 0.5, "metrics/a/exact_match": 1.0, "metrics/b/exact_match": 0.0},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n" + '{"step": 2, "rew')
    tailer.poll()
    with open(path, "a") as f:
        f.write('ard/mean": 0.75, "off_policy/level": 1}\n')
    tailer.poll()
    assert capsys.readouterr().out.splitlines() == [
        "[rl] step    0  reward 0.250  exact_match 0.500  off-policy 0",
        "[rl] step    1  reward 0.500  exact_match 1.000  exact_match 0.000  off-policy ?",
        "[rl] step    2  reward 0.750  off-policy 1",
    ]
    assert tailer.summary(12.3, tmp_path / "weights") == (
        f"[rl] done: 3 steps in 12s; reward 0.250 (first steps) -> 0.750 (last steps); weights in {tmp_path}/weights"
    )
    assert StepTailer(tmp_path / "none.jsonl", 0).summary(5, tmp_path) == "[rl] done in 5s (no reward logged)"


def test_each_step_of_this_run_once_across_a_rewrite(tmp_path, capsys):
    """A resumed run starts at step 2: the earlier run's rows before it are not this run's; a process that
    rewrites the file without the steps it redoes (shorter) makes the tailer read it again, counting nothing twice."""
    path = tmp_path / "orchestrator.jsonl"
    row = lambda step, reward: json.dumps({"step": step, "reward/mean": reward}) + "\n"  # noqa: E731
    path.write_text(row(0, 0.1) + row(1, 0.1))
    tailer = StepTailer(path, 2)
    with open(path, "a") as f:
        f.write(row(2, 0.5) + row(3, 0.6))
    tailer.poll()
    path.write_text(row(0, 0.1) + row(1, 0.1) + row(2, 0.5))  # shorter: step 3 dropped, to be redone
    tailer.poll()
    with open(path, "a") as f:
        f.write(row(3, 0.7) + row(4, 0.8))
    tailer.poll()
    assert [line.split()[2] for line in capsys.readouterr().out.splitlines()] == ["2", "3", "4"]
    assert tailer.summary(1, tmp_path).startswith("[rl] done: 3 steps")
