"""Run environments' examples against an OpenAI-compatible server and keep each rollout's messages and scores.

Shared by `eval` and `synthesize`. Environments are loaded and rolled out with the orchestrator's
code (`orchestrator.envs`: load_env / EnvMixture, verifiers' run_group), but through verifiers'
plain chat client, so any OpenAI-compatible server works (ours, vLLM, a hosted API): no token ids
are needed here.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from loguru import logger

from asyncrl.config.orchestrator import ClientConfig, EnvConfig, SamplingConfig
from asyncrl.core.errors import UserError
from asyncrl.orchestrator.envs.mixture import EnvMixture, EnvSlot, example_id, group_inputs
from asyncrl.orchestrator.envs.runners import RunGroup, Runners, runners_for, sampling_args
from asyncrl.utils.progress import Bar

# verifiers errors caused by the model's own answer (empty, unparsable, too long): the rollout did run
MODEL_ERRORS = {
    "InvalidModelResponseError",
    "EmptyModelResponseError",
    "OverlongPromptError",
    "ToolError",
    "ToolParseError",
    "ToolCallError",
}
DEFAULT_MAX_CONCURRENT = 256  # requests in flight when max_concurrent is unset


@dataclass
class RolloutRecord:
    env: str
    example_id: int
    rollout: int  # index within the example's rollouts
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)
    prompt: list[dict] | None = None
    completion: list[dict] | None = None
    tools: list[dict] | None = None
    error: str | None = None
    error_type: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def retryable(self) -> bool:
        """Failed for a reason outside the model's answer (server, network, environment bug)."""
        return self.error is not None and self.error_type not in MODEL_ERRORS


@dataclass
class Job:
    """One example's rollouts still to run: indices `first` .. `first + n - 1`."""

    slot: EnvSlot
    example_id: int
    row: dict
    n: int
    first: int = 0


def make_runners(client: ClientConfig, model: str, slots: list[EnvSlot], log_dir: Path | None = None) -> Runners:
    """verifiers' run_group through its plain chat client (one shared connection pool); v1 slots through
    verifiers v1's eval client (chat completions: any OpenAI-compatible server); `log_dir`: env servers'
    logs. Close it when done."""
    return runners_for(slots, client, model, model, train=False, log_dir=log_dir)


def load_slots(envs: list[EnvConfig], eval_split: bool) -> list[EnvSlot]:
    """The environments (orchestrator loader: clear errors for missing ones) with their split's rows."""
    return EnvMixture.load(envs, seq_len=None, eval_split=eval_split).slots


def example_rows(slot: EnvSlot, num_examples: int) -> list[tuple[int, dict]]:
    """The first `num_examples` rows (-1: all) with their example ids (verifiers sets `example_id`)."""
    rows = slot.rows if num_examples < 0 else slot.rows[:num_examples]
    return [(example_id(row, i), row) for i, row in enumerate(rows)]


def request_args(cfg: SamplingConfig) -> dict:
    """Sampling arguments without the vLLM-only defaults (top_k=-1, min_p=0) hosted APIs would reject."""
    args = sampling_args(cfg, with_seed=True)
    extra = {
        k: v
        for k, v in args.pop("extra_body").items()
        if not ((k == "top_k" and v == -1) or (k == "min_p" and v == 0.0))
    }
    if extra:
        args["extra_body"] = extra
    return args


def start_hint(url: str) -> str:
    return (
        f"start one with `inference --model.name <model> --server.port <port>` and pass "
        f"--client.base-url http://localhost:<port>/v1 (now {url})"
    )


async def check_server(cfg: ClientConfig, model: str, wait: float) -> None:
    """Wait up to `wait` s for `GET {url}/models`; a UserError naming the URL when nothing answers."""
    headers = {}
    key = os.environ.get(cfg.api_key_var)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    url = cfg.url.rstrip("/") + "/models"
    deadline = time.monotonic() + wait
    last, said = "", False
    async with httpx.AsyncClient(headers=headers, timeout=10.0) as http:
        while True:
            try:
                response = await http.get(url)
                if response.status_code in (401, 403):
                    raise UserError(
                        f"server at {cfg.url} refused the API key ({response.status_code}); set the "
                        f"key in ${cfg.api_key_var} or pick the variable with --client.api-key-var"
                    )
                if response.status_code == 200:
                    served = [m.get("id") for m in response.json().get("data", []) if isinstance(m, dict)]
                    if served and model not in served:
                        logger.warning(f"server at {cfg.url} lists {served[:5]}, not '{model}' (--model.name)")
                    return
                last = f"GET {url} answered {response.status_code}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            except ValueError:  # a non-JSON answer: something is there, let the requests tell
                return
            if time.monotonic() >= deadline:
                raise UserError(f"no OpenAI-compatible server reachable at {cfg.url} ({last}); {start_hint(cfg.url)}")
            if not said:
                said = True
                logger.info(f"waiting up to {wait:.0f}s for the server at {cfg.url} ({last})")
            await asyncio.sleep(1.0)


