"""Routing replay (R3) on a tiny mixture of experts: the sampler-trainer mismatch with and without it, and learning.

For each case x replay (off, on) x seed this runs `rl` (embedded engine, CPU, fp32, max_async_level 0: the
sampler's weights are the trainer's at every step, so the mismatch KL is numerics and routing only) on a tiny
Qwen3-MoE (8 experts, top-2, 2 layers, random init) and reads the trainer's metrics:

- fp32:      the model as built;
- near-tie:  the same model with every layer's router rows made equal up to 1e-8 noise (`near_tie`): which
             expert wins a tie is decided by float rounding, which differs between the engine's batched,
             KV-cached forwards and the trainer's full one, so the two route tokens differently.

Per cell it prints the mismatch KL (k3, per loss token) at step 0 and its mean over the run, the trainer's
`moe/replay_agreement` (replay on), and the training reward of the first and last 3 steps per seed; one table,
every number in `{out}/router_replay.json`. The near-tie rows separate once the router trains (Adam moves them
by ~lr a step), so that case's mismatch is largest at step 0.

    PYTHONPATH=src .venv/bin/python benchmarks/router_replay.py [--seeds 3] [--steps 15] [--jobs 2] \\
        [--out outputs/router_replay]
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ("fp32", "near-tie")
TIE_NOISE = 1e-8  # each router row = row 0 + this x N(0, 1)
EDGE = 3  # steps of the "first" and "last" reward means


def log(msg: str) -> None:
    print(f"[router_replay {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_models(out: Path) -> dict[str, Path]:
    """The tiny MoE, and its near-tie copy (built once)."""
    from asyncrl.utils.tiny_model import build_tiny_model

    base, tie = out / "models" / "fp32", out / "models" / "near-tie"
    if not (base / "config.json").exists():
        build_tiny_model(base, hidden_size=64, num_layers=2, experts=8, experts_per_token=2)
    if not (tie / "config.json").exists():
        shutil.copytree(base, tie, dirs_exist_ok=True)
        near_tie(tie)
    return {"fp32": base, "near-tie": tie}


def near_tie(model_dir: Path) -> None:
    """Make every router's rows equal to its first row up to TIE_NOISE (in place)."""
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(0)
    for path in model_dir.glob("*.safetensors"):
        tensors = load_file(path)
        for name, w in tensors.items():
            if name.endswith("mlp.gate.weight"):
                tensors[name] = w[:1] + TIE_NOISE * torch.randn(w.shape, generator=gen)
        save_file(tensors, path, metadata={"format": "pt"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(model: Path, run_dir: Path, replay: bool, seed: int, steps: int) -> dict:
    """One `rl` run (reused when its metrics are complete); its per-step trainer and orchestrator metrics."""
    if len(_rows(run_dir / "metrics" / "trainer.jsonl")) < steps:
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        cmd = [sys.executable, "-m", "asyncrl.entrypoints.rl", "--model.name", str(model), "--output-dir", str(run_dir)]
        cmd += ["--inference.server.host", "127.0.0.1", "--inference.server.port", str(free_port())]
        cmd += ["--max-steps", str(steps), "--seq-len", "128", "--max-async-level", "0", "--trainer.optim.lr", "3e-3"]
        cmd += ["--trainer.optim.weight-decay", "0", "--orchestrator.batch-size", "64"]
        cmd += ["--orchestrator.rollouts-per-example", "8", "--orchestrator.sampling.max-tokens", "16"]
        cmd += ["--orchestrator.seed", str(seed), "--inference.seed", str(seed), "--report", "false"]
        cmd += ["--trainer.model.router-replay"] if replay else []
        with open(run_dir.parent / f"{run_dir.name}.log", "w") as f:
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"rl failed (exit {done.returncode}); see {run_dir.parent / run_dir.name}.log")
    trainer = _rows(run_dir / "metrics" / "trainer.jsonl")
    rewards = [r["reward/mean"] for r in _rows(run_dir / "metrics" / "orchestrator.jsonl") if "reward/mean" in r]
    return {
        "kl_step0": trainer[0]["mismatch_kl"],
        "kl_mean": statistics.fmean(r["mismatch_kl"] for r in trainer),
        "agreement": [r.get("moe/replay_agreement") for r in trainer],
        "reward_first": statistics.fmean(rewards[:EDGE]),
        "reward_last": statistics.fmean(rewards[-EDGE:]),
    }


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind", "train") == "train"]


def table(results: dict[str, list[dict]]) -> str:
    head = "| case | replay | mismatch KL step 0 | mismatch KL mean over run | replay agreement step 0 / lowest"
    head += " | reward first 3 -> last 3"
    head += " | rose |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for cell, runs in results.items():
        case, replay = cell.split("/")
        lines.append(
            f"| {case} | {replay} | {statistics.fmean(r['kl_step0'] for r in runs):.2e} "
            f"| {statistics.fmean(r['kl_mean'] for r in runs):.2e} "
            f"| {_agreement(runs)} "
            f"| {statistics.fmean(r['reward_first'] for r in runs):.3f} -> "
            f"{statistics.fmean(r['reward_last'] for r in runs):.3f} "
            f"| {sum(r['reward_last'] > r['reward_first'] for r in runs)}/{len(runs)} |"
        )
    return "\n".join(lines)


def _agreement(runs: list[dict]) -> str:
    """`moe/replay_agreement` at step 0 (mean over seeds) / its lowest over every step and seed; n/a: replay off."""
    if runs[0]["agreement"][0] is None:
        return "n/a"
    first = statistics.fmean(r["agreement"][0] for r in runs)
    return f"{first:.3f} / {min(a for r in runs for a in r['agreement']):.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--jobs", type=int, default=2, help="runs at once")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "router_replay")
    args = p.parse_args(argv)
    models = build_models(args.out)
    cells = [(case, replay, seed) for case in CASES for replay in (False, True) for seed in range(1, args.seeds + 1)]

    def one(cell: tuple[str, bool, int]) -> dict:
        case, replay, seed = cell
        name = f"{case}-{'on' if replay else 'off'}-s{seed}"
        log(f"running {name}")
        return run_one(models[case], args.out / "runs" / name, replay, seed, args.steps)

    with ThreadPoolExecutor(args.jobs) as pool:
        done = list(pool.map(one, cells))
    results: dict[str, list[dict]] = {}
    for (case, replay, _), r in zip(cells, done):
        results.setdefault(f"{case}/{'on' if replay else 'off'}", []).append(r)
    (args.out / "router_replay.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
