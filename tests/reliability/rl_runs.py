"""A small real `rl` run for the reliability suites: its command line, what its metrics files say, and the
checks of a finished run's dir."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from asyncrl.transport.layout import RunLayout, is_stable
from asyncrl.utils.process import free_port

RL = [sys.executable, "-m", "asyncrl.entrypoints.rl"]
TORN = ("corrupt", "torn", "partial", "Traceback")  # what a reader that met a half-written file would say


def rl_args(model: Path, out: Path, steps: int, *extra: str) -> list[str]:
    """`rl` with its own server: tiny batches, async level 1, a checkpoint every 2 steps, no report (the suites
    that use it check processes and files; the report has tests of its own, and drawing it costs CPU at every
    run's end), no auto-restart (they check that a death stops the run and the documented resume; the kill
    storm turns it on with `--max-restarts N`: a later flag wins)."""
    return RL + [
        "--model.name", str(model), "--output-dir", str(out), "--max-steps", str(steps),
        "--inference.server.port", str(free_port()), "--inference.server.host", "127.0.0.1",
        "--seq-len", "96", "--max-async-level", "1", "--orchestrator.batch-size", "32",
        "--orchestrator.rollouts-per-example", "4", "--orchestrator.sampling.max-tokens", "8",
        "--ckpt", "--ckpt.interval", "2", "--max-restarts", "0", "--log.level", "info", "--no-report", *extra,
    ]  # fmt: skip


def steps_in(path: Path) -> list[int]:
    """The training steps a metrics file logged, in file order (eval rows left out)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if r.get("kind", "train") == "train"]


def check_run_dir(out: Path, steps: int, said: str) -> None:
    """The finished run: each step once in both metrics files, its last weights, no torn read in what its
    processes `said` (its attempts' stderr and log lines), no leftovers."""
    layout = RunLayout(out)
    assert steps_in(layout.metrics_file("trainer")) == list(range(steps))  # none lost, none twice
    assert steps_in(layout.metrics_file("orchestrator")) == list(range(steps))
    assert is_stable(layout.weights_dir(steps))
    assert not [line for line in said.splitlines() if any(w in line for w in TORN) and "skipping" not in line]
    left = [p for root in (layout.rollouts, layout.broadcast, layout.weights) for p in root.glob(".tmp_*")]
    assert not left + list(layout.checkpoints.glob("*/.tmp_*"))
