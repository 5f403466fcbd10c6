"""`run(fn, *args)`: CPU work on request bodies, off the event loop.

Chat templating, tokenizing and parsing big JSON bodies run in one worker thread, so a large request never
stalls the event loop (/health, streams, every other route) for longer than the Python interpreter hands
the GIL over (milliseconds; the tokenizers' Rust code releases it). One thread, not a pool: the server's
fast tokenizer is not thread-safe (the engine has its own), and the work is CPU-bound anyway.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from starlette.responses import Response

T = TypeVar("T")

SLICE = 50_000  # list items serialized per json.dumps call by `json_response`
_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncrl-cpu")


async def run(fn: Callable[..., T], *args, **kwargs) -> T:
    """`fn(*args, **kwargs)` in the CPU worker thread; its result (or exception) here."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_EXECUTOR, functools.partial(fn, *args, **kwargs))


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
