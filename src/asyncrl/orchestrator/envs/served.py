"""A v1 environment whose episodes run in a standalone env server: start it or reach it, watch it, use it.

`[[orchestrator.env]] server = {}` starts an `env-server` child process on a free local port (its log:
`{output_dir}/logs/env-server-<env>.log`); `server = {address = "tcp://host:port"}` reaches one started
elsewhere (`env-server --env.id ... --address tcp://0.0.0.0:5000`). Episodes go out as their task's data
through verifiers' `EnvClient` and come back as episodes, which `v1.episode_outputs` turns into rollouts
exactly as for an in-process episode.

Invariants: an episode in flight when its server dies (a started one) or stops answering (one at an
address) fails at once with one line naming the server, so its rollout is counted as failed, never lost
or left hanging; a started server that dies is started again, up to `restarts` times, after which every
episode of that environment fails with the reason (and the orchestrator stops once whole groups keep
failing); a started server is stopped with the run, and ends by itself if this process is killed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from loguru import logger

from asyncrl.config.orchestrator import EnvConfig
from asyncrl.core.errors import UserError
from asyncrl.orchestrator.envs.guard import secret
from asyncrl.utils.process import free_port, spawn, stop_group, telling_tail

POLL_S = 0.5  # how often a started server's process is checked
HEALTH_EVERY_S, HEALTH_TIMEOUT_S, HEALTH_MISSES = 5.0, 10.0, 3  # a server at an address: lost after 3 misses


class EnvServerError(RuntimeError):
    """The episode's env server could not be started or reached, or was lost while the episode ran."""


