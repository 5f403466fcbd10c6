"""tool-calc: a verifiers ToolEnv where the model answers arithmetic with a calculator tool.

Problems such as "What is 37 * 12 + 5?" are generated from a seed (no downloads). The tool
`calculate(expression)` evaluates arithmetic only: the expression is parsed with `ast` and
walked node by node, so names, calls, attributes and anything else that is not a number or an
arithmetic operator are refused. The reward is 1.0 when the last number in the final assistant
message equals the result; ToolEnv's monitor rubric reports `total_tool_calls`/`calculate_calls`.

Two partial-credit scores are always reported as metrics: `expression_similarity` (how close the
first tool call's expression is to the question's) and `answer_similarity` (how close the final
number is to the result), each a character similarity in [0, 1]. With `shaping` = s > 0 the reward
is (1 - s) * correct + s/2 * (the two similarities), still in [0, 1]: a small model that rarely gets
an answer exactly right then still sees a gradient.

SFT warm-up data shows the intended trajectory (call the tool with the question's expression, then
answer with its result): `sft_examples`, or `python -m tool_calc --sft-out FILE --n N`.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import math
import operator
import os
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import verifiers as vf
from datasets import Dataset

DEFAULT_SYSTEM_PROMPT = "Use the calculate tool for arithmetic, then reply with the final answer as a number."
MAX_EXPRESSION_CHARS = 200
MAX_RESULT_BITS = 256  # refuse results beyond ~1e77 so a short expression cannot eat the CPU

_BIN_OPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPS: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


def _bits(x: int | float) -> float:
    return abs(x).bit_length() if isinstance(x, int) else math.log2(abs(x) + 1)


def _check_size(x: int | float) -> int | float:
    if isinstance(x, float) and not math.isfinite(x):
        raise ValueError("result is not a finite number")
    if _bits(x) > MAX_RESULT_BITS:
        raise ValueError("result is too large")
    return x


def _eval_node(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ValueError(f"unsupported constant {node.value!r}: only numbers are allowed")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _UNARY_OPS[type(node.op)](_eval_node(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN_OPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        is_pow = isinstance(node.op, ast.Pow)
        if is_pow and left != 0 and math.log2(abs(left)) * right > MAX_RESULT_BITS:
            raise ValueError("result is too large")  # checked before computing a huge power
        result = _BIN_OPS[type(node.op)](left, right)
        if isinstance(result, complex):
            raise ValueError("result is not a real number")
        return _check_size(result)
    raise ValueError(f"unsupported syntax {type(node).__name__}: use numbers, + - * / // % ** and parentheses")


def safe_eval(expression: str) -> int | float:
    """Evaluate an arithmetic expression without executing code; raises ValueError if refused."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse expression: {e.msg}") from None
    try:
        return _eval_node(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("result is too large") from None


def format_number(x: int | float) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return str(x) if isinstance(x, int) else format(x, ".12g")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: Arithmetic using numbers, + - * / // % ** and parentheses, e.g. "37 * 12 + 5".
    """
    return format_number(safe_eval(expression))


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number in `text` (thousands separators like 1,234 allowed), or None."""
    matches = _NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))
    return float(matches[-1]) if matches else None


def _field(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def _final_answer(parser: vf.Parser, completion: vf.Messages) -> float | None:
    assistant = parser.get_assistant_messages(completion)
    if not assistant:
        return None
    if _field(assistant[-1], "tool_calls"):
        return None  # the rollout ended while the model was still calling tools
    return last_number(parser.parse_answer(completion) or "")


def correct_answer(parser: vf.Parser, completion: vf.Messages, answer: str, **kwargs: Any) -> float:
    value = _final_answer(parser, completion)
    return float(value is not None and math.isclose(value, float(answer), abs_tol=1e-6))


def _similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a.replace(" ", ""), b.replace(" ", "")).ratio()


def _first_expression(completion: vf.Messages) -> str | None:
    """The `expression` argument of the first calculate call, whatever form the messages take."""
    for message in completion:
        if _field(message, "role") != "assistant":
            continue
        for call in _field(message, "tool_calls") or []:
            if isinstance(call, str):
                call = json.loads(call)
            call = _field(call, "function") or call
            try:
                expression = json.loads(_field(call, "arguments") or "{}").get("expression")
            except (json.JSONDecodeError, AttributeError):
                continue
            if isinstance(expression, str):
                return expression
    return None


def expression_similarity(prompt: vf.Messages, completion: vf.Messages, **kwargs: Any) -> float:
    expression = _first_expression(completion)
    question = str(_field(prompt[-1], "content") or "").removeprefix("What is ").removesuffix("?")
    return 0.0 if expression is None else _similarity(expression, question)


