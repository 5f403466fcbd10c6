"""Turn verifiers rollout outputs into token-level training samples (interleaved or branching).

A verifiers rollout made with the token client carries `trajectory`: one step per model turn, each
with `tokens = {prompt_ids, completion_ids, completion_mask, completion_logprobs, ...}` exactly as
the server saw and produced them; from an MoE whose server records its routing, also `routed_experts` (uint8
[prompt + completion, layers, top_k]: `transport.routes`), carried to the sample unchanged.

- interleaved: one sample per rollout = turn 1's prompt + every completion and the env tokens in
  between; the loss mask is on model-generated tokens only. This is only correct when each turn's
  prompt ids extend the previous turn's prompt+completion ids (the exact-prefix invariant); when a
  rollout breaks it (e.g. a template that rewrites history) that rollout falls back to branching.
- branching: one sample per turn (that turn's prompt + completion).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from loguru import logger

Strategy = Literal["interleaved", "branching"]


@dataclass
class TeacherScores:
    """The teacher's scores of one sample's tokens (on-policy distillation; see `teacher.py`): `logprobs`, its
    logprob of each token (0.0 before the first loss token; shorter than the sample where it scored fewer), with
    top_k `baseline`, the estimated reverse KL at each of those positions (0.0 there too), or with forward_kl
    `top`, its listed tokens at each position ({token id: logprob}; empty there)."""

    logprobs: list[float]
    baseline: list[float] | None = None
    top: list[dict[int, float]] | None = None


@dataclass
class TokenSample:
    """One training sequence: ids, which tokens the model produced, and their sampling logprobs; with a teacher,
    its scores once its step awaits them (`GroupCollector.await_scores`). Buffered groups, what a checkpoint
    holds, carry none: a resumed run scores them again."""

    input_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]
    teacher: TeacherScores | None = None
    routes: Any = None  # MoE routing record: uint8 [len(input_ids), layers, top_k] (`transport.routes`), or None

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class Rollout:
    """One finished rollout reduced to what training and metrics need."""

    env: str
    example_id: int
    reward: float
    samples: list[TokenSample] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_len: int = 0
    completion_len: int = 0
    num_turns: int = 0
    is_truncated: bool = False
    context_full: bool = False  # ended because the next turn's prompt + max_tokens exceeded the context
    error: str | None = None
    advantage: float = 0.0
    text: str = ""  # the completion's messages as text (for W&B sample tables and the report), clipped
    prompt_text: str = ""  # the prompt's messages as text, clipped
    agent: str = ""  # the v1 agent (role) whose trace this is: its group's advantage baseline is per agent

    @property
    def ok(self) -> bool:
        return self.error is None


class TrajectoryError(ValueError):
    """A rollout's trajectory cannot be turned into training tokens."""


class TrajectoryConverter:
    """Converts rollout outputs into `Rollout`s; remembers prefix-invariant fallbacks to warn once."""

    def __init__(self, strategy: Strategy = "interleaved"):
        self.strategy = strategy
        self.fallbacks = 0

    def convert(self, output: Mapping[str, Any], env: str) -> Rollout:
        """A `Rollout` for one verifiers output; errors become `Rollout.error`, never exceptions."""
        rollout = Rollout(
            env=env, example_id=int(output.get("example_id", -1)), reward=0.0, agent=output.get("agent", "")
        )
        error = _output_error(output)
        if error is not None:
            rollout.error = error
            return rollout
        reward = output.get("reward")
        if reward is None:
            rollout.error = "rollout has no reward (scoring failed)"
            return rollout
        rollout.reward = float(reward)
        rollout.metrics = {k: float(v) for k, v in (output.get("metrics") or {}).items() if _is_number(v)}
        rollout.is_truncated = bool(output.get("is_truncated", False))
        rollout.context_full = output.get("stop_condition") == "prompt_too_long"
        rollout.text = _messages_text(output.get("completion"))
        rollout.prompt_text = _messages_text(output.get("prompt"), limit=1000)
        try:
            steps = [_step_tokens(step) for step in output.get("trajectory") or []]
            if not steps:
                raise TrajectoryError("rollout has no model turns (empty trajectory)")
            rollout.samples = self._samples(steps)
        except TrajectoryError as e:
            rollout.error = str(e)
            return rollout
        # model turns, as the environment counted them (a v1 branch may hold several); else one per step
        rollout.num_turns = int((output.get("metrics") or {}).get("num_turns") or len(steps))
        rollout.prompt_len = len(steps[0]["prompt_ids"])
        rollout.completion_len = sum(len(s["completion_ids"]) for s in steps)
        rollout.is_truncated = rollout.is_truncated or any(s["is_truncated"] for s in steps)
        return rollout

    def _samples(self, steps: list[dict]) -> list[TokenSample]:
        if self.strategy == "branching" or len(steps) == 1:
            return [branch_sample(s) for s in steps]
        sample = interleave(steps)
        if sample is not None:
            return [sample]
        if self.fallbacks == 0:
            logger.warning(
                "a multi-turn rollout broke the exact-prefix invariant (a turn's prompt ids do not extend the "
                "previous turn's ids, e.g. a chat template that rewrites history); such rollouts are trained "
                "as branching samples. Set trajectory_strategy = 'branching' to silence this."
            )
        self.fallbacks += 1
        return [branch_sample(s) for s in steps]


