"""reverse-text: a single-turn verifiers v1 taskset where the model reverses a random string.

Data is generated locally from a seed (no downloads); the `split` arg picks the train or the held-out
eval stream. The reward is the character-level similarity (difflib's matching-blocks ratio, in [0, 1])
between the stripped reply and the reversed string, `lcs_reward`; `exact_match` is logged beside it
(`reward="exact"` makes exact match the reward). The same prompt builder feeds the SFT warm-up data
(`sft_examples`, or `python -m reverse_text --sft-out FILE --n N`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import sys
import tempfile
from collections.abc import Iterator
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any, Literal

import verifiers.v1 as vf
from pydantic import Field, model_validator

USER_TEMPLATE = "Reverse the text: {text}"
DEFAULT_ALPHABET = string.ascii_lowercase


def _check_args(min_len: int, max_len: int, alphabet: str, user_template: str = USER_TEMPLATE) -> None:
    if "{text}" not in user_template:
        raise ValueError(f"user_template must contain {{text}}, got {user_template!r}")
    if min_len < 1:
        raise ValueError(f"min_len must be >= 1, got {min_len}")
    if max_len < min_len:
        raise ValueError(f"max_len ({max_len}) must be >= min_len ({min_len})")
    if not alphabet:
        raise ValueError("alphabet must not be empty")


def random_strings(
    n: int, seed: int, split: str, min_len: int, max_len: int, alphabet: str = DEFAULT_ALPHABET
) -> list[str]:
    """`n` random strings; `split` names an independent stream so train/eval/sft differ."""
    # A str seed is hashed with SHA-512 by `random`, so it is stable across runs and machines.
    rng = random.Random(f"reverse-text:{split}:{seed}")
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len))) for _ in range(n)]


def make_prompt(
    text: str, system_prompt: str | None = None, user_template: str = USER_TEMPLATE
) -> list[dict[str, str]]:
    """The chat prompt for one example (shared by the environment and the SFT data)."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": user_template.format(text=text)})
    return messages


def _rows(
    n: int,
    seed: int,
    split: str,
    min_len: int,
    max_len: int,
    alphabet: str,
    system_prompt: str | None,
    user_template: str = USER_TEMPLATE,
) -> list[dict[str, Any]]:
    texts = random_strings(n, seed, split, min_len, max_len, alphabet)
    return [{"prompt": make_prompt(t, system_prompt, user_template), "answer": t[::-1]} for t in texts]


def lcs_reward(reply: str, answer: str) -> float:
    """Similarity of the stripped reply to the reversed string: 2*matched / (len(a) + len(b))."""
    return SequenceMatcher(None, reply.strip(), answer).ratio()


def exact_match(reply: str, answer: str) -> float:
    return float(reply.strip() == answer)


SCORES = {"similarity": lcs_reward, "exact": exact_match}  # the `reward` arg -> the function that is the reward


class ReverseData(vf.TaskData):
    answer: str
    """The string reversed."""


class ReverseTaskConfig(vf.TaskConfig):
    reward: Literal["similarity", "exact"] = "similarity"


class ReverseTask(vf.Task[ReverseData, vf.State, ReverseTaskConfig]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def reward(self, trace: vf.Trace) -> dict[str, float]:
        fn = SCORES[self.config.reward]
        return {fn.__name__: fn(trace.last_reply, self.data.answer)}

    @vf.metric
    async def scores(self, trace: vf.Trace) -> dict[str, float]:
        return {fn.__name__: fn(trace.last_reply, self.data.answer) for fn in SCORES.values()}


class ReverseTextConfig(vf.TasksetConfig):
    """The environment's args (`[[orchestrator.env]] args = {...}`)."""

    task: ReverseTaskConfig = ReverseTaskConfig()
    """Each task's config: `reward` below set it (an env server builds its tasks from it)."""

    split: Literal["train", "eval"] = "train"
    """Which stream of strings: "train", or "eval" (held out; `eval` and the orchestrator's evals set it)."""
    num_train_examples: int = Field(2000, ge=1)
    num_eval_examples: int = Field(200, ge=0)
    min_len: int = Field(5, ge=1)
    max_len: int = Field(8, ge=1)
    seed: int = 0
    alphabet: str = Field(DEFAULT_ALPHABET, min_length=1)
    user_template: str = USER_TEMPLATE
    """The user message; `{text}` is the string ("{text}" alone sends the bare string)."""
    instructions: str | None = None
    """A system prompt's text (verifiers' own `system_prompt` arg names a file holding one)."""
    reward: Literal["similarity", "exact"] = "similarity"
    """"similarity" (lcs_reward) or "exact" (exact_match) is the reward; both are logged."""

    @model_validator(mode="after")
    def _valid(self) -> ReverseTextConfig:
        _check_args(self.min_len, self.max_len, self.alphabet, self.user_template)
        return self

    @model_validator(mode="after")
    def _task_follows_args(self) -> ReverseTextConfig:
        self.task = self.task.model_copy(update={"reward": self.reward})
        return self


class ReverseTextTaskset(vf.Taskset[ReverseTask, ReverseTextConfig]):
    def load(self) -> Iterator[ReverseTask]:
        c = self.config
        n = c.num_train_examples if c.split == "train" else c.num_eval_examples
        texts = random_strings(n, c.seed, c.split, c.min_len, c.max_len, c.alphabet)
        for i, text in enumerate(texts):
            prompt = c.user_template.format(text=text)
            data = ReverseData(idx=i, prompt=prompt, system_prompt=c.instructions, answer=text[::-1])
            yield ReverseTask(data, c.task)


__all__ = ["ReverseTextTaskset", "ReverseTextConfig", "ReverseTask"]


def sft_examples(
    n: int,
    seed: int = 0,
    min_len: int = 5,
    max_len: int = 8,
    system_prompt: str | None = None,
    alphabet: str = DEFAULT_ALPHABET,
    user_template: str = USER_TEMPLATE,
) -> list[dict[str, Any]]:
    """`n` prompt/completion rows in the environment's exact prompt format.

    They come from their own random stream ("sft"), so they are not the RL train prompts.
    """
    _check_args(min_len, max_len, alphabet, user_template)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rows = _rows(n, seed, "sft", min_len, max_len, alphabet, system_prompt, user_template)
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
        prog="python -m reverse_text",
        description="Write reverse-text SFT data (prompt/completion JSONL).",
    )
    ap.add_argument("--sft-out", required=True, help="output .jsonl file")
    ap.add_argument("--n", type=int, default=10000, help="number of examples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-len", type=int, default=5)
    ap.add_argument("--max-len", type=int, default=8)
    ap.add_argument("--system-prompt", default=None)
    ap.add_argument("--alphabet", default=DEFAULT_ALPHABET)
    ap.add_argument("--user-template", default=USER_TEMPLATE, help="user message; {text} is the string")
    args = ap.parse_args(argv)
    try:
        rows = sft_examples(
            args.n, args.seed, args.min_len, args.max_len, args.system_prompt, args.alphabet, args.user_template
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = write_jsonl(args.sft_out, rows)
    print(f"wrote {len(rows)} examples to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
