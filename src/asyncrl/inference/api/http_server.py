"""The HTTP layer under the app: uvicorn's h11 protocol with the deadlines uvicorn lacks, and its options.

`uvicorn_options(server)` is what both engines pass to uvicorn (the embedded server's `uvicorn.run`, vLLM's
`serve_http`): `BoundedH11Protocol` (below), the keep-alive timeout and the largest request head.

`BoundedH11Protocol` is uvicorn's h11 protocol plus:

- a head deadline: a request's line and headers must all arrive within `head_timeout_s` of its first byte
  (of the connection, for its first request), else 408 and the connection is closed: a client that trickles
  a header line a second (slowloris) or connects and says nothing holds no connection for long;
- a body deadline: the body must arrive within `body_timeout_s` of the head (408 while the app still waits);
- both count the client's time, not the server's: when a deadline falls due while the client's bytes wait
  unread in the kernel (the loop was busy or the process starved; uvloop runs due timers before it polls), the
  server reads them first and looks again `GRACE_S` later, once per deadline;
- the status h11 suggests for a request it cannot parse (431 for a head over `max_header_kib`, else 400)
  with the one error body, where uvicorn answers every such request with a plain-text 400;
- lingering close: a connection the server ends while the client is still sending (a 413, a 431) is
  half-closed and drained for `LINGER_S` before it is closed, so the client reads the answer rather than a
  reset (closing a socket with unread data makes the kernel reset it).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from asyncrl.config.inference import ServerConfig
from asyncrl.inference.api.errors import error_body

LINGER_S = 2.0
GRACE_S = 0.1


def uvicorn_options(server: ServerConfig) -> dict[str, Any]:
    """Keyword arguments for uvicorn (`uvicorn.run`, `uvicorn.Config`, vLLM's `serve_http`)."""
    protocol = type(
        "BoundedH11Protocol",
        (BoundedH11Protocol,),
        {"head_timeout_s": server.head_timeout_s, "body_timeout_s": server.body_timeout_s},
    )
    return {
        "http": protocol,
        "timeout_keep_alive": server.keep_alive_timeout_s,
        "h11_max_incomplete_event_size": server.max_header_kib * 1024,
    }


class _Connection(h11.Connection):
    """h11's connection, remembering the status h11 suggests for the last request it could not parse."""

    error_status = 400

    def next_event(self):
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.error_status = e.error_status_hint
            raise


class _LingeringTransport:
    """The connection's transport, whose `close()` half-closes, drains what the client still sends, and
    closes after `LINGER_S` (or at once when the client closes its side)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self.lingering = False

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.lingering or self._transport.is_closing():
            return
        self.lingering = True
        try:
            if self._transport.can_write_eof():
                self._transport.write_eof()
            self._transport.resume_reading()
        except (OSError, RuntimeError):
            return self._transport.close()
        self._loop.call_later(LINGER_S, self._transport.close)


class BoundedH11Protocol(H11Protocol):
    head_timeout_s = 10.0
    body_timeout_s = 60.0

    def __init__(self, config, server_state, app_state, _loop=None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.conn = _Connection(h11.SERVER, self.conn._max_incomplete_event_size)
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_for: str | None = None  # "head" | "body"
        self._graced = False  # the deadline now running was already extended once for unread bytes

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_LingeringTransport(transport, self.loop))  # type: ignore[arg-type]
        self._arm("head")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.lingering:
            return  # draining a connection that is being closed
        super().data_received(data)
        self._track_request()

    def eof_received(self) -> bool | None:
        if self.transport.lingering:
            self.transport._transport.close()
        return None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track_request()

    def _track_request(self) -> None:
        """Arm the deadline of what the server waits for now: a request's head, its body, or neither."""
        state = self.conn.their_state
        if state is h11.IDLE and self.conn.our_state is h11.IDLE and self._has_buffered_bytes():
            self._arm("head")  # the next request began (an idle connection is uvicorn's keep-alive timer's)
        elif state is h11.SEND_BODY and self.cycle is not None and not self.cycle.response_complete:
            self._arm("body")
        elif state is not h11.IDLE or self.conn.our_state is not h11.IDLE:
            self._disarm()

    def _has_buffered_bytes(self) -> bool:
        return bool(self.conn.trailing_data[0])

    def _arm(self, what: str) -> None:
        if self._deadline_for == what:
            return
        self._disarm()
        timeout = self.head_timeout_s if what == "head" else self.body_timeout_s
        self._deadline = self.loop.call_later(timeout, self._expired, what)
        self._deadline_for, self._graced = what, False

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._deadline_for = None, None

    def _expired(self, what: str) -> None:
        if self.transport.is_closing():
            return self._disarm()
        if not self._graced and _unread_bytes(self.transport):
            self._deadline, self._graced = self.loop.call_later(GRACE_S, self._expired, what), True
            return  # the client sent in time; the server was late to read it
        self._deadline, self._deadline_for = None, None
        if self.cycle is not None and not self.cycle.response_complete:
            if self.cycle.response_started:
                return  # the app is answering; only the head or body it waits for is bounded
            self.cycle.disconnected = True  # the app sees the client gone; its answer is dropped
            self.cycle.message_event.set()
        timeout = self.head_timeout_s if what == "head" else self.body_timeout_s
        self._send_error(408, f"the request {what} did not arrive within {timeout:g} s")

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse: the status h11 suggests (431: head too large), the one error body."""
        status = self.conn.error_status
        if status == 431:
            size = self.conn._max_incomplete_event_size // 1024
            msg = f"request line and headers are larger than {size} KiB (the server's --server.max-header-kib)"
        else:
            msg = "invalid HTTP request"
        self._send_error(status, msg)

    def _send_error(self, status: int, message: str) -> None:
        """Answer `status` outside any request cycle (the request is unusable), then close the connection."""
        self._disarm()
        body = json.dumps(error_body(status, message)).encode()
        head = f"HTTP/1.1 {status} {_reason(status)}\r\ncontent-type: application/json\r\n"
        head += f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        self.transport.write(head.encode() + body)  # raw: h11 may be in an error state or mid-request
        self.transport.close()


def _unread_bytes(transport: asyncio.BaseTransport) -> bool:
    """Whether the connection's socket holds received bytes the server has not read yet (peeked, not taken)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        with socket.socket(fileno=os.dup(sock.fileno())) as peer:
            return bool(peer.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # nothing waiting (BlockingIOError), or the socket is gone
        return False


def _reason(status: int) -> str:
    return HTTPStatus(status).phrase
