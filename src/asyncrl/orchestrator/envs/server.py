"""The `env-server` process: one verifiers v1 environment served over ZMQ by verifiers' own server (or pool).

An orchestrator (or `eval`/`synthesize`) sends it one task per episode and gets the episode back
(`verifiers.v1.EnvClient`; see `served.py`); the episode's model calls go from here to the inference
server the request names. The environment is configured exactly as in the orchestrator's own process
(`v1.load_v1_env`: agents on harness `asyncrl-chat`, the env's args), so an episode is the same
wherever it runs.

Each request's model endpoint and the environment variables it reads are checked against the server's own
configuration (`guard.py`); with a secret in `secret_var` only peers that share it get through (ZeroMQ CURVE),
and without one a server bound beyond loopback says so at start.

Invariants: a bad environment or args fail here, before anything binds, with one line; with
`parent_pid` set the server ends when that process is gone (even after its SIGKILL; at once when it is
the server's parent, by PR_SET_PDEATHSIG, else within a second), so a server an orchestrator started never
outlives it (one whose shutdown hangs or loses its SIGTERM is killed 3 s later).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import threading
import time

from loguru import logger

from asyncrl.config.env_server import EnvServerConfig
from asyncrl.core.errors import UserError
from asyncrl.orchestrator.envs.guard import Guard, is_loopback, secret, server_socket_options
from asyncrl.orchestrator.envs.loading import installed_module
from asyncrl.orchestrator.envs.tuning import tune_for_episodes
from asyncrl.orchestrator.envs.v1 import is_v1_module, load_v1_env
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
    if config.parent_pid is not None:  # first: a parent that dies while verifiers and the env load is seen at once
        watch_parent(config.parent_pid)
    from asyncrl.orchestrator.envs.guarded import quiet_serve_logs

    env = config.env
    module = installed_module(env.id)
    if not is_v1_module(module):
        raise UserError(f"env-server serves verifiers v1 environments; '{env.id}' is a classic one (run it in-process)")
    env_config = load_v1_env(module, env.id, env.args).config  # a bad env fails here, in one line, not per worker
    level = logging.DEBUG if config.log.level == "debug" else logging.WARNING  # a line per rollout: debug only
    quiet_serve_logs(level)
    tune_for_episodes()  # pool workers (spawned) run episodes untuned: their own processes
    logger.info(f"serving '{env.id}' with {config.workers} worker(s) on {config.address}")
    shared = secret(config.secret_var)
    warn_if_open(config, shared)
    options = server_socket_options(shared, config.max_frame_mib << 20)
    guard = Guard(tuple(config.allow_urls), tuple(config.allow_key_vars))
    kwargs = {"config": env_config, "max_concurrent": config.max_concurrent, "guard": guard}
    serving = serve_one if config.workers == 1 else serve_pool
    serving(kwargs, config, options, level, _SayAddress(env.id))


def serve_one(kwargs: dict, config: EnvServerConfig, options: dict, _level: int, says: _SayAddress) -> None:
    """One in-process verifiers `EnvServer` (what `serve_env` runs for one worker) whose SIGTERM/SIGINT cancel its
    serving task from the event loop. `serve_env` instead raises KeyboardInterrupt from a signal handler, at
    whatever line is running: inside a finalizer (aiohttp's `ClientResponse.__del__`, when a Ctrl-C stops
    episodes mid-request) Python prints and drops it, the handler has already ignored further SIGTERMs, and the
    server never shuts down (seen ~1 run in 6 under load; the parent watch then killed it, uncleanly)."""
    from asyncrl.orchestrator.envs.guarded import GuardedEnvServer

    server = GuardedEnvServer(address=config.address, socket_options=options, **kwargs)
    says.put(server.address)
    asyncio.run(_until_signalled(server.run()))


def serve_pool(kwargs: dict, config: EnvServerConfig, options: dict, level: int, says: _SayAddress) -> None:
    """verifiers' pool broker over `config.workers` worker processes, each a guarded server (`worker_setup`)."""
    from verifiers.v1.serve.pool import env_config_data

    from asyncrl.orchestrator.envs.guarded import GuardedPool, worker_setup

    kwargs = {**kwargs, "config_data": env_config_data(kwargs.pop("config"))}  # workers are spawned: picklable
    setup = functools.partial(worker_setup, level)
    broker = GuardedPool(kwargs, config.workers, config.address, setup, socket_options=options)
    says.put(broker.address)
    asyncio.run(_until_signalled(broker.run()))


def warn_if_open(config: EnvServerConfig, shared: str | None) -> None:
    """A WARNING when peers beyond this host can reach the server and no secret keeps them out."""
    host = config.address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if shared is not None or config.address.startswith("ipc://") or is_loopback(host):
        return
    logger.warning(
        f"no secret and bound to {host}: anyone who reaches {config.address} can run episodes here (their model "
        f"calls go only to {', '.join(config.allow_urls) or 'loopback hosts'}); set the same secret in "
        f"{config.secret_var} on this host and the orchestrator's to require it (ZeroMQ CURVE), or bind to 127.0.0.1"
    )


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
