"""`rl` with `[teacher]` on CPU: it starts, supervises and stops a teacher server beside the inference server."""

from __future__ import annotations

import json
import os
import signal
import socket

import httpx
import pytest

from asyncrl.utils.process import free_port
from tests.integration.test_rl import (
    assert_no_processes_left,
    orchestrator_rows,
    own_processes,
    rl_args,
    run_rl,
    start_rl_until,
    states,
)

pytestmark = pytest.mark.slow


def teacher_args(teacher_dir, port: int) -> list[str]:
    return ["--teacher.model.name", str(teacher_dir), "--teacher.server.host", "127.0.0.1",
            "--teacher.server.port", str(port), "--teacher.max-batch-size", "128"]  # fmt: skip


def test_rl_starts_the_teacher_and_its_death_stops_the_run(tiny_model_dir, tmp_path):
    out, port, teacher_port = tmp_path / "run", free_port(), free_port()
    args = rl_args(tiny_model_dir, out, 500, port) + teacher_args(tiny_model_dir, teacher_port)
    proc = start_rl_until(args, out / "metrics" / "trainer.jsonl")
    try:
        health = httpx.get(f"http://127.0.0.1:{teacher_port}/health", timeout=10)
        assert health.status_code == 200
        teachers = [x.split()[0] for x in own_processes(str(out)) if "teacher.toml" in x]
        assert len(teachers) == 1
        os.kill(int(teachers[0]), signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2 and "teacher died" in stderr and "Traceback" not in stderr, stderr[-2000:]
    assert "teacher server is up at http://127.0.0.1:" in (out / "logs" / "rl.log").read_text()
    assert "teacher" in (out / "logs" / "teacher.log").read_text().lower()  # its own log, not inference.log
    assert_no_processes_left(str(out))
    status = states(out)
    assert status["teacher"] == "killed (no exit recorded)" and status["inference"] == "stopped"
    # the teacher is never sent weights: only the student's server loads them
    assert "update_weights" not in (out / "logs" / "teacher.log").read_text()


def test_a_taken_teacher_port_is_one_line_before_anything_starts(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_rl(rl_args(tiny_model_dir, out, 2, free_port()) + teacher_args(tiny_model_dir, port), timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"teacher server's port {port}" in result.stderr and "--teacher.server.port" in result.stderr
    assert not (out / "logs" / "inference.pid").exists()  # nothing was started


def test_rl_distills_from_the_teacher_it_starts(warm_model, tiny_model_dir, tmp_path):
    """End to end: the orchestrator scores every sample with rl's teacher (its top 5 per position: forward KL) and
    logs the teacher-student KL; the trainer trains on the teacher's targets and logs their KL too. The teacher
    requires an API key, which rl hands the orchestrator in the variable its client reads."""
    out, steps = tmp_path / "run", 3
    args = rl_args(tiny_model_dir, out, steps, free_port()) + teacher_args(warm_model, free_port())
    args += ["--teacher.api-key", "t-key", "--orchestrator.teacher.api-key-var", "ASYNCRL_TEST_TEACHER_KEY"]
    assert "ASYNCRL_TEST_TEACHER_KEY" not in os.environ
    result = run_rl(args + ["--orchestrator.distill.kind", "forward_kl", "--orchestrator.distill.top-k", "5"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = orchestrator_rows(out)
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r["distill/teacher_kl"] == r["distill/teacher_kl"] for r in rows)  # present, not NaN
    assert all("time/teacher_s" in r for r in rows)
    trainer = [json.loads(x) for x in (out / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert len(trainer) == steps and all(r["teacher_kl"] > 0 for r in trainer), trainer
    assert_no_processes_left(str(out))
    assert states(out)["teacher"] == "stopped"
    assert "[teacher]" in (out / "configs" / "orchestrator.toml").read_text()
