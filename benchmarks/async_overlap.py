"""Does async pay? Run the same `rl` config with max_async_level k = 0, 1, 2 and compare step times.

With k >= 1 generation of step n+1 overlaps training of step n, so a step should take about
max(generation, training) instead of their sum. Prints one table; all runs happen in this one process
tree on this machine, so compare the ratios, not the absolute numbers.

    .venv/bin/python benchmarks/async_overlap.py [--steps 8] [--model DIR] [--ks 0,1,2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from asyncrl.utils.process import free_port


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def run(model: str, out: Path, k: int, steps: int, extra: list[str]) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.entrypoints.rl",
        "@",
        "examples/reverse_text/rl.toml",
        "--model.name",
        model,
        "--output-dir",
        str(out),
        "--max-steps",
        str(steps),
        "--max-async-level",
        str(k),
        "--inference.server.port",
        str(free_port()),
        *extra,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"rl failed for k={k}:\n{result.stderr[-3000:]}")
    return summarize(out, k)


def summarize(out: Path, k: int) -> dict:
    orch = [r for r in rows(out / "metrics" / "orchestrator.jsonl") if r.get("kind", "train") == "train"]
    trainer = rows(out / "metrics" / "trainer.jsonl")
    skip = 2  # warm-up steps (first weight loads, allocator growth)
    ends = [r["time"] for r in trainer]
    step_time = (ends[-1] - ends[skip - 1]) / (len(ends) - skip)
    gen = statistics.fmean(r["time/rollouts"] for r in orch[skip:])
    train = statistics.fmean(r["step_time_s"] for r in trainer[skip:])  # compute only: waiting is wait_s
    return {
        "k": k,
        "step_s": step_time,
        "gen_s": gen,
        "train_s": train,
        "reward_last": statistics.fmean(r["reward/mean"] for r in orch[-2:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--model", help="model dir (default: a fresh tiny model)")
    parser.add_argument("--ks", default="0,1,2")
    parser.add_argument("--reuse", help="re-read the runs of an earlier invocation from this dir (no new runs)")
    parser.add_argument("extra", nargs="*", help="more rl flags, after --")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    if args.reuse:
        report([summarize(Path(args.reuse) / f"k{k}", k) for k in ks], args.steps, args.reuse)
        return
    work = Path(tempfile.mkdtemp(prefix="async_overlap_"))
    model = args.model
    if model is None:
        from asyncrl.utils.tiny_model import build_tiny_model

        model = str(build_tiny_model(work / "tiny-model"))
    report([run(model, work / f"k{k}", k, args.steps, args.extra) for k in ks], args.steps, work)


def report(results: list[dict], steps: int, work) -> None:
    base = results[0]["step_s"]
    print(
        f"\n{'k':>2} | {'step s':>7} | {'gen s':>6} | {'train s':>7} | {'gen+train':>9} | {'max(gen,train)':>14} | "
        f"{'step / k0':>9}"
    )
    print("-" * 75)
    for r in results:
        print(
            f"{r['k']:>2} | {r['step_s']:>7.2f} | {r['gen_s']:>6.2f} | {r['train_s']:>7.2f} | "
            f"{r['gen_s'] + r['train_s']:>9.2f} | {max(r['gen_s'], r['train_s']):>14.2f} | {r['step_s'] / base:>9.2f}"
        )
    print(f"\n(steps {steps}, first 2 excluded; runs under {work})")


if __name__ == "__main__":
    main()
