"""Files another process wrote, found damaged on disk (a torn rollout batch, a corrupt orchestrator
checkpoint, a torn metrics line, half-written dirs of a killed publish) and writes that meet a full disk:
one-line errors that name the file and what to do, never a traceback; nothing torn is ever read.

Also here, run end to end elsewhere: a torn trainer checkpoint (tests/integration/test_sft.py,
test_trainer_fsdp.py), a corrupt weight dir sent to /update_weights (tests/integration/test_inference_contract.py),
a full disk during a run (test_full_disk.py).
"""

import errno
import json

import pytest
import torch

from asyncrl.core.errors import UserError, disk_full
from asyncrl.orchestrator import ckpt
from asyncrl.transport.batch import read_batch, write_batch
from asyncrl.transport.files import publish_dir
from asyncrl.transport.layout import RunLayout
from asyncrl.transport.row import Row
from asyncrl.utils.monitor import drop_rows_from

pytestmark = pytest.mark.reliability


def test_a_torn_rollout_batch_is_named(tmp_path):
    zeros = torch.zeros(8)
    mb = Row(torch.arange(8), torch.arange(8), zeros.bool(), zeros, zeros, torch.ones(8))  # temperature 0: refused
    write_batch(RunLayout(tmp_path), 3, [[mb]])
    assert len(read_batch(RunLayout(tmp_path), 3, 0)) == 1
    path = RunLayout(tmp_path).batch_dir(3) / "rank_0.pt"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(UserError, match=rf"rollout batch {path} is unreadable .* restart the orchestrator"):
        read_batch(RunLayout(tmp_path), 3, 0)


@pytest.mark.parametrize("damage", ["{not json", '{"step": 2}', ""])
def test_a_corrupt_orchestrator_checkpoint_is_named(tmp_path, damage):
    layout = RunLayout(tmp_path)
    path = ckpt.save(layout, ckpt.Progress(step=2), [])
    assert ckpt.load(layout, 2)[0].step == 2
    (path / "buffer.json").write_text(damage)
    with pytest.raises(UserError, match=rf"orchestrator checkpoint {path} is corrupted .* resume from another step"):
        ckpt.load(layout, 2)


def test_a_torn_metrics_line_is_dropped_with_the_steps_a_resume_redoes(tmp_path):
    path = tmp_path / "trainer.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)) + '{"step": 5, "lo')
    assert drop_rows_from(path, 3) == 3  # steps 3, 4 and the torn line of a writer killed mid-row
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1, 2]
    assert drop_rows_from(tmp_path / "none.jsonl", 0) == 0


def test_half_written_dirs_of_a_killed_publish_are_never_steps_and_are_removed(tmp_path):
    layout = RunLayout(tmp_path)
    publish_dir(layout.broadcast_dir(1), lambda tmp: (tmp / "model.safetensors").write_text("x"))
    for root in (layout.broadcast, layout.rollouts, layout.checkpoints / "step_2"):
        (root / ".tmp_step_2_deadbeef").mkdir(parents=True)  # what SIGKILL mid-write leaves
    layout.checkpoint_dir(2, "orchestrator").mkdir()
    assert layout.resumable_steps() == []  # no trainer checkpoint: nothing to resume from
    assert sorted(p.parent.name for p in layout.remove_leftovers()) == ["broadcast", "rollouts", "step_2"]
    assert [p.name for p in layout.broadcast.iterdir()] == ["step_1"]


def test_orchestrator_retention_spares_the_step_the_trainer_resumes_at(tmp_path):
    """Running ahead, the orchestrator saves step 6 while the trainer is still saving step 4; keep_last=1
    must not delete the orchestrator's step 4 before the trainer's step 4 is complete."""
    from asyncrl.config.base import CkptConfig

    layout = RunLayout(tmp_path)
    layout.trainer_world.write_text('{"world_size": 1}')
    (layout.checkpoint_dir(2, "trainer") / "STABLE").parent.mkdir(parents=True)
    (layout.checkpoint_dir(2, "trainer") / "STABLE").write_text("")
    for step in (2, 4, 6):
        ckpt.save(layout, ckpt.Progress(step=step), [])
    assert ckpt.prune(layout, CkptConfig(keep_last=1)) == []  # 2 is the trainer's latest; 4 and 6 are newer
    assert layout.resumable_steps() == [2]


def test_a_full_disk_is_one_line_wherever_the_writer_fails(tmp_path, monkeypatch):
    enospc = OSError(errno.ENOSPC, "No space left on device", "/run/x")
    assert disk_full(enospc).startswith("the disk is full (No space left on device) writing /run/x: free space")
    wrapped = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    assert disk_full(wrapped).startswith("the disk is full (RuntimeError: PytorchStreamWriter")
    assert disk_full(ValueError("bad value")) is None

    class Usage:  # torch says "iostream error": only the free space tells it was the disk
        free = 0

    monkeypatch.setattr("shutil.disk_usage", lambda path: Usage)

    def write(tmp):
        (tmp / "rank_0.pt").write_text("half")
        raise RuntimeError("basic_ios::clear: iostream error")

    with pytest.raises(OSError) as got:
        publish_dir(RunLayout(tmp_path).batch_dir(3), write, marker=False)
    assert got.value.errno == errno.ENOSPC and disk_full(got.value).endswith("complete checkpoints are intact")
    assert list((tmp_path / "rollouts").iterdir()) == []  # the half-written dir is gone


@pytest.mark.parametrize("spec", ["trainer.checkpoint", "trainer.ckpt:4", "trainer.step:x", "trainer.step:1:2:3"])
def test_a_malformed_fail_point_is_one_line_not_a_point_that_never_fires(monkeypatch, spec):
    from asyncrl.core import failpoint

    monkeypatch.setenv(failpoint.VAR, spec)
    with pytest.raises(UserError, match=r"ASYNCRL_FAILPOINT=.*expected <point>:<step>\[:<rank>\]"):
        failpoint.reached("trainer.step", 1)
    monkeypatch.setenv(failpoint.VAR, "trainer.step:2")
    failpoint.reached("trainer.step", 1)  # another step: nothing happens
