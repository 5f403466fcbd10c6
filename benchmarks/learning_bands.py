"""The bands behind the learning tests' thresholds: each test that asserts learning, run N times as it runs.

A test that asserts "the reward rose" takes its threshold from this distribution, not from a guess: the
statistic it checks (`test_rl.reward_rise`), over N runs of its configuration (model, flags, seed; without
the W&B and report flags one test adds, which do not touch training), and the 1st percentile
of it (the smaller of the lowest run and mean - 2.33 sd). The test's threshold is at or below that, and says
so next to it with the run count and date. Tests (each from the integration tests' warm model,
`tests/integration/warm_model.py`, built once here):

- rl:      tests/integration/test_rl.py::test_rl_runs_learns_and_resumes, its first run (k = 1, checkpoint at
           20; 40 steps in the test): the mean reward of the last 5 steps minus that of the first 5;
- classic: tests/integration/test_classic_envs.py::test_rl_trains_a_classic_environment (the same run on the
           classic reverse env, every process in .venv-classic; 40 steps in the test): the same statistic.

Each run is `--steps` long (40) at the tests' lr (`--lr`, 3e-4); `--at` gives the band at the tests' own lengths.

    PYTHONPATH=src:. .venv/bin/python benchmarks/learning_bands.py --tests rl,classic --runs 30 [--jobs 2] \\
        [--at 15,20,30,40] [--steps 40] [--lr 3e-4]

`--at` reports the band of the same statistic over each run's first N steps too (the steps before N are the
same process whatever the run's length, at a constant lr): how short a test can be and still see learning.

Runs already done under `--out` are reused (`rise.json` marks each); `{out}/bands.json` has the bands.
Not part of CI: it re-measures the bands when a default (loss, lr, sampling, warm-up) changes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.integration.test_rl import orchestrator_rows, reward_rise, rl_args  # noqa: E402 - as the tests run
from tests.integration.warm_model import build_warm_model, built_warm_model  # noqa: E402

STEPS, LR = 40, 3e-4  # the tests' run length and lr
CLASSIC_PY = ROOT / ".venv-classic" / "bin" / "python"
CLASSIC_ENVS = ROOT / "tests" / "integration" / "classic_envs"


def command(test: str, model: Path, out: Path, port: int, steps: int, lr: float) -> tuple[list[str], dict[str, str]]:
    """The `rl` command line (and environment) the test's learning run uses."""
    flags = rl_args(model, out, steps, port, lr=lr)
    if test == "rl":
        extra = ["--ckpt", "--ckpt.interval", str(steps // 2)]
        return [sys.executable, "-m", "asyncrl.entrypoints.rl", *flags, *extra], {}
    config = out.parent / "rl.toml"
    config.write_text('[[orchestrator.env]]\nid = "reverse-classic"\n')
    cmd = [str(CLASSIC_PY), "-m", "asyncrl.entrypoints.rl", "@", str(config), *flags]
    return cmd, {"PYTHONPATH": str(CLASSIC_ENVS)}


def one(test: str, i: int, model: Path, out: Path, port: int, steps: int, lr: float) -> list[dict]:
    """Run `i` of `test` (reused once done: `rise.json` marks it) and its metrics rows, one per step."""
    d = out / (test if (steps, lr) == (STEPS, LR) else f"{test}-{steps}-lr{lr:g}") / f"run{i:03d}"
    if not (d / "rise.json").exists():
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        cmd, env = command(test, model, d / "run", port, steps, lr)
        start = time.time()
        with open(d / "rl.log", "w") as log:
            run = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **env})
        if run.returncode != 0:
            raise RuntimeError(f"{test} run {i} failed (exit {run.returncode}): see {d / 'rl.log'}")
        rise = reward_rise(orchestrator_rows(d / "run"))
        (d / "rise.json").write_text(json.dumps({"rise": rise, "wall_s": time.time() - start}))
        shutil.rmtree(d / "run" / "checkpoints", ignore_errors=True)
        shutil.rmtree(d / "run" / "weights", ignore_errors=True)
    return orchestrator_rows(d / "run")


