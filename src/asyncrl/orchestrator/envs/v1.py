"""verifiers v1 environments: a taskset package, run as episodes of its agents against our server.

A v1 environment is an installed package whose `__all__` exports a `verifiers.v1.Taskset` subclass (the
rule of verifiers' own loader). Its tasks are the slot's prompts. A group is `rollouts_per_example`
episodes of one task, run in this process: the taskset's own Env (several agents) or the single-agent one,
every agent on harness `asyncrl-chat` (verifiers' chat loop as a coroutine here, `harness.py`) and
runtime `subprocess` unless the environment's args say otherwise (no sandbox, no tunnel). Each env's
serving resources (shared tool servers, one interception server) are held from its first group to the
run's end (`V1Runner`). For training, an episode whose agents verifiers' transport machinery cannot change
runs direct (`direct.py`: the same episode, its model calls made in this process, a group's shared prompt
sent once); the others go through verifiers' training client, which renders each turn with the `renderers`
package and posts the token ids to `/inference/v1/generate` (`eval`/`synthesize`: its eval client, plain
chat completions).

Invariant: each trace (an agent's run) is one rollout, and each of its branches one turn for the samples
converter. A branch's prompt is the tokens before the first sampled one, its completion the rest, with
`sampled_mask` as the completion mask and the engine's logprobs (and an MoE's routing record, when the engine
returned one). The trainer therefore sees exactly the ids and logprobs the engine sampled, env tokens between
turns masked out.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loguru import logger

from asyncrl.config.orchestrator import ClientConfig
from asyncrl.core.errors import UserError
from asyncrl.orchestrator.envs.http import close_shared_http
from asyncrl.orchestrator.envs.served import ServedEnv
from asyncrl.orchestrator.envs.tuning import tune_for_episodes

HARNESS_ID = "asyncrl-chat"  # verifiers' chat loop in this process (package asyncrl_chat; see harness.py)
AGENT_DEFAULTS = {"harness": {"id": HARNESS_ID}, "runtime": {"type": "subprocess"}}
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


def load_v1_env(module: str, env_id: str, args: dict[str, Any], eval_split: bool = False) -> Any:
    """The v1 Env for taskset `module` with `args` (see `v1_env_config`); user-facing errors."""
    from verifiers.v1.utils.loaders import load_environment

    config = v1_env_config(module, env_id, args, eval_split)
    try:
        return load_environment(config)
    except (OSError, ValueError, TypeError) as e:  # e.g. taskset system_prompt, a file path, given as text
        raise UserError(f"environment '{env_id}' (verifiers v1) failed to load with args {args}: {e}") from None


def v1_env_config(module: str, env_id: str, args: dict[str, Any], eval_split: bool = False) -> Any:
    """The v1 env config for taskset `module`: the taskset's own Env config when it exports one (several
    agents, each a role of its config), else the single-agent one. `args`: a role's name overrides that agent
    (each defaults to `AGENT_DEFAULTS`), another field of the env config sets it, the rest are the taskset
    config's fields. `eval_split`: a taskset with a `split` field gets split = "eval" unless args set it
    (the held-out convention of the environments asyncrl ships)."""
    from pydantic import ValidationError
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.utils.loaders import env_config_type, taskset_config_type

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
    if eval_split and "split" not in raw["taskset"] and "split" in taskset_config_type(module).model_fields:
        raw["taskset"]["split"] = "eval"
    try:
        return config_type.model_validate(raw)
    except ValidationError as e:
        raise UserError(f"environment '{env_id}' (verifiers v1) rejects args {args}: {first_error(e)}") from None


def first_error(e: Any) -> str:
    """A pydantic ValidationError's first error as `where: what`."""
    first = e.errors()[0]
    return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"


def v1_tasks(env: Any, env_id: str) -> list[Any]:
    """The taskset's tasks; of one with more than MAX_TASKS (one that generates them), the first MAX_TASKS."""
    return load_tasks(env, env_id)[0]


def load_tasks(env: Any, env_id: str) -> tuple[list[Any], bool]:
    """The taskset's tasks (at most MAX_TASKS) and whether it has more: a taskset that generates tasks, which
    training then takes in its own order, each once (`EnvSlot.stream`)."""
    tasks = list(itertools.islice(iter(env.taskset), MAX_TASKS + 1))
    if not tasks:
        raise UserError(f"environment '{env_id}' (verifiers v1) has no tasks")
    if len(tasks) > MAX_TASKS:
        logger.info(f"environment '{env_id}' has more than {MAX_TASKS} tasks: training takes them in order, each once")
    return tasks[:MAX_TASKS], len(tasks) > MAX_TASKS


