"""rl's auto-restart policy (`launcher.restart`): which deaths it restarts, from which step, how long it waits,
what it records; on run dirs whose checkpoints are made by hand (the kill-storm test runs the real thing)."""

from __future__ import annotations

import json
import time

import pytest

from asyncrl.config import loader
from asyncrl.config.rl import RLConfig, resolve_rl
from asyncrl.core.errors import UserError
from asyncrl.launcher import restart
from asyncrl.launcher.restart import ComponentDied, Restarts
from asyncrl.transport.layout import STABLE, RunLayout
from asyncrl.utils import runstate
from asyncrl.utils.process import exit_words

KILLED = ComponentDied("trainer died (exit code -9: SIGKILL); last lines of ...", "trainer", -9, exit_words(-9))


def config(out, *flags: str) -> RLConfig:
    argv = ["--model.name", "m", "--output-dir", str(out), "--max-steps", "20", "--ckpt", "--restart-backoff", "0.5"]
    raw, args = loader.collect_raw(RLConfig, argv + list(flags), {})
    return resolve_rl(raw, args)


def checkpoint(layout: RunLayout, step: int) -> None:
    for part in ("trainer", "orchestrator"):
        (layout.checkpoint_dir(step, part)).mkdir(parents=True)
        (layout.checkpoint_dir(step, part) / STABLE).touch()


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(restart.time, "sleep", slept.append)
    return slept


@pytest.fixture
def layout(tmp_path, monkeypatch) -> RunLayout:
    layout = RunLayout(tmp_path / "run")
    layout.logs.mkdir(parents=True)
    runstate.register("rl", layout)
    yield layout
    monkeypatch.setattr(runstate, "_record", None)


def test_a_killed_process_restarts_the_run_from_its_latest_checkpoint(layout, waits):
    restarts = Restarts(config(layout.root), layout)
    checkpoint(layout, 4)
    checkpoint(layout, 6)
    (layout.checkpoint_dir(8, "trainer")).mkdir(parents=True)  # a save that did not finish
    nxt = restarts.next_config(KILLED, started_at=0)
    assert nxt.trainer.ckpt.resume_step == nxt.orchestrator.ckpt.resume_step == 6
    assert restarts.config.trainer.ckpt.resume_step is None  # the first attempt's config is left as it was
    assert waits == [0.5]
    record = runstate.read(layout.pid_file("rl"))
    assert [(r["component"], r["why"], r["from_step"]) for r in record["restarts"]] == [
        ("trainer", "exit code -9: SIGKILL", 6)
    ]
    assert record["max_restarts"] == 3 and record["attempt"] <= time.time()


def test_without_a_checkpoint_the_run_starts_again_at_step_0(layout, waits):
    nxt = Restarts(config(layout.root), layout).next_config(KILLED, started_at=0)
    assert nxt.trainer.ckpt.resume_step is None and nxt.orchestrator.ckpt.resume_step is None


def test_deaths_in_a_row_wait_twice_as_long_and_end_at_the_limit(layout, waits):
    restarts = Restarts(config(layout.root, "--max-restarts", "2"), layout)
    checkpoint(layout, 2)
    restarts.next_config(KILLED, started_at=0)
    restarts.next_config(KILLED, started_at=2)  # died again before a new checkpoint
    with pytest.raises(UserError) as e:
        restarts.next_config(KILLED, started_at=2)
    assert waits == [0.5, 1.0]
    assert str(e.value).startswith("trainer died (exit code -9: SIGKILL)")
    assert "not restarted: 3 deaths in a row with no new checkpoint between them (max_restarts 2)" in str(e.value)
    checkpoint(layout, 4)  # progress: the count starts over
    restarts.next_config(KILLED, started_at=2)
    assert waits == [0.5, 1.0, 0.5] and restarts.in_a_row == 1


@pytest.mark.parametrize(
    ("flags", "died", "said"),
    [
        ((), ComponentDied("orchestrator died (exit code 2)", "orchestrator", 2, "exit code 2"), "exited 2"),
        (("--max-restarts", "0"), KILLED, None),
        (("--no-ckpt",), KILLED, "add --ckpt"),
    ],
    ids=["user-error", "off", "no-checkpoints"],
)
def test_what_is_not_restarted_stops_the_run_saying_why(layout, waits, flags, died, said):
    with pytest.raises(UserError) as e:
        Restarts(config(layout.root, *flags), layout).next_config(died, started_at=0)
    first, *rest = str(e.value).splitlines()
    assert first == str(died).splitlines()[0] and waits == []
    assert (said in rest[-1]) if said else not rest
    assert "restarts" not in runstate.read(layout.pid_file("rl"))


def test_status_shows_the_restarts(layout, waits, tmp_path):
    from asyncrl.report.status import status_lines

    checkpoint(layout, 2)
    Restarts(config(layout.root), layout).next_config(KILLED, started_at=0)
    lines = status_lines(layout.root)
    assert any(line.split()[:2] == ["restarts", "1:"] and "trainer (exit code -9: SIGKILL) from step 2" in line
               for line in lines), lines  # fmt: skip
    assert json.loads(layout.pid_file("rl").read_text())["restarts"][0]["from_step"] == 2


def test_a_stalled_run_is_restarted_like_a_death(layout, waits, caplog_loguru):
    stall = ComponentDied("no step for 40s ...", "stall", None, "no step for 40s: trainer is stopped (SIGSTOP)")
    checkpoint(layout, 2)
    nxt = Restarts(config(layout.root), layout).next_config(stall, started_at=0)
    assert nxt.trainer.ckpt.resume_step == 2 and waits == [0.5]
    said = "the run stalled (no step for 40s: trainer is stopped (SIGSTOP)); restart 1 of 3 in a row: the run starts"
    assert any(said in m for m in caplog_loguru), caplog_loguru
