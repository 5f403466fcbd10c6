"""Fakes for orchestrator unit tests, at the two network boundaries the integration test runs for real:
the rollout runner (verifiers + server) and the inference server's admin endpoints."""

from __future__ import annotations

import asyncio
import random

from asyncrl.orchestrator.envs.mixture import EnvMixture, EnvSlot


def fake_output(
    example_id: int,
    reward: float,
    turns: list[tuple[list[int], list[int]]],
    error=None,
    truncated: bool = False,
    metrics: dict | None = None,
    stop_condition: str = "has_final_answer",
) -> dict:
    """A verifiers-like RolloutOutput whose trajectory has (prompt_ids, completion_ids) per turn."""
    trajectory = []
    for prompt, completion in turns:
        trajectory.append(
            {
                "tokens": {
                    "prompt_ids": list(prompt),
                    "prompt_mask": [0] * len(prompt),
                    "completion_ids": list(completion),
                    "completion_mask": [1] * len(completion),
                    "completion_logprobs": [-0.5 - 0.01 * t for t in completion],
                    "is_truncated": truncated,
                    "overlong_prompt": False,
                    "routed_experts": None,
                },
                "is_truncated": truncated,
            }
        )
    return {
        "example_id": example_id,
        "reward": reward,
        "error": error,
        "is_truncated": truncated,
        "metrics": metrics or {"exact": float(reward == 1.0)},
        "trajectory": trajectory,
        "stop_condition": stop_condition,
    }


def fake_mixture(names=("a",), ratios=None, n_rows: int = 50, seed: int = 0) -> EnvMixture:
    slots = []
    for i, name in enumerate(names):
        rows = [
            {"prompt": [{"role": "user", "content": f"{name}{j}"}], "example_id": j, "answer": str(j)}
            for j in range(n_rows)
        ]
        slots.append(EnvSlot(name=name, env=None, ratio=(ratios[i] if ratios else 1.0), rows=rows))
    return EnvMixture(slots, seed=seed)


class FakeRunner:
    """Stands in for verifiers' run_group: rewards by a rule, optional delay, errors and multi-turn."""

    def __init__(self, reward_fn=None, delay: float = 0.0, error_fn=None, turns: int = 1, seed: int = 0, stop_fn=None):
        self.reward_fn = reward_fn or (lambda slot, row, i: float(i % 2))
        self.delay = delay
        self.error_fn = error_fn or (lambda slot, row, i: None)
        self.turns = turns
        self.stop_fn = stop_fn or (lambda slot, row, i: "has_final_answer")
        self.rng = random.Random(seed)
        self.in_flight = 0
        self.calls = 0
        self.cancelled = 0

    async def __call__(self, slot, inputs, args):
        self.calls += 1
        self.in_flight += 1
        try:
            if self.delay:
                await asyncio.sleep(self.delay * (0.5 + self.rng.random()))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1
        row = inputs[0]
        outs = []
        for i, _ in enumerate(inputs):
            prompt = [1, 2, 3, 4 + row["example_id"] % 7]
            completion = [10 + i, 11, 12]
            turns = [(prompt, completion)]
            for t in range(1, self.turns):
                prev = turns[-1][0] + turns[-1][1]
                turns.append((prev + [90, 91], [20 + t, 21]))
            outs.append(
                fake_output(
                    row["example_id"],
                    self.reward_fn(slot, row, i),
                    turns,
                    error=self.error_fn(slot, row, i),
                    stop_condition=self.stop_fn(slot, row, i),
                )
            )
        return outs


class FakeServer:
    """Records admin calls and what was in flight when weights changed."""

    def __init__(self, runner: FakeRunner | None = None, healthy: bool = True):
        self.runner = runner
        self.calls: list[tuple[str, str | None, int]] = []
        self.healthy = healthy
        self.root = self.url = "http://fake:0"

    async def update_weights(self, path):
        self.calls.append(("update", str(path), self.runner.in_flight if self.runner else 0))

    async def reload_weights(self):
        self.calls.append(("reload", None, self.runner.in_flight if self.runner else 0))

    async def is_healthy(self):
        return self.healthy

    async def close(self):
        pass
