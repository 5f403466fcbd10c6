"""verifiers v1 environments: a taskset package, run as episodes of its agents against our server.

A v1 environment is an installed package whose `__all__` exports a `verifiers.v1.Taskset` subclass (the
rule of verifiers' own loader). Its tasks are the slot's prompts. A group is `rollouts_per_example`
episodes of one task, run in this process: the taskset's own Env (several agents) or the single-agent one,
every agent on harness `null` and runtime `subprocess` unless the environment's args say otherwise (no
sandbox, no tunnel). Episodes go through verifiers' training client, which renders the prompt with the
`renderers` package and posts the token ids to `/inference/v1/generate`.

Invariant: each trace (an agent's run) is one rollout, and each of its branches one turn for the samples
converter. A branch's prompt is the tokens before the first sampled one, its completion the rest, with
`sampled_mask` as the completion mask and the engine's logprobs. The trainer therefore sees exactly the ids
and logprobs the engine sampled, env tokens between turns masked out.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
from collections.abc import Callable
from typing import Any

from loguru import logger

from asyncrl.config.orchestrator import ClientConfig
from asyncrl.core.errors import UserError

AGENT_DEFAULTS = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}
MAX_TASKS = 10_000  # of a taskset that never ends (one that generates tasks), the ones sampled from


def task_id(task: Any, default: int = -1) -> int:
    """A v1 task's `data.idx` (`default` when it has none): its example id in metrics and outputs."""
    idx = getattr(getattr(task, "data", None), "idx", None)
    return default if idx is None else int(idx)


def is_v1_env(env: Any) -> bool:
    """Whether a loaded environment is a v1 Env (else a classic one)."""
    try:
        from verifiers.v1 import Env
    except ImportError:
        return False
    return isinstance(env, Env)


def is_v1_module(module: str) -> bool:
    """Whether installed module `module` is a v1 environment: it exports a v1 Taskset subclass."""
    try:
        from verifiers.v1 import Taskset
    except ImportError:  # a verifiers without the v1 API
        return False
    mod = importlib.import_module(module)
    exported = (getattr(mod, name, None) for name in getattr(mod, "__all__", ()))
    return any(isinstance(obj, type) and issubclass(obj, Taskset) for obj in exported)


def load_v1_env(module: str, env_id: str, args: dict[str, Any]) -> Any:
    """The v1 Env for taskset `module`: the taskset's own Env class when it exports one (several agents,
    each a role of its config), else the single-agent one. `args`: a role's name overrides that agent
    (each defaults to `AGENT_DEFAULTS`), another field of the env config sets it, the rest are the taskset
    config's fields."""
    from pydantic import ValidationError
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.utils.loaders import env_config_type, load_environment

    config_type = env_config_type(module)
    roles = [n for n, f in config_type.model_fields.items() if isinstance(f.default, AgentConfig)]
    raw: dict[str, Any] = {"taskset": {"id": module}}
    for key, value in args.items():
        if key in roles or (key in config_type.model_fields and key not in ("taskset", "id")):
            raw[key] = value
        else:
            raw["taskset"][key] = value
    for role in roles:
        raw[role] = {**AGENT_DEFAULTS, **(raw.get(role) or {})}
    try:
        config = config_type.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise UserError(
            f"environment '{env_id}' (verifiers v1) does not take args {args}: {where}: {first['msg']}"
        ) from None
    return load_environment(config)


def v1_tasks(env: Any, env_id: str) -> list[Any]:
    """The taskset's tasks; of one that keeps generating them (an infinite taskset), the first MAX_TASKS."""
    tasks = list(itertools.islice(iter(env.taskset), MAX_TASKS + 1))
    if not tasks:
        raise UserError(f"environment '{env_id}' (verifiers v1) has no tasks")
    if len(tasks) > MAX_TASKS:
        logger.info(f"environment '{env_id}' generates tasks without end: sampling from its first {MAX_TASKS}")
        tasks = tasks[:MAX_TASKS]
    return tasks


def sampling_config(args: dict) -> Any:
    """The orchestrator's request arguments as a v1 SamplingConfig (extra keys such as top_k pass through)."""
    from verifiers.v1.types import SamplingConfig

    flat = {k: v for k, v in args.items() if k not in ("n", "extra_body")}
    return SamplingConfig(**flat, **(args.get("extra_body") or {}))


def v1_run_group(client: ClientConfig, base_model: str, model: str | Callable[[], str], train: bool = True) -> Callable:
    """A RunGroup for v1 slots: the group's episodes run concurrently; each becomes one rollout output.

    `train`: verifiers' training client (token ids and logprobs, our server or vLLM); else its eval client
    (chat completions, any OpenAI-compatible server: `eval` and `synthesize`)."""
    import verifiers.v1 as vf

    endpoint = {"base_url": client.url, "api_key_var": client.api_key_var}
    if train:
        chosen = vf.TrainClientConfig(**endpoint, renderer_model_name=base_model)
    else:
        chosen = vf.EvalClientConfig(**endpoint)

    async def run(slot, tasks: list[Any], args: dict) -> list[dict]:
        name = model() if callable(model) else model
        ctx = vf.ModelContext(model=name, client=chosen, sampling=sampling_config(args))
        episodes = await asyncio.gather(*(slot.env.run_episode(task, ctx) for task in tasks), return_exceptions=True)
        return [out for task, episode in zip(tasks, episodes) for out in episode_outputs(task, episode)]

    return run


def episode_outputs(task: Any, episode: Any) -> list[dict]:
    """One episode as rollout outputs for `samples.TrajectoryConverter`: one per trace (an agent's run; a
    multi-agent episode has several), its `trajectory` a turn per branch."""
    example_id = task_id(task)
    if isinstance(episode, BaseException):
        return [{"example_id": example_id, "error": f"{type(episode).__name__}: {episode}"}]
    if not episode.traces:
        errors = "; ".join(str(e) for e in episode.errors) or "the episode produced no trace"
        return [{"example_id": example_id, "error": errors}]
    # a seat that never got to act (a hand decided before its turn) has nothing to train on: left out
    played = [t for t in episode.traces if t.branches or t.has_error]
    if not played:
        return [{"example_id": example_id, "error": "no agent of the episode made a model call"}]
    return [trace_output(example_id, task, trace, episode.errors) for trace in played]


def trace_output(example_id: int, task: Any, trace: Any, episode_errors: list) -> dict:
    if trace.has_error or episode_errors:
        return {"example_id": example_id, "error": str(trace.last_error or episode_errors[0])}
    return {
        "example_id": example_id,
        "reward": trace.reward,
        "metrics": dict(trace.metrics or {}),
        "is_truncated": bool(trace.is_truncated),
        "prompt": getattr(task.data, "prompt", None),
        "completion": list(trace.assistant_messages),
        "trajectory": [branch_turn(b) for b in trace.branches],
    }


def branch_turn(branch: Any) -> dict:
    """A branch (one token sequence, `sampled_mask` on the model's tokens) as one turn's tokens."""
    ids, mask, logprobs = list(branch.token_ids), [bool(m) for m in branch.sampled_mask], list(branch.logprobs)
    first = mask.index(True) if True in mask else len(ids)
    return {
        "tokens": {
            "prompt_ids": ids[:first],
            "completion_ids": ids[first:],
            "completion_mask": [int(m) for m in mask[first:]],
            "completion_logprobs": logprobs[first:],
        }
    }