def sampling_config(args: dict) -> Any:
    """The orchestrator's request arguments as a v1 SamplingConfig (extra keys such as top_k pass through)."""
    from verifiers.v1.types import SamplingConfig

    flat = {k: v for k, v in args.items() if k not in ("n", "extra_body")}
    return SamplingConfig(**flat, **(args.get("extra_body") or {}))


def v1_run_group(
    client: ClientConfig,
    base_model: str,
    model: str | Callable[[], str],
    train: bool = True,
    renderer: dict | None = None,
    log_dir: Path | None = None,
) -> V1Runner:
    """A RunGroup for v1 slots: the group's episodes run concurrently; each becomes one rollout output.

    `train`: verifiers' training client (token ids and logprobs, our server or vLLM); else its eval client
    (chat completions, any OpenAI-compatible server: `eval` and `synthesize`). `renderer`: the `renderers`
    config the training client renders prompts and parses replies with (None: chosen from the model name).
    `log_dir`: where env servers started for slots with `server` set write their logs."""
    import verifiers.v1 as vf
    from pydantic import ValidationError

    endpoint = {"base_url": client.url, "api_key_var": client.api_key_var}
    if train:
        try:
            chosen = vf.TrainClientConfig(**endpoint, renderer_model_name=base_model, renderer=renderer)
        except ValidationError as e:
            raise UserError(f"orchestrator.renderer {renderer} is not a renderers config: {first_error(e)}") from None
    else:
        chosen = vf.EvalClientConfig(**endpoint)
    tune_for_episodes()
    return V1Runner(chosen, model, log_dir)


