"""Held-out exact match of a reverse-text model: greedy and sampled (T=1) answers to a fixed word list.

One job: score HF model dirs on words that no training stage of the bench job saw, with plain HF
`generate` on this machine. `rl --bench` (through `python -m asyncrl.bench.heldout`, so the launcher
never imports torch) and `benchmarks/trl_grpo.py` score with this same code, so their numbers compare.

Invariants:
- `heldout_words()` is fixed by the job's settings: the env's "eval" stream with every word of the SFT
  data and of the RL train set removed. `validation_words()` (the warm-up's stopping criterion) come
  from their own stream and are disjoint from the held-out words.
- Prompts are the environment's own (`reverse_text.make_prompt`, the job's system prompt and user
  template); an answer is right when its stripped text equals the reversed word.
- Sampling is T=1 with no top-k/top-p (the distribution RL samples from), seeded: reruns repeat.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from asyncrl.config import bench as job


def _strings(n: int, split: str) -> list[str]:
    import reverse_text

    return reverse_text.random_strings(n, job.ENV_SEED, split, job.MIN_LEN, job.MAX_LEN)


def _trained_words() -> set[str]:
    return set(_strings(job.SFT_EXAMPLES, "sft")) | set(_strings(job.TRAIN_EXAMPLES, "train"))


def _fresh(n: int, split: str, exclude: set[str]) -> list[str]:
    words = [w for w in dict.fromkeys(_strings(4 * n, split)) if w not in exclude]
    return words[:n]


def heldout_words(n: int = job.HELDOUT_WORDS) -> list[str]:
    """`n` words from the env's eval stream that are in neither the SFT data nor the RL train set."""
    return _fresh(n, "eval", _trained_words())


def validation_words(n: int = job.HELDOUT_WORDS) -> list[str]:
    """Words for the warm-up's stopping rule: unseen in training and disjoint from the held-out words."""
    return _fresh(n, "bench-validation", _trained_words() | set(heldout_words()))


def prompts(tokenizer, words: list[str]) -> list[str]:
    import reverse_text

    chats = [reverse_text.make_prompt(w, job.SYSTEM_PROMPT, job.USER_TEMPLATE) for w in words]
    return [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]


def _generate(model, tokenizer, texts: list[str], samples: int, greedy: bool) -> list[str]:
    import torch

    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=job.MAX_NEW_TOKENS,
            num_return_sequences=samples,
            pad_token_id=tokenizer.pad_token_id,
            **sampling,
        )
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def exact_match(answers: list[str], words: list[str], samples: int) -> float:
    """Fraction of answers equal to their word reversed (answers come `samples` per word, in order)."""
    targets = [w[::-1] for w in words for _ in range(samples)]
    return sum(a.strip() == t for a, t in zip(answers, targets, strict=True)) / len(targets)


def accuracy(model_dir: str | Path, words: list[str], samples: int = job.SAMPLES_PER_WORD, seed: int = 0) -> dict:
    """Greedy and sampled exact match of the model in `model_dir` on `words`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = prompts(tokenizer, words)
    greedy = exact_match(_generate(model, tokenizer, texts, 1, greedy=True), words, 1)
    torch.manual_seed(seed)
    sampled = exact_match(_generate(model, tokenizer, texts, samples, greedy=False), words, samples)
    return {"words": len(words), "samples_per_word": samples, "greedy": greedy, "sampled": sampled}


def first_reaching(model_dirs: list[str], target: float, score) -> int:
    """Index of the first dir whose `score(dir)` reaches `target` (else the last), by bisection.

    Assumes the score grows along `model_dirs` (checkpoints of one run), so ~log2(n) dirs are scored.
    """
    lo, hi = 0, len(model_dirs) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if score(model_dirs[mid]) >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncrl.bench.heldout", description=__doc__.splitlines()[0])
    ap.add_argument("model_dirs", nargs="+", help="HF model dirs to score")
    ap.add_argument("--validation", action="store_true", help="score the warm-up's validation words instead")
    ap.add_argument("--samples", type=int, default=job.SAMPLES_PER_WORD, help="sampled answers per word")
    ap.add_argument(
        "--first-reaching", type=float, default=None, help="find the first dir whose sampled accuracy reaches this"
    )
    args = ap.parse_args(argv)
    words = validation_words() if args.validation else heldout_words()

    def score(model_dir: str) -> float:
        result = {"model": model_dir, **accuracy(model_dir, words, args.samples)}
        print(json.dumps(result), flush=True)
        return result["sampled"]

    if args.first_reaching is None:
        for model_dir in args.model_dirs:
            score(model_dir)
    else:
        chosen = args.model_dirs[first_reaching(args.model_dirs, args.first_reaching, score)]
        print(json.dumps({"chosen": chosen}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
