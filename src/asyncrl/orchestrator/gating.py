"""The async bound: which trainer weights step n's rollouts may use, and waiting for them.

Rollouts of step n must come from a policy >= n-k (k = max_async_level). Policy p is the model after
p trainer updates: p = 0 is the base model, p >= 1 lives in `broadcast/step_p` (STABLE marker).
Before generating step n the orchestrator takes the newest policy in [max(n-k, 0), n] that exists:
it waits only when none does, i.e. only when the trainer is more than k steps behind. With `exactly`
(`async_lag = "exactly"`) it takes the oldest one instead: policy max(n-k, 0) itself, waited for, so every
step samples k steps behind however fast the trainer is (the trainer keeps the broadcast dirs from n-k on; a
resumed run whose dir n-k is gone takes the oldest policy of the window there is).

On resume at step N the trainer's checkpoint weights `weights/step_N` also count as policy N (the
broadcast dirs of that window may be gone); later `weights/` dirs are never used, since they may be
left from an earlier, longer run.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from asyncrl.transport.layout import RunLayout, is_stable, step_dirs


@dataclass(frozen=True)
class Policy:
    step: int
    path: Path | None  # None: the base model

    @property
    def is_base(self) -> bool:
        return self.path is None


def checkpoint_policy(layout: RunLayout, step: int) -> Policy | None:
    """`weights/step_{step}` as a policy if it is complete (renamed into place whole)."""
    path = layout.weights_dir(step)
    if step >= 1 and path.is_dir() and (is_stable(path) or (path / "config.json").exists()):
        return Policy(step, path)
    return None


class PolicyGate:
    """Chooses (and waits for) the policy each step generates with."""

    def __init__(
        self, layout: RunLayout, max_async_level: int, resume_policy: Policy | None = None, exactly: bool = False
    ):
        self.layout = layout
        self.k = max_async_level
        self.resume_policy = resume_policy
        self.exactly = exactly

    def newest(self, step: int) -> Policy | None:
        """The policy step `step` uses (the newest in its window; with `exactly`, the oldest), or None if it must
        wait for the trainer."""
        need = step - self.k
        if self.exactly and need <= 0:
            return Policy(0, None)
        found = [
            Policy(s, p)
            for s, p in step_dirs(self.layout.broadcast).items()
            if max(need, 1) <= s <= step and is_stable(p)
        ]
        r = self.resume_policy
        if r is not None and need <= r.step <= step:
            found.append(r)
        if not found:
            return Policy(0, None) if need <= 0 else None
        pick = min if self.exactly else max
        return pick(found, key=lambda p: p.step)

    async def wait(self, step: int, poll: float = 0.005, timeout: float | None = None) -> tuple[Policy, float]:
        """Wait until step `step` may generate; returns the policy to use and the seconds waited."""
        start = time.monotonic()
        while True:
            policy = self.newest(step)
            if policy is not None:
                return policy, time.monotonic() - start
            if timeout is not None and time.monotonic() - start > timeout:
                raise TimeoutError(
                    f"step {step} needs trainer weights of step >= {step - self.k} in "
                    f"{self.layout.broadcast}; none after {timeout:.0f}s (is the trainer running?)"
                )
            await asyncio.sleep(poll)
