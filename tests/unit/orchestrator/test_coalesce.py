"""A group's identical chat requests go out as one n = k request; each requester still gets its own answer.

The inner transport is a fake server that answers n = k with k choices (like vLLM and the embedded
engine) and records what it was sent, so each test sees both sides of the wire.
"""

from __future__ import annotations

import asyncio
import json

import httpx2
import pytest

from asyncrl.orchestrator.envs import coalesce
from asyncrl.orchestrator.envs.coalesce import MergingTransport, split_answer

URL = "http://server/v1/chat/completions"


@pytest.fixture(autouse=True)
def wide_window(monkeypatch):
    """These tests check what merging does, not how long a merge waits for its group: a 2 ms window let a loaded
    machine (a process descheduled between two arrivals) split a group that arrived together. 0.2 s here."""
    monkeypatch.setattr(coalesce, "MERGE_WINDOW_S", 0.2)


class FakeServer:
    def __init__(self, status: int = 200, short: bool = False, delay: float = 0.0) -> None:
        self.bodies: list[dict] = []
        self.status, self.short, self.delay = status, short, delay
        self.cancelled = 0
        self.gate: asyncio.Event | None = None  # set: each request waits for it instead of `delay`
        self.arrived: asyncio.Event | None = None  # set when a request reaches the server
        self.gone: asyncio.Event | None = None  # set when a request in the server is cancelled

    async def __call__(self, request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content) if request.content else {}
        self.bodies.append(body)
        if self.arrived is not None:
            self.arrived.set()
        try:
            await (self.gate.wait() if self.gate is not None else asyncio.sleep(self.delay))
        except asyncio.CancelledError:
            self.cancelled += 1
            if self.gone is not None:
                self.gone.set()
            raise
        n = body.get("n", 1)
        if self.status != 200 and n > 1:  # e.g. a server that caps n: only the merged request fails
            return httpx2.Response(self.status, json={"error": {"message": "n too large"}})
        choices = [
            {"index": i, "message": {"role": "assistant", "content": f"c{i}"}, "token_ids": list(range(i + 1))}
            for i in range(n - (self.short and n > 1))
        ]
        usage = {"prompt_tokens": 5, "completion_tokens": sum(i + 1 for i in range(n)), "total_tokens": 0}
        return httpx2.Response(
            200, json={"id": "cmpl-1", "object": "chat.completion", "choices": choices, "usage": usage}
        )


def client(server: FakeServer, **kw) -> tuple[httpx2.AsyncClient, MergingTransport]:
    transport = MergingTransport(httpx2.MockTransport(server), **kw)
    return httpx2.AsyncClient(transport=transport), transport