class V1Runner:
    """Runs groups of v1 episodes: in this process, direct where `direct` (a `direct.DirectEpisodes`) takes
    the slot, else holding each environment's serving resources (its taskset's shared tool servers, one
    interception server) from its first group until `close()`, as verifiers' own eval does; or, for a slot
    whose config sets `server`, in that env server (`served.py`)."""

    def __init__(self, client: Any, model: str | Callable[[], str], log_dir: Path | None = None):
        self.client, self.model, self.log_dir = client, model, log_dir
        self.direct: Any = None  # a direct.DirectEpisodes: the slots whose episodes run direct
        self.holders: dict[int, tuple[asyncio.Task, asyncio.Event]] = {}
        self.servers: dict[str, ServedEnv] = {}
        self.lock = asyncio.Lock()

    async def __call__(self, slot, tasks: list[Any], args: dict) -> list[dict]:
        import verifiers.v1 as vf

        name = self.model() if callable(self.model) else self.model
        sampling = sampling_config(args)
        server = self.server_of(slot)
        if server is not None:
            runs = [server.run(task, self.client, name, sampling) for task in tasks]
        else:
            if not await self.goes_direct(slot):
                await self.serve(slot.env)
            ctx = vf.ModelContext(model=name, client=self.client, sampling=sampling)
            runs = [slot.env.run_episode(task, ctx) for task in tasks]
        episodes = await asyncio.gather(*runs, return_exceptions=True)
        train = isinstance(self.client, vf.TrainClientConfig)
        return [out for task, episode in zip(tasks, episodes) for out in episode_outputs(task, episode, train)]

    async def goes_direct(self, slot) -> bool:
        """Whether the slot's episodes run direct (`direct.DirectEpisodes`, set by `envs.runners_for`)."""
        return self.direct is not None and await self.direct.ready(slot, self.serve)

    def server_of(self, slot) -> ServedEnv | None:
        """The slot's env server (made on its first group), or None when its episodes run here."""
        cfg = getattr(slot, "config", None)
        if cfg is None or cfg.server is None:
            return None
        if slot.name not in self.servers:
            self.servers[slot.name] = ServedEnv(slot.name, cfg, self.log_dir, self.client)
        return self.servers[slot.name]

    async def serve(self, env: Any) -> None:
        """Enter `env.serving()` once, in a task of its own that holds it open until `close()`."""
        async with self.lock:
            if id(env) in self.holders:
                return
            ready, done = asyncio.Event(), asyncio.Event()

            async def hold() -> None:
                async with env.serving():
                    ready.set()
                    await done.wait()

            holder = asyncio.create_task(hold())
            waiter = asyncio.create_task(ready.wait())
            await asyncio.wait([holder, waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if holder.done():  # serving failed to start: its error is every episode's, named once
                raise UserError(f"environment could not start its tool servers: {error_line(holder.exception())}")
            self.holders[id(env)] = (holder, done)

    async def close(self) -> None:
        for holder, done in self.holders.values():
            done.set()
            await asyncio.gather(holder, return_exceptions=True)
        self.holders.clear()
        for server in self.servers.values():
            await server.close()
        self.servers.clear()
        if self.direct is not None:
            await self.direct.close()
        await close_shared_http()


def episode_outputs(task: Any, episode: Any, train: bool = True) -> list[dict]:
    """One episode as rollout outputs for `samples.TrajectoryConverter`: one per trace of a trainable agent
    (a multi-agent episode has several; a simulated user or a judge is `trainable=False`), its `trajectory`
    a turn per branch. `train=False` (`eval`, `synthesize`): every agent's trace when none is trainable."""
    example_id = task_id(task)
    if isinstance(episode, BaseException):
        return [{"example_id": example_id, "error": error_line(episode)}]
    if not episode.traces:
        errors = "; ".join(error_line(e) for e in episode.errors) or "the episode produced no trace"
        return [{"example_id": example_id, "error": errors}]
    # a seat that never got to act (a hand decided before its turn) has nothing to train on: left out
    played = [t for t in episode.traces if t.branches or t.has_error]
    trainable = [t for t in played if t.agent.trainable]
    chosen = trainable if train else trainable or played
    if not chosen:
        why = "no agent of the episode made a model call" if not played else "no agent of the episode is trainable"
        return [{"example_id": example_id, "error": why}]
    return [trace_output(example_id, task, trace, episode.errors) for trace in chosen]


def trace_output(example_id: int, task: Any, trace: Any, episode_errors: list) -> dict:
    if trace.has_error or episode_errors:
        return {"example_id": example_id, "error": error_line(trace.last_error or episode_errors[0])}
    rewards = {name: r.score for name, r in (trace.rewards or {}).items() if r is not None}
    return {
        "example_id": example_id,
        "agent": trace.agent.name,
        "reward": trace.reward,
        # every named reward, metric and the turn count, as a classic environment reports them
        "metrics": {
            **rewards,
            **{k: v for k, v in (trace.metrics or {}).items() if v is not None},
            "num_turns": float(trace.num_turns),
        },
        "is_truncated": bool(trace.is_truncated),
        **conversation(task, trace),
        "trajectory": [branch_turn(b) for b in trace.branches],
    }


def conversation(task: Any, trace: Any) -> dict:
    """The trace's final branch as a classic output's `prompt` (the task's system prompt and prompt),
    `completion` (the rest: replies, tool results, the env's turns) and `tool_defs` (OpenAI form)."""
    branch = trace.branches[-1] if trace.branches else None
    messages = [node.message for node in (branch.nodes if branch is not None else [])]
    prompt = getattr(task.data, "prompt", None)
    first = (1 if isinstance(prompt, str) else len(prompt or [])) + (1 if task.data.system_prompt else 0)
    tools = [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in (branch.tools if branch is not None else [])
    ]
    return {"prompt": messages[:first], "completion": messages[first:], "tool_defs": tools or None}


def error_line(error: Any) -> str:
    """A trace's error as `Type: message`, its message cut to its last line (a failed program's error
    carries the program's whole traceback; the cause is at its end)."""
    kind = getattr(error, "type", None) or type(error).__name__
    message = str(getattr(error, "message", None) or error).strip()
    return f"{kind}: {message.splitlines()[-1] if message else ''}"


def branch_turn(branch: Any) -> dict:
    """A branch (one token sequence, `sampled_mask` on the model's tokens) as one turn's tokens."""
    ids, mask, logprobs = list(branch.token_ids), [bool(m) for m in branch.sampled_mask], list(branch.logprobs)
    first = mask.index(True) if True in mask else len(ids)
    tokens = {
        "prompt_ids": ids[:first],
        "completion_ids": ids[first:],
        "completion_mask": [int(m) for m in mask[first:]],
        "completion_logprobs": logprobs[first:],
    }
    routes = getattr(branch, "routed_experts", None)  # an MoE's routing record, one row per token
    return {"tokens": tokens if routes is None else tokens | {"routed_experts": routes}}