def plain_messages(messages: Any) -> list[dict] | None:
    """verifiers' message objects (pydantic) or dicts -> JSON-able dicts."""
    if messages is None:
        return None
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    return [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in messages]


def _records(job: Job, outputs: list[dict]) -> list[RolloutRecord]:
    out = []
    for i, o in enumerate(outputs):
        error, error_type = o.get("error"), None
        if isinstance(error, dict):
            error_type = error.get("error")
            error = error.get("error_chain_repr") or error.get("message") or str(error)
        reward = o.get("reward")
        if error is None and reward is None:
            error = "rollout has no reward (scoring failed)"
        metrics = {
            k: float(v)
            for k, v in (o.get("metrics") or {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        out.append(
            RolloutRecord(
                env=job.slot.name,
                example_id=job.example_id,
                rollout=job.first + i,
                reward=float(reward or 0.0),
                metrics=metrics,
                prompt=plain_messages(o.get("prompt")),
                completion=plain_messages(o.get("completion")),
                tools=o.get("tool_defs") or None,
                error=str(error) if error else None,
                error_type=error_type,
            )
        )
    return out


async def run_jobs(
    jobs: list[Job],
    run_group: RunGroup,
    args: dict,
    max_concurrent: int | None,
    on_group: Callable[[Job, list[RolloutRecord]], Awaitable[None] | None] | None = None,
) -> list[RolloutRecord]:
    """Run every job (one group of n rollouts each), at most `max_concurrent` requests in flight.

    A failing group (server down, environment bug) becomes records with `error` set, never an exception.
    `on_group` sees each finished group in completion order (synthesize appends it to disk there).
    """
    limit = max_concurrent or DEFAULT_MAX_CONCURRENT
    sem = asyncio.Semaphore(max(1, limit // max(1, max((j.n for j in jobs), default=1))))
    done = rollouts = failed = 0
    reward_sum = 0.0
    start = time.monotonic()

    async def one(job: Job) -> list[RolloutRecord]:
        nonlocal done, rollouts, failed, reward_sum
        async with sem:
            try:
                outputs = await run_group(job.slot, group_inputs(job.row, job.n), args)
                records = _records(job, list(outputs))
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                records = [
                    RolloutRecord(
                        job.slot.name, job.example_id, job.first + i, 0.0, error=error, error_type=type(e).__name__
                    )
                    for i in range(job.n)
                ]
        if on_group is not None:
            result = on_group(job, records)
            if asyncio.iscoroutine(result):
                await result
        done += 1
        reward_sum += sum(r.reward for r in records if r.ok)  # a failed rollout counts 0, as in `summarize`
        rollouts, failed = rollouts + len(records), failed + sum(not r.ok for r in records)
        bar.update(done, reward=reward_sum / max(rollouts, 1), errors=failed or None)
        if done * 10 // len(jobs) > (done - 1) * 10 // len(jobs):  # every 10%
            logger.info(f"{done}/{len(jobs)} examples done ({time.monotonic() - start:.1f}s)")
        return records

    with Bar("examples", len(jobs)) as bar:
        results = await asyncio.gather(*(one(j) for j in jobs))
    return [r for rs in results for r in rs]


def first_error(records: list[RolloutRecord]) -> str | None:
    return next((r.error for r in records if r.error), None)


def summarize(records: list[RolloutRecord]) -> dict[str, dict[str, Any]]:
    """Per environment: reward mean/std, rubric metric means, counts.

    Failed rollouts (e.g. an empty model answer, which verifiers aborts) count as reward 0 so they
    cannot flatter the mean; `errors` says how many there were.
    """
    import statistics

    by_env: dict[str, list[RolloutRecord]] = {}
    for r in records:
        by_env.setdefault(r.env, []).append(r)
    out = {}
    for env, rs in by_env.items():
        valid = [r for r in rs if r.ok]
        rewards = [r.reward if r.ok else 0.0 for r in rs]
        names = sorted({k for r in valid for k in r.metrics})
        out[env] = {
            "reward_mean": statistics.fmean(rewards) if rewards else None,
            "reward_std": statistics.pstdev(rewards) if rewards else None,
            "rollouts": len(rs),
            "errors": len(rs) - len(valid),
            "metrics": {n: statistics.fmean([r.metrics[n] for r in valid if n in r.metrics]) for n in names},
        }
    return out


def completion_text(messages: list[dict] | None) -> str:
    """The assistant messages' text of a completion, joined (for logs and eval rows)."""
    if not messages:
        return ""
    parts = []
    for m in messages:
        if m.get("role") != "assistant":
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(content or "")
    return "\n".join(parts)
