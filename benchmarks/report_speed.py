"""How big and how fast is `asyncrl report` of many runs? The write time, the file size and the load time in
headless Chromium, for N synthetic runs of M metrics x S steps each.

Each run dir is made here as `rl` leaves one (metrics rows with `time`, a pid record, configs that differ
in k and seed): about 60 metrics (reward and per-env rewards, 28 rubric metrics, step times, trainer loss,
KLs, importance-ratio quantiles, masked fractions, throughput) and a held-out eval every 50 steps. For each
N it runs the real command (`python -m asyncrl.entrypoints.asyncrl report ...`, imports included), then
opens the page in Chromium (the browser test's DevTools client) and reads two times from the page's own
clock: the load event (the page parsed, plotly.js compiled), the first screen's charts drawn (what a reader
waits for) and every chart drawn (`asyncrlReport.drawAll()`; the others draw as they scroll into view).
Write time is wall and CPU seconds (CPU: the work, whatever else the machine runs). Prints one table.

    .venv/bin/python benchmarks/report_speed.py [--runs 10,20] [--steps 1000] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))  # the browser test's DevTools client

RUBRIC = [f"metrics/env/m{i}" for i in range(28)]
TIMES = ["time/step", "time/rollouts", "time/wait_weights", "time/update_weights", "time/pack_write"]
ORCH = ["reward/mean", "reward/a/mean", "reward/b/mean", *RUBRIC, *TIMES, "perf/gen_tokens_per_s"]
ORCH += ["completion_len/mean", "completion_len/max", "off_policy/level"]
TRAINER = ["loss", "entropy", "grad_norm", "mismatch_kl", "ref_kl", "tokens_per_s", "step_time_s", "wait_s"]
TRAINER += ["publish_s", "off_policy/mean", "off_policy/max", "masked_frac", "token_masked_high_frac"]
TRAINER += [f"importance_ratio/p{q}" for q in ("01", "10", "50", "90", "99")] + ["importance_ratio/max"]


def make_run(run: Path, i: int, steps: int) -> None:
    for d in ("metrics", "logs", "configs"):
        (run / d).mkdir(parents=True)
    t0 = 1_800_000_000.0
    (run / "logs" / "rl.pid").write_text(json.dumps({"pid": 1, "host": "h", "started": t0, "ended": t0 + 1, "exit": 0}))
    (run / "configs" / "orchestrator.toml").write_text(f"max_async_level = {i % 2}\nseed = {i // 2}\n")
    dt = 3.0 + 0.2 * i

    def value(key: str, s: int) -> float:
        return 0.5 + 0.3 * math.tanh(s / 300) + 0.05 * math.sin(s * 0.7 + sum(map(ord, key)) % 7 + i)

    orch, trainer = [], []
    for s in range(steps):
        t = t0 + dt * (s + 1)
        orch.append({"step": s, "time": t, "kind": "train", **{k: value(k, s) for k in ORCH}})
        if s % 50 == 0 or s == steps - 1:
            orch.append({"step": s, "time": t + 0.5, "kind": "eval", "eval/reward/mean": value("eval", s)})
        trainer.append({"step": s, "time": t, **{k: value(k, s) for k in TRAINER}})
    for name, rows in (("orchestrator", orch), ("trainer", trainer)):
        (run / "metrics" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_time(runs: list[Path], out: Path) -> tuple[float, float]:
    """(wall s, CPU s) of the command: CPU time tells the work apart from a busy machine's waiting."""
    start, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    cmd = [sys.executable, "-m", "asyncrl.entrypoints.asyncrl", "report", *map(str, runs), "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter() - start, after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime


def load_times(page: Path, scratch: Path) -> tuple[float, float, float]:
    """(load event, first screen drawn, every chart drawn), in seconds of the page's clock, a fresh Chromium."""
    from test_report_browser import Cdp, _page_ws_url, connect

    from asyncrl.utils.process import free_port

    port = free_port()
    argv = [shutil.which("chromium"), "--headless=new", "--no-sandbox", "--disable-gpu"]
    argv += [f"--remote-debugging-port={port}", f"--user-data-dir={scratch / 'profile'}", "--window-size=1400,1000"]
    proc = subprocess.Popen([*argv, "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with connect(_page_ws_url(port, proc), max_size=None, open_timeout=30) as ws:
            cdp = Cdp(ws)
            cdp.send("Page.enable")
            cdp.open(page)
            load = cdp.evaluate("performance.getEntriesByType('navigation')[0].loadEventEnd")
            first = cdp.evaluate("window.asyncrlReport.firstScreen.then(() => performance.now())")
            drawn = cdp.evaluate("window.asyncrlReport.drawAll().then(() => performance.now())", timeout=600)
            return load / 1000, first / 1000, drawn / 1000
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="10,20", help="comma-separated run counts")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=2, help="medians over this many writes and loads")
    args = ap.parse_args()
    print(f"{len(ORCH) + len(TRAINER) + 1} metrics x {args.steps} steps per run; medians of {args.repeats}")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    head = ["runs", "write s", "CPU s", "MiB", "load s", "1st screen s", "all drawn s"]
    print("  ".join(f"{h:>{w}}" for h, w in zip(head, (4, 8, 6, 6, 7, 12, 11))))
    for n in [int(x) for x in args.runs.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            scratch = Path(tmp)
            runs = [scratch / f"k{i % 2}-s{i // 2}" / "run" for i in range(n)]
            for i, run in enumerate(runs):
                make_run(run, i, args.steps)
            page = scratch / "report.html"
            wall, cpu = (statistics.median(x) for x in zip(*(write_time(runs, page) for _ in range(args.repeats))))
            loads = [load_times(page, scratch / f"browser{r}") for r in range(args.repeats)]
            size = page.stat().st_size / 2**20
            load, first, drawn = (statistics.median(x) for x in zip(*loads))
            print(f"{n:>4}  {wall:>8.2f}  {cpu:>6.2f}  {size:>6.1f}  {load:>7.2f}  {first:>12.2f}  {drawn:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
