"""Learning under asynchrony: does a recipe learn as well at async level k = 1, 2 as at k = 0, without collapse?

For every task x recipe x lr scale x k x seed this runs `rl` (embedded engine, CPU) from one cached SFT-warmed
checkpoint per task and reads the run's metrics: the training reward per step, the held-out eval reward on
the env's eval split before the first step and of the final weights (`[orchestrator.eval]`, final eval on),
completion lengths, the staleness each step sampled at (`off_policy/level`) and wall time. Per cell it prints
mean ± sd over seeds of the last-10-step train reward and of the held-out gain, the number of collapses, the
staleness (mean/max), the completion-length drift, the time to a threshold (`s to thr`: seconds from the eval
before step 0 until a run's trailing 10-step reward first reached its task's lowest cell mean among the cells
without a collapse) and the wall time; one table, and every number in `{out}/learning.json`.

k bounds the staleness (`--lags at_most`, rl's default); where generation is the bottleneck (this CPU), runs
at any k >= 1 sample ~1 step behind. `--lags exactly` runs `--orchestrator.async-lag exactly`: every step
from k on samples with the policy exactly k steps old (cells named `.../kKx`, run dirs `lrS-kKx-sSEED`).

A run **collapses** when its last-10-step mean reward is below 80% of its best 10-step mean, or its final
held-out reward is below its start. Tasks (each warmed once: tiny Qwen3 + byte tokenizer, SFT on the
env's own `--sft-out` data):
- reverse: reverse-text (similarity reward), the demo's RL settings (16 prompts x 8, 16 tokens, lr 3e-4, 60 steps);
- sort:    sort-letters (similarity reward), a task no other part of the project trains on, same shape;
- echo:    echo-twice (two model turns, similarity reward): the multi-turn path, 8 prompts x 8.
- tool:    tool-calc (multi-turn tool use: a calculator MCP server, up to 3 model turns), examples/tool_calc's
           SFT warm-up (1400 steps) and RL recipe (shaping 0.5, lr 2e-4, 128 tokens a turn), 4 questions x 8.
- vf-reverse: verifiers' own v1 `reverse_text` example, unmodified (VF_REVERSE_TEXT=its directory in a
           verifiers checkout), on a local dataset; reward = LCS ratio of the answer in <reversed_text> tags.

    PYTHONPATH=src .venv/bin/python benchmarks/learning.py --tasks reverse,sort,echo --k 0,1,2 --seeds 8 \\
        --recipes default [--lr-scales 1,3] [--lags at_most,exactly] [--jobs 2] [--out outputs/learning]

Each run's dir is `{out}/runs/TASK/RECIPE/lrS-kK-sSEED/run`: `asyncrl report` over a task's run dirs draws
their curves (one colour per run, labelled k=... seed=...) and prints the time-to-accuracy table (the first
step and wall time each run reached the worst run's final reward; the final value's mean ± sd per cell).

Runs already finished under `{out}/runs/` are reused (delete the dir to rerun): an interrupted benchmark
continues where it stopped. A run is known by task, recipe, lr, k, lag and seed: give `--steps N` runs (a census
of short runs) an `--out` of their own. Recipes are lists of `rl` flags (RECIPES); `default` is the shipped one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WINDOW = 10  # steps per "last-10" / "best 10-step" mean
COLLAPSE_FRACTION = 0.8


@dataclass(frozen=True)
class Task:
    env: str
    sft_module: str  # `python -m MODULE --sft-out FILE --n N` writes its SFT data
    sft_n: int
    sft_steps: int
    env_args: dict[str, Any] = field(default_factory=dict)
    steps: int = 60
    prompts: int = 16
    rollouts: int = 8
    max_tokens: int = 16
    lr: float = 3e-4
    seq_len: int = 256
    eval_examples: int = 200
    eval_args: dict[str, Any] | None = None  # the held-out split's env args (None: the env's eval split)
    pythonpath: str | None = None  # an env var naming a directory to import the env (and its data module) from
    sft_seq_len: int = 512
    sft_micro_batch: int = 4
    orchestrator: dict[str, Any] = field(default_factory=dict)  # more `[orchestrator]` settings (a renderer)


TASKS = {
    "reverse": Task("reverse-text", "reverse_text", 10000, 150),
    "sort": Task("sort-letters", "sort_letters", 10000, 150),
    "echo": Task("echo-twice", "echo_twice", 4000, 400, {"reward": "similarity"}, prompts=8, eval_examples=100),
    # multi-turn tool use: examples/tool_calc's recipe (its SFT, renderer, shaping and lr), 4 questions a step
    "tool": Task(
        "tool-calc",
        "tool_calc",
        4000,
        1400,
        {"max_turns": 3, "shaping": 0.5},
        steps=40,
        prompts=4,
        max_tokens=128,
        lr=2e-4,
        seq_len=2048,
        eval_examples=50,
        sft_seq_len=2048,
        sft_micro_batch=2,
        orchestrator={"renderer": {"name": "default", "tool_parser": "qwen3"}},
    ),
    # verifiers' own v1 example, unmodified: VF_REVERSE_TEXT names its directory in a verifiers checkout
    # (environments/reverse_text); its dataset and SFT rows come from benchmarks/vf_reverse_data.py
    "vf-reverse": Task(
        "reverse-text",
        "vf_reverse_data",
        10000,
        800,  # ~3 samples per 512-token row (its system prompt): 4x the steps of reverse for the same data
        {"dataset_name": "{warm}/dataset"},
        max_tokens=48,
        eval_args={"dataset_name": "{warm}/dataset", "dataset_split": "test"},
        pythonpath="VF_REVERSE_TEXT",
    ),
}

RECIPES: dict[str, list[str]] = {
    "default": [],  # whatever the shipped defaults are
    "aipo": ["--trainer.loss.type", "aipo"],
    "grpo": ["--trainer.loss.type", "grpo"],
    "dppo": ["--trainer.loss.type", "dppo", "--trainer.loss.kl-tau", "1e-3"],
    "dppo-nokl": ["--trainer.loss.type", "dppo", "--trainer.loss.kl-tau", "0"],
    "aipo-tis2": ["--trainer.loss.type", "aipo", "--trainer.loss.token-is-cap", "2"],
    "aipo-std": ["--trainer.loss.type", "aipo", "--orchestrator.advantage.type", "mean_std"],
    "grpo-std": ["--trainer.loss.type", "grpo", "--orchestrator.advantage.type", "mean_std"],
    "m2po": ["--trainer.loss.type", "m2po"],
    "m2po-0.2": ["--trainer.loss.type", "m2po", "--trainer.loss.m2-max", "0.2"],
    # the default plus a pull toward the start weights: a gradient even where every advantage is 0
    "refkl": ["--trainer.loss.ref-kl", "0.1"],
    # the IS weight held at 1 (cispo's clip to [1, 1]): -A·logπ, every sample treated as on-policy
    "pg": ["--trainer.loss.type", "cispo", "--trainer.loss.clip-low", "0", "--trainer.loss.clip-high", "0"],
}


def log(msg: str) -> None:
    print(f"[learning {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def task_env(task: Task) -> dict[str, str]:
    """The process environment for a task's commands: its env's directory (and benchmarks/) importable."""
    if task.pythonpath is None:
        return dict(os.environ)
    where = os.environ.get(task.pythonpath)
    if not where:
        raise SystemExit(f"set {task.pythonpath} to the environment's directory (see TASKS)")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([where, str(ROOT / "benchmarks")])}


def with_warm(args: dict[str, Any], warm_dir: Path) -> dict[str, Any]:
    return {k: v.format(warm=warm_dir) if isinstance(v, str) else v for k, v in args.items()}


def run(cmd: list[str], logfile: Path, env: dict | None = None) -> None:
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with open(logfile, "a") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed (exit {proc.returncode}); see {logfile}")


# ---- warm-up: one SFT checkpoint per task -------------------------------------------------------------


def warm(name: str, task: Task, out: Path) -> Path:
    """The task's SFT-warmed weights (built once; the dir name hashes the settings)."""
    spec = {"task": name, "module": task.sft_module, "n": task.sft_n, "steps": task.sft_steps, "recipe": 1}
    if (task.sft_seq_len, task.sft_micro_batch) != (Task.sft_seq_len, Task.sft_micro_batch):  # older keys kept
        spec.update(seq_len=task.sft_seq_len, micro_batch=task.sft_micro_batch)
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:8]
    d = out / "warm" / f"{name}-{key}"
    weights = d / "sft" / "weights" / f"step_{task.sft_steps}"
    if (weights / "config.json").exists():
        return weights
    log(f"warming {name}: tiny model + {task.sft_steps} SFT steps -> {d}")
    run([str(BIN / "asyncrl-tiny-model"), str(d / "tiny-model")], d / "warm.log")
    run(
        [sys.executable, "-m", task.sft_module, "--sft-out", str(d / "sft.jsonl"), "--n", str(task.sft_n)],
        d / "warm.log",
        task_env(task),
    )
    sft = [str(BIN / "sft"), "--model.name", str(d / "tiny-model"), "--data.name", str(d / "sft.jsonl")]
    sft += ["--data.seq-len", str(task.sft_seq_len), "--data.batch-size", "4", "--optim.lr", "1e-3"]
    sft += ["--data.micro-batch-size", str(task.sft_micro_batch)]
    sft += ["--optim.weight-decay", "0", "--max-steps", str(task.sft_steps), "--output-dir", str(d / "sft")]
    run(sft + ["--ckpt.interval", str(task.sft_steps)], d / "warm.log")
    return weights


