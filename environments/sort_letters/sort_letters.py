"""sort-letters: a single-turn verifiers environment where the model sorts a random string's letters.

Data is generated locally from a seed (no downloads). The reward is the character-level
similarity (difflib's matching-blocks ratio, in [0, 1]) between the stripped answer and the
letters sorted alphabetically; `exact_match` is logged with weight 0 (`reward="exact"` swaps the
weights: exact match is then the reward). The train, eval and SFT strings come from independent
random streams of the same seed ("train", "eval", "sft"); they are not deduplicated against each
other, so a short string may occur in more than one of them by chance. The same prompt builder
feeds the SFT warm-up data (`sft_examples`, or `python -m sort_letters --sft-out FILE --n N`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import sys
import tempfile
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any

import verifiers as vf
from datasets import Dataset

USER_TEMPLATE = "Sort the letters: {text}"
ALPHABET = string.ascii_lowercase
REWARD_WEIGHTS = {"similarity": [1.0, 0.0], "exact": [0.0, 1.0]}  # weights of [similarity, exact_match]


def _check_args(min_len: int, max_len: int) -> None:
    if min_len < 1:
        raise ValueError(f"min_len must be >= 1, got {min_len}")
    if max_len < min_len:
        raise ValueError(f"max_len ({max_len}) must be >= min_len ({min_len})")


def random_strings(n: int, seed: int, split: str, min_len: int, max_len: int) -> list[str]:
    """`n` random lowercase strings; `split` names an independent stream so train/eval/sft differ."""
    # A str seed is hashed with SHA-512 by `random`, so it is stable across runs and machines.
    rng = random.Random(f"sort-letters:{split}:{seed}")
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(min_len, max_len))) for _ in range(n)]


def sorted_letters(text: str) -> str:
    """The target answer: the letters of `text` in alphabetical order."""
    return "".join(sorted(text))


def make_prompt(text: str, system_prompt: str | None = None) -> list[dict[str, str]]:
    """The chat prompt for one example (shared by the environment and the SFT data)."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": USER_TEMPLATE.format(text=text)})
    return messages


def _rows(n: int, seed: int, split: str, min_len: int, max_len: int, system_prompt: str | None) -> list[dict[str, Any]]:
    texts = random_strings(n, seed, split, min_len, max_len)
    return [{"prompt": make_prompt(t, system_prompt), "answer": sorted_letters(t)} for t in texts]


def _answer_text(parser: vf.Parser, completion: vf.Messages) -> str:
    return (parser.parse_answer(completion) or "").strip()


def similarity(parser: vf.Parser, completion: vf.Messages, answer: str, **kwargs: Any) -> float:
    """Similarity of the answer to the sorted string: 2*matched / (len(a) + len(b))."""
    return SequenceMatcher(None, _answer_text(parser, completion), answer).ratio()


def exact_match(parser: vf.Parser, completion: vf.Messages, answer: str, **kwargs: Any) -> float:
    return float(_answer_text(parser, completion) == answer)


def load_environment(
    num_train_examples: int = 2000,
    num_eval_examples: int = 200,
    min_len: int = 5,
    max_len: int = 8,
    seed: int = 0,
    system_prompt: str | None = None,
    reward: str = "similarity",
) -> vf.SingleTurnEnv:
    """Sort the letters of a random lowercase string of `min_len`..`max_len` letters.

    `eval_dataset` is the held-out "eval" stream (none when `num_eval_examples` is 0); it is
    independent of the "train" stream, not deduplicated against it.
    `reward`: "similarity" (the default) or "exact" (exact_match); both are logged.
    """
    _check_args(min_len, max_len)
    if num_train_examples < 1 or num_eval_examples < 0:
        raise ValueError("need num_train_examples >= 1 and num_eval_examples >= 0 (0: no eval set)")
    if reward not in REWARD_WEIGHTS:
        raise ValueError(f"reward must be one of {sorted(REWARD_WEIGHTS)}, got {reward!r}")
    common = dict(seed=seed, min_len=min_len, max_len=max_len, system_prompt=system_prompt)
    dataset = Dataset.from_list(_rows(num_train_examples, split="train", **common))
    eval_rows = _rows(num_eval_examples, split="eval", **common)
    eval_dataset = Dataset.from_list(eval_rows) if eval_rows else None
    parser = vf.Parser()
    rubric = vf.Rubric(funcs=[similarity, exact_match], weights=REWARD_WEIGHTS[reward], parser=parser)
    return vf.SingleTurnEnv(dataset=dataset, eval_dataset=eval_dataset, parser=parser, rubric=rubric)


def sft_examples(
    n: int, seed: int = 0, min_len: int = 5, max_len: int = 8, system_prompt: str | None = None
) -> list[dict[str, Any]]:
    """`n` prompt/completion rows in the environment's exact prompt format.

    They come from their own random stream ("sft"), so they are not the RL train prompts.
    """
    _check_args(min_len, max_len)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rows = _rows(n, seed, "sft", min_len, max_len, system_prompt)
    return [{"prompt": r["prompt"], "completion": [{"role": "assistant", "content": r["answer"]}]} for r in rows]


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Write rows as JSON lines atomically (temp file in the same folder, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m sort_letters",
        description="Write sort-letters SFT data (prompt/completion JSONL).",
    )
    ap.add_argument("--sft-out", required=True, help="output .jsonl file")
    ap.add_argument("--n", type=int, default=10000, help="number of examples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-len", type=int, default=5)
    ap.add_argument("--max-len", type=int, default=8)
    ap.add_argument("--system-prompt", default=None)
    args = ap.parse_args(argv)
    try:
        rows = sft_examples(args.n, args.seed, args.min_len, args.max_len, args.system_prompt)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = write_jsonl(args.sft_out, rows)
    print(f"wrote {len(rows)} examples to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
