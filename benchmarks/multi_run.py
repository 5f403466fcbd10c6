"""Multi-run training: what N concurrent LoRA runs cost one trainer, next to one run.

Every configuration trains the same synthetic, real-shaped batches (packed samples whose inference logprobs
come from the base model) on a locally built model, each in its own `trainer` process:

- `full`: one run, every weight trained (AdamW over the whole model);
- `lora`: one run, a LoRA adapter (the single-run path);
- `runs=N`: the multi-run trainer (`max_concurrent_runs = N`) with N runs, each its own adapter and AdamW
  (their steps trained together: rows of every run in shared forward passes).

Per configuration: run-steps per second over all runs and next to `runs=1`, tokens per second, the median
time of one run's step (`step_time_s`: with N runs, the round that trains all of them), the trainer's peak RSS
next to `runs=1`'s.

`--e2e`: whole `rl` jobs on the tiny model (reverse-text, 64 rollouts per run-step): one full-weight run, and
`[[runs]]` of N LoRA runs sharing one server and one trainer; run-steps per second over all runs (each run-step
= one batch generated, trained and published, counted after every run's step 1) from the orchestrators' metrics,
and each run's reward rise (mean train reward of its last 3 steps minus its first 3).

`--baseline-src DIR`: also every multi-run configuration with the asyncrl source tree DIR (e.g. a `git worktree`
of an earlier commit), in the same invocation: a before/after on the same machine and data.

    .venv/bin/python benchmarks/multi_run.py [--hidden 512 --layers 8 --steps 6 --runs 1 2 4 8] [--e2e]
        [--no-trainer | --multi-only] [--baseline-src /tmp/old]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from asyncrl.transport.batch import write_batch
from asyncrl.transport.layout import RunLayout
from asyncrl.transport.row import Row
from asyncrl.utils.tiny_model import build_tiny_model

ROWS, SAMPLES, SAMPLE_LEN, PROMPT = 8, 4, 128, 32  # per step: 8 rows of 4 samples x 128 tokens


def batches(model_dir: Path, steps: int) -> list[list[Row]]:
    """`steps` batches of ROWS packed rows; inference logprobs from the base model (ratios start at 1)."""
    from transformers import AutoModelForCausalLM

    from asyncrl.trainer.loss import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        rows = []
        for _ in range(ROWS):
            n = SAMPLES * SAMPLE_LEN
            ids = torch.randint(0, vocab, (n,), generator=g)
            pos = torch.arange(SAMPLE_LEN).repeat(SAMPLES)
            temps = torch.ones(n)
            with torch.no_grad():
                mu = token_logprobs(model(input_ids=ids[None], position_ids=pos[None]).logits[0], ids, temps)
            mask = pos >= PROMPT
            adv = torch.randn(SAMPLES, generator=g).repeat_interleave(SAMPLE_LEN) * mask
            rows.append(Row(ids, pos, mask, adv, mu * mask, temps))
        out.append(rows)
    return out


def trainer_toml(model: Path, out: Path, steps: int, lora: bool, runs: list[str] | None) -> str:
    lines = [
        f'output_dir = "{out}"\nmax_steps = {steps}\nmax_async_level = 1\n',
        f"data = {{ seq_len = {SAMPLES * SAMPLE_LEN}, micro_batch_size = 4 }}\n",
        f'[model]\nname = "{model}"\n',
        "[model.lora]\nrank = 16\nalpha = 32\n" if lora else "",
        "[optim]\nlr = 1e-5\nweight_decay = 0.0\n",
    ]
    if runs:
        lines.insert(0, f"max_concurrent_runs = {len(runs)}\nruns = {json.dumps(runs)}\n")
    return "".join(lines)


def env_for(src: str | None) -> dict[str, str]:
    """The environment of a benchmarked process: all cores; the asyncrl of source tree `src` when given."""
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count())}
    if src:
        env["PYTHONPATH"] = str(Path(src) / "src")
    return env


def label(lora: bool, runs: int | None, src: str | None) -> str:
    name = "full" if not lora else "lora" if runs is None else f"runs{runs}"
    return name + ("_before" if src else "")


def measure(
    model: Path, data: list[list[Row]], root: Path, lora: bool, runs: int | None, src: str | None = None
) -> dict:
    """Train one configuration in its own process; throughput from its metrics rows, peak RSS from wait4."""
    out = root / label(lora, runs, src)
    names = [f"r{i}" for i in range(runs)] if runs else None
    dirs = [RunLayout(out).run_dir(n) for n in names] if names else [out]
    for d in dirs:
        for step, rows in enumerate(data):
            write_batch(RunLayout(d), step, [rows])
        if names:
            (d / "run.toml").write_text("")
    cfg = root / f"{out.name}.toml"
    cfg.write_text(trainer_toml(model, out, len(data), lora, names))
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.entrypoints.trainer", "@", str(cfg)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env_for(src),
    )  # fmt: skip
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        sys.exit(f"{out.name} failed: {proc.stderr.read().decode()[-2000:]}")
    rows = [json.loads(x) for d in dirs for x in RunLayout(d).metrics_file("trainer").read_text().splitlines()]
    timed = sorted((r for r in rows if r["step"] > 0), key=lambda r: r["time"])  # step 0 of each run: warm-up
    first = min(r["time"] for r in rows if r["step"] == 0)
    wall = timed[-1]["time"] - first
    print(f"  {out.name}: {len(timed) / wall:.2f} run-steps/s", file=sys.stderr, flush=True)
    return {
        "config": out.name,
        "runs": runs or 1,
        "steps_per_s": len(timed) / wall,
        "tokens_per_s": sum(r["tokens"] for r in timed) / wall,
        "step_s": statistics.median(r["step_time_s"] for r in timed),
        "rss_gib": usage.ru_maxrss / 2**20,
    }


RL_JOB = """max_steps = {steps}
seq_len = 128
max_async_level = 1
output_dir = "{out}"
[model]
name = "{model}"
[trainer.optim]
lr = 1e-4
[orchestrator]
batch_size = 64
rollouts_per_example = 8
[orchestrator.sampling]
max_tokens = 16
[inference.server]
host = "127.0.0.1"
port = {port}
"""


def measure_rl(model: Path, root: Path, steps: int, runs: int | None, src: str | None = None) -> dict:
    """One `rl` job: a full-weight run (runs None) or `runs` LoRA runs; run-steps/s after each run's step 1,
    and each run's reward rise."""
    from asyncrl.utils.process import free_port

    out = root / f"rl_{label(runs is not None, runs, src)}"
    text = RL_JOB.format(steps=steps, out=out, model=model, port=free_port())
    if runs:
        text += "[trainer.model.lora]\nrank = 16\nalpha = 32\n"
        text += "".join(f'[[runs]]\nname = "r{i}"\n' for i in range(runs))
    cfg = root / f"{out.name}.toml"
    cfg.write_text(text)
    cmd = [sys.executable, "-m", "asyncrl.entrypoints.rl", "@", str(cfg)]
    proc = subprocess.run(cmd, capture_output=True, env=env_for(src))
    if proc.returncode != 0:
        sys.exit(f"{out.name} failed: {proc.stderr.decode()[-2000:]}")
    dirs = [RunLayout(out).run_dir(f"r{i}") for i in range(runs)] if runs else [out]
    per_run = [
        [r for x in RunLayout(d).metrics_file("orchestrator").read_text().splitlines() if (r := json.loads(x))
         and r.get("kind", "train") == "train"]
        for d in dirs
    ]  # fmt: skip
    rows = [r for rs in per_run for r in rs]
    start = max(r["time"] for r in rows if r["step"] == 1)  # every run warmed up
    timed = [r for r in rows if r["time"] > start]
    wall = max(r["time"] for r in timed) - start
    rises = [rise([r["reward/mean"] for r in sorted(rs, key=lambda r: r["step"])]) for rs in per_run]
    print(f"  {out.name}: {len(timed) / wall:.2f} run-steps/s", file=sys.stderr, flush=True)
    return {"config": out.name.removeprefix("rl_"), "runs": runs or 1, "steps_per_s": len(timed) / wall, "rises": rises}


