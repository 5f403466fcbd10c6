"""Standalone env servers (`env-server`, `[[orchestrator.env]] server`): episodes run in another process.

Real processes throughout: the `env-server` entrypoint (verifiers' `serve_env` over ZMQ) started by the
runner or by hand, the shipped tool-calc environment (its calculator MCP server inside the env server),
and a real local HTTP server playing the model (scripted_server.py). What is checked: a served episode is
the in-process one; a server killed mid-episode fails that episode with one line and is started again; one
that stays dead (or never answers) fails every episode with the reason; a server ends with its parent.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from scripted_server import ScriptedServer

from asyncrl.config.orchestrator import ClientConfig, EnvConfig
from asyncrl.orchestrator.envs import served
from asyncrl.orchestrator.envs.loading import load_env
from asyncrl.orchestrator.envs.v1 import v1_run_group, v1_tasks
from asyncrl.utils.process import free_port, running
from tests import warm

pytestmark = pytest.mark.slow
KEY_VAR = "ASYNCRL_TEST_SCRIPTED_KEY"


def _slot(server: dict | None, **args: Any) -> tuple[SimpleNamespace, list[Any]]:
    cfg = EnvConfig(id="tool-calc", args={"num_train_examples": 4, "seed": 1, **args}, server=server)
    env = load_env(cfg)
    return SimpleNamespace(name="tool-calc", env=env, config=cfg), v1_tasks(env, "tool-calc")


def _script(task: Any) -> list[dict]:
    """A tool call that computes the task's expression, then the answer."""
    expression = task.data.prompt.removeprefix("What is ").removesuffix("?")
    return [
        {"content": None, "tool_calls": [("calculate", {"expression": expression})]},
        {"content": f"The answer is {task.data.answer}."},
    ]


def _groups(slot, tasks, replies, log_dir: Path, between=None) -> list[list[dict]]:
    """Run one group per task (in turn) through one runner; `between(i)` runs before group i."""

    async def main() -> list[list[dict]]:
        with ScriptedServer(replies) as model:
            client = ClientConfig(base_url=model.url, api_key_var=KEY_VAR)
            runner = v1_run_group(client, "scripted", "scripted", train=False, log_dir=log_dir)
            outs = []
            try:
                for i, task in enumerate(tasks):
                    if between is not None:
                        await between(i, runner)
                    outs.append(await runner(slot, [task], {"n": 1}))
            finally:
                await runner.close()
            return outs

    return asyncio.run(main())


@pytest.fixture(autouse=True)
def _key(monkeypatch):
    monkeypatch.setenv(KEY_VAR, "scripted-key")


def test_a_started_server_runs_the_episode_as_in_process(tmp_path):
    slot, tasks = _slot({})
    (served,) = _groups(slot, tasks[:1], _script(tasks[0]), tmp_path)
    local, _ = _slot(None)
    (here,) = _groups(local, tasks[:1], _script(tasks[0]), tmp_path)
    (out,), (ref,) = served, here
    assert "error" not in out, out
    assert out["reward"] == ref["reward"] == 1.0
    assert out["metrics"] == ref["metrics"] and out["metrics"]["calculate_calls"] == 1.0
    assert out["completion"] == ref["completion"] and out["tool_defs"] == ref["tool_defs"]
    log = (tmp_path / "env-server-tool-calc.log").read_text()
    assert "listening on tcp://127.0.0.1:" in log and "EnvServer down" in log  # stopped with the runner


def _held(tasks: list[Any]):
    """Replies: the first task's model call is held (for 10 s, then a wrong answer), the others scripted; the
    event set once the held call has arrived, and the one set once it has been answered."""
    arrived, released = threading.Event(), threading.Event()
    scripts = {t.data.prompt: _script(t) for t in tasks}

    def reply(body: dict) -> dict:
        prompt = next(m["content"] for m in body["messages"] if m["role"] == "user")
        if prompt == tasks[0].data.prompt:
            arrived.set()
            time.sleep(10)
            released.set()
            return {"content": "too late"}
        return scripts[prompt].pop(0)

    return reply, arrived, released


async def _when(event: threading.Event, act) -> None:
    while not event.is_set():
        await asyncio.sleep(0.05)
    act()


def _kill_mid_episode(tasks: list[Any]):
    """Replies (`_held`), a `between` that SIGKILLs the started server once the held call is in flight, and the
    list to which `between` appends, as the first group ends, whether the held call had been answered by then."""
    reply, arrived, released = _held(tasks)
    answered: list[bool] = []

    async def between(i: int, runner) -> None:
        if i == 0:
            kill = lambda: os.killpg(runner.servers["tool-calc"].proc.pid, signal.SIGKILL)  # noqa: E731
            asyncio.get_running_loop().create_task(_when(arrived, kill))
        elif i == 1:
            answered.append(released.is_set())

    return reply, between, answered