def answer_similarity(parser: vf.Parser, completion: vf.Messages, answer: str, **kwargs: Any) -> float:
    value = _final_answer(parser, completion)
    return 0.0 if value is None else _similarity(format_number(value), answer)


def make_problems(n: int, seed: int, split: str, num_terms: int, max_value: int) -> list[tuple[str, str]]:
    """`n` (expression, result) pairs of `num_terms` integers in [1, max_value] joined by + - *."""
    rng = random.Random(f"tool-calc:{split}:{seed}")
    problems = []
    for _ in range(n):
        expr = str(rng.randint(1, max_value))
        for _ in range(num_terms - 1):
            expr += f" {rng.choice('+-*')} {rng.randint(1, max_value)}"
        problems.append((expr, format_number(safe_eval(expr))))
    return problems


def _dataset(n: int, seed: int, split: str, num_terms: int, max_value: int, system_prompt: str | None) -> Dataset:
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    rows = [
        {"prompt": [*system, {"role": "user", "content": f"What is {expr}?"}], "answer": result}
        for expr, result in make_problems(n, seed, split, num_terms, max_value)
    ]
    return Dataset.from_list(rows)


def load_environment(
    num_train_examples: int = 1000,
    num_eval_examples: int = 100,
    num_terms: int = 3,
    max_value: int = 50,
    seed: int = 0,
    max_turns: int = 3,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    shaping: float = 0.0,
) -> vf.ToolEnv:
    """Arithmetic questions answered with the `calculate` tool within `max_turns` model turns.

    `shaping` in [0, 1] moves that share of the reward to the two partial-credit scores.
    """
    if num_terms < 2:
        raise ValueError(f"num_terms must be >= 2, got {num_terms}")
    if max_value < 1:
        raise ValueError(f"max_value must be >= 1, got {max_value}")
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if not 0.0 <= shaping <= 1.0:
        raise ValueError(f"shaping must be in [0, 1], got {shaping}")
    if num_train_examples < 1 or num_eval_examples < 0:
        raise ValueError("need num_train_examples >= 1 and num_eval_examples >= 0 (0: no eval set)")
    common = dict(seed=seed, num_terms=num_terms, max_value=max_value, system_prompt=system_prompt)
    parser = vf.Parser()
    rubric = vf.Rubric(
        funcs=[correct_answer, expression_similarity, answer_similarity],
        weights=[1.0 - shaping, shaping / 2, shaping / 2],
        parser=parser,
    )
    eval_ds = _dataset(num_eval_examples, split="eval", **common) if num_eval_examples else None
    return vf.ToolEnv(
        tools=[calculate],
        max_turns=max_turns,
        dataset=_dataset(num_train_examples, split="train", **common),
        eval_dataset=eval_ds,
        parser=parser,
        rubric=rubric,
        error_formatter=lambda e: f"Error: {e}",
    )


def sft_examples(
    n: int,
    seed: int = 0,
    num_terms: int = 3,
    max_value: int = 50,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
) -> list[dict[str, Any]]:
    """`n` rows of the ideal trajectory in the environment's exact prompt and tool format.

    Each row is prompt/completion/tools: the assistant calls `calculate` with the question's
    expression, the tool answers, the assistant replies with the result. Problems come from their
    own random stream ("sft"), so they are not the RL train or eval problems.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    env = load_environment(
        num_train_examples=1,
        num_eval_examples=0,
        num_terms=num_terms,
        max_value=max_value,
        seed=seed,
        system_prompt=system_prompt,
    )
    # what verifiers' OpenAI client sends as `tools`, so SFT prompts tokenize as RL prompts do
    tools = [{"type": "function", "function": t.model_dump(exclude_none=True)} for t in env.tool_defs]
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    rows = []
    for i, (expr, result) in enumerate(make_problems(n, seed, "sft", num_terms, max_value)):
        call = {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "calculate", "arguments": json.dumps({"expression": expr})},
        }
        rows.append(
            {
                "prompt": [*system, {"role": "user", "content": f"What is {expr}?"}],
                "completion": [
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": result},
                    {"role": "assistant", "content": result},
                ],
                "tools": tools,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tool_calc", description="Write tool-calc SFT data (prompt/completion/tools JSONL)."
    )
    ap.add_argument("--sft-out", required=True, help="output .jsonl file")
    ap.add_argument("--n", type=int, default=2000, help="number of examples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-terms", type=int, default=3)
    ap.add_argument("--max-value", type=int, default=50)
    args = ap.parse_args(argv)
    try:
        rows = sft_examples(args.n, args.seed, args.num_terms, args.max_value)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.sft_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # readers never see a half-written file
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(tmp, out)
    print(f"wrote {len(rows)} examples to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
