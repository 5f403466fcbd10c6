"""A distillation teacher on another network host, behind an API key (issue 30's multi-host check).

Host A (a network namespace linked by a veth pair, `hosts.py`) runs `inference --api-key KEY` on the teacher
model; this namespace runs `rl` with its own [inference] (the student) and only `[orchestrator.teacher]`:
`base_url = http://A:8000/v1`, `api_key_var = TEACHER_API_KEY`. rl starts no teacher of its own; the orchestrator
scores every sample on A (distill/teacher_kl per step). A wrong key and an unreachable teacher end the run with
one line.
"""

from __future__ import annotations

import os
import sys

import pytest
from hosts import CAN_MAKE_HOSTS, WHY_NOT, network_host

from asyncrl.utils.process import free_port, spawn, stop_groups, wait_for_http
from tests import warm
from tests.integration.test_rl import assert_no_processes_left, orchestrator_rows, rl_args, run_rl

KEY = "teacher-test-key"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CAN_MAKE_HOSTS, reason=WHY_NOT),
]


@pytest.fixture(scope="module")
def teacher(warm_model, tmp_path_factory):
    """Host A's teacher server (`inference --api-key KEY`), its /v1 URL and host."""
    with network_host("teacher") as a:
        root = tmp_path_factory.mktemp("teacher")
        cmd = [sys.executable, "-m", "asyncrl.entrypoints.inference", "--model.name", str(warm_model)]
        cmd += ["--model.max-model-len", "128", "--server.port", "8000", "--api-key", KEY, "--num-threads", "1"]
        proc = spawn(a.run(cmd + ["--output-dir", str(root)]), root / "teacher.out")
        try:
            wait_for_http(f"http://{a.ip}:8000/health", 300, proc, root / "teacher.out")
            yield f"http://{a.ip}:8000/v1", a
        finally:
            stop_groups([proc])


def remote(url: str) -> list[str]:
    return ["--orchestrator.teacher.base-url", url, "--orchestrator.teacher.api-key-var", "TEACHER_API_KEY"]


def run_with_key(args: list[str], key: str, timeout: float = 600):
    env = {**os.environ, "TEACHER_API_KEY": key}
    cmd = [sys.executable, "-m", "asyncrl.entrypoints.rl", *args]
    return warm.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_rl_distills_from_a_teacher_on_another_host_with_an_api_key(teacher, tiny_model_dir, tmp_path):
    url, _ = teacher
    out, steps = tmp_path / "run", 3
    result = run_with_key(rl_args(tiny_model_dir, out, steps, free_port()) + remote(url), KEY)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = orchestrator_rows(out)
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r["distill/teacher_kl"] == r["distill/teacher_kl"] for r in rows)  # scored on A, not NaN
    assert not (out / "logs" / "teacher.pid").exists()  # rl started no teacher: it used A's
    assert_no_processes_left(str(out))


def test_wrong_key_and_unreachable_teacher_are_one_line_errors(teacher, tiny_model_dir, tmp_path):
    url, a = teacher
    wrong = run_with_key(rl_args(tiny_model_dir, tmp_path / "a", 2, free_port()) + remote(url), "not-the-key")
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr, wrong.stderr[-2000:]
    assert "TEACHER_API_KEY" in wrong.stderr and "401" in wrong.stderr, wrong.stderr[-2000:]
    nowhere = f"http://{a.ip[:-1]}9:8000/v1"  # an address on A's link that no host has
    gone = run_rl(rl_args(tiny_model_dir, tmp_path / "b", 2, free_port()) + remote(nowhere), timeout=120)
    assert gone.returncode == 2 and "no teacher server answers at" in gone.stderr, gone.stderr[-2000:]
