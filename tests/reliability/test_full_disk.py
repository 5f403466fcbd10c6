"""A full disk in the middle of a real `rl` run: it stops cleanly, says the disk is full, and resumes.

The run's output dir is a small tmpfs (a real filesystem with a real size limit; mounting needs root and
the test skips where it cannot mount). Once the first checkpoint is complete, a ballast file takes every
free byte, so the next write of any process (batch, weights, checkpoint, metrics) fails with ENOSPC.
`rl` must exit 2 naming the dead process and the full disk, with no traceback on its console; with the
ballast gone, `--ckpt.resume-step -1` resumes from a complete checkpoint and every step is logged once.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from pathlib import Path

import pytest
from rl_runs import rl_args, steps_in

from asyncrl.transport.layout import RunLayout, is_stable
from tests import warm

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

STEPS = 10


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    path.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(disk: Path) -> Path:
    """Take every free byte of `disk` with one file."""
    ballast = disk / "ballast"
    with open(ballast, "wb") as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 2**16)
                f.flush()
    return ballast


def test_a_full_disk_stops_the_run_cleanly_and_it_resumes(tiny_model_dir, tmp_path):
    with tmpfs(tmp_path / "disk", "64m") as disk:
        out = disk / "run"
        first_ckpt = RunLayout(out).checkpoint_dir(2, "trainer")
        proc = warm.popen(
            rl_args(tiny_model_dir, out, STEPS), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            deadline = time.monotonic() + 300
            while not is_stable(first_ckpt):
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "the first checkpoint never completed"
                time.sleep(0.05)
            ballast = fill(disk)
            stdout, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(30)
        assert proc.returncode == 2, stdout[-2000:] + stderr[-2000:]
        died = next(line for line in stderr.splitlines() if " died (exit code" in line)
        assert f"the disk holding {out} is full" in died and "--ckpt.resume-step -1" in died, died
        assert "Traceback" not in stderr.split(" died (exit code")[0], stderr[-3000:]  # rl's own lines before it
        assert "(exit code 2)" in died  # the process that hit it ended with its one-line error, not a crash

        ballast.unlink()
        resumed = warm.run(rl_args(tiny_model_dir, out, STEPS, "--ckpt.resume-step", "-1"),
                                 capture_output=True, text=True, timeout=300)  # fmt: skip
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        layout = RunLayout(out)
        assert steps_in(layout.metrics_file("trainer")) == list(range(STEPS))
        assert steps_in(layout.metrics_file("orchestrator")) == list(range(STEPS))
        assert is_stable(layout.weights_dir(STEPS))


@pytest.mark.parametrize("phase", ["checkpoint", "weights"])
def test_a_full_disk_during_a_checkpoint_or_weight_export_keeps_the_last_checkpoint(
    tiny_model_dir, tmp_path, monkeypatch, phase
):
    """The trainer alone (fake data), the disk filled right before step 4's checkpoint or step 3's weights:
    the write fails with ENOSPC naming the dir, nothing half-written is marked complete, and once space is
    back the run resumes from checkpoint 2."""
    from asyncrl.config.trainer import TrainerConfig
    from asyncrl.core.errors import disk_full
    from asyncrl.trainer.ckpt import CheckpointManager
    from asyncrl.trainer.rl import train as train_in

    train = lambda cfg: train_in(cfg, RunLayout.for_config(cfg))  # noqa: E731  (as its entrypoint runs it)
    from asyncrl.trainer.rl.loop import RLLoop

    def config(**ckpt) -> TrainerConfig:
        fake = {"batch_size": 4, "samples_per_row": 2, "seq_len": 32}
        return TrainerConfig.model_validate(
            {
                "model": {"name": str(tiny_model_dir)},
                "output_dir": str(out),
                "max_steps": 6,
                "data": {"fake": fake},
                "ckpt": {"interval": 2, **ckpt},
            }  # fmt: skip
        )

    def filling(method, at: int):
        def run(self, step, *args, **kwargs):
            if step == at:
                fill(disk)
            return method(self, step, *args, **kwargs)

        return run

    with tmpfs(tmp_path / "disk", "32m") as disk:
        out = disk / "run"
        if phase == "checkpoint":
            monkeypatch.setattr(CheckpointManager, "save", filling(CheckpointManager.save, 4))
        else:
            monkeypatch.setattr(RLLoop, "_publish", filling(RLLoop._publish, 3))
        with pytest.raises(OSError) as failed:
            train(config())
        assert disk_full(failed.value).startswith("the disk is full (No space left on device) writing ")
        layout = RunLayout(out)
        assert layout.complete_checkpoints("trainer") == [2]
        assert all(is_stable(d) for d in (*layout.broadcast.glob("step_*"), *layout.weights.glob("step_*")))
        monkeypatch.undo()
        (disk / "ballast").unlink()
        resumed = train(config(resume_step=-1))
        assert len(resumed) == 4 and is_stable(layout.weights_dir(6))  # steps 2..5 from checkpoint 2
