"""echo-twice: a two-turn verifiers environment — say a word, then say it again when asked.

The user asks the model to say a random word; the environment answers once with a follow-up
("Say it again.") and the rollout ends after the model's second reply. Reward 1.0 when both
replies (stripped) equal the word. Small on purpose: it exercises the multi-turn path of an
inference server and orchestrator (env messages between model turns) with a learnable task.
SFT warm-up data in the same format: `python -m echo_twice --sft-out FILE --n N` (words from their own
random stream, so not the RL prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import sys
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any

import verifiers as vf
from datasets import Dataset

USER_TEMPLATE = "Say exactly: {word}"
DEFAULT_FOLLOW_UP = "Say it again."
REWARD_WEIGHTS = {"exact": [1.0, 0.0, 0.0], "similarity": [0.0, 1.0, 0.0]}  # over both_correct, similarity, replies


def random_words(n: int, seed: int, split: str, min_len: int, max_len: int) -> list[str]:
    rng = random.Random(f"echo-twice:{split}:{seed}")
    return ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(min_len, max_len))) for _ in range(n)]


def _replies(parser: vf.Parser, completion: vf.Messages) -> list[str]:
    """The stripped text of each assistant message, in order."""
    assistant = parser.get_assistant_messages(completion)
    return [(parser.parse_answer([m]) or "").strip() for m in assistant]


def both_correct(parser: vf.Parser, completion: vf.Messages, answer: str, **kwargs: Any) -> float:
    replies = _replies(parser, completion)
    return float(len(replies) == 2 and all(r == answer for r in replies))


def similarity(parser: vf.Parser, completion: vf.Messages, answer: str, **kwargs: Any) -> float:
    """Partial credit: each of the two replies' similarity to the word (2*matched / total length), averaged."""
    replies = (_replies(parser, completion) + ["", ""])[:2]
    return sum(SequenceMatcher(None, r, answer).ratio() for r in replies) / 2


def correct_replies(parser: vf.Parser, completion: vf.Messages, answer: str, **kwargs: Any) -> float:
    """Number of replies equal to the word (0, 1 or 2); logged as a metric."""
    return float(sum(r == answer for r in _replies(parser, completion)))


class EchoTwiceEnv(vf.MultiTurnEnv):
    """Two model turns with one fixed follow-up message in between."""

    def __init__(self, follow_up: str = DEFAULT_FOLLOW_UP, **kwargs: Any):
        super().__init__(max_turns=2, **kwargs)
        self.follow_up = follow_up

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: Any) -> vf.Messages:
        return [vf.UserMessage(content=self.follow_up)]


def load_environment(
    num_train_examples: int = 1000,
    num_eval_examples: int = 100,
    min_len: int = 3,
    max_len: int = 6,
    seed: int = 0,
    system_prompt: str | None = None,
    follow_up: str = DEFAULT_FOLLOW_UP,
    reward: str = "exact",
) -> EchoTwiceEnv:
    """Say a random lowercase word of `min_len`..`max_len` letters, then repeat it once asked.

    `reward`: "exact" (1 when both replies are the word, the default) or "similarity" (partial credit: the
    replies' mean similarity to the word); all three are logged.
    """
    if reward not in REWARD_WEIGHTS:
        raise ValueError(f"reward must be one of {sorted(REWARD_WEIGHTS)}, got {reward!r}")
    if min_len < 1 or max_len < min_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if num_train_examples < 1 or num_eval_examples < 0:
        raise ValueError("need num_train_examples >= 1 and num_eval_examples >= 0 (0: no eval set)")

    system = [{"role": "system", "content": system_prompt}] if system_prompt else []

    def dataset(n: int, split: str) -> Dataset:
        words = random_words(n, seed, split, min_len, max_len)
        return Dataset.from_list(
            [
                {"prompt": [*system, {"role": "user", "content": USER_TEMPLATE.format(word=w)}], "answer": w}
                for w in words
            ]
        )

    parser = vf.Parser()
    rubric = vf.Rubric(funcs=[both_correct, similarity, correct_replies], weights=REWARD_WEIGHTS[reward], parser=parser)
    return EchoTwiceEnv(
        follow_up=follow_up,
        dataset=dataset(num_train_examples, "train"),
        eval_dataset=dataset(num_eval_examples, "eval") if num_eval_examples else None,
        parser=parser,
        rubric=rubric,
    )


def sft_examples(n: int, seed: int = 0, min_len: int = 3, max_len: int = 6) -> list[dict[str, Any]]:
    """`n` prompt/completion rows, alternately the first turn and the second (after the follow-up)."""
    rows = []
    for i, word in enumerate(random_words(n, seed, "sft", min_len, max_len)):
        ask, said = {"role": "user", "content": USER_TEMPLATE.format(word=word)}, {"role": "assistant", "content": word}
        prompt = [ask] if i % 2 == 0 else [ask, said, {"role": "user", "content": DEFAULT_FOLLOW_UP}]
        rows.append({"prompt": prompt, "completion": [said]})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m echo_twice", description="Write echo-twice SFT data (JSONL).")
    ap.add_argument("--sft-out", required=True, help="output .jsonl file")
    ap.add_argument("--n", type=int, default=4000, help="number of examples")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.n < 1:
        print(f"error: --n must be >= 1, got {args.n}", file=sys.stderr)
        return 2
    out = Path(args.sft_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in sft_examples(args.n, args.seed)))
    os.replace(tmp, out)
    print(f"wrote {args.n} examples to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