# ---- one RL run ---------------------------------------------------------------------------------------


def rl_config(task: Task, model: Path, eval_rollouts: int) -> dict[str, Any]:
    warm_dir = model.parents[2]  # {warm}/sft/weights/step_N
    env = {"id": task.env, "args": with_warm(task.env_args, warm_dir)}
    held_out = [{"id": task.env, "args": with_warm(task.eval_args, warm_dir)}] if task.eval_args else []
    return {
        "max_steps": task.steps,
        "seq_len": task.seq_len,
        "model": {"name": str(model)},
        "trainer": {"optim": {"lr": task.lr, "weight_decay": 0.0}},
        "orchestrator": {
            "batch_size": task.prompts * task.rollouts,
            "rollouts_per_example": task.rollouts,
            "sampling": {"max_tokens": task.max_tokens, "temperature": 1.0},
            "env": [env],
            **task.orchestrator,
            "eval": {
                "env": held_out,
                "interval": 10_000,
                "num_examples": task.eval_examples,
                "rollouts_per_example": eval_rollouts,
                "eval_base": True,
                "eval_final": True,
            },
        },
        "inference": {"max_batch_size": task.prompts * task.rollouts, "server": {"host": "127.0.0.1"}},
    }


@dataclass(frozen=True)
class Cell:
    task: str
    recipe: str
    lr_scale: float
    k: int
    lag: str = "at_most"  # `--orchestrator.async-lag`: "exactly" samples every step k policies behind

    @property
    def name(self) -> str:
        return f"{self.task}/{self.recipe}/lr{self.lr_scale:g}/k{self.k}{self.mark}"

    @property
    def mark(self) -> str:
        return "x" if self.lag == "exactly" else ""


