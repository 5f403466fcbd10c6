"""`rl --bench`: warm (or reuse) the job's model, score it, run the RL job, score it again, report.

One job: glue. The job's settings are `config.bench`'s (applied as config defaults by `rl`'s resolution,
so every flag still applies); the warm-up is `bench.warmup`'s, the held-out scoring
`bench.heldout`'s (in a child process: this process stays torch-free), the numbers
`bench.summary`'s; the run itself is the ordinary launcher's (`rl` passes `launch` in).

Invariants: only rows this run logged count (metrics files are appended to across runs, so rows
before the launch time are ignored). The result goes to `{output_dir}/bench.json`, written
atomically after the run; the table is printed last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loguru import logger

from asyncrl.bench import summary
from asyncrl.bench.warmup import WarmModel, ensure_warm_model
from asyncrl.config import bench as job
from asyncrl.config.rl import RLConfig
from asyncrl.core.errors import UserError
from asyncrl.transport.files import write_text_atomic
from asyncrl.transport.layout import RunLayout

RESULT = "bench.json"


def score(model_dir: Path, log: Path) -> dict:
    """Held-out greedy/sampled exact match of `model_dir` (a child process)."""
    cmd = [sys.executable, "-m", "asyncrl.bench.heldout", str(model_dir)]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise UserError(f"bench: scoring {model_dir} on the held-out words failed; see {log}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.pop("model", None)
    return result


def _warm(config: RLConfig) -> WarmModel | None:
    """The warmed model when the run starts from the job's own (not from a --model.name of the user's)."""
    model = Path(config.trainer.model.name)
    if (model.name, model.parent.name, model.parent.parent.name) != ("model", job.warm_key(), "warmup"):
        return None
    return ensure_warm_model(model.parent)


def _before(config: RLConfig, warm: WarmModel | None, log: Path) -> dict:
    if warm is not None and "heldout" in warm.info:
        return warm.info["heldout"]
    result = score(Path(config.trainer.model.name), log)
    if warm is not None:
        warm.info["heldout"] = result
        write_text_atomic(warm.path.parent / "warmup.json", json.dumps(warm.info, indent=1))
    return result


def job_settings(config: RLConfig) -> dict[str, Any]:
    """What the run was: the settings a reader needs to compare two bench results."""
    t, o = config.trainer, config.orchestrator
    return {
        "model": t.model.name,
        "max_steps": t.max_steps,
        "max_async_level": t.max_async_level,
        "batch_size": o.batch_size,
        "rollouts_per_example": o.rollouts_per_example,
        "max_tokens": o.sampling.max_tokens,
        "temperature": o.sampling.temperature,
        "lr": t.optim.lr,
        "weight_decay": t.optim.weight_decay,
        "max_norm": t.optim.max_norm,
        "env": [e.model_dump() for e in o.env],
        "trainer_cpu_processes": config.trainer_cpu_processes,
        "backend": config.inference.backend if config.inference else "external server",
    }


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "load_avg": list(os.getloadavg())}


def run_bench_job(config: RLConfig, launch: Callable[[RLConfig, RunLayout], None], layout: RunLayout) -> dict[str, Any]:
    """Run the bench job with `launch` (the launcher's, passed in by `rl`: bench never imports its sibling);
    returns what it writes to `{output_dir}/bench.json`; `layout`: the trainer's run."""
    log = layout.log_file("bench")
    warm = _warm(config)
    before = _before(config, warm, log)
    logger.info(f"bench: held-out exact match before RL, greedy {before['greedy']:.3f} sampled {before['sampled']:.3f}")
    load_start, start = machine(), time.time()
    launch(config, layout)
    wall = time.time() - start
    load_end = machine()
    numbers = summary.summarize(
        summary.read_rows(layout.metrics_file("orchestrator"), since=start),
        summary.read_rows(layout.metrics_file("trainer"), since=start),
        job.WARMUP_STEPS,
    )
    after = score(layout.weights_dir(config.trainer.max_steps), log)
    result = {
        **numbers,
        "wall_s": wall,
        "heldout": {"before": before, "after": after},
        "warm_model": _warm_info(warm),
        "job": job_settings(config),
        "machine": {"start": load_start, "end": load_end},
    }
    path = Path(config.trainer.output_dir) / RESULT
    write_text_atomic(path, json.dumps(result, indent=1))
    print(report(result, path), flush=True)
    return result


def _warm_info(warm: WarmModel | None) -> dict[str, Any] | None:
    if warm is None:
        return None
    info = {k: v for k, v in warm.info.items() if k in ("key", "sft_step", "seconds")}
    return {"path": str(warm.path), "cached": warm.cached, **info}


def report(result: dict[str, Any], path: Path) -> str:
    """The table, held-out accuracy, warm-up note and where the JSON is."""
    j, warm = result["job"], result["warm_model"]
    title = (
        f"rl --bench: {result['steps']} steps, {j['batch_size'] // j['rollouts_per_example']} prompts x "
        f"{j['rollouts_per_example']} rollouts, async level {j['max_async_level']}, "
        f"{result['wall_s']:.0f}s wall, load avg {result['machine']['start']['load_avg'][0]:.1f} at start, "
        f"{result['machine']['end']['load_avg'][0]:.1f} at the end"
    )
    lines = [title.replace("\n", " "), summary.format_table("", result)]
    lines.append(summary.format_heldout(result["heldout"]["before"], result["heldout"]["after"]))
    if warm is not None:
        how = "reused (warm-up skipped)" if warm["cached"] else f"built and SFT-warmed in {warm['seconds']:.0f}s"
        lines.append(f"warm model: {warm['path']} (SFT step {warm['sft_step']}), {how}")
    lines.append(f"numbers in {path}")
    return "\n".join(line for line in lines if line)
