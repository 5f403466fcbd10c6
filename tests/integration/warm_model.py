"""The integration tests' warm model: the demo's SFT warm-up of a tiny model on reverse-text, through the real `sft`
entrypoint, taken at a stage of learning rather than at a step count. `conftest.warm_model` builds it once per test
session; `benchmarks/learning_bands.py` builds the same one to measure the learning tests' bands.

SFT on this task has a sharp drop in loss whose step moves with the CPU: the tiny model's initial weights differ in
their last bits between CPU kernel paths (`ATEN_CPU_CAPABILITY=avx2` and `default` give different files), and the
small differences grow over the run. At step 149 one
machine's model had a loss of 0.35 (past the drop), another's 1.02 (before it: from that model the learning tests'
reward rose by +0.025 and +0.041, and they failed). So the warm model is the first 10-step checkpoint whose last 10
steps' mean loss is at most `STAGE_LOSS` (step 180 on the second machine); `build_warm_model` stops the SFT there.
Invariants: the same machine always gives the same model (data order and reduction order pinned); a warm-up that
does not reach the stage by `MAX_STEPS` is an error, never a weaker model; a root is built once, under its lock.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests import warm

STAGE_LOSS = 0.40  # mean SFT loss over the 10 steps before a checkpoint that marks the warm model's stage
EVERY = 10  # steps between checkpoints (weights/step_N)
MAX_STEPS = 300
CHOSEN = "warm_model.txt"  # in the build dir: the chosen weights dir, written last (the build is then complete)


def built_warm_model(root: Path) -> Path | None:
    """The warm model `build_warm_model(root)` chose, if that build completed."""
    chosen = root / CHOSEN
    return Path(chosen.read_text().strip()) if chosen.is_file() else None


def shared_warm_model(root: Path) -> Path:
    """The warm model of `root`, built there first if no one has (one builder at a time: the others wait)."""
    from filelock import FileLock

    with FileLock(f"{root}.lock"):
        return built_warm_model(root) or build_warm_model(root)


def build_warm_model(root: Path) -> Path:
    from asyncrl.utils.tiny_model import build_tiny_model

    build_tiny_model(root / "tiny", hidden_size=128, num_layers=4)
    subprocess.run(
        [sys.executable, "-m", "reverse_text", "--sft-out", str(root / "sft.jsonl"), "--n", "10000"],
        check=True,
        capture_output=True,
    )
    out = root / "sft"
    with open(root / "sft.out", "w") as log:
        # forked where the tests fork (`tests.warm`): the sft an exec would make, less its imports
        proc = warm.popen(_sft_command(root, out), stdout=log, stderr=subprocess.STDOUT, env=_one_thread(),
                          cwd=Path(__file__).resolve().parents[2])  # fmt: skip
        try:
            chosen = _await_stage(proc, out)
        finally:
            proc.kill()
            proc.wait()
    (root / f"{CHOSEN}.tmp").write_text(str(chosen))
    os.replace(root / f"{CHOSEN}.tmp", root / CHOSEN)
    return chosen


def _sft_command(root: Path, out: Path) -> list[str]:
    # the demo's recipe (data, lr, batch); weights every EVERY steps, the optimizer state of the last one only
    return [sys.executable, "-m", "asyncrl.entrypoints.sft", "@", "examples/reverse_text/sft.toml",
            "--model.name", str(root / "tiny"), "--data.name", str(root / "sft.jsonl"), "--output-dir", str(out),
            "--max-steps", str(MAX_STEPS), "--ckpt", "--ckpt.interval", str(EVERY), "--ckpt.keep-last", "1",
            "--log.level", "warning"]  # fmt: skip


def _one_thread() -> dict[str, str]:
    # One thread, where the demo has two: the same losses to the last digit at this size, and two threads beside
    # the other test worker on 2 cores spin (325 CPU s for what takes 67 with one).
    return dict(os.environ, OMP_NUM_THREADS="1")


def _await_stage(proc: subprocess.Popen, out: Path) -> Path:
    """The first weights/step_N whose last EVERY steps' mean loss is <= STAGE_LOSS, once it is complete."""
    metrics, checked = out / "metrics" / "sft.jsonl", 0
    while True:
        losses = _losses(metrics)
        for n in range(checked + EVERY, len(losses) + 1, EVERY):
            checked = n
            if sum(losses[n - EVERY : n]) / EVERY <= STAGE_LOSS:
                return _stable(proc, out / "weights" / f"step_{n}")
        if _exited(proc, 0.5) and len(_losses(metrics)) == len(losses):
            raise RuntimeError(
                f"the warm-up SFT ended (exit {proc.returncode}) before its 10-step mean loss reached {STAGE_LOSS} "
                f"(losses at every 10th step: {[round(x, 2) for x in losses[::EVERY]]}); see {out.parent / 'sft.out'}"
            )


def _losses(metrics: Path) -> list[float]:
    if not metrics.is_file():
        return []
    losses = []
    for line in metrics.read_text().splitlines():
        try:
            losses.append(json.loads(line)["loss"])
        except ValueError:  # the last line, half written
            break
    return losses


def _stable(proc: subprocess.Popen, weights: Path) -> Path:
    """`weights` once its STABLE marker is written (the SFT writes it after the step's metrics)."""
    while not (weights / "STABLE").exists():
        if _exited(proc, 0.2) and not (weights / "STABLE").exists():
            raise RuntimeError(f"the warm-up SFT ended (exit {proc.returncode}) before it wrote {weights}")
    return weights


def _exited(proc: subprocess.Popen, wait_s: float) -> bool:
    """Whether `proc` has exited, waiting up to `wait_s` for it (the poll interval of the loops above)."""
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        return False
    return True
