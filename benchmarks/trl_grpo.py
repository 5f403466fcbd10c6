"""`rl --bench`'s job with TRL's GRPOTrainer, from the same warmed checkpoint: the back-to-back comparison.

TRL is not an asyncrl dependency; install it into the env you run this with:

    .venv/bin/pip install trl          # tested with trl 1.16.0 (torch 2.13 CPU, transformers 5.23)
    PYTHONPATH=src .venv/bin/python benchmarks/trl_grpo.py [--max-steps 80] [--model DIR] [--output-dir DIR]

Same job as `rl --bench` (asyncrl.config.bench): the tiny Qwen3 SFT-warmed by `rl --bench` (reused from
`outputs/bench/warmup/<key>/model`, warmed here first if missing), reverse a 5-8 letter word with the
same system prompt, exact-match reward, 16 prompts x 8 rollouts, 16 new tokens, T=1, AdamW lr 1e-4,
weight decay 0, grad clip 1, constant schedule, 80 steps. TRL's own defaults stay for the rest
(loss_type "dapo", rewards scaled by the group std, beta 0, one iteration per batch); TRL is
synchronous, so there is no async level. Generation is HF `generate` in the training process.

Timings per step: generation = TRL's `_generate_and_score_completions` (generate + reward), training =
the rest of the step (forward, backward, optimizer, logging), s/step = the gap between consecutive
step ends. Held-out accuracy uses asyncrl.bench.heldout, the same code and words as `rl --bench`.
Writes `{output_dir}/bench_trl.json` (default outputs/bench-trl).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

try:
    import trl
except ImportError:
    sys.exit("benchmarks/trl_grpo.py needs TRL, which asyncrl does not depend on: pip install trl (tested: 1.16.0)")

from asyncrl.bench import heldout, summary  # noqa: E402
from asyncrl.bench.warmup import ensure_warm_model  # noqa: E402
from asyncrl.config import bench as job  # noqa: E402


def dataset():
    """The RL prompts: the env's train stream, as chat prompts with the answer alongside."""
    import reverse_text
    from datasets import Dataset

    words = reverse_text.random_strings(job.TRAIN_EXAMPLES, job.ENV_SEED, "train", job.MIN_LEN, job.MAX_LEN)
    rows = [
        {"prompt": reverse_text.make_prompt(w, job.SYSTEM_PROMPT, job.USER_TEMPLATE), "answer": w[::-1]} for w in words
    ]
    return Dataset.from_list(rows)


def exact_match(completions, answer, **kwargs) -> list[float]:
    return [float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer)]


class TimedGRPOTrainer(trl.GRPOTrainer):
    """GRPOTrainer that adds up the seconds spent generating and scoring, per optimizer step."""

    generation_s = 0.0

    def _generate_and_score_completions(self, inputs):
        start = time.perf_counter()
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self.generation_s += time.perf_counter() - start


class StepClock(__import__("transformers").TrainerCallback):
    """One trainer row and one generation row per step, in the shape of asyncrl's metrics files."""

    def __init__(self, trainer_ref: list):
        self.trainer_ref, self.trainer_rows, self.gen_rows = trainer_ref, [], []
        self.begin = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin = time.perf_counter()
        self.trainer_ref[0].generation_s = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        step, gen = state.global_step - 1, self.trainer_ref[0].generation_s
        self.trainer_rows.append(
            {"step": step, "time": time.time(), "step_time_s": time.perf_counter() - self.begin - gen}
        )
        self.gen_rows.append({"step": step, "time/rollouts": gen})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs and self.gen_rows:
            self.gen_rows[-1]["reward/mean"] = logs["reward"]


def grpo_config(out: Path, max_steps: int, seed: int = 0):
    return trl.GRPOConfig(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=job.PROMPTS * job.ROLLOUTS,
        gradient_accumulation_steps=1,
        num_generations=job.ROLLOUTS,
        max_completion_length=job.MAX_NEW_TOKENS,
        temperature=1.0,
        learning_rate=job.LR,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=seed,
        disable_tqdm=True,
    )


def train(model_dir: Path, out: Path, max_steps: int, seed: int = 0) -> tuple[dict, float]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    ref: list = [None]
    clock = StepClock(ref)
    trainer = TimedGRPOTrainer(
        model=str(model_dir),
        reward_funcs=exact_match,
        args=grpo_config(out, max_steps, seed),
        train_dataset=dataset(),
        processing_class=tokenizer,
        callbacks=[clock],
    )
    ref[0] = trainer
    start = time.time()
    trainer.train()
    wall = time.time() - start
    trainer.save_model(str(out / "final"))
    tokenizer.save_pretrained(out / "final")
    return summary.summarize(clock.gen_rows, clock.trainer_rows, job.WARMUP_STEPS), wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="start model (default: rl --bench's warmed model)")
    ap.add_argument("--max-steps", type=int, default=job.STEPS)
    ap.add_argument("--output-dir", type=Path, default=Path("outputs/bench-trl"))
    ap.add_argument("--seed", type=int, default=0, help="TRL's seed (sampling, data order)")
    args = ap.parse_args(argv)
    model = args.model or ensure_warm_model(job.warm_dir(job.DEFAULT_OUTPUT_DIR)).path
    words = heldout.heldout_words()
    before = heldout.accuracy(model, words)
    load_start = list(os.getloadavg())
    numbers, wall = train(model, args.output_dir, args.max_steps, args.seed)
    after = heldout.accuracy(args.output_dir / "final", words)
    result = {**numbers, "wall_s": wall, "heldout": {"before": before, "after": after}, "model": str(model)}
    result["machine"] = {"cpus": os.cpu_count(), "load_avg_start": load_start, "load_avg_end": list(os.getloadavg())}
    result["trl_version"] = trl.__version__
    path = args.output_dir / "bench_trl.json"
    path.write_text(json.dumps(result, indent=1))
    title = f"TRL {trl.__version__} GRPOTrainer: {numbers['steps']} steps, {wall:.0f}s wall"
    title += f", load avg {load_start[0]:.1f} at start, {result['machine']['load_avg_end'][0]:.1f} at the end"
    print(summary.format_table(title, result))
    print(summary.format_heldout(before, after))
    print(f"numbers in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
