"""echo-twice: a two-turn verifiers v1 environment — say a word, then say it again when asked.

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
from collections.abc import Iterator
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any, Literal

import verifiers.v1 as vf
from pydantic import Field, model_validator

USER_TEMPLATE = "Say exactly: {word}"
DEFAULT_FOLLOW_UP = "Say it again."


def random_words(n: int, seed: int, split: str, min_len: int, max_len: int) -> list[str]:
    rng = random.Random(f"echo-twice:{split}:{seed}")
    return ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(min_len, max_len))) for _ in range(n)]


def replies(trace: vf.Trace) -> list[str]:
    """The stripped text of each model reply, in order."""
    return [(m.content or "").strip() for m in trace.assistant_messages]


def both_correct(said: list[str], word: str) -> float:
    return float(len(said) == 2 and all(r == word for r in said))


def similarity(said: list[str], word: str) -> float:
    """Partial credit: each of the two replies' similarity to the word (2*matched / total length), averaged."""
    return sum(SequenceMatcher(None, r, word).ratio() for r in (said + ["", ""])[:2]) / 2


def correct_replies(said: list[str], word: str) -> float:
    """Number of replies equal to the word (0, 1 or 2); logged as a metric."""
    return float(sum(r == word for r in said))


SCORES = {"exact": both_correct, "similarity": similarity}  # the `reward` arg -> the function that is the reward


class EchoData(vf.TaskData):
    answer: str
    """The word."""
    follow_up: str = DEFAULT_FOLLOW_UP
    """The user's second message."""


class EchoTaskConfig(vf.TaskConfig):
    reward: Literal["exact", "similarity"] = "exact"


class EchoTask(vf.Task[EchoData, vf.State, EchoTaskConfig]):
    @vf.reward(weight=1.0)
    async def reward(self, trace: vf.Trace) -> dict[str, float]:
        fn = SCORES[self.config.reward]
        return {fn.__name__: fn(replies(trace), self.data.answer)}

    @vf.metric
    async def scores(self, trace: vf.Trace) -> dict[str, float]:
        fns = [*SCORES.values(), correct_replies]
        return {fn.__name__: fn(replies(trace), self.data.answer) for fn in fns}


class EchoTwiceEnv(vf.SingleAgentEnv):
    """Two model turns with the task's follow-up message in between, then the exchange ends."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as interaction:
            segment = await interaction.turn()
            if not segment.terminated:
                await interaction.turn([vf.UserMessage(content=task.data.follow_up)])


class EchoTwiceConfig(vf.TasksetConfig):
    """The environment's args (`[[orchestrator.env]] args = {...}`)."""

    task: EchoTaskConfig = EchoTaskConfig()
    """Each task's config: `reward` below set it (an env server builds its tasks from it)."""

    split: Literal["train", "eval"] = "train"
    """Which stream of words: "train", or "eval" (held out; `eval` and the orchestrator's evals set it)."""
    num_train_examples: int = Field(1000, ge=1)
    num_eval_examples: int = Field(100, ge=0)
    min_len: int = Field(3, ge=1)
    max_len: int = Field(6, ge=1)
    seed: int = 0
    follow_up: str = DEFAULT_FOLLOW_UP
    reward: Literal["exact", "similarity"] = "exact"
    """"exact" (both replies are the word) or "similarity" (partial credit) is the reward; all are logged."""

    @model_validator(mode="after")
    def _valid(self) -> EchoTwiceConfig:
        if self.max_len < self.min_len:
            raise ValueError(f"need min_len <= max_len, got min_len={self.min_len}, max_len={self.max_len}")
        return self

    @model_validator(mode="after")
    def _task_follows_args(self) -> EchoTwiceConfig:
        self.task = self.task.model_copy(update={"reward": self.reward})
        return self


class EchoTwiceTaskset(vf.Taskset[EchoTask, EchoTwiceConfig]):
    def load(self) -> Iterator[EchoTask]:
        c = self.config
        n = c.num_train_examples if c.split == "train" else c.num_eval_examples
        for i, word in enumerate(random_words(n, c.seed, c.split, c.min_len, c.max_len)):
            data = EchoData(idx=i, prompt=USER_TEMPLATE.format(word=word), answer=word, follow_up=c.follow_up)
            yield EchoTask(data, c.task)


__all__ = ["EchoTwiceEnv", "EchoTwiceTaskset", "EchoTwiceConfig", "EchoTask"]


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