def rise(rewards: list[float], k: int = 3) -> float:
    """Mean of the last k rewards minus the mean of the first k."""
    return statistics.mean(rewards[-k:]) - statistics.mean(rewards[:k])


def one_run(rows: list[dict], r: dict) -> dict:
    """The `runs1` row measured with the same source tree as `r` (`r` itself when there is none)."""
    return next((x for x in rows if x["config"] == r["config"].replace(f"runs{r['runs']}", "runs1")), r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first is a warm-up)")
    ap.add_argument("--runs", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--e2e", action="store_true", help="also whole rl jobs (tiny model, reverse-text)")
    ap.add_argument("--no-trainer", action="store_true", help="skip the trainer-alone configurations")
    ap.add_argument("--multi-only", action="store_true", help="trainer alone: the multi-run configurations only")
    ap.add_argument("--rl-steps", type=int, default=12, help="steps per run of each rl job")
    ap.add_argument("--baseline-src", help="an asyncrl source tree to measure the multi-run configurations with too")
    args = ap.parse_args()
    srcs = [None] + ([args.baseline_src] if args.baseline_src else [])
    results, e2e = [], []
    with tempfile.TemporaryDirectory(prefix="multi_run_bench_") as tmp:
        root = Path(tmp)
        if not args.no_trainer:
            model = build_tiny_model(root / "model", hidden_size=args.hidden, num_layers=args.layers, num_heads=8)
            params = sum(t.numel() for t in load_file(model / "model.safetensors").values())
            data = batches(model, args.steps)
            if not args.multi_only:
                results = [measure(model, data, root, lora=False, runs=None), measure(model, data, root, True, None)]
            results += [measure(model, data, root, True, n, src) for src in srcs for n in args.runs]
        if args.e2e:
            tiny = build_tiny_model(root / "tiny", hidden_size=128, num_layers=4)
            e2e = [measure_rl(tiny, root, args.rl_steps, None)]
            e2e += [measure_rl(tiny, root, args.rl_steps, n, src) for src in srcs for n in args.runs]
    if results:
        shape = f"{ROWS} rows x {SAMPLES * SAMPLE_LEN} tokens per run-step, {args.steps - 1} timed steps per run"
        print(f"model: hidden {args.hidden}, {args.layers} layers, {params / 1e6:.1f}M parameters; {shape}; "
              f"{os.cpu_count()} cores")  # fmt: skip
        print(f"{'config':<13} {'runs':>4} {'run-steps/s':>11} {'vs 1 run':>8} {'tok/s':>8} {'round s':>8} "
              f"{'peak RSS GiB':>12} {'RSS vs 1 run':>12}")  # fmt: skip
        for r in results:
            one = one_run(results, r)
            vs = r["steps_per_s"] / one["steps_per_s"]
            print(f"{r['config']:<13} {r['runs']:>4} {r['steps_per_s']:>11.2f} {vs:>8.2f} "
                  f"{r['tokens_per_s']:>8,.0f} {r['step_s']:>8.3f} {r['rss_gib']:>12.2f} "
                  f"{r['rss_gib'] / one['rss_gib']:>12.2f}")  # fmt: skip
    if e2e:
        print(f"\nrl end to end (tiny model, reverse-text, 64 rollouts per run-step, {args.rl_steps} steps per run)")
        print(f"{'config':<13} {'runs':>4} {'run-steps/s':>11} {'vs 1 run':>8} {'per run':>8}  reward rise per run")
        for r in e2e:
            vs = r["steps_per_s"] / one_run(e2e, r)["steps_per_s"]
            rises = " ".join(f"{x:+.3f}" for x in r["rises"])
            print(f"{r['config']:<13} {r['runs']:>4} {r['steps_per_s']:>11.2f} {vs:>8.2f} "
                  f"{r['steps_per_s'] / r['runs']:>8.2f}  {rises}")  # fmt: skip


if __name__ == "__main__":
    main()
