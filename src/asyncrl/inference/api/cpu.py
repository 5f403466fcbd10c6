"""`run(fn, *args)`: CPU work on request bodies, off the event loop.

Chat templating, tokenizing and parsing big JSON bodies run in one worker thread, so a large request never
stalls the event loop (/health, streams, every other route) for longer than the Python interpreter hands
the GIL over (milliseconds; the tokenizers' Rust code releases it). One thread, not a pool: the server's
fast tokenizer is not thread-safe (the engine has its own), and the work is CPU-bound anyway.

The worker is a plain thread reading a `queue.SimpleQueue`, not a `ThreadPoolExecutor`: the executor's submit
takes a lock the worker holds between jobs (its idle semaphore), and under load the event loop sat blocked on
it, waiting out the GIL's switch interval, for ~1.5 ms per job. A job whose caller was cancelled before it
started is skipped; a result whose caller is gone is dropped.
"""

from __future__ import annotations

import asyncio
import functools
import json
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from starlette.responses import Response

T = TypeVar("T")

SLICE = 50_000  # list items serialized per json.dumps call by `json_response`
_JOBS: queue.SimpleQueue = queue.SimpleQueue()  # (loop, future, job) for the worker
_WORKER: list[threading.Thread] = []  # the worker, once started
_START = threading.Lock()


async def run(fn: Callable[..., T], *args, **kwargs) -> T:
    """`fn(*args, **kwargs)` in the CPU worker thread; its result (or exception) here."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    _start_worker()
    _JOBS.put((loop, future, functools.partial(fn, *args, **kwargs)))
    return await future


def _start_worker() -> None:
    if not _WORKER:
        with _START:
            if not _WORKER:
                _WORKER.append(threading.Thread(target=_work, name="asyncrl-cpu", daemon=True))
                _WORKER[0].start()


def _work() -> None:
    while True:
        loop, future, job = _JOBS.get()
        if future.cancelled():  # a read of the future's state only: a stale answer runs a job for nothing
            continue
        try:
            outcome = (job(), None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, as an executor would
            outcome = (None, e)
        try:
            loop.call_soon_threadsafe(_settle, future, *outcome)
        except RuntimeError:  # the caller's loop is closed: nobody waits for this result
            pass


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Hand a job's outcome to its caller (on the caller's loop), unless the caller stopped waiting."""
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def json_response(content: dict[str, Any]) -> Response:
    """A JSON response whose body is rendered here (call it through `run`): long lists (a big prompt's token ids)
    a slice at a time, so the event loop gets the GIL between slices; FastAPI would encode them on the loop."""
    parts = [f"{json.dumps(key)}:{_dumps(value)}" for key, value in content.items()]
    return Response(("{" + ",".join(parts) + "}").encode(), media_type="application/json")


def _dumps(value: Any) -> str:
    if not isinstance(value, list) or len(value) <= SLICE:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    slices = (_dumps(value[i : i + SLICE])[1:-1] for i in range(0, len(value), SLICE))
    return "[" + ",".join(slices) + "]"
