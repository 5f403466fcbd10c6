"""The aiohttp-backed httpx transport sends what httpx built and hands back what the server sent.

A real aiohttp server on a local port records each request, so each test sees both sides of the wire:
bodies and headers go out unchanged, JSON, streamed (SSE) and compressed answers read as over httpcore,
failures surface as the httpx exceptions the OpenAI SDK classifies, and the per-loop client closes.
"""

from __future__ import annotations

import asyncio
import gzip
import json

import httpx
import pytest
from aiohttp import web
from openai import APIConnectionError, AsyncOpenAI

from asyncrl.orchestrator.envs.http import AioHttpTransport, close_shared_http, shared_http
from asyncrl.utils.process import free_port


async def serve(seen: list) -> tuple[web.AppRunner, str]:
    async def echo(request: web.Request) -> web.Response:
        seen.append((request.method, request.path_qs, dict(request.headers), await request.read()))
        return web.json_response({"got": json.loads(await request.read() or b"null")}, headers={"X-Reply": "1"})

    async def stream(request: web.Request) -> web.StreamResponse:
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        for i in range(3):
            await reply.write(f"data: {i}\n\n".encode())
        await reply.write_eof()
        return reply

    async def gzipped(request: web.Request) -> web.Response:
        return web.Response(body=gzip.compress(b'{"zipped": true}'), headers={"Content-Encoding": "gzip"})

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(1)
        return web.Response(text="late")

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_get("/echo", echo)
    app.router.add_get("/stream", stream)
    app.router.add_get("/gzip", gzipped)
    app.router.add_get("/slow", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def run(test) -> None:
    async def main():
        seen: list = []
        runner, url = await serve(seen)
        http = httpx.AsyncClient(transport=AioHttpTransport(), timeout=httpx.Timeout(2.0))
        try:
            await test(http, url, seen)
        finally:
            await http.aclose()
            await runner.cleanup()

    asyncio.run(main())


def test_a_post_goes_out_as_httpx_built_it_and_its_answer_comes_back():
    async def test(http, url, seen):
        got = await http.post(f"{url}/echo?q=1", json={"a": [1, 2]}, headers={"X-Session-ID": "s1"})
        assert got.status_code == 200 and got.json() == {"got": {"a": [1, 2]}}
        assert got.headers["x-reply"] == "1" and got.http_version == "HTTP/1.1"
        method, path, headers, body = seen[0]
        assert (method, path, json.loads(body)) == ("POST", "/echo?q=1", {"a": [1, 2]})
        assert headers["X-Session-ID"] == "s1" and headers["Content-Type"] == "application/json"
        assert int(headers["Content-Length"]) == len(body)
        assert (await http.get(f"{url}/echo")).json() == {"got": None}  # a GET without a body

    run(test)


def test_a_streamed_answer_arrives_in_order_and_httpx_decodes_gzip_itself():
    async def test(http, url, seen):
        async with http.stream("GET", f"{url}/stream") as reply:
            text = b"".join([chunk async for chunk in reply.aiter_raw()])
        assert text == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        assert (await http.get(f"{url}/gzip")).json() == {"zipped": True}

    run(test)


def test_connections_are_reused_across_requests():
    async def test(http, url, seen):
        for _ in range(5):
            await http.post(f"{url}/echo", json={})
        assert len({h.get("Host") for _, _, h, _ in seen}) == 1
        connector = http._transport.session().connector
        assert sum(len(conns) for conns in connector._conns.values()) == 1  # one idle connection, kept

    run(test)


def test_failures_are_httpx_exceptions_the_openai_sdk_classifies():
    async def test(http, url, seen):
        with pytest.raises(httpx.ReadTimeout):
            await http.get(f"{url}/slow", timeout=httpx.Timeout(0.2))
        with pytest.raises(httpx.ConnectError):
            await http.get(f"http://127.0.0.1:{free_port()}/echo")
        sdk = AsyncOpenAI(base_url=f"http://127.0.0.1:{free_port()}/v1", api_key="k", max_retries=0, http_client=http)
        with pytest.raises(APIConnectionError):
            await sdk.models.list()

    run(test)


def test_the_shared_client_is_one_per_event_loop_until_closed():
    async def main():
        first = shared_http()
        assert shared_http() is first
        await close_shared_http()
        assert first.is_closed and shared_http() is not first
        await close_shared_http()

    asyncio.run(main())


def test_the_shared_client_closes_at_its_loops_end_without_close_shared_http():
    seen: list = []

    async def main():
        runner, url = await serve(seen)
        http = shared_http()
        await http.post(f"{url}/echo", json={})  # an idle keep-alive connection left open
        await runner.cleanup()
        return http

    http = asyncio.run(main())  # asyncio.run finalizes the loop's async generators: the client's closer
    assert http.is_closed and http._transport._session is None
