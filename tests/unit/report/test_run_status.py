"""`asyncrl status RUN_DIR` and the run records it reads (utils/runstate.py), on run dirs made here."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from asyncrl.core.errors import UserError
from asyncrl.report.status import last_row, status_lines
from asyncrl.transport.layout import RunLayout
from asyncrl.utils import runstate
from tests import warm


def record(layout: RunLayout, name: str, **info) -> None:
    layout.logs.mkdir(parents=True, exist_ok=True)
    base = {"pid": 1, "host": runstate.socket.gethostname(), "started": time.time() - 60}
    layout.pid_file(name).write_text(json.dumps({**base, **info}))


def metrics(layout: RunLayout, name: str, rows: list[dict]) -> None:
    layout.metrics.mkdir(parents=True, exist_ok=True)
    layout.metrics_file(name).write_text("".join(json.dumps({"time": time.time(), **r}) + "\n" for r in rows))


def test_a_process_record_from_start_to_exit(tmp_path, monkeypatch):
    monkeypatch.setattr(runstate, "_record", None)
    runstate.register("trainer", RunLayout(tmp_path))
    path = RunLayout(tmp_path).pid_file("trainer")
    info = runstate.read(path)
    assert info["pid"] == runstate.os.getpid() and runstate.state(info) == f"running (pid {info['pid']})"
    runstate.finish(2, "model not found")
    assert runstate.state(runstate.read(path)) == "failed (exit 2)"
    runstate.close(path, runstate.STOPPED)  # an end is written once
    assert runstate.read(path)["error"] == "model not found"


def test_states_of_records():
    host = runstate.socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert runstate.state({"pid": dead.pid, "host": host}) == "killed (no exit recorded)"
    assert runstate.state({"exit": 0}) == "finished" and runstate.state({"exit": 143}) == "stopped"
    assert runstate.state({"exit": 130}) == "interrupted"
    assert runstate.state({"pid": 5, "host": "node-7"}) == "started on node-7 (cannot check from here)"


def test_status_of_a_run_that_crashed(tmp_path):
    layout = RunLayout(tmp_path)
    layout.configs.mkdir(parents=True)
    (layout.configs / "trainer.toml").write_text('max_steps = 20\n[model]\nname = "m"\n')
    record(layout, "rl", exit=2, error="trainer died (exit code -9); last lines of ...\n  more")
    record(layout, "trainer", pid=2**22 + 12345)  # no such pid: killed
    record(layout, "orchestrator", exit=143)
    metrics(layout, "orchestrator", [{"step": 6, "kind": "train", "reward/mean": 0.5, "off_policy/level": 1}])
    metrics(layout, "trainer", [{"step": 5, "loss": 0.25, "tokens_per_s": 1234.0}])
    (layout.logs / "trainer.log").write_text("12:00:00 INFO    [trainer] step 5\n12:00:01 ERROR   [trainer] boom\n")
    lines = status_lines(tmp_path)
    assert lines[0] == f"run {tmp_path}: model m, max_steps 20"
    line = {row.split()[0]: row for row in lines[1:] if row.startswith("  ") and not row.startswith("   ")}
    assert "stopped" in line["orchestrator"] and "step 6/20" in line["orchestrator"]
    assert "reward 0.500" in line["orchestrator"] and "off-policy 1" in line["orchestrator"]
    assert "killed (no exit recorded)" in line["trainer"] and "loss 0.2500" in line["trainer"]
    assert "tok/s 1,234" in line["trainer"] and "failed (exit 2)" in line["rl"]
    assert lines[lines.index("errors:") + 1 :] == [
        "  rl: trainer died (exit code -9); last lines of ...",
        "  trainer.log: 12:00:01 ERROR   [trainer] boom",
    ]


def test_a_process_of_an_earlier_attempt_is_marked(tmp_path):
    layout = RunLayout(tmp_path)
    record(layout, "rl", exit=2, started=time.time())
    record(layout, "trainer", exit=0, started=time.time() - 3600)
    assert "finished, earlier attempt" in next(line for line in status_lines(tmp_path) if "trainer" in line)


def test_last_row_skips_a_line_being_written(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0, "kind": "train"}\n{"step": 1, "kind": "eval"}\n{"step": 2, "ki')
    assert last_row(path, kind="train") == {"step": 0, "kind": "train"}
    assert last_row(tmp_path / "missing.jsonl") is None


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["status", "/no/such/run"], "/no/such/run is not a directory"),
        (["status"], "asyncrl status takes one run directory"),
        (["stats", "x"], "unknown command 'stats'"),
    ],
)
def test_asyncrl_cli_mistakes_are_one_line(argv, says):
    done = warm.run([sys.executable, "-m", "asyncrl.entrypoints.asyncrl", *argv], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith("error: ")
    assert says in done.stderr


def test_a_dir_that_is_no_run(tmp_path):
    with pytest.raises(UserError, match="has no logs/ or metrics/"):
        status_lines(tmp_path)


def test_a_multi_run_dir_has_a_line_per_run(tmp_path):
    top = RunLayout(tmp_path)
    record(top, "trainer")
    runs = {name: RunLayout(top.run_dir(name)) for name in ("a", "b", "c")}
    for run in runs.values():
        run.root.mkdir(parents=True)
        run.run_config.write_text("")
    metrics(runs["a"], "orchestrator", [{"step": 9, "reward/mean": 0.75}])
    runs["a"].run_status.write_text(json.dumps({"state": "done", "step": 10, "error": None}))
    metrics(runs["b"], "trainer", [{"step": 3, "loss": 0.1}])
    runs["b"].run_status.write_text(json.dumps({"state": "failed", "step": 4, "error": "loss is nan at step 4"}))
    lines = status_lines(tmp_path)
    said = {line.split()[1]: line for line in lines if line.startswith("  run ")}
    assert said["a"].split()[2] == "done" and "step 9" in said["a"] and "reward 0.750" in said["a"]
    assert said["b"].split()[2] == "failed" and "waiting for a slot" in said["c"]
    assert "  run b: loss is nan at step 4" in lines


@pytest.mark.parametrize("command", ["status", "report"])
def test_each_command_answers_help(command, capsys):
    from asyncrl.entrypoints.asyncrl import main

    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"usage: asyncrl {command} RUN_DIR") and "error:" not in out
