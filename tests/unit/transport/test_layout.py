"""The run directory: its paths, step_N parsing, the STABLE marker, retention and stale clean-up."""

from asyncrl.transport.files import mark_stable, publish_dir
from asyncrl.transport.layout import RunLayout, is_stable, step_dirs, step_of


def test_paths_are_the_documented_layout(tmp_path):
    run = RunLayout(tmp_path)
    assert run.batch_dir(3) == tmp_path / "rollouts" / "step_3"
    assert run.broadcast_dir(3) == tmp_path / "broadcast" / "step_3"
    assert run.weights_dir(3) == tmp_path / "weights" / "step_3"
    assert run.checkpoint_dir(3, "trainer") == tmp_path / "checkpoints" / "step_3" / "trainer"
    assert (run.logs, run.metrics, run.configs) == (tmp_path / "logs", tmp_path / "metrics", tmp_path / "configs")


def test_a_config_gives_its_layout_and_a_run_its_own(tmp_path):
    from asyncrl.config.base import CkptConfig
    from asyncrl.config.trainer import TrainerConfig

    run = RunLayout.for_config(TrainerConfig(output_dir=tmp_path, ckpt=CkptConfig(path="ckpts")))
    assert (run.root, run.checkpoints) == (tmp_path, tmp_path / "ckpts")
    assert RunLayout.for_config(TrainerConfig(output_dir=tmp_path)).checkpoints == tmp_path / "checkpoints"
    a = run.run("a")
    assert (a.root, a.run_status, a.checkpoints) == (
        run.run_dir("a"),
        tmp_path / "run_a" / "run_status.json",
        tmp_path / "run_a" / "ckpts",
    )


def test_step_dirs_ignore_temp_dirs_files_and_other_names(tmp_path):
    for name in ("step_10", "step_2", ".tmp_step_3_abcd", "step_x", "latest"):
        (tmp_path / name).mkdir()
    (tmp_path / "step_4").write_text("")  # a file, not a dir
    assert list(step_dirs(tmp_path)) == [2, 10]
    assert step_of("step_7") == 7 and step_of("step_7.tmp") is None
    assert step_dirs(tmp_path / "missing") == {}


def test_published_dirs_are_stable_and_marked_dirs_too(tmp_path):
    run = RunLayout(tmp_path)
    publish_dir(run.broadcast_dir(1), lambda d: (d / "config.json").write_text("{}"))
    assert is_stable(run.broadcast_dir(1)) and sorted(p.name for p in run.broadcast_dir(1).iterdir()) == [
        "STABLE",
        "config.json",
    ]
    ckpt = run.checkpoint_dir(2, "trainer")
    ckpt.mkdir(parents=True)
    assert not is_stable(ckpt)
    mark_stable(ckpt)
    assert is_stable(ckpt) and [p.name for p in ckpt.iterdir()] == ["STABLE"]


def test_retention_per_component_removes_step_dir_with_its_last_part(tmp_path):
    run = RunLayout(tmp_path)
    for step in (1, 2, 3, 4):
        mark_stable(_mkdir(run.checkpoint_dir(step, "trainer")))
    for step in (1, 2):
        (_mkdir(run.checkpoint_dir(step, "orchestrator")) / "progress.json").write_text("{}")
    mark_stable(_mkdir(run.checkpoints / "step_5"))  # no trainer part: not a trainer checkpoint
    (run.checkpoint_dir(6, "trainer")).mkdir(parents=True)  # partial: never counted, never pruned
    assert run.prune_checkpoints("trainer", keep_last=1, keep_interval=2) == [1, 3]
    assert list(run.checkpoints_of("trainer")) == [2, 4, 6]
    assert run.checkpoint_dir(1, "orchestrator").is_dir() and not (tmp_path / "checkpoints" / "step_3").exists()
    has_progress = lambda d: (d / "progress.json").exists()  # noqa: E731
    assert run.prune_checkpoints("orchestrator", keep_last=1, keep_interval=None, complete=has_progress) == [1]
    assert not (tmp_path / "checkpoints" / "step_1").exists()
    assert run.prune_checkpoints("trainer", keep_last=None, keep_interval=None) == []


def test_clear_stale_and_pruning_touch_only_their_steps(tmp_path):
    run = RunLayout(tmp_path)
    for step in range(1, 6):
        run.batch_dir(step).mkdir(parents=True)
        run.broadcast_dir(step).mkdir(parents=True)
    run.weights_dir(5).mkdir(parents=True)
    removed = run.clear_stale(3)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in removed) == [
        "broadcast/step_4",
        "broadcast/step_5",
        "rollouts/step_3",
        "rollouts/step_4",
        "rollouts/step_5",
    ]
    assert run.weights_dir(5).is_dir()
    run.prune_batches(keep_from_step=2)
    run.prune_broadcast(keep_from_step=3, keep={1})
    assert list(step_dirs(run.rollouts)) == [2] and list(step_dirs(run.broadcast)) == [1, 3]


def _mkdir(path):
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_weight_exports_follow_checkpoint_retention(tmp_path):
    """keep_last / keep_interval prune weights/step_N too, but never a step with a complete trainer checkpoint
    (a resume there serves its weights) nor one past the step just saved (an earlier, longer run's)."""
    run = RunLayout(tmp_path)
    for step in (1, 2, 3, 4, 5, 9):
        mark_stable(_mkdir(run.weights_dir(step)))
    mark_stable(_mkdir(run.checkpoint_dir(1, "trainer")))  # kept by the trainer (e.g. an older keep rule)
    assert run.prune_weights(5, keep_last=1, keep_interval=2) == [3]
    assert sorted(step_dirs(run.weights)) == [1, 2, 4, 5, 9]
    assert run.prune_weights(5, keep_last=None, keep_interval=None) == []
