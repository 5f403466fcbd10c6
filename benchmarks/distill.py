"""On-policy distillation vs RL from the reward alone, from one student start, on CPU (issue 30's table).

The task is the bench job's reverse-text (`asyncrl.config.bench`: bare 5-8 letter words, exact-match reward,
16 prompts x 8 rollouts, 16 tokens). One SFT run of the tiny model (cached; the dir name hashes the settings)
gives both models: the **student** is its weights after `--student-step` SFT steps, the **teacher** after
`--teacher-step`. Then, for every recipe x seed, `rl` runs `--steps` steps from the student:

- reward:  RL from the environment's reward alone (no teacher);
- distill: on-policy distillation alone: `[teacher]` = the teacher checkpoint; per-token advantage =
           teacher logprob - student logprob (reward.weight defaults to 0 with a teacher);
- mixed:   both, `orchestrator.reward.weight = 1`, `orchestrator.distill.weight = 1`;
- plain:   distillation without the per-position baseline (`orchestrator.distill.top_k = 0`).
- forward: dense distillation alone, `distill.kind = "forward_kl"`, `top_k = 20`: the trainer pulls the student
           toward the teacher's top 20 at every position (cross-entropy);
- fmixed:  forward plus the reward (`reward.weight = 1`).

Every `--eval-every` steps the run keeps its weights (`--ckpt.interval`); each is scored on the held-out words
with `python -m asyncrl.bench.heldout` (sampled T=1 exact match, 128 words x 4 samples; the same scorer, words
and sampling for teacher, student and every checkpoint). One table: recipe, seed, held-out at each scored
step, wall time, and the first scored step (and seconds into the run) at which held-out reaches the teacher's
minus 2 points. Numbers in `{out}/distill.json`; finished runs under `{out}/runs/` are reused.

    PYTHONPATH=src .venv/bin/python benchmarks/distill.py --seeds 3 --steps 200 --eval-every 20 --lr 5e-4 \\
        --lr-for reward=3e-4 --recipes reward,forward,fmixed --rl-args "--trainer.scheduler.warmup-steps 10" \\
        [--out outputs/distill-bench]

Recipes that need the orchestrator's `teacher` (distill, mixed) are skipped, said so, where it lacks it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TEACHER_MARGIN = 0.02  # "reaches the teacher": held-out within 2 points of it

RECIPES: dict[str, list[str]] = {
    "reward": [],
    "distill": [],  # a teacher, and reward.weight's default with one (0): distillation alone
    "mixed": ["--orchestrator.reward.weight", "1", "--orchestrator.distill.weight", "1"],
    "plain": ["--orchestrator.distill.top-k", "0"],  # distillation without the per-position baseline
    # forward KL to the teacher's top-20 at every position (the trainer's cross-entropy term)
    "forward": ["--orchestrator.distill.kind", "forward_kl", "--orchestrator.distill.top-k", "20"],
    "fmixed": ["--orchestrator.distill.kind", "forward_kl", "--orchestrator.distill.top-k", "20"]
    + ["--orchestrator.reward.weight", "1"],
}
NEEDS_TEACHER = {"distill", "mixed", "plain", "forward", "fmixed"}


def log(msg: str) -> None:
    print(f"[distill {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], logfile: Path, env: dict[str, str] | None = None) -> None:
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with open(logfile, "a") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}); see {logfile}")


def orchestrator_has_teacher() -> bool:
    from asyncrl.config.orchestrator import OrchestratorConfig

    return "teacher" in OrchestratorConfig.model_fields


# ---- the two models: one SFT run, two of its checkpoints ------------------------------------------------


def sft_models(out: Path, student_step: int, teacher_step: int, lr: float) -> tuple[Path, Path]:
    """(student, teacher) weight dirs of one cached SFT run of the bench job's tiny model and data."""
    from asyncrl.config import bench as job

    spec = {"model": job.MODEL, "student": student_step, "teacher": teacher_step, "lr": lr, "recipe": 1}
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:8]
    d = out / "warm" / key
    student, teacher = (d / "sft" / "weights" / f"step_{n}" for n in (student_step, teacher_step))
    if (student / "config.json").exists() and (teacher / "config.json").exists():
        return student, teacher
    log(f"SFT: tiny model, student = step {student_step}, teacher = step {teacher_step} -> {d}")
    m = job.MODEL
    tiny = [sys.executable, "-m", "asyncrl.utils.tiny_model", str(d / "base")]
    for flag in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "seed"):
        tiny += [f"--{flag.replace('_', '-')}", str(m[flag])]
    run(tiny, d / "warm.log")
    data = [sys.executable, "-m", "reverse_text", "--sft-out", str(d / "sft.jsonl"), "--n", str(job.SFT_EXAMPLES)]
    data += ["--seed", str(job.ENV_SEED), "--min-len", str(job.MIN_LEN), "--max-len", str(job.MAX_LEN)]
    run(data + ["--system-prompt", job.SYSTEM_PROMPT, "--user-template", job.USER_TEMPLATE], d / "warm.log")
    sft = [sys.executable, "-m", "asyncrl.entrypoints.sft", "--model.name", str(d / "base")]
    sft += ["--data.name", str(d / "sft.jsonl"), "--data.seq-len", "512", "--data.batch-size", "4"]
    sft += ["--data.micro-batch-size", "4", "--optim.lr", str(lr), "--optim.weight-decay", "0"]
    sft += ["--max-steps", str(teacher_step), "--output-dir", str(d / "sft"), "--ckpt.interval", "50"]
    # the loss drops sharply at a step that moves with the float reduction order: pin the threads
    run(sft, d / "warm.log", {**os.environ, "OMP_NUM_THREADS": "1"})
    return student, teacher