def run_one(cell: Cell, seed: int, model: Path, out: Path, port: int, eval_rollouts: int) -> dict[str, Any]:
    """Run (or reuse) one seed of a cell; returns its summary."""
    task = TASKS[cell.task]
    d = out / "runs" / cell.task / cell.recipe / f"lr{cell.lr_scale:g}-k{cell.k}{cell.mark}-s{seed}"
    done = d / "result.json"
    if done.exists():
        result = json.loads(done.read_text())
        if "seconds" not in result:  # summarized before the time-to-threshold column: read its run again
            result.update(summarize_run(d / "run", result["wall_s"]))
        return result
    if d.exists():
        subprocess.run(["rm", "-rf", str(d)], check=True)
    d.mkdir(parents=True)
    import tomli_w

    (d / "rl.toml").write_text(tomli_w.dumps(rl_config(task, model, eval_rollouts)))
    cmd = [str(BIN / "rl"), "@", str(d / "rl.toml"), "--output-dir", str(d / "run"), "--max-async-level", str(cell.k)]
    cmd += ["--trainer.seed", str(seed), "--orchestrator.seed", str(seed), "--inference.server.port", str(port)]
    cmd += ["--trainer.optim.lr", f"{task.lr * cell.lr_scale:g}", "--orchestrator.async-lag", cell.lag]
    cmd += RECIPES[cell.recipe]
    env = {**task_env(task), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.time()
    run(cmd, d / "rl.log", env)
    result = summarize_run(d / "run", time.time() - start)
    result.update(cell=asdict(cell), seed=seed)
    done.write_text(json.dumps(result, indent=1))
    return result


def _rows(path: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind", "train") == kind]


def _windows(values: list[float]) -> list[float]:
    return [statistics.fmean(values[i : i + WINDOW]) for i in range(0, max(len(values) - WINDOW, 0) + 1)]


def summarize_run(run_dir: Path, wall: float) -> dict[str, Any]:
    train = _rows(run_dir / "metrics" / "orchestrator.jsonl", "train")
    evals = sorted(_rows(run_dir / "metrics" / "orchestrator.jsonl", "eval"), key=lambda r: r["step"])
    trainer = _rows(run_dir / "metrics" / "trainer.jsonl", "train")
    rewards = [r["reward/mean"] for r in train]
    lags = [r["off_policy/level"] for r in train]
    lengths = [r["completion_len/mean"] for r in train]
    windows = _windows(rewards)
    last, best = statistics.fmean(rewards[-WINDOW:]), max(windows)
    before, after = evals[0]["eval/reward/mean"], evals[-1]["eval/reward/mean"]
    return {
        "steps": len(rewards),
        "rewards": rewards,
        "seconds": [r["time"] - evals[0]["time"] for r in train],  # each step's end, from the held-out eval before it
        "last10": last,
        "best10": best,
        "heldout_before": before,
        "heldout_after": after,
        "heldout_steps": [evals[0]["step"], evals[-1]["step"]],
        "collapsed": last < COLLAPSE_FRACTION * best or after < before,
        "staleness_mean": statistics.fmean(lags),  # steps behind the trainer each step sampled (off_policy/level)
        "staleness_max": max(lags),
        "length_first10": statistics.fmean(lengths[:WINDOW]),
        "length_last10": statistics.fmean(lengths[-WINDOW:]),
        "entropy_last10": statistics.fmean([r["entropy"] for r in trainer[-WINDOW:]]) if trainer else None,
        "wall_s": wall,
    }


# ---- the bench job: held-out after 80 steps and time to TRL's score ----------------------------------------


def trl_score(out: Path, seed: int) -> dict[str, Any]:
    """TRL's GRPOTrainer on the `rl --bench` job (benchmarks/trl_grpo.py), once per seed."""
    d = out / "trl" / f"s{seed}"
    if not (d / "bench_trl.json").exists():
        log(f"bench job with TRL, seed {seed} -> {d}")
        cmd = [sys.executable, str(ROOT / "benchmarks" / "trl_grpo.py"), "--output-dir", str(d), "--seed", str(seed)]
        run(cmd, out / "trl" / f"s{seed}.log", {**os.environ, "PYTHONPATH": str(ROOT / "src")})
    return json.loads((d / "bench_trl.json").read_text())


def race(out: Path, recipe: str, k: int, seed: int, target: float, port: int) -> dict[str, Any]:
    """`rl --bench` (checkpoints every 10 steps): held-out after 80 steps, and the wall time until the first
    checkpoint whose sampled held-out accuracy reaches `target` (bisection over the checkpoints)."""
    from asyncrl.config import bench as job

    d = out / "race" / recipe / f"k{k}-s{seed}"
    done = d / "race.json"
    if done.exists():
        return json.loads(done.read_text())
    model = job.warm_dir(job.DEFAULT_OUTPUT_DIR) / "model"  # `rl --bench`'s own warmed model, shared
    cmd = [str(BIN / "rl"), "--bench", "--output-dir", str(d), "--model.name", str(model), "--max-async-level", str(k)]
    cmd += ["--trainer.seed", str(seed), "--orchestrator.seed", str(seed), "--inference.server.port", str(port)]
    cmd += ["--ckpt.interval", "10", *RECIPES[recipe]]
    start = time.time()
    run(cmd, d.parent / f"k{k}-s{seed}.log")
    bench = json.loads((d / "bench.json").read_text())
    steps = sorted(int(p.name.split("_")[1]) for p in (d / "weights").glob("step_*"))
    dirs = [str(d / "weights" / f"step_{n}") for n in steps]
    cmd = [sys.executable, "-m", "asyncrl.bench.heldout", *dirs, "--first-reaching", f"{target}"]
    found = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True).stdout.splitlines()
    chosen = json.loads(found[-1])["chosen"]
    scores = {json.loads(x)["model"]: json.loads(x)["sampled"] for x in found[:-1]}
    step = int(Path(chosen).name.split("_")[1])
    if chosen not in scores:  # the bisection ends on the last checkpoint unscored: that is the run's end, scored above
        scores[chosen] = bench["heldout"]["after"]["sampled"] if step == steps[-1] else 0.0
    rows = [json.loads(x) for x in (d / "metrics" / "trainer.jsonl").read_text().splitlines() if x.strip()]
    at = next((r["time"] for r in rows if r["step"] == step - 1), None)
    result = {
        "heldout_after": bench["heldout"]["after"],
        "wall_s": bench["wall_s"],
        "target": target,
        "reached": scores.get(chosen, 0.0) >= target,
        "first_step_reaching": step,
        "seconds_to_target": (at - start) if at is not None else None,
    }
    done.write_text(json.dumps(result, indent=1))
    return result


def trl_table(trl: list[dict], races: dict[str, list[dict]]) -> str:
    """Held-out after 80 steps (sampled, greedy) and seconds to TRL's sampled score, TRL vs each recipe."""
    trl_wall = statistics.fmean(t["wall_s"] for t in trl)
    lines = [
        f"{'bench job (80 steps)':<24} {'n':>2}  {'sampled':>15}  {'greedy':>15}  {'s to TRL score':>15}  {'x TRL':>6}"
    ]
    lines.append("-" * len(lines[0]))
    sampled, greedy = [t["heldout"]["after"]["sampled"] for t in trl], [t["heldout"]["after"]["greedy"] for t in trl]
    lines.append(
        f"{'TRL GRPOTrainer':<24} {len(trl):>2}  {_ms(sampled):>15}  {_ms(greedy):>15}  {trl_wall:>15.0f}  1.00"
    )
    for name, rs in races.items():
        secs = [r["seconds_to_target"] for r in rs if r["reached"] and r["seconds_to_target"] is not None]
        t = f"{statistics.fmean(secs):.0f} ({len(secs)}/{len(rs)})" if secs else f"- (0/{len(rs)})"
        ratio = f"{statistics.fmean(secs) / trl_wall:.2f}" if secs else "-"
        s, g = [r["heldout_after"]["sampled"] for r in rs], [r["heldout_after"]["greedy"] for r in rs]
        lines.append(f"{name:<24} {len(rs):>2}  {_ms(s):>15}  {_ms(g):>15}  {t:>15}  {ratio:>6}")
    return "\n".join(lines)


# ---- the table ----------------------------------------------------------------------------------------


def _ms(values: list[float]) -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {sd:.3f}"


def cell_summary(results: list[dict], threshold: float) -> dict[str, Any]:
    gains = [r["heldout_after"] - r["heldout_before"] for r in results]
    return {
        "threshold": threshold,
        "time_to_threshold": time_to(results, threshold),
        "seeds": len(results),
        "last10": [r["last10"] for r in results],
        "heldout_before": [r["heldout_before"] for r in results],
        "heldout_after": [r["heldout_after"] for r in results],
        "heldout_gain": gains,
        "collapses": sum(r["collapsed"] for r in results),
        "staleness_mean": statistics.fmean(r.get("staleness_mean", 0.0) for r in results),
        "staleness_max": max(r.get("staleness_max", 0) for r in results),
        "length_drift": [r["length_last10"] / max(r["length_first10"], 1e-9) for r in results],
        "wall_s": [r["wall_s"] for r in results],
    }


def seconds_to(result: dict, threshold: float) -> float | None:
    """Seconds (from the eval before step 0) until the run's trailing 10-step mean reward first reached
    `threshold`; None if it never did."""
    rewards, seconds = result["rewards"], result["seconds"]
    for end in range(WINDOW, len(rewards) + 1):
        if statistics.fmean(rewards[end - WINDOW : end]) >= threshold:
            return seconds[end - 1]
    return None


def thresholds(results: dict[str, list[dict]]) -> dict[str, float]:
    """Per task, the lowest cell mean of last-10 reward over the cells none of whose runs collapsed (over all
    its cells where each had a collapse): a level every healthy cell reaches on average."""
    means: dict[str, dict[bool, list[float]]] = {}
    for name, rs in results.items():
        if rs:
            healthy = not any(r["collapsed"] for r in rs)
            means.setdefault(name.split("/")[0], {True: [], False: []})[healthy].append(
                statistics.fmean(r["last10"] for r in rs)
            )
    return {task: min(m[True] or m[False]) for task, m in means.items()}


def time_to(results: list[dict], threshold: float) -> str:
    times = [t for r in results if (t := seconds_to(r, threshold)) is not None]
    return f"{statistics.fmean(times):.0f} ({len(times)}/{len(results)})" if times else f"- (0/{len(results)})"


def table(cells: dict[str, dict]) -> str:
    head = f"{'cell':<30} {'n':>2}  {'last-10 reward':>15}  {'held-out after':>15}  {'held-out gain':>15}"
    head += f"  {'collapses':>9}  {'stale':>8}  {'len drift':>9}  {'s to thr':>10}  {'wall s':>6}"
    lines = [head, "-" * len(head)]
    for name, c in cells.items():
        drift = statistics.fmean(c["length_drift"]) if c["length_drift"] else 0
        stale = f"{c['staleness_mean']:.2f}/{c['staleness_max']}"
        lines.append(
            f"{name:<30} {c['seeds']:>2}  {_ms(c['last10']):>15}  {_ms(c['heldout_after']):>15}  "
            f"{_ms(c['heldout_gain']):>15}  {c['collapses']:>9}  {stale:>8}  {drift:>8.2f}x  "
            f"{c['time_to_threshold']:>10}  {statistics.fmean(c['wall_s']):>6.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="reverse,sort,echo")
    ap.add_argument("--recipes", default="default", help=f"comma-separated, of {', '.join(RECIPES)}")
    ap.add_argument("--k", default="0,1,2", help="async levels")
    ap.add_argument(
        "--lags",
        default="at_most",
        help="comma-separated async lags: at_most (k bounds the staleness), exactly (every step k behind)",
    )
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--steps", type=int, help="every task's run length instead of its own (short runs for a census)")
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--lr-scales", default="1", help="multiples of each task's lr, e.g. 1,3")
    ap.add_argument("--eval-rollouts", type=int, default=1, help="held-out samples per eval example")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (each rl: 3 processes)")
    ap.add_argument("--out", type=Path, default=Path("outputs/learning"))
    ap.add_argument("--port", type=int, default=8300, help="first inference port (one per job)")
    ap.add_argument(
        "--trl",
        action="store_true",
        help="instead: the bench job, TRL (pip install trl) vs rl --bench, per recipe and k",
    )
    ap.add_argument("--trl-seeds", type=int, default=2, help="TRL runs (each ~2 min)")
    args = ap.parse_args(argv)
    if args.trl:
        return main_trl(args)
    tasks, recipes = args.tasks.split(","), args.recipes.split(",")
    for name, known in (("task", TASKS), ("recipe", RECIPES)):
        bad = [x for x in (tasks if name == "task" else recipes) if x not in known]
        if bad:
            sys.exit(f"error: unknown {name} {bad[0]!r}; choose from {', '.join(known)}")
    ks, scales = [int(x) for x in args.k.split(",")], [float(x) for x in args.lr_scales.split(",")]
    lags = args.lags.split(",")
    if args.steps is not None:
        if args.steps < 2 * WINDOW:
            sys.exit(f"error: --steps {args.steps}: at least {2 * WINDOW} (the collapse rule compares 10-step windows)")
        TASKS.update({t: replace(TASKS[t], steps=args.steps) for t in tasks})
    if bad := [x for x in lags if x not in ("at_most", "exactly")]:
        sys.exit(f"error: unknown lag {bad[0]!r}; choose from at_most, exactly")
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    models = {t: warm(t, TASKS[t], args.out) for t in tasks}
    cells = [Cell(t, r, s, k, lag) for t in tasks for r in recipes for s in scales for k in ks for lag in lags]
    jobs = [(c, seed) for seed in seeds for c in cells]  # seed-major: partial results cover every cell early
    results: dict[str, list[dict]] = {c.name: [] for c in cells}
    ports: queue.Queue[int] = queue.Queue()
    for port in range(args.port, args.port + args.jobs):
        ports.put(port)
    started = time.time()

    def one(cell: Cell, seed: int) -> None:
        port = ports.get()  # a run holds its port until it ends
        try:
            r = run_one(cell, seed, models[cell.task], args.out, port, args.eval_rollouts)
        except Exception as e:  # one failed run is reported, not fatal
            log(f"{cell.name} seed {seed}: {e}")
            return
        finally:
            ports.put(port)
        results[cell.name].append(r)
        log(
            f"[{sum(map(len, results.values()))}/{len(jobs)}] {cell.name} seed {seed}: last-10 {r['last10']:.3f} "
            f"held-out {r['heldout_before']:.3f} -> {r['heldout_after']:.3f}"
            f"{' COLLAPSED' if r['collapsed'] else ''} ({r['wall_s']:.0f}s)"
        )

    with ThreadPoolExecutor(args.jobs) as pool:
        for cell, seed in jobs:
            pool.submit(one, cell, seed)
    lows = thresholds(results)
    summary = {name: cell_summary(rs, lows[name.split("/")[0]]) for name, rs in results.items() if rs}
    out = {"cells": summary, "args": {k: str(v) for k, v in vars(args).items()}, "wall_s": time.time() - started}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "learning.json").write_text(json.dumps(out, indent=1))
    print(table(summary))
    print("s to thr: mean seconds (from the eval before step 0; runs that got there) until a run's trailing 10-step")
    levels = ", ".join(f"{t} {v:.3f}" for t, v in lows.items())
    print(f"reward reached its task's lowest last-10 reward of a cell without collapses: {levels}")
    print(f"numbers in {args.out / 'learning.json'}")
    for task in tasks:  # the curves, and the time-to-accuracy table of each run
        for recipe in recipes:
            print(f"curves: asyncrl report {args.out / 'runs' / task / recipe}/*/run")
    return 0


def main_trl(args: argparse.Namespace) -> int:
    trl = [trl_score(args.out, seed) for seed in range(args.trl_seeds)]
    target = statistics.fmean(t["heldout"]["after"]["sampled"] for t in trl)
    log(f"TRL's held-out sampled exact match after 80 steps: {target:.3f} (mean of {len(trl)})")
    races: dict[str, list[dict]] = {}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for recipe in args.recipes.split(","):
            for k in [int(x) for x in args.k.split(",")]:
                r = race(args.out, recipe, k, seed, target, args.port)
                races.setdefault(f"rl {recipe} k={k}", []).append(r)
                log(f"race {recipe} k={k} seed {seed}: {r}")
    text = trl_table(trl, races)
    (args.out / "trl_race.json").write_text(json.dumps({"trl": trl, "races": races}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
