"""Identical chat requests in flight together go out as one request with n = k (the HTTP transport layer).

verifiers runs every rollout of a group as its own request, so one step of 16 prompts x 8 rollouts is
128 requests although only 16 bodies differ: 128 times the client's and the server's per-request work
(building, sending, parsing, admitting) for what one `n = 8` request asks. `MergingTransport` wraps the
OpenAI client's transport: a chat request whose body (bytes) and target equal another's that is still
waiting to be sent joins it; the merged request asks for `n = k` and each requester gets a response that
reads exactly like the answer to its own request (one choice, index 0, its own completion token count,
an id of its own). The server samples the k choices independently (vLLM and the embedded engine do),
so the rollouts are distributed as if sent one by one, and it prefills the prompt once.

Invariants:
- Only POSTs to `.../chat/completions` or `.../chat/completions/tokens` whose JSON body asks for one
  non-streamed choice without a seed merge (k seeded requests would give k equal samples, one seeded
  n = k request k different ones); anything else passes through untouched.
- Inside `one_group(k)` (a group of k rollouts), the first k mergeable requests are the rollouts' first model
  calls: none goes out until all k have come (no rollout gets an answer, so none can call twice, before
  then), and then each set of identical ones goes out at once as one request. Arrival times do not matter;
  only if `GATE_QUIET_S` passes with none of the k arriving (a rollout that failed before calling) do the
  ones that came go out.
- Any other request waits for identical ones until `MERGE_WINDOW_S` passes with none joining (each arrival
  extends the wait, at most `MAX_WINDOWS` windows), then goes out with the at most `max_merge` that came.
- A merged request that fails in any way (an HTTP error, a malformed or short answer) is sent again one
  request at a time, so every requester sees exactly what it would have seen alone.
- Cancelling a requester cancels the merged request once every requester of it has gone.
- Requests and answers are in the HTTP library of the client it wraps: httpx under openai 2 (verifiers 0.4),
  httpx2 under openai 3 (verifiers 0.3's lock); `http_of(request)` says which.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from types import ModuleType
from typing import Any

import httpx
import httpx2

MERGEABLE_PATHS = ("/chat/completions", "/chat/completions/tokens")
MERGE_WINDOW_S = 0.002  # how long a new request waits for identical ones (the other rollouts of its group)
MAX_WINDOWS = 10  # windows a merge waits at most while identical requests keep arriving
GATE_QUIET_S = 0.5  # a group's gate opens with what came once this long passes with no first call arriving
_DROPPED_HEADERS = {b"content-length", b"content-encoding", b"transfer-encoding"}


class _Merge:
    """Identical requests about to go out as one."""

    def __init__(self) -> None:
        self.requests: list[httpx2.Request] = []
        self.waiters: list[asyncio.Future] = []
        self.task: asyncio.Task | None = None

    def join(self, request: httpx2.Request) -> asyncio.Future:
        waiter = asyncio.get_running_loop().create_future()
        self.requests.append(request)
        self.waiters.append(waiter)
        return waiter


class _Gate:
    """A group's first model calls, held until each of its `size` rollouts has made one."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.admitted = 0
        self.merges: dict[tuple, _Merge] = {}  # the held requests, by what identical ones share
        self._go = asyncio.Event()
        self._last = 0.0  # loop time of the latest first call

    def admit(self) -> bool:
        """Whether this request is one of the group's first `size` (it then waits for the gate)."""
        if self.admitted >= self.size:
            return False
        self.admitted += 1
        self._last = asyncio.get_running_loop().time()
        if self.admitted == self.size:
            self._go.set()
        return True

    async def opened(self, _merge: _Merge) -> None:
        loop = asyncio.get_running_loop()
        while not self._go.is_set():
            left = self._last + GATE_QUIET_S - loop.time()
            if left <= 0:
                self._go.set()
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._go.wait(), left)


_GROUP: ContextVar[_Gate | None] = ContextVar("asyncrl_coalesce_group", default=None)


@contextlib.contextmanager
def one_group(size: int) -> Iterator[None]:
    """The rollouts started within this block are one group of `size`: their first calls merge by the group."""
    token = _GROUP.set(_Gate(size))
    try:
        yield
    finally:
        _GROUP.reset(token)