def band(rises: list[float]) -> dict:
    mean, sd = statistics.fmean(rises), statistics.stdev(rises)
    return {
        "runs": len(rises),
        "mean": mean,
        "sd": sd,
        "min": min(rises),
        "max": max(rises),
        "p1": min(min(rises), mean - 2.33 * sd),  # the 1st percentile: the lower of the lowest run and a normal fit
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tests", default="rl,classic", help="comma-separated, of rl, classic")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (each rl: 3 processes)")
    ap.add_argument("--out", type=Path, default=Path("outputs/learning_bands"))
    ap.add_argument("--port", type=int, default=8400, help="first inference port (one per job)")
    ap.add_argument("--steps", type=int, default=STEPS, help="each run's length")
    ap.add_argument("--lr", type=float, default=LR, help="each run's lr (the tests': 3e-4)")
    ap.add_argument(
        "--at",
        default="40",
        help="run lengths to report the band at, e.g. 15,20,40: the rise over a run's first N steps (a shorter test)",
    )
    args = ap.parse_args()
    tests = args.tests.split(",")
    if args.steps < 10 or args.lr <= 0:  # reward_rise compares two 5-step windows; the rl run checkpoints at steps/2
        sys.exit(f"error: --steps {args.steps} --lr {args.lr:g}: give at least 10 steps and an lr above 0")
    if bad := [t for t in tests if t not in ("rl", "classic")]:
        sys.exit(f"error: unknown test {bad[0]!r}; choose from rl, classic")
    if "classic" in tests and not CLASSIC_PY.exists():
        sys.exit("error: the classic test needs .venv-classic: run `bash scripts/setup.sh --classic`")
    model = built_warm_model(args.out / "warm")
    if model is None:
        print(f"building the tests' warm model in {args.out / 'warm'} (SFT to its stage, 150-300 steps)", flush=True)
        model = build_warm_model(args.out / "warm")
    print(f"warm model: {model}", flush=True)
    jobs = [(t, i) for i in range(args.runs) for t in tests]
    ports = list(range(args.port, args.port + args.jobs))
    results: dict[str, list[list[dict]]] = {t: [] for t in tests}  # each run's metrics rows, a row per step
    failed: list[str] = []

    def run(n: int) -> None:
        test, i = jobs[n]
        try:
            rows = one(test, i, model, args.out, ports[n % args.jobs], args.steps, args.lr)
        except Exception as e:  # one failed run is reported (and counted), not fatal
            failed.append(f"{test} run {i}: {e}")
            print(failed[-1], flush=True)
            return
        results[test].append(rows)
        done = sum(map(len, results.values()))
        print(f"[{done}/{len(jobs)}] {test} run {i}: rise {reward_rise(rows):+.3f}", flush=True)

    with ThreadPoolExecutor(args.jobs) as pool:  # job n runs on port n % jobs: at most one run per port at once
        for lane in range(args.jobs):
            pool.submit(lambda lane=lane: [run(n) for n in range(lane, len(jobs), args.jobs)])
    lengths = [int(n) for n in args.at.split(",")]
    runs_of = {t: runs for t, runs in results.items() if len(runs) > 1}
    bands = {f"{t}@{n}": band([reward_rise(r[:n]) for r in runs]) for t, runs in runs_of.items() for n in lengths}
    (args.out / "bands.json").write_text(json.dumps({"bands": bands, "failed": failed}, indent=1))
    print(f"\n{'test@steps':<12} {'runs':>4}  {'rise mean ± sd':>16}  {'min':>7}  {'1st pct':>7}")
    for name, b in bands.items():
        print(f"{name:<12} {b['runs']:>4}  {b['mean']:>+8.3f} ± {b['sd']:.3f}  {b['min']:>+7.3f}  {b['p1']:>+7.3f}")
    print(f"numbers in {args.out / 'bands.json'}" + (f"; {len(failed)} run(s) failed" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
