"""verifiers' env server, pool broker and client, with `guard.py`'s checks and socket options, and one-line logs.

`GuardedEnvServer` refuses a request the `Guard` refuses before its episode starts; the bound socket of a server
or broker gets the frame cap and CURVE (`guard.server_socket_options`) and a client's socket the matching keys,
set as verifiers assigns the socket, before it binds or connects. A pool's workers (spawned processes) serve
through `GuardedEnvServer` too: `worker_setup`, the pool's per-process setup hook, installs it there.

A client's health check is bounded as a whole, its send included (verifiers bounds only the wait for the reply).

Three things verifiers logs with a traceback are one line here: a refused request, a request whose data does
not validate, and a client that went away mid-episode (its ROUTER then cannot deliver the episode's next frame).

Invariants: every class here is registered in `core/patches.py` (it relies on how verifiers builds its sockets);
a pool worker that lacks the guard fails on its unknown `guard` argument instead of serving unguarded.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import zmq
from pydantic import ValidationError
from verifiers.v1.serve import pool
from verifiers.v1.serve.client import EnvClient
from verifiers.v1.serve.server import EnvServer

from asyncrl.orchestrator.envs.guard import Guard, RequestRefused, client_socket_options
from asyncrl.utils.logging import forward_stdlib

SERVE_LOGGERS = ("verifiers.v1.serve.server", "verifiers.v1.serve.pool", "verifiers.v1.serve.delta")
GONE = "a client went away mid-episode: its episode's frames are dropped (trace {})"


def _optioned(attr: str) -> property:
    """A socket attribute that gets the instance's `_socket_options` as it is assigned."""

    def get(self) -> Any:
        return self.__dict__[attr]

    def set_(self, socket: Any) -> None:
        for option, value in self._socket_options.items():
            socket.setsockopt(option, value)
        self.__dict__[attr] = socket

    return property(get, set_)


class GuardedEnvServer(EnvServer):
    frontend = _optioned("frontend")

    def __init__(self, *, guard: Guard, socket_options: dict[int, Any] | None = None, **kwargs: Any):
        self.guard, self._socket_options = guard, socket_options or {}
        super().__init__(**kwargs)

    async def _run(self, req: Any, client_id: bytes, request_id: bytes) -> Any:
        why = self.guard.refusal(req.client)
        if why is not None:
            raise RequestRefused(f"refused: {why}")
        return await super()._run(req, client_id, request_id)


class GuardedPool(pool.EnvServerPool):
    frontend = _optioned("frontend")

    def __init__(self, *args: Any, socket_options: dict[int, Any], **kwargs: Any):
        self._socket_options = socket_options
        super().__init__(*args, **kwargs)


class GuardedEnvClient(EnvClient):
    socket = _optioned("socket")

    def __init__(self, address: str, secret: str | None):
        self._socket_options = client_socket_options(secret)
        super().__init__(address)

    async def health(self, timeout: float = 2.0) -> bool:
        """Whether the server answers within `timeout` s. verifiers' `health` bounds the wait for the reply only; its
        send waits while the socket has no connected peer, which is forever against a server whose handshake refuses
        this client's keys (it drops each connection the socket makes)."""
        try:
            return await asyncio.wait_for(super().health(timeout), timeout)
        except TimeoutError:
            return False


def worker_setup(level: int) -> None:
    """A pool worker's setup (spawned: nothing of the parent's is set): the guard, and its logs as the parent's."""
    pool.EnvServer = GuardedEnvServer
    quiet_serve_logs(level)


def quiet_serve_logs(level: int) -> None:
    """verifiers' records at `level` and above into loguru; the serve loggers' lines at INFO, one line each."""
    forward_stdlib("verifiers", level)
    for name in SERVE_LOGGERS:
        served = logging.getLogger(name)
        served.setLevel(logging.INFO)
        served.addFilter(_one_line)


def _one_line(record: logging.LogRecord) -> bool:
    """A refused request without its traceback; a departed client as one line for its episode (verifiers logs a
    traceback for each frame the episode then fails to send, and one for its reply)."""
    error = record.exc_info[1] if record.exc_info else None
    if isinstance(error, RequestRefused):
        record.exc_info = record.exc_text = None
        return True
    if isinstance(error, ValidationError):  # a request whose task data or config is not what this env takes
        said = " ".join(str(error).split())
        record.msg, record.args, record.exc_info, record.exc_text = f"request refused: {said}", (), None, None
        return True
    if record.args and _client_gone(record.args[0]):
        return False  # "failed to send response": the reply to a departed client, whose episode was reported
    if not _client_gone(error):
        return True
    trace = record.args[0] if record.args else "?"  # "failed to send delta for %s"
    if trace in _reported:
        return False
    _reported[trace] = None
    while len(_reported) > 4096:
        del _reported[next(iter(_reported))]
    record.msg, record.args, record.exc_info, record.exc_text = GONE.format(trace), (), None, None
    return True


_reported: dict = {}  # the traces whose departed client was logged (oldest first)


def _client_gone(error: Any) -> bool:
    """A ZMQ EHOSTUNREACH anywhere in `error`'s chain (or group): the ROUTER's peer has disconnected."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, zmq.ZMQError) and e.errno == zmq.EHOSTUNREACH:
            return True
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return False
