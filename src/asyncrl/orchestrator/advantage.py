"""Per-group advantages: each prompt's rollouts are compared with each other, never across prompts.

- mean:     A_i = r_i - mean(r)                              (PRIME-RL's default)
- mean_std: A_i = (r_i - mean(r)) / (std(r) + eps)           (GRPO-style normalisation)
- rloo:     A_i = r_i - mean(r_j for j != i)                 (leave-one-out baseline)
- opo:      A_i = r_i - sum(l_j r_j) / sum(l_j)              (length-weighted baseline, l = completion tokens)

With `length_penalty = w > 0` the rewards are shaped first, within the group:
r_i' = r_i - w * max(mean(r), 0) * l_i / max(l): the longer answers of a group that earns reward lose up to
w times its mean reward; a group that earns nothing is not pushed toward short wrong answers.

On-policy distillation (a teacher) makes advantages per token (`token_advantages`): on each loss token t
A_t = distill_weight * (teacher_lp_t - sampler_lp_t) + reward_weight * A (A: the sample's advantage above),
the reverse KL to the teacher on the sampled token; tokens that are not loss tokens get 0, and so do the
distillation terms of loss tokens the teacher did not score (its list is shorter than the sample). With a
baseline (`distill.top_k`), KL_t, the reverse KL at position t estimated from both models' top-k logprobs, is
added to the distillation term: teacher_lp_t - sampler_lp_t + KL_t. KL_t depends on the tokens before t only,
so the expected gradient is unchanged while the term's average over the sampled token is ~0. `distill.clip`
clamps the distillation term (baseline included) to [-clip, clip].

With `distill.kind = "forward_kl"` the teacher's signal is no advantage: `teacher_targets` gives each loss token
the teacher's listed tokens at its position, their probabilities renormalized over the list and times the
distillation weight, the target mass of the trainer's cross-entropy term (token_advantages then get
distill_weight 0: the reward part only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

AdvantageType = Literal["mean", "mean_std", "rloo", "opo"]
STD_EPS = 1e-6


def compute_advantages(
    rewards: Sequence[float],
    kind: AdvantageType = "mean",
    lengths: Sequence[int] | None = None,
    length_penalty: float = 0.0,
) -> list[float]:
    """Advantages of one group's rewards (a group of one gets 0: it has no baseline)."""
    if length_penalty > 0:
        rewards = shape_by_length(rewards, lengths, length_penalty)
    n = len(rewards)
    if n == 0:
        return []
    if n == 1:
        return [0.0]
    mean = sum(rewards) / n
    if kind == "mean":
        return [r - mean for r in rewards]
    if kind == "mean_std":
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
        return [(r - mean) / (std + STD_EPS) for r in rewards]
    if kind == "rloo":
        total = sum(rewards)
        return [r - (total - r) / (n - 1) for r in rewards]
    if kind == "opo":
        if lengths is None or len(lengths) != n:
            raise ValueError("opo advantages need one completion length per reward")
        weight = sum(lengths)
        if weight <= 0:
            return [r - mean for r in rewards]
        baseline = sum(n * r for n, r in zip(lengths, rewards)) / weight
        return [r - baseline for r in rewards]
    raise ValueError(f"unknown advantage type {kind!r}; use mean, mean_std, rloo or opo")


def shape_by_length(rewards: Sequence[float], lengths: Sequence[int] | None, weight: float) -> list[float]:
    """r_i - weight * max(mean(r), 0) * l_i / max(l) (see the module docstring)."""
    if lengths is None or len(lengths) != len(rewards):
        raise ValueError("a length penalty needs one completion length per reward")
    if not rewards:
        return []
    scale = weight * max(sum(rewards) / len(rewards), 0.0) / max(max(lengths), 1)
    return [r - scale * n for r, n in zip(rewards, lengths)]


def token_advantages(
    loss_mask: Sequence[bool],
    sampler_logprobs: Sequence[float],
    teacher_logprobs: Sequence[float],
    reward_advantage: float,
    distill_weight: float,
    reward_weight: float,
    baseline: Sequence[float] | None = None,
    clip: float | None = None,
) -> list[float]:
    """A_t per token of one sample (see the module docstring); `baseline[t]` (the estimated reverse KL at
    position t) is added to the distillation term where given, and the term is clamped to [-clip, clip]."""
    base = reward_weight * reward_advantage
    scored = len(teacher_logprobs)
    kl = baseline if baseline is not None else [0.0] * scored
    bound = math.inf if clip is None else clip

    def distill(t: int) -> float:
        return distill_weight * max(-bound, min(bound, teacher_logprobs[t] - sampler_logprobs[t] + kl[t]))

    return [(base + (distill(t) if t < scored else 0.0)) if m else 0.0 for t, m in enumerate(loss_mask)]


def teacher_targets(
    loss_mask: Sequence[bool], top: Sequence[dict[int, float]], weight: float
) -> list[dict[int, float]]:
    """Per token, {token id: weight x the teacher's probability renormalized over its listed tokens} on loss tokens
    the teacher scored (`top[t]`: {id: logprob}); {} elsewhere."""
    out: list[dict[int, float]] = []
    for t, m in enumerate(loss_mask):
        entry = top[t] if m and t < len(top) else {}
        peak = max(entry.values(), default=0.0)
        mass = {x: math.exp(lp - peak) for x, lp in entry.items()}
        total = sum(mass.values())
        out.append({x: weight * p / total for x, p in mass.items()} if total > 0 else {})
    return out
