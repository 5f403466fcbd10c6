"""rl --bench's numbers from synthetic metrics rows: medians, means, warm-up steps, overlap, table, JSON rows."""

from __future__ import annotations

import json

import pytest

from asyncrl.bench import summary
from asyncrl.config import bench as job


def _rows(n: int, gen: float, train: float, pace: float, slow: float = 5.0) -> tuple[list[dict], list[dict]]:
    """n steps every `pace` s, but step 1 ends `slow` s late (a warm-up step)."""
    orch = [
        {"kind": "train", "step": s, "time": 100.0 + s, "time/rollouts": gen + s % 2, "time/update_weights": 0.1}
        | {"reward/mean": s / n, "batch/tokens": 1000 + 10 * s}
        for s in range(n)
    ]
    trainer = [
        {"step": s, "time": 1000.0 + pace * s + (slow if s >= 1 else 0.0), "step_time_s": train, "publish_s": 0.2}
        | {"wait_s": 0.5}
        for s in range(n)
    ]
    return orch, trainer


def test_summarize_medians_means_and_overlap():
    orch, trainer = _rows(10, gen=2.0, train=1.0, pace=2.5)
    s = summary.summarize(orch, trainer, warmup=3)
    assert s["steps"] == 10 and s["warmup_steps"] == 3 and s["measured_steps"] == [3, 9]
    assert s["step_s"] == {"median": pytest.approx(2.5), "mean": pytest.approx(2.5)}  # step 1's 5 s delay is left out
    gens = [2.0 + s % 2 for s in range(3, 10)]  # 3.0 2.0 3.0 2.0 3.0 2.0 3.0
    assert s["generation_s"]["median"] == 3.0 and s["generation_s"]["mean"] == pytest.approx(sum(gens) / 7)
    assert s["training_s"] == {"median": 1.0, "mean": 1.0}
    assert s["weight_update_s"]["median"] == pytest.approx(0.3)  # publish 0.2 + load 0.1
    assert s["overlap"] == pytest.approx(2.5 / 3.0)
    assert s["trainer_wait_s"]["median"] == 0.5
    assert s["train_tokens"] == {"median": 1060.0, "mean": 1060.0}  # steps 3..9
    assert s["reward"]["first"] == pytest.approx(0.05) and s["reward"]["last"] == pytest.approx(0.85)


def test_few_steps_keep_at_least_one_measured_step():
    orch, trainer = _rows(3, gen=1.0, train=1.0, pace=2.0, slow=0.0)
    s = summary.summarize(orch, trainer, warmup=job.WARMUP_STEPS)
    assert s["measured_steps"] == [1, 2] and s["step_s"]["median"] == pytest.approx(2.0)
    empty = summary.summarize([], [], warmup=3)
    assert empty["step_s"] == {"median": None, "mean": None} and empty["overlap"] is None


def test_overlap_bounds():
    assert summary.overlap(3.0, 2.0, 3.0) == 1.0  # full overlap
    assert summary.overlap(5.0, 2.0, 3.0) == pytest.approx(5 / 3)  # serial: 1 + min/max
    assert summary.overlap(None, 1.0, 1.0) is None and summary.overlap(1.0, None, None) is None


def test_read_rows_keeps_this_runs_train_rows(tmp_path):
    path = tmp_path / "orchestrator.jsonl"
    rows = [
        {"step": 0, "time": 1.0, "kind": "train"},  # an earlier run
        {"step": 0, "time": 5.0, "kind": "eval"},
        {"step": 0, "time": 6.0, "kind": "train"},
        {"step": 1, "time": 7.0},  # trainer rows have no kind
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2, "ti')  # a row still being written
    assert [r["time"] for r in summary.read_rows(path, since=2.0)] == [6.0, 7.0]
    assert summary.read_rows(tmp_path / "missing.jsonl") == []


def test_table_and_heldout_lines():
    orch, trainer = _rows(10, gen=2.0, train=1.0, pace=2.5)
    table = summary.format_table("title", summary.summarize(orch, trainer, warmup=3))
    lines = table.splitlines()
    assert lines[0] == "title" and "steps 3-9 (3 warm-up steps left out)" in lines[1]
    s_step = next(line for line in lines if line.strip().startswith("s/step")).split()
    assert s_step[1:] == ["2.500", "2.500"]
    assert any(line.split()[:2] == ["overlap", "0.83"] for line in lines)
    assert any(line.split()[:3] == ["tokens/step", "1060", "1060"] for line in lines)
    before = {"words": 128, "samples_per_word": 4, "greedy": 0.25, "sampled": 0.2}
    after = {**before, "greedy": 0.5, "sampled": 0.45}
    assert summary.format_heldout(before, after) == (
        "held-out exact match (128 words): greedy 0.250 -> 0.500, sampled (T=1, 4 per word) 0.200 -> 0.450"
    )
