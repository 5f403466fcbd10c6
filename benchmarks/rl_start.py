"""What starting `rl` costs: its children exec'd (`ASYNCRL_ZYGOTE=0`) against forked warm from the zygote.

A tiny model (`asyncrl-tiny-model`, built once under `--out`) and a short run of it (`--steps`, reverse-text,
32 samples a step, 8 new tokens: the steps themselves cost little, so the run is mostly its start). The two
modes alternate, `--repeats` runs each, back to back on this machine. Per run: the wall time until `rl`
exited, the wall time until the trainer logged its first step (the first row of `metrics/trainer.jsonl`,
from the moment `rl` was started), and the CPU seconds of `rl` and every process under it (all of them
reaped: getrusage's children). Prints the medians per mode and their ratio. `--trainer-ranks 2`: the trainer
under torchrun with two CPU ranks (forked warm too: `launcher/warm_ranks.py`).

    .venv/bin/python benchmarks/rl_start.py [--repeats 3] [--steps 2] [--trainer-ranks 1] [--out outputs/rl_start]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.utils.process import free_port

BIN = Path(sys.executable).parent
MODES = {"exec": "0", "zygote": "1"}  # ASYNCRL_ZYGOTE


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(model: Path, out: Path, steps: int, zygote: str, ranks: int = 1) -> dict:
    """One `rl` run; its wall time to the end and to the first trainer step, and its CPU seconds."""
    shutil.rmtree(out, ignore_errors=True)
    args = [str(BIN / "rl"), "--model.name", str(model), "--output-dir", str(out), "--max-steps", str(steps),
            "--seq-len", "96", "--max-async-level", "1", "--orchestrator.batch-size", "32",
            "--orchestrator.rollouts-per-example", "4", "--orchestrator.sampling.max-tokens", "8",
            "--inference.server.port", str(free_port()), "--inference.server.host", "127.0.0.1",
            "--trainer-cpu-processes", str(ranks), "--no-report"]  # fmt: skip
    cpu, start = children_cpu(), time.time()
    done = subprocess.run(args, env={**os.environ, "ASYNCRL_ZYGOTE": zygote}, capture_output=True, text=True)
    wall, cpu = time.time() - start, children_cpu() - cpu
    if done.returncode != 0:
        raise SystemExit(f"error: rl exited {done.returncode}: {done.stderr[-2000:]}")
    first = json.loads((out / "metrics" / "trainer.jsonl").read_text().splitlines()[0])
    return {"wall_s": wall, "first_step_s": first["time"] - start, "cpu_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--trainer-ranks", type=int, default=1, help="the trainer's CPU ranks (>1: under torchrun)")
    parser.add_argument("--out", type=Path, default=Path("outputs/rl_start"))
    args = parser.parse_args()
    model = args.out / "model"
    if not (model / "config.json").exists():
        subprocess.run([str(BIN / "asyncrl-tiny-model"), str(model)], check=True, capture_output=True)
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for i in range(args.repeats):
        for mode, value in MODES.items():
            results[mode].append(run(model, args.out / "run", args.steps, value, args.trainer_ranks))
            print(f"[rl_start] {mode} run {i + 1}/{args.repeats}: {results[mode][-1]}", file=sys.stderr, flush=True)
    table(results, args.steps, args.trainer_ranks)
    (args.out / "rl_start.json").write_text(json.dumps(results, indent=1))


def table(results: dict[str, list[dict]], steps: int, ranks: int = 1) -> None:
    med = {mode: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for mode, rows in results.items()}
    trainer = f", {ranks} trainer ranks" if ranks > 1 else ""
    print(f"\n| `rl`, {steps} steps of the tiny model{trainer} | wall to exit s | wall to first step s | CPU s |")
    print("|---|---|---|---|")
    for mode, m in med.items():
        print(f"| children {mode} (median of {len(results[mode])}) | {m['wall_s']:.1f} | {m['first_step_s']:.1f} "
              f"| {m['cpu_s']:.1f} |")  # fmt: skip
    z, e = med["zygote"], med["exec"]
    print(f"| zygote / exec | {z['wall_s'] / e['wall_s']:.2f} | {z['first_step_s'] / e['first_step_s']:.2f} "
          f"| {z['cpu_s'] / e['cpu_s']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