class MergingTransport(httpx2.AsyncBaseTransport):
    def __init__(self, inner: httpx2.AsyncBaseTransport, max_merge: int = 64) -> None:
        self.inner = inner
        self.max_merge = max_merge
        self._open: dict[tuple, _Merge] = {}
        self.sent = 0  # HTTP requests that went out for mergeable requests (merged or not)
        self.merged = 0  # requests answered by a merged request

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        key = mergeable_key(request)
        if key is None:
            return await self.inner.handle_async_request(request)
        gate = _GROUP.get()
        if gate is not None and gate.admit():
            merge = self._merge(gate.merges, key, gate.opened)
        else:
            merge = self._merge(self._open, key, self._quiet)
        waiter = merge.join(request)
        try:
            return await waiter
        except asyncio.CancelledError:
            if all(w.done() for w in merge.waiters) and merge.task is not None:
                merge.task.cancel()  # nobody is waiting for its answer any more
            raise

    async def aclose(self) -> None:
        await self.inner.aclose()

    def _merge(self, merges: dict[tuple, _Merge], key: tuple, ready: Callable[[_Merge], Awaitable]) -> _Merge:
        """The open merge `key`'s request joins in `merges`, started (sent once `ready`) if there is none."""
        merge = merges.get(key)
        if merge is None or len(merge.requests) >= self.max_merge:
            merge = merges[key] = _Merge()
            merge.task = asyncio.ensure_future(self._send(merges, key, merge, ready))
        return merge

    async def _send(self, merges: dict, key: tuple, merge: _Merge, ready: Callable[[_Merge], Awaitable]) -> None:
        await ready(merge)
        if merges.get(key) is merge:
            del merges[key]
        live = [(r, w) for r, w in zip(merge.requests, merge.waiters) if not w.done()]
        if not live:
            return
        try:
            results = await self._answers([r for r, _ in live])
        except asyncio.CancelledError:  # every requester has gone
            for _, waiter in live:
                waiter.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - handed to every requester, as its own request would raise it
            results = [e] * len(live)
        for (_, waiter), result in zip(live, results):
            if waiter.done():
                continue
            if isinstance(result, BaseException):
                waiter.set_exception(result)
            else:
                waiter.set_result(result)

    async def _quiet(self, merge: _Merge) -> None:
        """Wait until a whole window passes with no new joiner (a loaded machine spreads a group's arrivals)."""
        for _ in range(MAX_WINDOWS):
            seen = len(merge.requests)
            await asyncio.sleep(MERGE_WINDOW_S)
            if len(merge.requests) == seen or len(merge.requests) >= self.max_merge:
                return

    async def _answers(self, requests: list[httpx2.Request]) -> list[httpx2.Response | BaseException]:
        if len(requests) > 1:
            split = await self._send_merged(requests)
            if split is not None:
                self.sent += 1
                self.merged += len(requests)
                return split
        self.sent += len(requests)
        return await asyncio.gather(*(self.inner.handle_async_request(r) for r in requests), return_exceptions=True)

    async def _send_merged(self, requests: list[httpx2.Request]) -> list[httpx2.Response] | None:
        """One request with n = len(requests), split into one response per requester; None if it failed."""
        first = requests[0]
        body = json.loads(first.content)
        body["n"] = len(requests)
        http = http_of(first)
        merged = http.Request(
            first.method,
            first.url,
            headers=[(k, v) for k, v in first.headers.raw if k.lower() not in _DROPPED_HEADERS],
            content=json.dumps(body).encode(),
            extensions=first.extensions,
        )
        try:
            response = await self.inner.handle_async_request(merged)
            content = await response.aread()
            await response.aclose()
        except Exception:  # noqa: BLE001 - sent again one by one, where the error shows as it would alone
            return None
        if response.status_code != 200:
            return None
        answers = split_answer(content, len(requests))
        if answers is None:
            return None
        headers = [(k, v) for k, v in response.headers.raw if k.lower() not in _DROPPED_HEADERS]
        return [
            http.Response(200, headers=headers, content=json.dumps(a).encode(), request=r)
            for a, r in zip(answers, requests)
        ]


def mergeable_key(request: httpx2.Request) -> tuple | None:
    """What identical requests share (target, credentials, body), or None if this one must go alone."""
    if request.method != "POST" or not request.url.path.endswith(MERGEABLE_PATHS):
        return None
    try:
        content = request.content
        body = json.loads(content)
    except (httpx.RequestNotRead, httpx2.RequestNotRead, ValueError):
        return None
    if not isinstance(body, dict) or body.get("stream") or body.get("n", 1) != 1 or body.get("seed") is not None:
        return None
    return str(request.url), request.headers.get("authorization"), content


def http_of(request: httpx.Request | httpx2.Request) -> ModuleType:
    """The HTTP library `request` is of (httpx or httpx2): the merged request and the answers are built in it."""
    return httpx2 if isinstance(request, httpx2.Request) else httpx


def split_answer(content: bytes, k: int) -> list[dict[str, Any]] | None:
    """The answer to an n = k chat request as k answers of one choice each; None if it has not k choices."""
    try:
        data = json.loads(content)
        choices = sorted(data["choices"], key=lambda c: c["index"])
    except (ValueError, KeyError, TypeError):
        return None
    if len(choices) != k:
        return None
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
    answers = []
    for i, choice in enumerate(choices):
        one = {**data, "id": f"{data.get('id', 'merged')}-{i}", "choices": [{**choice, "index": 0}]}
        if usage is not None:
            completion = completion_tokens(choice, usage, k)
            prompt = usage.get("prompt_tokens", 0)
            one["usage"] = {**usage, "completion_tokens": completion, "total_tokens": prompt + completion}
        answers.append(one)
    return answers


def completion_tokens(choice: dict, usage: dict, k: int) -> int:
    """One choice's completion tokens: its token ids, else its logprob entries, else an even share."""
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    content = (choice.get("logprobs") or {}).get("content")
    if isinstance(content, list):
        return len(content)
    return int(usage.get("completion_tokens", 0)) // k
