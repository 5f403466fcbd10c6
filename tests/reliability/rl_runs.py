"""A small real `rl` run for the reliability suites: its command line and what its metrics files say."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from asyncrl.utils.process import free_port

RL = [sys.executable, "-m", "asyncrl.entrypoints.rl"]


def rl_args(model: Path, out: Path, steps: int, *extra: str) -> list[str]:
    """`rl` with its own server: tiny batches, async level 1, a checkpoint every 2 steps, no report (the suites
    that use it check processes and files; the report has tests of its own, and drawing it costs CPU at every
    run's end)."""
    return RL + [
        "--model.name", str(model), "--output-dir", str(out), "--max-steps", str(steps),
        "--inference.server.port", str(free_port()), "--inference.server.host", "127.0.0.1",
        "--seq-len", "96", "--max-async-level", "1", "--orchestrator.batch-size", "32",
        "--orchestrator.rollouts-per-example", "4", "--orchestrator.sampling.max-tokens", "8",
        "--ckpt", "--ckpt.interval", "2", "--log.level", "info", "--no-report", *extra,
    ]  # fmt: skip


def steps_in(path: Path) -> list[int]:
    """The training steps a metrics file logged, in file order (eval rows left out)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if r.get("kind", "train") == "train"]
