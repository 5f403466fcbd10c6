"""Checkpoint retention rules and resume-step resolution (missing, partial, latest)."""

import pytest

from asyncrl.core.errors import UserError
from asyncrl.trainer.ckpt import complete_steps
from asyncrl.transport.layout import TRAINER, RunLayout, resolve_resume_step, steps_to_delete


def test_keep_all_by_default():
    assert steps_to_delete([5, 10, 15], None, None) == []


def test_keep_last():
    assert steps_to_delete([5, 10, 15, 20], 2, None) == [5, 10]


def test_keep_last_plus_interval():
    assert steps_to_delete([5, 10, 15, 20, 25, 30], 1, 10) == [5, 15, 25]
    assert steps_to_delete([2, 4, 6], 5, 3) == []


def make_ckpt(root, step, complete=True):
    d = RunLayout(root).checkpoint_dir(step, TRAINER)
    d.mkdir(parents=True)
    (d / ".metadata").write_text("x")
    if complete:
        (d / "STABLE").write_text("")


def test_resolve_latest_skips_partial(tmp_path):
    make_ckpt(tmp_path, 2)
    make_ckpt(tmp_path, 4)
    make_ckpt(tmp_path, 6, complete=False)
    assert complete_steps(RunLayout(tmp_path)) == [2, 4]
    assert resolve_resume_step(RunLayout(tmp_path), -1) == 4
    assert resolve_resume_step(RunLayout(tmp_path), 2) == 2


def test_resolve_latest_needs_both_halves_of_an_rl_checkpoint(tmp_path):
    """Killed mid-save, one process leaves a step the other never finished: -1 is the latest step both have."""
    for step in (2, 4, 8):
        make_ckpt(tmp_path, step)
    for step in (2, 4, 12):  # the orchestrator died before saving step 8, after it saved 12
        (tmp_path / "checkpoints" / f"step_{step}" / "orchestrator").mkdir(parents=True)
    assert RunLayout(tmp_path).resumable_steps() == [2, 4]
    assert resolve_resume_step(RunLayout(tmp_path), -1) == 4


def test_resolve_missing_step_lists_available(tmp_path):
    make_ckpt(tmp_path, 2)
    with pytest.raises(UserError, match=r"no trainer checkpoint for step 3 .* available steps: \[2\]"):
        resolve_resume_step(RunLayout(tmp_path), 3)


def test_resolve_partial_step_is_refused_by_name(tmp_path):
    make_ckpt(tmp_path, 6, complete=False)
    with pytest.raises(UserError, match=r"step_6/trainer is partial or corrupted"):
        resolve_resume_step(RunLayout(tmp_path), 6)


def test_resolve_latest_without_any(tmp_path):
    with pytest.raises(UserError, match="no checkpoint under .* is complete"):
        resolve_resume_step(RunLayout(tmp_path), -1)


def test_resume_at_or_past_max_steps_is_refused_before_training(tmp_path):
    make_ckpt(tmp_path, 4)
    assert resolve_resume_step(RunLayout(tmp_path), 4, max_steps=5) == 4
    for max_steps in (4, 3):
        with pytest.raises(UserError, match=rf"resuming at step 4 but max_steps is {max_steps}: nothing to train"):
            resolve_resume_step(RunLayout(tmp_path), -1, max_steps=max_steps)