def heldout(model_dirs: list[Path], cache: Path) -> dict[str, float]:
    """Sampled held-out exact match of each dir (cached in `cache`, by path)."""
    scores = json.loads(cache.read_text()) if cache.exists() else {}
    todo = [str(p) for p in model_dirs if str(p) not in scores]
    if todo:
        cmd = [sys.executable, "-m", "asyncrl.bench.heldout", *todo]
        lines = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True).stdout.splitlines()
        for line in lines:
            row = json.loads(line)
            scores[row["model"]] = row["sampled"]
        cache.write_text(json.dumps(scores, indent=1))
    return {str(p): scores[str(p)] for p in model_dirs}


# ---- one run ------------------------------------------------------------------------------------------


def rl_config(student: Path, teacher: Path | None, steps: int, eval_every: int, lr: float) -> dict[str, Any]:
    from asyncrl.config import bench as job

    config = job.component_defaults()
    config["trainer"]["optim"]["lr"] = lr
    config.update(max_steps=steps, seq_len=job.SEQ_LEN, max_async_level=1, model={"name": str(student)})
    config["ckpt"] = {"interval": eval_every}
    if teacher is not None:
        config["teacher"] = {"model": {"name": str(teacher)}, "max_batch_size": 128, "server": {"host": "127.0.0.1"}}
    return config


