"""The `env-server` process: one verifiers v1 environment served over ZMQ with verifiers' own `serve_env`.

An orchestrator (or `eval`/`synthesize`) sends it one task per episode and gets the episode back
(`verifiers.v1.EnvClient`; see `served.py`); the episode's model calls go from here to the inference
server the request names. The environment is configured exactly as in the orchestrator's own process
(`v1.load_v1_env`: agents on harness `asyncrl-chat`, the env's args), so an episode is the same
wherever it runs.

Invariants: a bad environment or args fail here, before anything binds, with one line; with
`parent_pid` set the server ends when that process is gone (even after its SIGKILL; at once when it is
the server's parent, by PR_SET_PDEATHSIG, else within a second), so a server an orchestrator started never
outlives it (one whose shutdown hangs or loses its SIGTERM is killed 3 s later).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time

from loguru import logger

from asyncrl.config.env_server import EnvServerConfig
from asyncrl.core.errors import UserError
from asyncrl.orchestrator.envs.loading import installed_module
from asyncrl.orchestrator.envs.tuning import tune_for_episodes
from asyncrl.orchestrator.envs.v1 import is_v1_module, load_v1_env
from asyncrl.utils.logging import forward_stdlib
from asyncrl.utils.process import die_with_parent, pid_alive

PARENT_POLL_S = 1.0
PARENT_GRACE_S = 3.0  # after SIGTERM, for a server whose parent is gone: then SIGKILL


class _SayAddress:
    """`serve_env`'s address queue: the bound address (a port-0 bind's real port) goes to the log."""

    def __init__(self, env_id: str):
        self.env_id = env_id

    def put(self, address: str) -> None:
        logger.success(f"env server for '{self.env_id}' listening on {address}")


def serve(config: EnvServerConfig) -> None:
    """Validate the environment, then serve it until SIGTERM/SIGINT (or the parent process is gone)."""
    from verifiers.v1.serve import serve_env

    env = config.env
    module = installed_module(env.id)
    if not is_v1_module(module):
        raise UserError(f"env-server serves verifiers v1 environments; '{env.id}' is a classic one (run it in-process)")
    env_config = load_v1_env(module, env.id, env.args).config  # a bad env fails here, in one line, not per worker
    quiet = config.log.level != "debug"  # a line per rollout at INFO: only with debug
    forward_stdlib("verifiers", logging.WARNING if quiet else logging.DEBUG)
    logging.getLogger("verifiers.v1.serve").setLevel(logging.INFO)  # the server's up/down lines
    tune_for_episodes()  # pool workers (spawned) run episodes untuned: their own processes
    if config.parent_pid is not None:
        watch_parent(config.parent_pid)
    logger.info(f"serving '{env.id}' with {config.workers} worker(s) on {config.address}")
    if config.workers == 1:
        serve_one(env_config, config, _SayAddress(env.id))
        return
    serve_env(
        max_workers=config.workers,
        address=config.address,
        address_queue=_SayAddress(env.id),
        config=env_config,
        max_concurrent=config.max_concurrent,
    )


def serve_one(env_config, config: EnvServerConfig, address_queue: _SayAddress) -> None:
    """One in-process verifiers `EnvServer` (what `serve_env` runs for one worker) whose SIGTERM/SIGINT cancel its
    serving task from the event loop. `serve_env` instead raises KeyboardInterrupt from a signal handler, at
    whatever line is running: inside a finalizer (aiohttp's `ClientResponse.__del__`, when a Ctrl-C stops
    episodes mid-request) Python prints and drops it, the handler has already ignored further SIGTERMs, and the
    server never shuts down (seen ~1 run in 6 under load; the parent watch then killed it, uncleanly)."""
    from verifiers.v1.serve.server import EnvServer

    server = EnvServer(config=env_config, address=config.address, max_concurrent=config.max_concurrent)
    address_queue.put(server.address)
    asyncio.run(_until_signalled(server.run()))


async def _until_signalled(serving) -> None:
    """Run `serving` until it ends or SIGTERM/SIGINT cancels it (its own finally then closes the server)."""
    task = asyncio.ensure_future(serving)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        pass


def watch_parent(pid: int) -> None:
    """SIGTERM this process once `pid` is gone (our parent, once we are reparented; another process, once
    it no longer exists), and SIGKILL it if it is still running `PARENT_GRACE_S` later."""
    child = os.getppid() == pid
    if child:  # at once, by the kernel, however the parent ends (the watch below covers a non-parent pid)
        die_with_parent(pid)

    def gone() -> bool:
        return os.getppid() != pid if child else not pid_alive(pid)

    def watch() -> None:  # says why on fd 2 (our log), not through the logger: a lock there must not stop it
        while not gone():
            time.sleep(PARENT_POLL_S)
        os.write(2, f"env-server: parent process {pid} is gone: stopping\n".encode())
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(PARENT_GRACE_S)  # verifiers takes the first SIGTERM only, and its shutdown can hang
        os.write(2, f"env-server: still running {PARENT_GRACE_S:g} s later: killing myself\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
