"""Group-level decisions: drop errored rollouts, score groups, and online difficulty filtering.

A group is the `rollouts_per_example` rollouts of one prompt. Rollouts that errored (env exception,
server error, missing tokens) are dropped from their group and counted; the rest of the group keeps
its advantages computed among the valid rollouts only; a group where every rollout failed is
'failed'. With `online_difficulty_filtering`, groups whose rewards are
all at or above `easy_threshold` (solved every time) or all at or below `hard_threshold` (never
solved) are dropped too, and the orchestrator keeps sampling prompts to fill the batch. With on-policy
distillation (`distilled`) no group is dropped for its rewards: every token still carries the teacher's signal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from asyncrl.config.orchestrator import AdvantageConfig, BufferConfig
from asyncrl.orchestrator.advantage import compute_advantages
from asyncrl.orchestrator.samples import Rollout, TokenSample

Verdict = Literal["accept", "too_easy", "too_hard", "failed"]


@dataclass
class Group:
    """The rollouts of one prompt, generated under the policy after `policy_step` updates."""

    env: str
    example_id: int
    policy_step: int
    rollouts: list[Rollout] = field(default_factory=list)
    verdict: Verdict = "accept"

    @property
    def valid(self) -> list[Rollout]:
        return [r for r in self.rollouts if r.ok]

    @property
    def samples(self) -> list[TokenSample]:
        """The training samples of its valid rollouts, in order (what the teacher scores)."""
        return [s for r in self.valid for s in r.samples]

    @property
    def num_errors(self) -> int:
        return sum(not r.ok for r in self.rollouts)


def difficulty(rewards: list[float], buffer: BufferConfig) -> Verdict:
    """'too_easy' / 'too_hard' if every reward is past a threshold, else 'accept'."""
    if rewards and all(r >= buffer.easy_threshold for r in rewards):
        return "too_easy"
    if rewards and all(r <= buffer.hard_threshold for r in rewards):
        return "too_hard"
    return "accept"


def judge_group(group: Group, buffer: BufferConfig, advantage: AdvantageConfig, distilled: bool = False) -> Verdict:
    """Set advantages on the group's valid rollouts and decide whether it goes into a batch (`distilled`: the
    teacher's per-token signal makes every group that did not fail worth training on)."""
    valid = group.valid
    for r in group.rollouts:
        r.advantage = 0.0
    if not valid:
        group.verdict = "failed"
        return group.verdict
    for agent in dict.fromkeys(r.agent for r in valid):  # each agent (role) of a multi-agent episode: own baseline
        mine = [r for r in valid if r.agent == agent]
        lengths = [r.completion_len for r in mine]
        advantages = compute_advantages([r.reward for r in mine], advantage.type, lengths, advantage.length_penalty)
        for r, a in zip(mine, advantages):
            r.advantage = a
    verdict = difficulty([r.reward for r in valid], buffer)
    group.verdict = verdict if buffer.online_difficulty_filtering and not distilled else "accept"
    return group.verdict
