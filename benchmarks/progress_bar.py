"""Does the live progress bar cost step time? The same `sft` and `rl` jobs with the bar on and off.

Each run's console is a pseudo-terminal (as a user's would be), with `ASYNCRL_PROGRESS=bar` or `=plain`;
runs alternate (bar, plain, bar, plain, ...) so drift on a noisy machine hits both alike. Step time is the
median gap between consecutive metrics rows (the first two steps skipped: warm-up). Prints one table.

    .venv/bin/python benchmarks/progress_bar.py [--repeats 2] [--sft-steps 60] [--rl-steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from asyncrl.utils.process import free_port

SKIP = 2


def on_a_terminal(cmd: list[str], mode: str) -> None:
    """Run `cmd` with a pseudo-terminal as stdout and stderr (drained and dropped); exit on failure."""
    master, slave = pty.openpty()
    env = {**os.environ, "ASYNCRL_PROGRESS": mode, "COLUMNS": "160"}
    env.pop("CI", None)
    proc = subprocess.Popen(cmd, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    tail = bytearray()

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                return
            if not chunk:
                return
            tail.extend(chunk)
            del tail[:-4000]

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    code = proc.wait()
    reader.join(timeout=5)
    os.close(master)
    if code:
        sys.exit(f"{' '.join(cmd)} failed ({mode}):\n{tail.decode(errors='replace')}")


def median_gap(path: Path) -> float:
    times = [json.loads(line)["time"] for line in path.read_text().splitlines() if line.strip()]
    gaps = [b - a for a, b in zip(times[SKIP:], times[SKIP + 1 :])]
    return statistics.median(gaps)


def setup(work: Path) -> tuple[str, str]:
    py = sys.executable
    model, data = work / "tiny-model", work / "reverse_sft.jsonl"
    subprocess.run([py, "-m", "asyncrl.utils.tiny_model", str(model)], check=True, capture_output=True)
    subprocess.run([py, "-m", "reverse_text", "--sft-out", str(data), "--n", "4000"], check=True, capture_output=True)
    return str(model), str(data)


def sft_job(model: str, data: str, out: Path, steps: int) -> tuple[list[str], Path]:
    cmd = [sys.executable, "-m", "asyncrl.entrypoints.sft", "@", "examples/reverse_text/sft.toml"]
    cmd += ["--model.name", model, "--data.name", data, "--output-dir", str(out), "--max-steps", str(steps)]
    return cmd + ["--no-report"], out / "metrics" / "sft.jsonl"


def rl_job(model: str, out: Path, steps: int) -> tuple[list[str], Path]:
    cmd = [sys.executable, "-m", "asyncrl.entrypoints.rl", "@", "examples/reverse_text/rl.toml"]
    cmd += ["--model.name", model, "--output-dir", str(out), "--max-steps", str(steps)]
    return cmd + ["--inference.server.port", str(free_port()), "--no-report"], out / "metrics" / "trainer.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--rl-steps", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, data = setup(work)
        gaps: dict[tuple[str, str], list[float]] = {}
        for i in range(args.repeats):
            for mode in ("bar", "plain"):
                for job, (cmd, metrics) in {
                    "sft": sft_job(model, data, work / f"sft-{mode}-{i}", args.sft_steps),
                    "rl": rl_job(model, work / f"rl-{mode}-{i}", args.rl_steps),
                }.items():
                    on_a_terminal(cmd, mode)
                    gaps.setdefault((job, mode), []).append(median_gap(metrics))
                    print(f"{job} {mode} run {i}: {gaps[job, mode][-1]:.3f} s/step", flush=True)
    print(f"\n| job | bar s/step | plain s/step | bar / plain |  ({args.repeats} runs each, medians)")
    print("|---|---|---|---|")
    for job in ("sft", "rl"):
        bar, plain = statistics.median(gaps[job, "bar"]), statistics.median(gaps[job, "plain"])
        print(f"| {job} | {bar:.3f} | {plain:.3f} | {bar / plain:.3f} |")


if __name__ == "__main__":
    main()
