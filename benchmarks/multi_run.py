"""Multi-run training: what N concurrent LoRA runs cost one trainer, next to one full-weight run.

Every configuration trains the same synthetic, real-shaped batches (packed samples whose inference logprobs
come from the base model) on a locally built model, each in its own `trainer` process:

- `full`: one run, every weight trained (AdamW over the whole model);
- `lora`: one run, a LoRA adapter (the single-run path);
- `runs=N`: the multi-run trainer (`max_concurrent_runs = N`) with N runs, each its own adapter and AdamW.

Per configuration: steps trained per second over all runs, tokens per second, the median compute time of
one run's step (`step_time_s`), the trainer's peak RSS, and what N runs cost next to N separate `lora`
trainers (each holding its own copy of the base model).

`--e2e`: then whole `rl` jobs on the tiny model (reverse-text, 64 rollouts per run-step): one full-weight
run, and `[[runs]]` of 1, 2, 4 LoRA runs sharing one server and one trainer; run-steps per second over all
runs (each run-step = one batch generated, trained and published), from the orchestrators' metrics.

    .venv/bin/python benchmarks/multi_run.py [--hidden 512 --layers 8 --steps 6 --runs 1 2 4] [--e2e]
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
from asyncrl.utils.tiny_model import build_tiny_model

ROWS, SAMPLES, SAMPLE_LEN, PROMPT = 8, 4, 128, 32  # per step: 8 rows of 4 samples x 128 tokens


def batches(model_dir: Path, steps: int) -> list[list[dict]]:
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
            rows.append(
                {"input_ids": ids, "position_ids": pos, "loss_mask": mask, "advantages": adv,
                 "inference_logprobs": mu * mask, "temperatures": temps}
            )  # fmt: skip
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


def measure(model: Path, data: list[list[dict]], root: Path, lora: bool, runs: int | None) -> dict:
    """Train one configuration in its own process; throughput from its metrics rows, peak RSS from wait4."""
    out = root / f"{'full' if not lora else 'lora' if runs is None else f'runs{runs}'}"
    names = [f"r{i}" for i in range(runs)] if runs else None
    dirs = [RunLayout(out).run_dir(n) for n in names] if names else [out]
    for d in dirs:
        for step, rows in enumerate(data):
            write_batch(d, step, [rows])
        if names:
            (d / "run.toml").write_text("")
    cfg = root / f"{out.name}.toml"
    cfg.write_text(trainer_toml(model, out, len(data), lora, names))
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count())}
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.entrypoints.trainer", "@", str(cfg)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        sys.exit(f"{out.name} failed: {proc.stderr.read().decode()[-2000:]}")
    rows = [json.loads(x) for d in dirs for x in RunLayout(d).metrics_file("trainer").read_text().splitlines()]
    timed = sorted((r for r in rows if r["step"] > 0), key=lambda r: r["time"])  # step 0 of each run: warm-up
    first = min(r["time"] for r in rows if r["step"] == 0)
    wall = timed[-1]["time"] - first
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


def measure_rl(model: Path, root: Path, steps: int, runs: int | None) -> dict:
    """One `rl` job: a full-weight run (runs None) or `runs` LoRA runs; run-steps/s after each run's step 1."""
    from asyncrl.utils.process import free_port

    out = root / f"rl_{runs or 'full'}"
    text = RL_JOB.format(steps=steps, out=out, model=model, port=free_port())
    if runs:
        text += "[trainer.model.lora]\nrank = 16\nalpha = 32\n"
        text += "".join(f'[[runs]]\nname = "r{i}"\n' for i in range(runs))
    cfg = root / f"{out.name}.toml"
    cfg.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "asyncrl.entrypoints.rl", "@", str(cfg)], capture_output=True)
    if proc.returncode != 0:
        sys.exit(f"{out.name} failed: {proc.stderr.decode()[-2000:]}")
    dirs = [RunLayout(out).run_dir(f"r{i}") for i in range(runs)] if runs else [out]
    rows = [json.loads(x) for d in dirs for x in RunLayout(d).metrics_file("orchestrator").read_text().splitlines()]
    rows = [r for r in rows if r.get("kind", "train") == "train"]
    start = max(r["time"] for r in rows if r["step"] == 1)  # every run warmed up
    timed = [r for r in rows if r["time"] > start]
    wall = max(r["time"] for r in timed) - start
    return {"config": "full" if runs is None else f"runs{runs}", "runs": runs or 1, "steps_per_s": len(timed) / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first is a warm-up)")
    ap.add_argument("--runs", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--e2e", action="store_true", help="also whole rl jobs (tiny model, reverse-text)")
    ap.add_argument("--rl-steps", type=int, default=12, help="steps per run of each rl job")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="multi_run_bench_") as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model", hidden_size=args.hidden, num_layers=args.layers, num_heads=8)
        params = sum(t.numel() for t in load_file(model / "model.safetensors").values())
        data = batches(model, args.steps)
        results = [measure(model, data, root, lora=False, runs=None), measure(model, data, root, lora=True, runs=None)]
        results += [measure(model, data, root, lora=True, runs=n) for n in args.runs]
        if args.e2e:
            tiny = build_tiny_model(root / "tiny", hidden_size=128, num_layers=4)
            e2e = [measure_rl(tiny, root, args.rl_steps, None)]
            e2e += [measure_rl(tiny, root, args.rl_steps, n) for n in args.runs]
    lora = results[1]
    shape = f"{ROWS} rows x {SAMPLES * SAMPLE_LEN} tokens per run-step, {args.steps - 1} timed steps per run"
    print(f"model: hidden {args.hidden}, {args.layers} layers, {params / 1e6:.1f}M parameters; {shape}; "
          f"{os.cpu_count()} cores")  # fmt: skip
    print(f"{'config':<8} {'runs':>4} {'steps/s':>8} {'tok/s':>8} {'run step s':>10} {'peak RSS GiB':>12} "
          f"{'RSS vs N lora':>13}")  # fmt: skip
    for r in results:
        vs = r["rss_gib"] / (lora["rss_gib"] * r["runs"]) if r["config"].startswith("runs") else float("nan")
        print(f"{r['config']:<8} {r['runs']:>4} {r['steps_per_s']:>8.2f} {r['tokens_per_s']:>8,.0f} "
              f"{r['step_s']:>10.3f} {r['rss_gib']:>12.2f} {vs:>13.2f}")  # fmt: skip
    if args.e2e:
        print(f"\nrl end to end (tiny model, reverse-text, 64 rollouts per run-step, {args.rl_steps} steps per run)")
        print(f"{'config':<8} {'runs':>4} {'run-steps/s':>11} {'per run':>8}")
        for r in e2e:
            print(f"{r['config']:<8} {r['runs']:>4} {r['steps_per_s']:>11.2f} {r['steps_per_s'] / r['runs']:>8.2f}")


if __name__ == "__main__":
    main()
