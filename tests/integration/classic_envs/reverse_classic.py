"""reverse-classic: the reverse-text task as a classic verifiers environment (verifiers < 0.4), for the tests
that check classic environments still load, roll out and train where that verifiers is installed.

It is the classic `reverse-text` asyncrl shipped before its port to verifiers v1: the same prompts (so the
demo's warm-up SFT data fits it), `vf.SingleTurnEnv` with a `vf.Rubric` of lcs_reward and exact_match.
"""

from __future__ import annotations

import random
import string
from difflib import SequenceMatcher
from typing import Any

import verifiers as vf
from datasets import Dataset

USER_TEMPLATE = "Reverse the text: {text}"
DEFAULT_ALPHABET = string.ascii_lowercase
REWARD_WEIGHTS = {"similarity": [1.0, 0.0], "exact": [0.0, 1.0]}  # weights of [lcs_reward, exact_match]


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


def _answer_text(parser: vf.Parser, completion: vf.Messages) -> str:
    return (parser.parse_answer(completion) or "").strip()


def lcs_reward(parser: vf.Parser, completion: vf.Messages, answer: str, **kwargs: Any) -> float:
    """Similarity of the answer to the reversed string: 2*matched / (len(a) + len(b))."""
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
    alphabet: str = DEFAULT_ALPHABET,
    user_template: str = USER_TEMPLATE,
    reward: str = "similarity",
) -> vf.SingleTurnEnv:
    """Reverse a random string of `min_len`..`max_len` characters drawn from `alphabet`.

    `reward`: "similarity" (lcs_reward, the default) or "exact" (exact_match); both are logged.
    """
    _check_args(min_len, max_len, alphabet, user_template)
    if num_train_examples < 1 or num_eval_examples < 0:
        raise ValueError("need num_train_examples >= 1 and num_eval_examples >= 0 (0: no eval set)")
    if reward not in REWARD_WEIGHTS:
        raise ValueError(f"reward must be one of {sorted(REWARD_WEIGHTS)}, got {reward!r}")
    common = dict(
        seed=seed,
        min_len=min_len,
        max_len=max_len,
        alphabet=alphabet,
        system_prompt=system_prompt,
        user_template=user_template,
    )
    dataset = Dataset.from_list(_rows(num_train_examples, split="train", **common))
    eval_rows = _rows(num_eval_examples, split="eval", **common)
    eval_dataset = Dataset.from_list(eval_rows) if eval_rows else None
    parser = vf.Parser()
    rubric = vf.Rubric(funcs=[lcs_reward, exact_match], weights=REWARD_WEIGHTS[reward], parser=parser)
    return vf.SingleTurnEnv(dataset=dataset, eval_dataset=eval_dataset, parser=parser, rubric=rubric)
