"""`synthesize`: roll out environments against a model and write the rollouts as an SFT dataset.

Each kept rollout is one JSONL row in the `sft` format: `prompt` and `completion` (chat messages,
tool calls in OpenAI form), `tools` for tool environments (so `sft` renders the same tool prompt
the server did), and `env`, `example_id`, `rollout`, `reward` for provenance (`sft` ignores them).
`min_reward` keeps only rollouts scoring at least that much.

Resumable: `<file>.progress` beside the dataset records, per example, how many rollouts have been
run (kept or not). A re-run runs only what is missing — new examples, extra rollouts per example,
groups that failed — after dropping rows that a crash left beyond the recorded progress. A group is
appended (rows first, then its progress line) unless a rollout failed for a reason outside the model
(server, network, environment bug); such groups are retried by the next run.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from asyncrl.config.synthesize import SynthesizeConfig
from asyncrl.core.errors import UserError
from asyncrl.evaluation.runner import (
    Job,
    RolloutRecord,
    check_server,
    example_rows,
    load_slots,
    make_runners,
    request_args,
    run_jobs,
    start_hint,
)
from asyncrl.transport.files import write_text_atomic
from asyncrl.transport.layout import RunLayout
from asyncrl.utils.messages import openai_messages, openai_tools

Key = tuple[str, int]  # (env name, example id)


@dataclass
class SynthStats:
    groups: int = 0
    failed_groups: int = 0
    rollouts: int = 0
    kept: int = 0
    rewards: list[float] = field(default_factory=list)
    first_error: str | None = None


def dataset_path(config: SynthesizeConfig) -> Path:
    return Path(config.output) if config.output else Path(config.output_dir) / "synthetic" / "data.jsonl"


def progress_path(data: Path) -> Path:
    return data.with_name(data.name + ".progress")  # no .jsonl suffix: `sft --data.name DIR` skips it


def _json_lines(path: Path) -> list[dict]:
    """Parsed lines; a torn last line (a crash mid-write) is dropped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read_progress(path: Path) -> dict[Key, int]:
    done: dict[Key, int] = {}
    for entry in _json_lines(path):
        key = (str(entry["env"]), int(entry["example_id"]))
        done[key] = max(done.get(key, 0), int(entry["rollouts"]))
    return done


def repair_dataset(data: Path, done: dict[Key, int]) -> int:
    """Drop rows not covered by the progress file (a crash between the two appends); returns rows kept."""
    if not data.exists():
        return 0
    rows = _json_lines(data)
    keep = [r for r in rows if "env" in r and r.get("rollout", 0) < done.get((str(r["env"]), int(r["example_id"])), 0)]
    raw_lines = len(data.read_text().splitlines())
    if len(keep) != raw_lines:
        logger.warning(f"{data}: dropping {raw_lines - len(keep)} row(s) written after the last recorded progress")
        write_text_atomic(data, "".join(json.dumps(r) + "\n" for r in keep))
    return len(keep)


def sft_row(r: RolloutRecord) -> dict:
    row = {
        "prompt": openai_messages(r.prompt or [], "user"),
        "completion": openai_messages(r.completion or [], "assistant"),
    }
    tools = openai_tools(r.tools)
    if tools:
        row["tools"] = tools
    row.update(env=r.env, example_id=r.example_id, rollout=r.rollout, reward=r.reward)
    return row


def _append(path: Path, lines: list[dict]) -> None:
    with path.open("a") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())


async def _synthesize(config: SynthesizeConfig, layout: RunLayout) -> SynthStats:
    data = dataset_path(config)
    progress = progress_path(data)
    data.parent.mkdir(parents=True, exist_ok=True)
    done = read_progress(progress)
    existing = repair_dataset(data, done)
    slots = load_slots(config.envs(), eval_split=config.split == "eval")
    jobs = []
    for slot in slots:
        for ex_id, row in example_rows(slot, config.num_examples):
            have = done.get((slot.name, ex_id), 0)
            if have < config.rollouts_per_example:
                jobs.append(Job(slot, ex_id, row, config.rollouts_per_example - have, first=have))
    stats = SynthStats()
    if not jobs:
        logger.success(f"nothing to do: {data} already has every requested rollout ({existing} rows)")
        return stats
    skipped = sum(len(example_rows(s, config.num_examples)) for s in slots) - len(jobs)
    logger.info(f"{len(jobs)} example(s) to roll out" + (f" ({skipped} already done in {data})" if skipped else ""))
    await check_server(config.client, config.model.name, config.server_wait)

    def on_group(job: Job, records: list[RolloutRecord]) -> None:
        stats.groups += 1
        retry = [r.error for r in records if r.retryable]
        if retry:
            stats.failed_groups += 1
            if stats.first_error is None:
                stats.first_error = retry[0]
                logger.warning(f"a rollout group of {job.slot.name} failed (it is retried on the next run): {retry[0]}")
            return
        # rollouts the model itself broke (e.g. an empty answer) count as run but are never written
        kept = [r for r in records if r.ok and (config.min_reward is None or r.reward >= config.min_reward)]
        if kept:
            _append(data, [sft_row(r) for r in kept])
        _append(progress, [{"env": job.slot.name, "example_id": job.example_id, "rollouts": job.first + job.n}])
        stats.rollouts += len(records)
        stats.kept += len(kept)
        stats.rewards += [r.reward for r in records]

    runners = make_runners(config.client, config.model.name, slots, layout.logs)
    try:
        await run_jobs(jobs, runners.run_group, request_args(config.sampling), config.max_concurrent, on_group)
    finally:
        await runners.close()
    if stats.failed_groups == stats.groups:
        raise UserError(
            f"every rollout group failed; first error: {stats.first_error} "
            f"(is the server at {config.client.url} up? {start_hint(config.client.url)})"
        )
    mean = statistics.fmean(stats.rewards) if stats.rewards else 0.0
    threshold = f" with reward >= {config.min_reward}" if config.min_reward is not None else ""
    logger.success(
        f"kept {stats.kept}/{stats.rollouts} new rollouts{threshold} (mean reward {mean:.3f}); "
        f"{data} has {existing + stats.kept} rows"
        + (f"; {stats.failed_groups} group(s) failed, re-run to retry them" if stats.failed_groups else "")
    )
    return stats


def run_synthesize(config: SynthesizeConfig, layout: RunLayout) -> SynthStats:
    return asyncio.run(_synthesize(config, layout))
