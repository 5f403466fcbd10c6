"""Run an environment's rollout groups: the RunGroup for a set of slots (v1, direct v1 or classic).

`runners_for` makes what a mixture's slots need and nothing more: verifiers v1's runner for v1 slots (with
direct episodes for training), the classic client for classic ones; `Runners.close()` ends what it opened.
`sampling_args` is every model turn's request arguments. Invariant: the keys the orchestrator sets itself
never also come from `sampling.extra_body`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config.orchestrator import ClientConfig, SamplingConfig
from asyncrl.core.errors import UserError
from asyncrl.orchestrator.envs.classic import PLAIN_CLIENT, TOKEN_CLIENT, make_vf_client, run_classic_group
from asyncrl.orchestrator.envs.mixture import EnvSlot
from asyncrl.orchestrator.envs.v1 import is_v1_env, v1_run_group

# (env slot, group inputs, sampling args) -> verifiers rollout outputs; the boundary tests replace.
RunGroup = Callable[[EnvSlot, list[dict], dict], Awaitable[list[dict]]]
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


def verifiers_run_group(
    model: str | Callable[[], str], classic_client: Any = None, v1: RunGroup | None = None
) -> RunGroup:
    """The production RunGroup: the slot's environment runs and scores the group via verifiers; `model` is the
    served model's name, or a function giving it at each group (a LoRA run's adapter, once loaded).
    `classic_client`: verifiers' client for classic slots (`make_vf_client`); `v1`: the runner for verifiers
    v1 slots (`envs.v1`). Each is needed only where the mixture has such slots."""

    async def run(slot: EnvSlot, inputs: list[dict], args: dict) -> list[dict]:
        if is_v1_env(slot.env):
            return await v1(slot, inputs, args)
        name = model() if callable(model) else model
        return await run_classic_group(slot, classic_client, name, inputs, args)

    return run


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
    verifiers' transport machinery cannot change run direct (`direct.py`)."""
    classic = [s for s in slots if not is_v1_env(s.env)]
    v1 = v1_run_group(client, base_model, model, train, renderer, log_dir) if len(classic) < len(slots) else None
    if v1 is not None and train and direct:
        from asyncrl.orchestrator.envs.direct import DirectEpisodes

        v1.direct = DirectEpisodes(v1.client, client.timeout, client.merge_requests)
    classic_client = make_vf_client(client, TOKEN_CLIENT if train else PLAIN_CLIENT) if classic else None
    return Runners(verifiers_run_group(model, classic_client, v1), classic_client, v1)
