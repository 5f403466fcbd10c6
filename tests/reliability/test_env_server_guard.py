"""An env server under peers that are not its orchestrator (issue 46, cases 2 and 10), over real ZMQ sockets.

Each server is the `env-server` entrypoint (the shipped tool-calc environment) in a process of its own; the
peers speak its wire by hand (a DEALER socket and msgpack frames, as verifiers' client does), so what they send
is exactly what an attacker can. Checked: a request cannot point the server's model client at a URL of its
choosing, nor have it read an environment variable it does not allow, and the server calls nothing then; a
frame above the cap drops its connection unread; a server bound beyond loopback without a secret says so, and
with one refuses peers without it; a client that disconnects mid-episode costs one log line, no traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgpack
import pytest
import zmq
from waiting import wait_until

from asyncrl.orchestrator.envs.guarded import GuardedEnvClient
from asyncrl.utils.process import free_port, stop_group
from tests import warm

pytestmark = [pytest.mark.reliability, pytest.mark.slow]
CANARY = "canary-key-3f9d"


class Listener:
    """A local HTTP server that records every request's path and headers, and answers each one with `reply(i)`
    (an OpenAI chat completion), or 404, once `release` is set (set from the start unless `held`)."""

    def __init__(self, reply=None, held: bool = False):
        self.seen: list[tuple[str, dict]] = []
        self.release = threading.Event()
        if not held:
            self.release.set()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                outer.seen.append((self.path, dict(self.headers)))
                outer.release.wait(60)
                answer = reply(len(outer.seen), json.loads(body or b"{}")) if reply else None
                data = json.dumps(answer or {}).encode()
                self.send_response(200 if answer else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


@contextlib.contextmanager
def env_server(log: Path, *flags: str, host: str = "127.0.0.1", env: dict | None = None):
    address = f"tcp://{host}:{free_port()}"
    cmd = [sys.executable, "-m", "asyncrl.entrypoints.env_server", "--env.id", "tool-calc", "--address", address]
    environ = {**os.environ, "OPENAI_API_KEY": CANARY, "ASYNCRL_LEAK_ME": CANARY, **(env or {})}
    with open(log, "wb") as out:
        proc = warm.popen(
            [*cmd, "--log.file", "false", *flags],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environ,
            start_new_session=True,
        )
    try:
        reach = address.replace("0.0.0.0", "127.0.0.1")
        _wait_healthy(reach, env.get("ASYNCRL_ENV_SECRET") if env else None, proc, log)
        yield reach, proc
    finally:
        stop_group(proc, grace=10.0)


def _wait_healthy(address: str, secret: str | None, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        if asyncio.run(_health(address, secret, 1.0)):
            return
    raise AssertionError(f"env server never answered: {log.read_text()}")


async def _health(address: str, secret: str | None, timeout: float) -> bool:
    client = GuardedEnvClient(address, secret)
    try:
        return await client.health(timeout=timeout)
    finally:
        await client.close()


def dealer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def run_frames(client: dict, task_data: dict | None = None) -> list[bytes]:
    request = {"task_data": task_data or {}, "client": client, "model": "m", "sampling": {}}
    return [uuid.uuid4().hex.encode(), b"run", msgpack.packb(request)]


def reply_to(sock: zmq.Socket, frames: list[bytes], timeout_s: float = 30.0) -> dict | None:
    sock.send_multipart(frames)
    while sock.poll(int(timeout_s * 1000)):
        request_id, kind, data = sock.recv_multipart()
        if kind == b"reply":
            return msgpack.unpackb(data)
    return None


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A server that calls http://127.0.0.1:1 only, with a frame cap of 8 MiB (shared by this module's tests)."""
    log = tmp_path_factory.mktemp("guarded") / "env.log"
    with env_server(log, "--allow-urls", "http://127.0.0.1:1", "--max-frame-mib", "8") as (address, proc):
        yield address, proc, log


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A server as it starts by default (shared by this module's tests)."""
    log = tmp_path_factory.mktemp("plain") / "env.log"
    with env_server(log) as (address, proc):
        yield address, proc, log


@pytest.mark.parametrize(
    "client, refused",
    [
        ({"base_url": "{listener}"}, "is not one this env server calls (http://127.0.0.1:1)"),
        ({"base_url": "http://127.0.0.1:1/v1", "headers_from_env": {"X-Leak": "ASYNCRL_LEAK_ME"}}, "'ASYNCRL_LEAK_ME'"),
        ({"base_url": "http://127.0.0.1:1/v1", "api_key_var": "ASYNCRL_LEAK_ME"}, "'ASYNCRL_LEAK_ME'"),
        ({"base_url": "http://127.0.0.1:1@{listener_host}/v1"}, "is not one this env server calls"),
    ],
)
def test_a_request_cannot_point_the_model_client_elsewhere_or_read_other_variables(guarded, client, refused):
    address, _, log = guarded
    listener = Listener()
    host = listener.url.removeprefix("http://").removesuffix("/v1")
    client = {
        k: v.format(listener=listener.url, listener_host=host) for k, v in client.items() if isinstance(v, str)
    } | {k: v for k, v in client.items() if not isinstance(v, str)}
    try:
        answer = reply_to(dealer(address), run_frames({"type": "eval", "api_key_var": "OPENAI_API_KEY", **client}))
        assert answer is not None and answer["success"] is False
        assert answer["error"].startswith("RequestRefused: refused: ") and refused in answer["error"], answer
        assert listener.seen == []  # nothing called, no key sent anywhere
        assert "Traceback" not in log.read_text()
    finally:
        listener.close()


def test_the_default_allows_loopback_model_endpoints_only(plain):
    address, _, log = plain
    listener = Listener()
    try:
        sock = dealer(address)
        far = reply_to(sock, run_frames({"type": "eval", "base_url": "http://10.255.0.1:8000/v1"}))
        allow = "(loopback hosts only); to allow it, start the env server with --allow-urls http://10.255.0.1:8000"
        assert allow in far["error"]
        near = reply_to(sock, run_frames({"type": "eval", "base_url": listener.url, "api_key_var": "OPENAI_API_KEY"}))
        assert "RequestRefused" not in (near or {}).get("error", "")  # let through: the task data is what fails
        wait_until(lambda: "request refused: 2 validation errors for CalcData" in log.read_text())
        assert "Traceback" not in log.read_text()  # a client's bad task data: one line
    finally:
        listener.close()


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_frame_above_the_cap_drops_its_connection_unread(guarded):
    address, proc, _ = guarded
    before = _rss_mib(proc.pid)
    sock = dealer(address)
    sock.send_multipart([b"id", b"run", b"\x00" * (256 << 20)])
    assert not sock.poll(3000)  # no answer: the connection was dropped
    del sock
    assert asyncio.run(_health(address, None, 5.0))  # still serving others
    grown = _rss_mib(proc.pid) - before
    assert grown < 64, f"the server's memory grew {grown:.0f} MiB for a 256 MiB frame"


def test_bound_beyond_loopback_without_a_secret_it_warns(caplog_loguru):
    from asyncrl.config.env_server import EnvServerConfig
    from asyncrl.orchestrator.envs.server import warn_if_open

    warn_if_open(EnvServerConfig(address="tcp://0.0.0.0:5000"), None)
    assert any(m.startswith("no secret and bound to 0.0.0.0: anyone who reaches") for m in caplog_loguru)
    caplog_loguru.clear()
    warn_if_open(EnvServerConfig(address="tcp://0.0.0.0:5000"), "s3cret")
    warn_if_open(EnvServerConfig(address="tcp://127.0.0.1:5000"), None)
    warn_if_open(EnvServerConfig(address="ipc:///tmp/env.sock"), None)
    assert caplog_loguru == []


def test_with_a_secret_it_refuses_strangers(tmp_path):
    with env_server(tmp_path / "shut.log", host="0.0.0.0", env={"ASYNCRL_ENV_SECRET": "s3cret"}) as (address, _):
        assert asyncio.run(_health(address, "s3cret", 5.0))
        assert not asyncio.run(_health(address, None, 2.0))
        assert not asyncio.run(_health(address, "guess", 2.0))
        sock = dealer(address)  # a stranger's request gets no answer and reaches nothing
        assert reply_to(sock, run_frames({"type": "eval", "base_url": "http://127.0.0.1:1/v1"}), timeout_s=2) is None
    assert "no secret" not in (tmp_path / "shut.log").read_text()


def _tool_calc_task() -> dict:
    from asyncrl.config.orchestrator import EnvConfig
    from asyncrl.orchestrator.envs.loading import load_env
    from asyncrl.orchestrator.envs.v1 import v1_tasks

    env = load_env(EnvConfig(id="tool-calc", args={"num_train_examples": 2, "seed": 1}))
    return v1_tasks(env, "tool-calc")[0].data.model_dump(mode="json")


def _chat_reply(i: int, body: dict) -> dict:
    """A tool call on every turn (the episode goes on till its turn limit)."""
    call = {"id": f"c{i}", "type": "function", "function": {"name": "calculate", "arguments": '{"expression": "1+1"}'}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    return {"id": f"r{i}", "object": "chat.completion", "created": 0, "model": body.get("model", "m"),
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]}  # fmt: skip


def test_clients_gone_mid_episode_cost_a_line_each_and_no_traceback(plain):
    address, _, log_file = plain
    start = len(log_file.read_text())  # what this test's clients make the server say
    model = Listener(_chat_reply, held=True)
    task = _tool_calc_task()
    try:
        for i in range(3):  # each starts an episode and vanishes (a killed process: no cancel)
            sock = dealer(address)
            sock.send_multipart(
                run_frames({"type": "eval", "base_url": model.url, "api_key_var": "OPENAI_API_KEY"}, task)
            )
            assert wait_until(lambda i=i: len(model.seen) > i)  # its episode calls the model: under way
            sock.close()
        model.release.set()  # the model answers: each episode goes on, with no client to send to
        wait_until(lambda: log_file.read_text().count("went away") >= 3)
        log = log_file.read_text()[start:]
    finally:
        model.close()
    assert log.count("a client went away mid-episode: its episode's frames are dropped (trace ") == 3, log
    assert "Traceback" not in log and "ZMQError" not in log and "failed to send response" not in log, log


def test_a_pool_of_workers_guards_as_one_server_does(tmp_path):
    log = tmp_path / "env.log"
    with env_server(log, "--workers", "2", "--max-frame-mib", "8") as (address, proc):
        # the pool's broker answers health itself, before its first worker (spawned: it imports verifiers and
        # loads the env) is up; a request sent before that waits for it
        assert wait_until(lambda: "EnvServer up" in log.read_text(), timeout_s=90), log.read_text()
        sock = dealer(address)
        answer = reply_to(sock, run_frames({"type": "eval", "base_url": "http://10.255.0.1:8000/v1"}))
        assert answer is not None and "RequestRefused: refused: its model endpoint" in answer["error"], answer
        before = _rss_mib(proc.pid)
        sock.send_multipart([b"id", b"run", b"\x00" * (256 << 20)])
        assert not sock.poll(3000)
        assert _rss_mib(proc.pid) - before < 64
    assert "Traceback" not in (tmp_path / "env.log").read_text()