def body(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


async def post_many(http: httpx2.AsyncClient, bodies: list[dict], url: str = URL) -> list[httpx2.Response]:
    return await asyncio.gather(*(http.post(url, json=b) for b in bodies))


def test_identical_requests_go_out_as_one_with_n_and_come_back_one_choice_each():
    async def go():
        server = FakeServer()
        http, transport = client(server)
        answers = [r.json() for r in await post_many(http, [body()] * 8)]
        return server, transport, answers

    server, transport, answers = asyncio.run(go())
    assert len(server.bodies) == 1 and server.bodies[0] == {**body(), "n": 8}
    assert (transport.sent, transport.merged) == (1, 8)
    assert sorted(a["choices"][0]["message"]["content"] for a in answers) == [f"c{i}" for i in range(8)]
    assert all(len(a["choices"]) == 1 and a["choices"][0]["index"] == 0 for a in answers)
    assert len({a["id"] for a in answers}) == 8
    for a in answers:  # each answer counts only its own tokens
        assert a["usage"]["completion_tokens"] == len(a["choices"][0]["token_ids"])
        assert a["usage"]["total_tokens"] == 5 + a["usage"]["completion_tokens"]


@pytest.mark.parametrize(
    ("bodies", "url"),
    [
        ([body(), body(max_tokens=5)], URL),  # different bodies
        ([body(seed=1)] * 2, URL),  # seeded: merged they would differ, alone they are equal
        ([body(stream=True)] * 2, URL),
        ([body(n=2)] * 2, URL),
        ([body()] * 2, "http://server/v1/completions"),
        ([body()] * 2, "http://server/v1/embeddings"),
    ],
    ids=["different", "seeded", "streamed", "n>1", "completions", "other-path"],
)
def test_requests_that_must_go_alone_pass_through(bodies, url):
    async def go():
        server = FakeServer()
        http, _ = client(server)
        await post_many(http, bodies, url)
        return server

    server = asyncio.run(go())
    assert len(server.bodies) == len(bodies) and all("n" not in b or b["n"] == 2 for b in server.bodies)


def test_at_most_max_merge_requests_share_one():
    async def go():
        server = FakeServer()
        http, _ = client(server, max_merge=3)
        await post_many(http, [body()] * 7)
        return server

    assert sorted(b.get("n", 1) for b in asyncio.run(go()).bodies) == [1, 3, 3]


@pytest.mark.parametrize("failure", ["http-error", "short-answer"])
def test_a_failed_merge_is_sent_again_one_by_one(failure):
    async def go():
        server = FakeServer(status=400) if failure == "http-error" else FakeServer(short=True)
        http, transport = client(server)
        responses = await post_many(http, [body()] * 4)
        return server, transport, responses

    server, transport, responses = asyncio.run(go())
    assert [b.get("n", 1) for b in server.bodies] == [4, 1, 1, 1, 1]
    assert transport.merged == 0
    if failure == "short-answer":
        assert all(r.status_code == 200 and len(r.json()["choices"]) == 1 for r in responses)
    else:  # alone, n = 1 is accepted
        assert all(r.status_code == 200 for r in responses)


def test_cancelling_every_requester_cancels_the_merged_request_and_one_does_not():
    """In order, never by the clock: the merged request is in the server before anyone cancels."""

    async def go():
        server = FakeServer()
        server.gate, server.arrived, server.gone = asyncio.Event(), asyncio.Event(), asyncio.Event()
        http, _ = client(server)
        tasks = [asyncio.create_task(http.post(URL, json=body())) for _ in range(3)]
        await server.arrived.wait()  # the three went out merged (one request, n = 3)
        tasks[0].cancel()
        await asyncio.gather(tasks[0], return_exceptions=True)
        still_in_server = server.cancelled == 0  # two requesters still wait
        for t in tasks[1:]:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.gone.wait()  # hangs (the test times out) if the merged request is never cancelled
        cancelled_all, server.arrived = server.cancelled, asyncio.Event()

        kept = [asyncio.create_task(http.post(URL, json=body())) for _ in range(3)]
        await server.arrived.wait()
        kept[0].cancel()
        await asyncio.gather(kept[0], return_exceptions=True)
        server.gate.set()
        done = await asyncio.gather(*kept, return_exceptions=True)
        return still_in_server, cancelled_all, server.bodies, done

    still_in_server, cancelled_all, bodies, done = asyncio.run(asyncio.wait_for(go(), 60))
    assert still_in_server and cancelled_all == 1
    assert [b["n"] for b in bodies] == [3, 3]
    assert isinstance(done[0], asyncio.CancelledError)
    assert all(isinstance(r, httpx2.Response) and r.status_code == 200 for r in done[1:])


def test_the_openai_client_reads_merged_answers_as_its_own():
    from openai import AsyncOpenAI

    async def go():
        server = FakeServer()
        http, _ = client(server)
        oai = AsyncOpenAI(api_key="x", base_url="http://server/v1", http_client=http, max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        outs = await asyncio.gather(*(oai.chat.completions.create(model="m", messages=msgs) for _ in range(4)))
        return server, outs

    server, outs = asyncio.run(go())
    assert len(server.bodies) == 1 and server.bodies[0]["n"] == 4
    assert sorted(o.choices[0].message.content for o in outs) == ["c0", "c1", "c2", "c3"]


def test_split_answer_rejects_what_it_cannot_split():
    assert split_answer(b"not json", 2) is None
    assert split_answer(json.dumps({"choices": [{"index": 0}]}).encode(), 2) is None
    got = split_answer(json.dumps({"id": "a", "choices": [{"index": 1}, {"index": 0}]}).encode(), 2)
    assert [g["id"] for g in got] == ["a-0", "a-1"] and "usage" not in got[0]


def test_an_httpx_client_merges_too():
    """openai 2 (verifiers 0.4's lock) builds its clients on httpx, openai 3 on httpx2: the merged request and
    its answers are built in the wrapped client's library (httpx2's Request refused httpx's URL before)."""
    import httpx

    async def answer(request: httpx.Request) -> httpx.Response:
        reply = await FakeServer()(request)
        return httpx.Response(reply.status_code, content=reply.content)

    async def go():
        transport = MergingTransport(httpx.MockTransport(answer))
        async with httpx.AsyncClient(transport=transport) as http:
            replies = await asyncio.gather(*(http.post(URL, json=body()) for _ in range(4)))
        return transport, replies

    transport, replies = asyncio.run(go())
    assert (transport.sent, transport.merged) == (1, 4)
    assert all(isinstance(r, httpx.Response) and len(r.json()["choices"]) == 1 for r in replies)


def admitted_events(monkeypatch) -> dict[int, asyncio.Event]:
    """{n: an event set once a group's gate has admitted n first calls}: ordering without the clock."""
    events: dict[int, asyncio.Event] = {}
    admit = coalesce._Gate.admit

    def counting(gate):
        took = admit(gate)
        events.setdefault(gate.admitted, asyncio.Event()).set()
        return took

    monkeypatch.setattr(coalesce._Gate, "admit", counting)
    return events


async def reached(events: dict[int, asyncio.Event], n: int) -> None:
    await events.setdefault(n, asyncio.Event()).wait()


def test_a_group_whose_first_calls_come_apart_still_goes_out_as_one(monkeypatch):
    """The last rollout calls long after the window would have sent the others (a loaded machine): the group
    still goes out as one request, and a second turn's calls merge by the window as before."""
    monkeypatch.setattr(coalesce, "MERGE_WINDOW_S", 0.0)
    events = admitted_events(monkeypatch)

    async def go():
        server = FakeServer()
        http, transport = client(server)
        with coalesce.one_group(8):
            first = [asyncio.create_task(http.post(URL, json=body())) for _ in range(7)]
            await reached(events, 7)
            held = len(server.bodies)  # nothing went out with one rollout still to call
            first.append(asyncio.create_task(http.post(URL, json=body())))
            await asyncio.gather(*first)
            turn_two = await post_many(http, [body(max_tokens=i) for i in range(3)])
        return server, transport, held, turn_two

    server, transport, held, turn_two = asyncio.run(asyncio.wait_for(go(), 60))
    assert held == 0
    assert [b.get("n", 1) for b in server.bodies] == [8, 1, 1, 1]
    assert (transport.sent, transport.merged) == (4, 8) and all(r.status_code == 200 for r in turn_two)


def test_a_group_with_two_first_prompts_goes_out_as_two_requests_once_all_called(monkeypatch):
    async def go():
        server = FakeServer()
        http, _ = client(server)
        with coalesce.one_group(4):
            await post_many(http, [body(), body(max_tokens=5)] * 2)
        return server

    assert sorted(b["n"] for b in asyncio.run(go()).bodies) == [2, 2]


def test_a_group_missing_a_first_call_goes_out_once_none_came_for_the_quiet_time(monkeypatch):
    """One rollout of four never calls (it failed first): the three go out together after GATE_QUIET_S."""
    monkeypatch.setattr(coalesce, "GATE_QUIET_S", 0.05)

    async def go():
        server = FakeServer()
        http, _ = client(server)
        with coalesce.one_group(4):
            replies = await post_many(http, [body()] * 3)
        return server, replies

    server, replies = asyncio.run(asyncio.wait_for(go(), 60))
    assert [b["n"] for b in server.bodies] == [3] and all(r.status_code == 200 for r in replies)


def test_groups_do_not_merge_with_each_other():
    async def go():
        server = FakeServer()
        http, _ = client(server)

        async def group():
            with coalesce.one_group(2):
                await post_many(http, [body()] * 2)

        await asyncio.gather(group(), group())
        return server

    assert [b["n"] for b in asyncio.run(go()).bodies] == [2, 2]
