"""An httpx transport over one aiohttp connection pool, for the v1 episodes' HTTP calls in this process.

A v1 episode makes its model calls over HTTP twice in this process: the chat loop (`harness`) posts to
verifiers' interception server, and verifiers' training client posts the rendered token ids to the
engine's `/inference/v1/generate`. Both are httpx clients, and httpcore's pool probes every idle
connection (a `poll` and a `getpeername` each) on each request it starts or ends: with one connection
per episode in flight, that scan was the largest CPU cost of an episode after the GC. aiohttp's pool
takes an idle connection off a per-host queue instead. `AioHttpTransport` is only the wire: httpx (and
the OpenAI SDK above it) still build the requests and read the responses, so both clients send the same
bytes and see the same answers as over httpcore.

Invariants:
- The request goes out as httpx built it (method, URL, headers, body); the response comes back
  undecoded (httpx applies its own content decoding), streamed, its connection released on close.
- A failure is raised as the httpx exception its class maps to (connect, timeout, protocol), so the
  OpenAI SDK and verifiers classify it as they would one from httpcore.
- The aiohttp session is made on first use, in the running event loop, and closed by `aclose()`.
- `shared_http()` is one client per event loop (a loop's chat loops share it), until `close_shared_http()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
import weakref
from collections.abc import AsyncIterator

import aiohttp
import httpx

# headers aiohttp sets itself from the body it sends
_BODY_HEADERS = frozenset({b"content-length", b"transfer-encoding"})


class AioHttpTransport(httpx.AsyncBaseTransport):
    """httpx's transport interface on an aiohttp session: every connection kept alive, none limited."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # httpx's TLS settings (certifi), its content decoding (auto_decompress off) and its cookies
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ssl=tls_context()),
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = b"".join([part async for part in request.stream])
        # as httpx would send them: raw, names in their own case
        headers = [
            (k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw if k.lower() not in _BODY_HEADERS
        ]
        try:
            reply = await self.session().request(
                request.method,
                str(request.url),
                headers=headers,
                data=body or None,
                timeout=client_timeout(request),
                allow_redirects=False,
                skip_auto_headers=("Content-Type",),
            )
        except (aiohttp.ClientError, TimeoutError) as e:
            raise as_httpx_error(e, request) from e
        return httpx.Response(
            reply.status,
            headers=list(reply.raw_headers),
            stream=AioHttpStream(reply, request),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": (reply.reason or "").encode()},
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class AioHttpStream(httpx.AsyncByteStream):
    """A response body read from aiohttp as it arrives; closing it releases the connection to the pool."""

    def __init__(self, reply: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self.reply, self.request = reply, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.reply.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as e:
            raise as_httpx_error(e, self.request) from e

    async def aclose(self) -> None:
        self.reply.release()


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default TLS context (certifi's CA bundle), loaded once for every session."""
    return httpx.create_ssl_context()


def client_timeout(request: httpx.Request) -> aiohttp.ClientTimeout:
    """httpx's per-request connect and read timeouts as aiohttp's (no pool limit to wait for; aiohttp has
    no write timeout)."""
    t = request.extensions.get("timeout") or {}
    return aiohttp.ClientTimeout(total=None, sock_connect=t.get("connect"), sock_read=t.get("read"))


def as_httpx_error(error: Exception, request: httpx.Request) -> httpx.TransportError:
    """An aiohttp failure (or a timeout) as the httpx exception of its kind."""
    if isinstance(error, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(str(error) or "connect timed out", request=request)
    if isinstance(error, TimeoutError):  # aiohttp's read timeouts are TimeoutErrors too
        return httpx.ReadTimeout(str(error) or "read timed out", request=request)
    if isinstance(error, aiohttp.ClientConnectorError):
        return httpx.ConnectError(str(error), request=request)
    if isinstance(error, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError):
        return httpx.RemoteProtocolError(str(error), request=request)
    return httpx.NetworkError(str(error), request=request)


_SHARED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[httpx.AsyncClient, AsyncIterator[None]]] = (
    weakref.WeakKeyDictionary()
)


def shared_http() -> httpx.AsyncClient:
    """This event loop's HTTP client for the in-process chat loops (model calls to the local interception
    server, tool gating): made on first use, every connection kept alive until `close_shared_http()` or
    the loop's end, whichever comes first (a process that never closes its runner, e.g. an env server's
    worker, still closes it: `asyncio.run` finalizes the loop's live async generators, `closer` among them)."""
    loop = asyncio.get_running_loop()
    if loop not in _SHARED:
        client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), transport=AioHttpTransport())
        guard = closer(client)
        with contextlib.suppress(StopIteration):  # run it to its `yield`: the loop now tracks it
            guard.__anext__().send(None)
        _SHARED[loop] = (client, guard)
    return _SHARED[loop][0]


async def closer(client: httpx.AsyncClient) -> AsyncIterator[None]:
    """Closes `client` when finalized (`aclose()`, by `close_shared_http` or by the loop's shutdown)."""
    try:
        yield
    finally:
        await client.aclose()


async def close_shared_http() -> None:
    """Close this event loop's shared client (its runner is done); a later episode opens a new one."""
    entry = _SHARED.pop(asyncio.get_running_loop(), None)
    if entry is not None:
        await entry[1].aclose()