def run_one(recipe: str, seed: int, models: tuple[Path, Path], args: argparse.Namespace) -> dict[str, Any]:
    """Run (or reuse) one recipe x seed; returns held-out per scored step and the wall time."""
    import tomli_w

    student, teacher = models
    d = args.out / "runs" / f"{recipe}-s{seed}"
    done = d / "result.json"
    if done.exists():
        result = json.loads(done.read_text())
        result.setdefault("s_per_step", steady_period(trainer_rows(d / "run")))  # results of before the column
        return result
    subprocess.run(["rm", "-rf", str(d)], check=True)
    d.mkdir(parents=True)
    lr = args.lrs.get(recipe, args.lr)
    config = rl_config(student, teacher if recipe in NEEDS_TEACHER else None, args.steps, args.eval_every, lr)
    (d / "rl.toml").write_text(tomli_w.dumps(config))
    cmd = [sys.executable, "-m", "asyncrl.entrypoints.rl", "@", str(d / "rl.toml"), "--output-dir", str(d / "run")]
    cmd += ["--trainer.seed", str(seed), "--orchestrator.seed", str(seed), "--inference.server.port", str(args.port)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.time()
    run(cmd + RECIPES[recipe] + args.rl_args.split(), d / "rl.log", env)
    wall = time.time() - start
    weights = sorted((d / "run" / "weights").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    weights = [w for w in weights if int(w.name.split("_")[1]) % args.eval_every == 0]
    scores = heldout(weights, d / "heldout.json")
    trainer = trainer_rows(d / "run")
    finished = {r["step"] + 1: r["time"] - start for r in trainer if "time" in r}  # weights step_N: after step N-1
    result = {
        "recipe": recipe,
        "seed": seed,
        "lr": lr,
        "heldout": {w.name.split("_")[1]: scores[str(w)] for w in weights},
        "seconds_at": {w.name.split("_")[1]: finished.get(int(w.name.split("_")[1])) for w in weights},
        "wall_s": wall,
        "s_per_step": steady_period(trainer),
    }
    done.write_text(json.dumps(result, indent=1))
    return result


def trainer_rows(run_dir: Path) -> list[dict]:
    """The trainer's metrics rows of a run (none if it wrote none)."""
    path = run_dir / "metrics" / "trainer.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def steady_period(trainer: list[dict]) -> float | None:
    """Seconds per step once running: between the trainer's steps after its first 10 (start-up left out)."""
    steady = sorted(r["time"] for r in trainer if "time" in r)[10:]
    return (steady[-1] - steady[0]) / (len(steady) - 1) if len(steady) > 1 else None


def recipe_lrs(spec: str) -> dict[str, float]:
    """{recipe: lr} from 'reward=3e-4,fmixed=5e-4' (exits with a one-line error on a malformed entry)."""
    out = {}
    for part in filter(None, spec.split(",")):
        name, _, value = part.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            sys.exit(f"error: --lr-for entry {part!r} is not RECIPE=LR (e.g. reward=3e-4)")
        if name not in RECIPES:
            sys.exit(f"error: --lr-for names unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
    return out


def reaching(result: dict[str, Any], target: float) -> tuple[int | None, float | None]:
    """The first scored step (and seconds into the run) whose held-out reaches `target`."""
    for step, score in sorted(result["heldout"].items(), key=lambda kv: int(kv[0])):
        if score >= target:
            return int(step), result["seconds_at"].get(step)
    return None, None


# ---- the table ----------------------------------------------------------------------------------------


def _mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _num(x: float | None, width: int, places: int) -> str:
    return f"{x:>{width}.{places}f}" if x is not None else f"{'-':>{width}}"


def table(results: list[dict], steps: list[int], student: float, teacher: float) -> str:
    target = teacher - TEACHER_MARGIN
    head = f"{'recipe':<8} {'seed':>4}  " + "  ".join(f"{'@' + str(s):>6}" for s in [0, *steps])
    head += f"  {'wall s':>7}  {'s/step':>6}  {f'steps to {target:.3f}':>16}  {'s to it':>7}"
    lines = [f"teacher held-out {teacher:.3f}, student {student:.3f} (sampled T=1 exact match)", head, "-" * len(head)]
    for r in results:
        cells = [student] + [r["heldout"].get(str(s)) for s in steps]
        at, secs = reaching(r, target)
        reached = at if at is not None else "not reached"
        lines.append(
            f"{r['recipe']:<8} {r['seed']:>4}  "
            + "  ".join(_num(c, 6, 3) for c in cells)
            + f"  {r['wall_s']:>7.0f}  {_num(r.get('s_per_step'), 6, 2)}  {reached:>16}  {_num(secs, 7, 0)}"
        )
    for recipe in dict.fromkeys(r["recipe"] for r in results):
        rs = [r for r in results if r["recipe"] == recipe]
        means = [student] + [_mean([r["heldout"].get(str(s)) for r in rs]) for s in steps]
        lr = ", ".join(sorted({f"{r['lr']:g}" for r in rs if "lr" in r}))
        lines.append(
            f"{recipe:<8} {'mean':>4}  "
            + "  ".join(_num(c, 6, 3) for c in means)
            + f"  {statistics.fmean(r['wall_s'] for r in rs):>7.0f}  "
            + f"{_num(_mean([r.get('s_per_step') for r in rs]), 6, 2)}  ({len(rs)} seeds, lr {lr or '?'})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default="reward,distill,mixed", help=f"comma-separated, of {', '.join(RECIPES)}")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40, help="RL steps per run")
    ap.add_argument("--eval-every", type=int, default=10, help="held-out of the weights every N steps")
    ap.add_argument("--lr", type=float, default=1e-4, help="RL learning rate (the bench job's)")
    ap.add_argument("--lr-for", default="", help="per-recipe learning rates over --lr: 'reward=3e-4,fmixed=5e-4'")
    ap.add_argument("--rl-args", default="", help="more rl flags for every run ('--trainer.scheduler.warmup-steps 10')")
    ap.add_argument("--student-step", type=int, default=250, help="the student: weights after this many SFT steps")
    ap.add_argument("--teacher-step", type=int, default=400, help="the teacher: weights after this many SFT steps")
    ap.add_argument("--sft-lr", type=float, default=5e-4)
    ap.add_argument("--out", type=Path, default=Path("outputs/distill-bench"))
    ap.add_argument("--port", type=int, default=8400, help="inference port (the teacher: port + 1)")
    args = ap.parse_args(argv)
    recipes = args.recipes.split(",")
    if bad := [r for r in recipes if r not in RECIPES]:
        sys.exit(f"error: unknown recipe {bad[0]!r}; choose from {', '.join(RECIPES)}")
    args.lrs = recipe_lrs(args.lr_for)  # a malformed --lr-for fails before any run
    if args.steps % args.eval_every:
        sys.exit(f"error: --steps {args.steps} is not a multiple of --eval-every {args.eval_every}")
    if not orchestrator_has_teacher() and (skipped := [r for r in recipes if r in NEEDS_TEACHER]):
        log(f"skipping {', '.join(skipped)}: this orchestrator has no `teacher` (on-policy distillation)")
        recipes = [r for r in recipes if r not in NEEDS_TEACHER]
    args.out.mkdir(parents=True, exist_ok=True)
    models = sft_models(args.out, args.student_step, args.teacher_step, args.sft_lr)
    scores = heldout(list(models), args.out / "heldout_models.json")
    student, teacher = (scores[str(p)] for p in models)
    log(f"held-out: student {student:.3f}, teacher {teacher:.3f}")
    results = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for recipe in recipes:
            try:
                r = run_one(recipe, seed, models, args)
            except Exception as e:  # one failed run is reported, not fatal
                log(f"{recipe} seed {seed}: {e}")
                continue
            results.append(r)
            log(f"{recipe} seed {seed}: held-out {r['heldout']} ({r['wall_s']:.0f}s)")
    steps = list(range(args.eval_every, args.steps + 1, args.eval_every))
    text = table(results, steps, student, teacher)
    said = {k: str(v) for k, v in vars(args).items()}
    summary = {"student": student, "teacher": teacher, "results": results, "args": said}
    (args.out / "distill.json").write_text(json.dumps(summary, indent=1))
    print(text)
    print(f"numbers in {args.out / 'distill.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
