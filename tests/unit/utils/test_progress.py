"""Live progress: a bar on a real (pseudo-)terminal with log lines above it, nothing drawn elsewhere;
`rl`'s bar follows the orchestrator's steps and names a long quiet wait."""

import json
import os
import pty
import sys

import pytest

from asyncrl.config import loader
from asyncrl.config.rl import RLConfig, resolve_rl
from asyncrl.launcher import supervisor
from asyncrl.launcher.supervisor import Launcher
from asyncrl.transport.layout import RunLayout
from asyncrl.utils.logging import setup_logger
from asyncrl.utils.progress import Bar, bar_wanted, fields_text


def test_fields_are_short_and_none_is_left_out():
    text = fields_text({"reward": 0.51234, "loss": -0.0012, "tok/s": 3679.4, "off-policy": 1, "errors": None})
    assert text == "reward 0.512  loss -1.20e-03  tok/s 3,679  off-policy 1"
    assert fields_text({"reward": 0.0}) == "reward 0.000"


@pytest.mark.parametrize(
    ("mode", "tty", "ci", "wanted"),
    [
        ("auto", True, None, True),
        ("auto", False, None, False),
        ("auto", True, "true", False),
        ("bar", False, "true", True),
        ("plain", True, None, False),
    ],
)
def test_bar_only_on_a_terminal_outside_ci_unless_told(monkeypatch, mode, tty, ci, wanted):
    monkeypatch.setenv("ASYNCRL_PROGRESS", mode)
    monkeypatch.delenv("CI", raising=False)
    if ci:
        monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    assert bar_wanted() is wanted


@pytest.fixture
def terminal(monkeypatch):
    """A pseudo-terminal: (its writable end, a function returning what it showed so far)."""
    master, slave = pty.openpty()
    term = os.fdopen(slave, "w", buffering=1)
    monkeypatch.setenv("ASYNCRL_PROGRESS", "auto")
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("COLUMNS", "150")
    shown = bytearray()

    def read() -> str:
        term.flush()
        os.set_blocking(master, False)
        try:
            while chunk := os.read(master, 65536):
                shown.extend(chunk)
        except BlockingIOError:
            pass
        return shown.decode(errors="replace")

    yield term, read
    term.close()
    os.close(master)


def test_bar_draws_under_the_log_lines_on_a_terminal(terminal, tmp_path, monkeypatch):
    term, read = terminal
    monkeypatch.setattr(sys, "stderr", term)  # here, not in the fixture: pytest's capture resets it per phase
    monkeypatch.setattr(sys, "stdout", term)
    setup_logger("sft", RunLayout(tmp_path), to_file=False)
    with Bar("sft", 5) as bar:
        assert bar.enabled
        bar.waiting("the model to load")
        bar.update(3, loss=1.25, **{"tok/s": 2000.0})
        from loguru import logger

        logger.info("a log line during the bar")
    monkeypatch.undo()
    logger.remove()  # setup_logger's sinks; back to loguru's default
    logger.add(sys.stderr)
    shown = read()
    assert "waiting for the model to load" in shown
    assert "3/5" in shown and "loss 1.250  tok/s 2,000" in shown and "━" in shown
    line = next(x for x in shown.splitlines() if "a log line during the bar" in x)
    assert "━" not in line  # printed whole, above the bar, not through it


def test_nothing_is_drawn_off_a_terminal(capsys, caplog_loguru, monkeypatch):
    monkeypatch.setenv("ASYNCRL_PROGRESS", "auto")
    with Bar("eval", 4) as bar:
        assert not bar.enabled
        bar.waiting("the server")
        bar.update(4, reward=1.0)
    out, err = capsys.readouterr()
    assert "━" not in out + err and "4/4" not in out + err
    assert caplog_loguru == ["waiting for the server"]  # a long wait is never silent


def _config(tmp_path, *argv: str) -> RLConfig:
    raw, args = loader.collect_raw(RLConfig, ["--model.name", "m", "--output-dir", str(tmp_path), *argv], {})
    return resolve_rl(raw, args)


def test_rl_bar_follows_steps_and_names_a_quiet_wait(tmp_path, capsys, caplog_loguru):
    config = _config(tmp_path, "--max-steps", "10")
    launcher = Launcher(config, RunLayout.for_config(config.trainer))
    metrics = launcher.layout.metrics_file("orchestrator")
    metrics.parent.mkdir(parents=True)
    row = {"step": 3, "reward/mean": 0.5, "off_policy/level": 1, "perf/gen_tokens_per_s": 900.0}
    metrics.write_text(json.dumps(row) + "\n")
    launcher._show_progress()
    assert launcher.bar.done == 4 and "[rl] step    3" in capsys.readouterr().out
    log = launcher.layout.log_file("orchestrator")
    log.parent.mkdir(parents=True)
    log.write_text("12:00:00 INFO    [orchestrator] step 4: waiting for trainer weights\n")
    launcher._show_progress()
    assert not caplog_loguru  # quiet, but not for long yet
    launcher.last_news -= supervisor.QUIET_S + 1
    launcher._show_progress()
    assert caplog_loguru == [
        "waiting for step 4 (none for 120s; orchestrator's last line: "
        "12:00:00 INFO    [orchestrator] step 4: waiting for trainer weights)"
    ]
