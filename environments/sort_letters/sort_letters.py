"""sort-letters: a single-turn verifiers v1 taskset where the model sorts a random string's letters.

Data is generated locally from a seed (no downloads). The reward is the character-level
similarity (difflib's matching-blocks ratio, in [0, 1]) between the stripped reply and the
letters sorted alphabetically; `exact_match` is logged beside it (`reward="exact"` makes exact match
the reward); the `split` arg picks the train or the held-out eval stream. The train, eval and SFT
strings come from independent random streams of the same seed ("train", "eval", "sft"); they are not
deduplicated against each other, so a short string may occur in more than one of them by chance. The same prompt builder
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
from collections.abc import Iterator
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any, Literal

import verifiers.v1 as vf
from pydantic import Field, model_validator

USER_TEMPLATE = "Sort the letters: {text}"
ALPHABET = string.ascii_lowercase


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


def similarity(reply: str, answer: str) -> float:
    """Similarity of the stripped reply to the sorted string: 2*matched / (len(a) + len(b))."""
    return SequenceMatcher(None, reply.strip(), answer).ratio()


def exact_match(reply: str, answer: str) -> float:
    return float(reply.strip() == answer)


SCORES = {"similarity": similarity, "exact": exact_match}  # the `reward` arg -> the function that is the reward


class SortData(vf.TaskData):
    answer: str
    """The letters sorted."""


class SortTaskConfig(vf.TaskConfig):
    reward: Literal["similarity", "exact"] = "similarity"


class SortTask(vf.Task[SortData, vf.State, SortTaskConfig]):
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


class SortLettersConfig(vf.TasksetConfig):
    """The environment's args (`[[orchestrator.env]] args = {...}`)."""

    task: SortTaskConfig = SortTaskConfig()
    """Each task's config: `reward` below set it (an env server builds its tasks from it)."""

    split: Literal["train", "eval"] = "train"
    """Which stream of strings: "train", or "eval" (held out; `eval` and the orchestrator's evals set it)."""
    num_train_examples: int = Field(2000, ge=1)
    num_eval_examples: int = Field(200, ge=0)
    min_len: int = Field(5, ge=1)
    max_len: int = Field(8, ge=1)
    seed: int = 0
    reward: Literal["similarity", "exact"] = "similarity"
    """"similarity" or "exact" (exact_match) is the reward; both are logged."""
    instructions: str | None = None
    """A system prompt's text (verifiers' own `system_prompt` arg names a file holding one)."""

    @model_validator(mode="after")
    def _valid(self) -> SortLettersConfig:
        _check_args(self.min_len, self.max_len)
        return self

    @model_validator(mode="after")
    def _task_follows_args(self) -> SortLettersConfig:
        self.task = self.task.model_copy(update={"reward": self.reward})
        return self


class SortLettersTaskset(vf.Taskset[SortTask, SortLettersConfig]):
    def load(self) -> Iterator[SortTask]:
        c = self.config
        n = c.num_train_examples if c.split == "train" else c.num_eval_examples
        for i, text in enumerate(random_strings(n, c.seed, c.split, c.min_len, c.max_len)):
            prompt = USER_TEMPLATE.format(text=text)
            data = SortData(idx=i, prompt=prompt, system_prompt=c.instructions, answer=sorted_letters(text))
            yield SortTask(data, c.task)


__all__ = ["SortLettersTaskset", "SortLettersConfig", "SortTask"]


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