class ServedEnv:
    """One environment's env server and the client to it; `run` one episode, `close` at the run's end."""

    def __init__(self, name: str, cfg: EnvConfig, log_dir: Path | None, client: Any = None):
        assert cfg.server is not None
        self.name, self.cfg, self.serving = name, cfg, cfg.server
        self.endpoint = client  # the model client (verifiers' config) episodes get: a server started here allows it
        self.log = (log_dir / f"env-server-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.log") if log_dir else None
        self.proc: Any = None
        self.client: Any = None
        self.lost: asyncio.Future | None = None  # its result: why the current server was lost
        self.watcher: asyncio.Task | None = None
        self.gone: str | None = None  # set once no server will come back
        self.restarts_left = self.serving.restarts
        self.retired: list[Any] = []  # clients of lost servers, closed with the run
        self.lock = asyncio.Lock()

    @property
    def where(self) -> str:
        return self.serving.address or (f"started here, log {self.log}" if self.log else "started here")

    async def run(self, task: Any, client: Any, model: str, sampling: Any) -> Any:
        """One episode of `task` in the server: its episode, or EnvServerError when the server goes away first."""
        env_client, lost = await self.ready()
        data = task.data.model_dump(mode="json")
        episode = asyncio.ensure_future(env_client.run(client, model, sampling, data))
        await asyncio.wait({episode, lost}, return_when=asyncio.FIRST_COMPLETED)
        if episode.done():
            return episode.result()
        episode.cancel()
        raise EnvServerError(lost.result())

    async def ready(self) -> tuple[Any, asyncio.Future]:
        async with self.lock:
            if self.gone is not None:
                raise EnvServerError(self.gone)
            if self.client is None:
                try:
                    await self.start()
                except UserError as e:
                    self.gone = str(e)
                    raise EnvServerError(self.gone) from None
            return self.client, self.lost

    async def start(self) -> None:
        from asyncrl.orchestrator.envs.guarded import GuardedEnvClient

        address = self.serving.address
        if address is None:
            address = f"tcp://127.0.0.1:{free_port()}"
            self.proc = spawn(self.command(address), self.log)
        client = GuardedEnvClient(address, secret(self.serving.secret_var))
        try:
            await self.wait_healthy(client)
        except BaseException:
            await client.close()
            raise
        self.client, self.lost = client, asyncio.get_running_loop().create_future()
        self.watcher = asyncio.create_task(self.watch(client, self.lost))
        logger.info(f"environment {self.name}: env server at {address} ({self.where})")

    def command(self, address: str) -> list[str]:
        cmd = [sys.executable, "-m", "asyncrl.entrypoints.env_server", "--env.id", self.cfg.id]
        cmd += ["--env.args", json.dumps(self.cfg.args), "--address", address, "--workers", str(self.serving.workers)]
        if self.serving.max_concurrent is not None:
            cmd += ["--max-concurrent", str(self.serving.max_concurrent)]
        if self.endpoint is not None:  # what this orchestrator's episodes call, and the key variable they read
            cmd += ["--allow-urls", json.dumps([self.endpoint.base_url])]
            cmd += ["--allow-key-vars", json.dumps([self.endpoint.api_key_var])]
        cmd += ["--secret-var", self.serving.secret_var]
        if self.log is not None:  # the run's directory (its logs/ holds ours): the server is findable by it
            cmd += ["--output-dir", str(self.log.parent.parent)]
        return cmd + ["--parent-pid", str(os.getpid()), "--log.file", "false"]

    async def wait_healthy(self, client: Any) -> None:
        deadline = time.monotonic() + self.serving.startup_timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                if self.log is not None:
                    logger.error(f"env server for environment {self.name}:\n{telling_tail(self.log, prefix='    ')}")
                raise UserError(
                    f"env server for environment {self.name} exited with code {self.proc.returncode} while starting"
                    + (f" (its log: {self.log})" if self.log else "")
                )
            if await client.health(timeout=2.0):
                return
            await asyncio.sleep(0.2)
        self.stop_process()
        started = (
            f"; its log: {self.log}" if self.proc is not None else f" (start it: {self.hint()}; or {self.secret_hint})"
        )
        raise UserError(
            f"env server for environment {self.name} at {self.serving.address or 'a local port'} did not answer "
            f"in {self.serving.startup_timeout:g} s{started}"
        )

    @property
    def secret_hint(self) -> str:
        return f"the secret in {self.serving.secret_var} is set here or there, not on both hosts"

    def hint(self) -> str:
        args = json.dumps(self.cfg.args)
        return f"env-server --env.id {self.cfg.id} --env.args '{args}' --address {self.serving.address}"

    async def watch(self, client: Any, lost: asyncio.Future) -> None:
        """Until the server is lost: then fail its episodes in flight, and start it again (or give up)."""
        reason = await (self.process_exit() if self.proc is not None else self.silence(client))
        lost.set_result(reason)
        self.client = None
        self.retired.append(client)
        self.stop_process()  # what the dead server left of its process group (a pool's workers)
        if self.proc is None:
            logger.error(f"{reason}: its episodes in flight failed; reconnecting for the next ones")
        elif self.restarts_left > 0:
            self.restarts_left -= 1
            n = self.serving.restarts - self.restarts_left
            logger.error(f"{reason}: its episodes in flight failed; starting it again ({n} of {self.serving.restarts})")
        else:
            self.gone = f"{reason}, and was restarted {self.serving.restarts} times already (server.restarts)"
            logger.error(f"{self.gone}: every episode of environment {self.name} now fails")

    async def process_exit(self) -> str:
        while self.proc.poll() is None:
            await asyncio.sleep(POLL_S)
        return f"env server for environment {self.name} died (exit code {self.proc.returncode}; log {self.log})"

    async def silence(self, client: Any) -> str:
        misses = 0
        while misses < HEALTH_MISSES:
            await asyncio.sleep(HEALTH_EVERY_S)
            misses = 0 if await client.health(timeout=HEALTH_TIMEOUT_S) else misses + 1
        return f"env server for environment {self.name} at {self.serving.address} stopped answering"

    def stop_process(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace=10.0)

    async def close(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
            await asyncio.gather(self.watcher, return_exceptions=True)
        self.stop_process()  # first: a server whose client is gone can hang in its shutdown on a reply it owes
        for client in [*self.retired, *([self.client] if self.client is not None else [])]:
            await client.close()