def test_a_server_killed_mid_episode_fails_it_in_one_line_and_comes_back(tmp_path):
    slot, tasks = _slot({"restarts": 1})
    reply, between, answered = _kill_mid_episode(tasks)
    first, second = _groups(slot, tasks[:2], reply, tmp_path, between)
    assert answered == [False]  # the episode failed while its model call was still held: the death was seen
    (lost,) = first
    assert lost["error"].startswith("EnvServerError: env server for environment tool-calc died (exit code -9")
    assert "\n" not in lost["error"]
    (ok,) = second  # started again
    assert "error" not in ok and ok["reward"] == 1.0


def test_a_server_past_its_restarts_fails_every_episode_with_the_reason(tmp_path):
    slot, tasks = _slot({"restarts": 0})
    reply, between, _ = _kill_mid_episode(tasks)
    first, second, third = _groups(slot, tasks[:3], reply, tmp_path, between)
    assert first[0]["error"].startswith("EnvServerError: env server for environment tool-calc died")
    for (out,) in (second, third):
        assert "restarted 0 times already (server.restarts)" in out["error"]


def _env_server(address: str, *extra: str, log: Path | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "asyncrl.entrypoints.env_server", "--env.id", "tool-calc", "--address", address]
    out = open(log, "wb") if log else subprocess.DEVNULL
    cmd += ["--allow-key-vars", KEY_VAR, "--log.file", "false"]
    return warm.popen([*cmd, *extra], stdout=out, stderr=subprocess.STDOUT)


def test_a_server_at_an_address_is_used_and_left_running(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    proc = _env_server(address)
    try:
        slot, tasks = _slot({"address": address, "startup_timeout": 60})
        (out,), (again,) = _groups(slot, tasks[:2], _script(tasks[0]) + _script(tasks[1]), tmp_path)
        assert "error" not in out and out["reward"] == 1.0 and again["reward"] == 1.0
        assert proc.poll() is None  # not ours to stop
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0  # SIGTERM: a clean exit


def test_a_server_at_an_address_that_stops_answering_fails_its_episodes(tmp_path, monkeypatch):
    monkeypatch.setattr(served, "HEALTH_EVERY_S", 0.2)
    monkeypatch.setattr(served, "HEALTH_TIMEOUT_S", 2.0)  # lost ~7 s after the SIGSTOP, inside the 10 s hold
    address = f"tcp://127.0.0.1:{free_port()}"
    proc = _env_server(address)
    try:
        slot, tasks = _slot({"address": address, "startup_timeout": 30})
        reply, arrived, _ = _held(tasks)

        async def between(i: int, runner) -> None:
            if i == 0:
                asyncio.get_running_loop().create_task(_when(arrived, lambda: os.kill(proc.pid, signal.SIGSTOP)))
            if i == 1:  # the next episode waits startup_timeout for it, then every later one fails at once
                runner.servers["tool-calc"].serving.startup_timeout = 1

        first, second, third = _groups(slot, tasks[:3], reply, tmp_path, between)
        assert (
            first[0]["error"] == f"EnvServerError: env server for environment tool-calc at {address} stopped answering"
        )
        assert "did not answer in 1 s" in second[0]["error"] and third[0]["error"] == second[0]["error"]
    finally:
        proc.kill()
        proc.wait()


def test_an_address_nothing_answers_fails_each_episode_with_how_to_start_it(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    slot, tasks = _slot({"address": address, "startup_timeout": 1})
    first, second = _groups(slot, tasks[:2], [], tmp_path)
    error = "did not answer in 1 s (start it: env-server --env.id tool-calc --env.args '"
    assert error in first[0]["error"] and f"--address {address}; or the secret" in first[0]["error"]
    assert second[0]["error"] == first[0]["error"]  # not waited for again


def test_env_server_ends_with_its_parent(tmp_path):
    """`--parent-pid` (what a runner passes): SIGKILL of the parent, and the server is gone within seconds."""
    address = f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "asyncrl.entrypoints.env_server", "--env.id", "tool-calc", "--address", address]
    script = (
        f"import os, subprocess, time; subprocess.Popen({cmd!r} + ['--parent-pid', str(os.getpid())]); time.sleep(120)"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        child = _wait_for_child(parent.pid)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 20
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not running(child)
    finally:
        os.killpg(parent.pid, signal.SIGKILL)


def _wait_for_child(pid: int) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.1)
    raise AssertionError("the env server was not started")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--env.id", "no-such-env"], "environment 'no-such-env' is not installed"),
        (["--env.id", "tool-calc", "--env.args", json.dumps({"bogus": 1})], "rejects args {'bogus': 1}"),
        (["--address", "localhost:5000"], "not a ZMQ address: give tcp://HOST:PORT"),
    ],
)
def test_env_server_bad_input_is_one_line(args, said, tmp_path):
    done = warm.run(
        [sys.executable, "-m", "asyncrl.entrypoints.env_server", *args, "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert said in done.stderr and "Traceback" not in done.stderr
