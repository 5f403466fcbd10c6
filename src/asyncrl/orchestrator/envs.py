"""Verifiers environments: load them, sample prompts across several by ratio, run rollout groups.

Environments are installed packages. A package exporting a verifiers v1 Taskset runs through
`orchestrator.v1` (verifiers >= 0.4 has only these). A classic one, loaded with `load_environment(id,
**args)` where verifiers < 0.4 is installed, runs through verifiers' own `run_group` with its token client
(`openai_chat_completions_token`). Either way single-turn, multi-turn and tool environments run unmodified
and every turn comes back with the engine's token ids and sampling logprobs. verifiers' classic modules are
imported only when a classic environment is loaded.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import random
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

from asyncrl.config.orchestrator import ClientConfig, EnvConfig, SamplingConfig
from asyncrl.core.errors import UserError
from asyncrl.orchestrator.curriculum import DifficultyPools
from asyncrl.orchestrator.v1 import is_v1_env, is_v1_module, load_tasks, load_v1_env, task_id, v1_run_group

# (env slot, group inputs, sampling args) -> verifiers rollout outputs; the boundary tests replace.
RunGroup = Callable[["EnvSlot", list[dict], dict], Awaitable[list[dict]]]
TOKEN_CLIENT = "openai_chat_completions_token"
PLAIN_CLIENT = "openai_chat_completions"  # no token ids: `eval`/`synthesize` against any OpenAI-compatible server
# Keys the orchestrator sets itself; the same key in sampling.extra_body would be sent twice.
_OWN_SAMPLING_KEYS = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "max_completion_tokens",
    "seed",
    "logprobs",
    "n",
    "return_token_ids",
}


def env_module(env_id: str) -> str:
    return env_id.replace("-", "_").split("/")[-1]


# PRIME-RL's benchmark and math environments: verifiers environments on Prime Intellect's Environments Hub
# (not on PyPI), by the id the PRIME-RL docs use.
HUB_ENVIRONMENTS = {
    "math500": "primeintellect/math500",
    "aime2024": "primeintellect/aime2024",
    "aime2025": "primeintellect/aime2025",
    "gpqa": "primeintellect/gpqa",
    "hendrycks-math": "primeintellect/hendrycks-math",
    "intellect-math": "primeintellect/intellect-math",
}


def install_hint(env_id: str) -> str:
    network = " (needs network)" if env_id in HUB_ENVIRONMENTS or "/" in env_id else ""
    then = f', then use id = "{env_id.split("/", 1)[1]}"' if "/" in env_id else ""
    return f"install it with {install_commands(env_id)}{network}{then}"


def install_commands(env_id: str) -> str:
    """How to install an environment: from the Environments Hub (owner/name, or one of PRIME-RL's), else locally."""
    hub_id = HUB_ENVIRONMENTS.get(env_id, env_id if "/" in env_id else None)
    if hub_id is not None:
        owner, name = hub_id.split("/", 1)
        return (
            f"`prime env install {hub_id}` or `uv pip install {name} "
            f"--extra-index-url https://hub.primeintellect.ai/{owner}/simple/`"
        )
    return f"`uv pip install -e environments/{env_module(env_id)}` (a local environment) or `pip install {env_id}`"


def check_installed(env_ids: list[str]) -> None:
    """Every missing environment in one error, rather than one per attempt (a single one: `load_env` says it)."""
    missing = [i for i in dict.fromkeys(env_ids) if importlib.util.find_spec(env_module(i)) is None]
    if len(missing) < 2:
        return
    hints = "; ".join(f"{i}: {install_commands(i)}" for i in missing)
    raise UserError(f"environments not installed: {', '.join(missing)}; install them with {hints}")


def installed_module(env_id: str) -> str:
    """The module of environment `env_id`; a UserError with how to install it when it is not installed."""
    module = env_module(env_id)
    if importlib.util.find_spec(module) is None:
        raise UserError(f"environment '{env_id}' is not installed (no module '{module}'); {install_hint(env_id)}")
    return module


def load_env(cfg: EnvConfig, eval_split: bool = False) -> Any:
    """The environment `cfg` names: a verifiers v1 taskset package, else a classic one
    (`verifiers.load_environment(cfg.id, **cfg.args)`, where verifiers < 0.4 provides it); user-facing errors."""
    module = installed_module(cfg.id)
    if is_v1_module(module):
        return load_v1_env(module, cfg.id, cfg.args, eval_split=eval_split)
    import verifiers as vf

    if not hasattr(vf, "load_environment"):
        raise UserError(
            f"environment '{cfg.id}' is not a verifiers v1 environment (its package exports no v1 Taskset), and "
            f"verifiers {vf.__version__} loads only those: port it to verifiers.v1 (docs/rl.md, 'verifiers v1 "
            "environments') or, for a classic environment, install verifiers<0.4"
        )
    try:
        return vf.load_environment(module, **cfg.args)
    except (TypeError, ValueError, RuntimeError) as e:
        cause = e.__cause__ or e
        raise UserError(f"environment '{cfg.id}' failed to load with args {cfg.args}: {cause}") from e


@dataclass
class EnvSlot:
    """One environment of the mixture, with its prompt order and position for resumable sampling."""

    name: str
    env: Any
    ratio: float
    rows: list[dict] = field(default_factory=list)
    config: EnvConfig | None = None  # what it was loaded from (its `server`: where its episodes run)
    curriculum: DifficultyPools | None = None  # draws by recent reward instead of shuffled epochs
    stream: Callable[[], Iterator[Any]] | None = None  # a taskset with more tasks than rows: taken in order
    source: Iterator[Any] | None = None  # the stream's iterator, `cursor` tasks in
    epoch: int = 0
    cursor: int = 0
    order: list[int] = field(default_factory=list)

    def next_row(self, seed: int) -> dict:
        if self.curriculum is not None:
            return self.rows[self.curriculum.next_index(seed)]
        if self.stream is not None:
            return self.next_streamed()
        if not self.order or self.cursor >= len(self.order):
            if self.order:
                self.epoch += 1
            self.cursor = 0
            self.order = shuffled(len(self.rows), f"{seed}:{self.name}:{self.epoch}")
        row = self.rows[self.order[self.cursor]]
        self.cursor += 1
        return row

    def next_streamed(self) -> Any:
        """The stream's next task (past the end of a stream that does end: from its start again)."""
        if self.source is None:
            self.source = itertools.islice(self.stream(), self.cursor, None)  # resumed: skip what was taken
        task = next(self.source, None)
        if task is None:
            self.epoch, self.cursor, self.source = self.epoch + 1, 0, self.stream()
            task = next(self.source)
        self.cursor += 1
        return task


def shuffled(n: int, seed: str) -> list[int]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


class EnvMixture:
    """Several environments sampled per prompt by their ratios (equal when unset)."""

    def __init__(self, slots: list[EnvSlot], seed: int = 0):
        if not slots:
            raise UserError("at least one environment is needed")
        names = [s.name for s in slots]
        if len(set(names)) != len(names):
            raise UserError(f"environment names must be unique, got {names}; give duplicates a distinct `name`")
        self.slots = slots
        self.by_name = {s.name: s for s in slots}
        self.seed = seed
        self.problems = 0  # prompts drawn so far (the next draw's index)

    @classmethod
    def load(cls, configs: list[EnvConfig], seq_len: int | None, seed: int = 0, eval_split: bool = False) -> EnvMixture:
        check_installed([c.id for c in configs])
        slots = []
        for cfg in configs:
            env = load_env(cfg, eval_split)
            if cfg.server is not None and not is_v1_env(env):
                raise UserError(
                    f"environment '{cfg.id}' is a classic one: only verifiers v1 environments run in an "
                    "env server; drop its `server`"
                )
            endless = False
            if is_v1_env(env):  # its tasks are its prompts; a held-out split is its `split` arg (or own args)
                rows, endless = load_tasks(env, cfg.id)
            else:
                if seq_len is not None and hasattr(env, "set_max_seq_len"):
                    env.set_max_seq_len(seq_len)
                rows = (env.get_eval_dataset() if eval_split else env.get_dataset()).to_list()
            if not rows:
                raise UserError(f"environment '{cfg.id}' has an empty {'eval ' if eval_split else ''}dataset")
            name = cfg.name or cfg.id
            slots.append(EnvSlot(name=name, env=env, ratio=cfg.ratio or 1.0, rows=rows, config=cfg))
            if endless and not eval_split:
                slots[-1].stream = env.taskset.__iter__  # a fresh pass over the taskset per call
            if cfg.curriculum is not None and not eval_split:
                if endless:
                    raise UserError(
                        f"environment '{cfg.id}' generates tasks without end: a curriculum needs a "
                        "finite taskset; drop `curriculum`"
                    )
                ids = [example_id(row, i) for i, row in enumerate(rows)]
                slots[-1].curriculum = DifficultyPools(name, cfg.curriculum, ids)
            logger.info(f"loaded environment {slots[-1].name} ({type(env).__name__}, {len(rows)} prompts)")
        return cls(slots, seed)

    def draw(self) -> tuple[EnvSlot, dict]:
        """The next prompt: an environment chosen by ratio, then its next row."""
        rng = random.Random(f"{self.seed}:draw:{self.problems}")
        self.problems += 1
        slot = rng.choices(self.slots, weights=[s.ratio for s in self.slots])[0]
        return slot, slot.next_row(self.seed)

    def observe(self, env: str, task: int, mean_reward: float) -> None:
        """A finished group's mean reward on task `task` of environment `env` (for its curriculum, if any)."""
        slot = self.by_name.get(env)
        if slot is not None and slot.curriculum is not None:
            slot.curriculum.observe(task, mean_reward)

    def metrics(self) -> dict[str, float]:
        return {k: v for s in self.slots if s.curriculum is not None for k, v in s.curriculum.metrics().items()}

    def state(self) -> dict:
        envs = {s.name: {"epoch": s.epoch, "cursor": s.cursor, "size": len(s.rows)} for s in self.slots}
        for s in self.slots:
            if s.curriculum is not None:
                envs[s.name]["curriculum"] = s.curriculum.state()
        return {"problems": self.problems, "envs": envs}

    def load_state(self, state: dict) -> None:
        self.problems = int(state.get("problems", 0))
        for name, st in (state.get("envs") or {}).items():
            slot = self.by_name.get(name)
            if slot is None:
                logger.warning(f"checkpoint has sampling state for unknown environment {name!r}; ignored")
                continue
            if st.get("size") != len(slot.rows):
                logger.warning(f"environment {name!r} changed size since the checkpoint; restarting its order")
                continue
            slot.epoch, slot.cursor, slot.source = int(st["epoch"]), int(st["cursor"]), None
            if slot.curriculum is not None:
                slot.curriculum.load_state(st.get("curriculum") or {})
            slot.order = shuffled(len(slot.rows), f"{self.seed}:{slot.name}:{slot.epoch}")


def example_id(row: Any, default: int = -1) -> int:
    """A classic row's `example_id`, a v1 task's `data.idx` (`default` when it has none)."""
    return int(row.get("example_id", default)) if isinstance(row, dict) else task_id(row, default)


def group_inputs(row: Any, n: int) -> list[Any]:
    """The group's n inputs: copies of a classic row; a v1 task itself, n times."""
    return [dict(row) if isinstance(row, dict) else row for _ in range(n)]


def sampling_args(cfg: SamplingConfig, with_seed: bool = False) -> dict:
    """Request arguments for every model turn (top_p=1/top_k=-1/min_p=0 keep importance ratios exact)."""
    clash = _OWN_SAMPLING_KEYS & set(cfg.extra_body)
    if clash:
        raise UserError(
            f"sampling.extra_body sets {sorted(clash)}, which the orchestrator sets itself; "
            "use the [orchestrator.sampling] fields instead"
        )
    args: dict[str, Any] = {
        "n": 1,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "extra_body": {"top_k": cfg.top_k, "min_p": cfg.min_p, **cfg.extra_body},
    }
    if cfg.max_tokens is not None:
        args["max_tokens"] = cfg.max_tokens
    if with_seed and cfg.seed is not None:
        args["seed"] = cfg.seed
    return args


def make_vf_client(cfg: ClientConfig, client_type: str = TOKEN_CLIENT) -> Any:
    """Verifiers' token client for our server, over one aiohttp connection pool.

    `eval`/`synthesize` pass client_type=PLAIN_CLIENT: no token ids, any OpenAI-compatible server.
    aiohttp, not verifiers' default httpx pool: httpcore scans every open connection on each request it
    starts or ends, which with one connection per rollout in flight (128 in the bench job) took most of the
    orchestrator's CPU and made it, not the server, the bottleneck of generation. With
    `cfg.merge_requests`, the rollouts of a group go out as one request (`coalesce.MergingTransport`).
    """
    import os

    from openai import AsyncOpenAI, DefaultAioHttpClient, DefaultAsyncHttpxClient
    from verifiers.clients import OpenAIChatCompletionsClient, OpenAIChatCompletionsTokenClient

    from asyncrl.orchestrator.coalesce import MergingTransport

    classes = {TOKEN_CLIENT: OpenAIChatCompletionsTokenClient, PLAIN_CLIENT: OpenAIChatCompletionsClient}
    try:
        http = DefaultAioHttpClient(timeout=cfg.timeout)
    except RuntimeError as e:  # an openai build without its aiohttp transport: keep httpx's pool
        logger.warning(f"rollouts go through httpx's connection pool, slower with many in flight ({e})")
        http = DefaultAsyncHttpxClient(timeout=cfg.timeout)
    if cfg.merge_requests:
        http._transport = MergingTransport(http._transport)  # the client's one transport (no proxy mounts here)
    key = os.environ.get(cfg.api_key_var) or "EMPTY"
    client = AsyncOpenAI(api_key=key, base_url=cfg.url, max_retries=2, timeout=cfg.timeout, http_client=http)
    return classes[client_type](client)


def verifiers_run_group(
    model: str | Callable[[], str], classic_client: Any = None, v1: RunGroup | None = None
) -> RunGroup:
    """The production RunGroup: the slot's environment runs and scores the group via verifiers; `model` is the
    served model's name, or a function giving it at each group (a LoRA run's adapter, once loaded).
    `classic_client`: verifiers' client for classic slots (`make_vf_client`); `v1`: the runner for verifiers
    v1 slots (`orchestrator.v1`). Each is needed only where the mixture has such slots."""

    async def run(slot: EnvSlot, inputs: list[dict], args: dict) -> list[dict]:
        if is_v1_env(slot.env):
            return await v1(slot, inputs, args)
        merged = {
            **slot.env.sampling_args,
            **args,
            "extra_body": {**(slot.env.sampling_args.get("extra_body") or {}), **args.get("extra_body", {})},
        }
        name = model() if callable(model) else model
        return await slot.env.run_group(inputs, classic_client, name, merged, state_columns=["trajectory"])

    return run


def problems_per_step(batch_size: int, rollouts_per_example: int) -> int:
    return max(1, batch_size // rollouts_per_example)


def in_flight_target(problems: int, oversampling_factor: float) -> int:
    return max(problems, math.ceil(problems * oversampling_factor))


@dataclass
class Runners:
    """The RunGroup for a set of slots, with what it opened: the classic client, the v1 runner (each None
    without such slots); `close()` ends them."""

    run_group: RunGroup
    classic_client: Any = None
    v1: Any = None

    async def close(self) -> None:
        if self.classic_client is not None:
            await self.classic_client.close()
        if self.v1 is not None:
            await self.v1.close()


def runners_for(
    slots: list[EnvSlot],
    client: ClientConfig,
    base_model: str,
    model: str | Callable[[], str],
    train: bool = True,
    renderer: dict | None = None,
    log_dir: Path | None = None,
    direct: bool = True,
) -> Runners:
    """The RunGroup for these slots: verifiers v1's client for v1 slots, the classic token client (train) or
    plain chat client (`eval`/`synthesize`) for classic ones; each made only when a slot needs it. `log_dir`:
    the logs of env servers started for slots that set `server`. `direct` (training only): v1 episodes that
    verifiers' transport machinery cannot change run direct (`v1_direct.py`)."""
    classic = [s for s in slots if not is_v1_env(s.env)]
    v1 = v1_run_group(client, base_model, model, train, renderer, log_dir) if len(classic) < len(slots) else None
    if v1 is not None and train and direct:
        from asyncrl.orchestrator.v1_direct import DirectEpisodes

        v1.direct = DirectEpisodes(v1.client, client.timeout, client.merge_requests)
    classic_client = make_vf_client(client, TOKEN_CLIENT if train else PLAIN_CLIENT) if classic else None
    return Runners(verifiers_run_group(model, classic_client, v1), classic_client, v1)
