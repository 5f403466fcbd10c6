"""The `rl` console: one line per training step from the orchestrator's metrics, then a summary."""

import json

from asyncrl.launcher.tailer import StepTailer


def test_one_line_per_whole_training_row_then_summary(tmp_path, capsys):
    path = tmp_path / "metrics" / "orchestrator.jsonl"
    tailer = StepTailer(path)
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
    assert StepTailer(tmp_path / "none.jsonl").summary(5, tmp_path) == "[rl] done in 5s (no reward logged)"


def test_rows_of_an_earlier_run_are_skipped(tmp_path, capsys):
    path = tmp_path / "orchestrator.jsonl"
    path.write_text(json.dumps({"step": 0, "reward/mean": 0.1}) + "\n")
    tailer = StepTailer(path)
    with open(path, "a") as f:
        f.write(json.dumps({"step": 0, "reward/mean": 0.9}) + "\n")
    tailer.poll()
    assert capsys.readouterr().out.splitlines() == ["[rl] step    0  reward 0.900  off-policy ?"]
    assert tailer.summary(1, tmp_path).startswith("[rl] done: 1 steps")
