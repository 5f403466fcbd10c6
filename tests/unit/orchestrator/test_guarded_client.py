"""`GuardedEnvClient.health` is bounded as a whole: a client whose socket never gets a connected peer (a server
whose handshake refuses its keys drops every connection) answers False in its time instead of waiting forever."""

from __future__ import annotations

import asyncio

import zmq

from asyncrl.orchestrator.envs import guarded
from asyncrl.utils.process import free_port


def test_health_answers_false_in_its_time_while_no_connection_completes(monkeypatch):
    # ZMQ_IMMEDIATE: the socket queues nothing until a connection completes, and none does (nothing listens), as
    # between the dropped connections of a refused handshake. verifiers' send then waits with no deadline.
    monkeypatch.setattr(guarded, "client_socket_options", lambda secret: {zmq.IMMEDIATE: 1})

    async def check() -> bool:
        client = guarded.GuardedEnvClient(f"tcp://127.0.0.1:{free_port()}", None)
        try:  # the outer bound only keeps a regression from hanging the suite: it fails the test with TimeoutError
            return await asyncio.wait_for(client.health(timeout=0.5), 20)
        finally:
            await client.close()

    assert asyncio.run(check()) is False