def branch_sample(step: Mapping[str, Any]) -> TokenSample:
    prompt, completion = step["prompt_ids"], step["completion_ids"]
    return TokenSample(
        input_ids=list(prompt) + list(completion),
        loss_mask=[False] * len(prompt) + [bool(m) for m in step["completion_mask"]],
        logprobs=[0.0] * len(prompt) + [float(x) for x in step["completion_logprobs"]],
        routes=step.get("routed_experts"),
    )


def interleave(steps: list[Mapping[str, Any]]) -> TokenSample | None:
    """One sample for a whole multi-turn rollout, or None if the exact-prefix invariant breaks."""
    sample = branch_sample(steps[0])
    for step in steps[1:]:
        prompt = step["prompt_ids"]
        n = len(sample.input_ids)
        if len(prompt) < n or list(prompt[:n]) != sample.input_ids:
            return None
        env_tokens = list(prompt[n:])
        sample.input_ids += env_tokens + list(step["completion_ids"])
        sample.loss_mask += [False] * len(env_tokens) + [bool(m) for m in step["completion_mask"]]
        sample.logprobs += [0.0] * len(env_tokens) + [float(x) for x in step["completion_logprobs"]]
        sample.routes = step.get("routed_experts")  # a turn's record covers its whole prompt: the last one all
    return sample


def _step_tokens(step: Mapping[str, Any]) -> dict:
    tokens = step.get("tokens")
    if tokens is None:
        raise TrajectoryError(
            "the server returned no token ids/logprobs for a turn; the inference server must answer "
            "chat completions with `return_token_ids` (asyncrl's `inference` server or vLLM do)"
        )
    out = {
        k: list(tokens.get(k) or []) for k in ("prompt_ids", "completion_ids", "completion_mask", "completion_logprobs")
    }
    if not out["completion_mask"]:
        out["completion_mask"] = [1] * len(out["completion_ids"])
    n = len(out["completion_ids"])
    if len(out["completion_logprobs"]) != n or len(out["completion_mask"]) != n:
        raise TrajectoryError(
            f"turn has {n} completion ids but {len(out['completion_logprobs'])} logprobs and "
            f"{len(out['completion_mask'])} mask entries"
        )
    out["is_truncated"] = bool(tokens.get("is_truncated") or step.get("is_truncated"))
    out["routed_experts"] = _routes(tokens.get("routed_experts"), len(out["prompt_ids"]) + n)
    return out


def _routes(routes: Any, tokens: int) -> Any:
    """A turn's routing record, checked to cover its `tokens` tokens (None stays None)."""
    if routes is not None and len(routes) != tokens:
        raise TrajectoryError(f"turn has {tokens} tokens but a routing record of {len(routes)} (routed_experts)")
    return routes


def _output_error(output: Mapping[str, Any]) -> str | None:
    error = output.get("error")
    if not error:
        return None
    if isinstance(error, Mapping):
        return str(error.get("error_chain_repr") or error.get("message") or error.get("error"))
    return str(error)


def _messages_text(messages: Any, limit: int = 2000) -> str:
    if isinstance(messages, str):
        return messages[:limit]
    parts = []
    for message in messages or []:
        get = message.get if isinstance(message, Mapping) else lambda k, m=message: getattr(m, k, None)
        parts.append(
            f"[{get('role')}] {get('content') or ''}{' ' + str(get('tool_calls')) if get('tool_calls') else ''}"
        )
    return "\n".join(parts)[:limit]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
