"""echo-twice: a two-turn verifiers environment — say a word, then say it again when asked.

The user asks the model to say a random word; the environment answers once with a follow-up
("Say it again.") and the rollout ends after the model's second reply. Reward 1.0 when both
replies (stripped) equal the word. Small on purpose: it exercises the multi-turn path of an
inference server and orchestrator (env messages between model turns) with a learnable task.
"""

from __future__ import annotations

import random
import string
from typing import Any

import verifiers as vf
from datasets import Dataset

USER_TEMPLATE = "Say exactly: {word}"
DEFAULT_FOLLOW_UP = "Say it again."


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
) -> EchoTwiceEnv:
    """Say a random lowercase word of `min_len`..`max_len` letters, then repeat it once asked."""
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
    rubric = vf.Rubric(funcs=[both_correct, correct_replies], weights=[1.0, 0.0], parser=parser)
    return EchoTwiceEnv(
        follow_up=follow_up,
        dataset=dataset(num_train_examples, "train"),
        eval_dataset=dataset(num_eval_examples, "eval") if num_eval_examples else None,
        parser=parser,
        rubric=rubric,
    )
