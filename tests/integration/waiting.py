"""`wait_until`: poll a condition until it holds or a deadline passes (the suite's one polling loop)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(done: Callable[[], object], timeout_s: float = 30.0, every_s: float = 0.05) -> bool:
    """Whether `done()` came true within `timeout_s` (checked every `every_s` seconds)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(every_s)
    return True
