"""tool-calc: a verifiers v1 taskset where the model answers arithmetic with a calculator tool.

Problems such as "What is 37 * 12 + 5?" are generated from a seed (no downloads). The tool
`calculate(expression)` evaluates arithmetic only: the expression is parsed with `ast` and
walked node by node, so names, calls, attributes and anything else that is not a number or an
arithmetic operator are refused. The tool is an MCP server (`Calculator`, a v1 Toolset) started for
each rollout; the model calls it in the chat template's tool format, so the training client needs a
renderer with a tool parser (`[orchestrator.renderer]`). The reward is 1.0 when the last number in
the final reply equals the result; `calculate_calls` counts the tool calls.

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
import difflib
import json
import math
import os
import random
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import verifiers.v1 as vf
from pydantic import Field, model_validator

from tool_calc.calculator import Calculator, calculate, format_number, safe_eval

DEFAULT_SYSTEM_PROMPT = "Use the calculate tool for arithmetic, then reply with the final answer as a number."

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number in `text` (thousands separators like 1,234 allowed), or None."""
    matches = _NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))
    return float(matches[-1]) if matches else None


def final_answer(trace: vf.Trace) -> float | None:
    """The last number of the model's last reply; None when there is none or it was still calling tools."""
    replies = trace.assistant_messages
    if not replies or replies[-1].tool_calls:
        return None
    return last_number(replies[-1].content or "")


def correct_answer(value: float | None, answer: str) -> float:
    return float(value is not None and math.isclose(value, float(answer), abs_tol=1e-6))


def _similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a.replace(" ", ""), b.replace(" ", "")).ratio()


def first_expression(trace: vf.Trace) -> str | None:
    """The `expression` argument of the first calculate call."""
    for message in trace.assistant_messages:
        for call in message.tool_calls or []:
            try:
                expression = json.loads(call.arguments or "{}").get("expression")
            except (json.JSONDecodeError, AttributeError):
                continue
            if isinstance(expression, str):
                return expression
    return None


def expression_similarity(expression: str | None, question: str) -> float:
    return 0.0 if expression is None else _similarity(expression, question)


def answer_similarity(value: float | None, answer: str) -> float:
    return 0.0 if value is None else _similarity(format_number(value), answer)


class CalcData(vf.TaskData):
    expression: str
    """The question's expression."""
    answer: str
    """Its value, formatted."""


class CalcTaskConfig(vf.TaskConfig):
    max_turns: int = 3
    shaping: float = 0.0


class CalcTask(vf.Task[CalcData, vf.State, CalcTaskConfig]):
    @vf.stop
    async def out_of_turns(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= self.config.max_turns

    def _scores(self, trace: vf.Trace) -> dict[str, float]:
        value = final_answer(trace)
        return {
            "correct_answer": correct_answer(value, self.data.answer),
            "expression_similarity": expression_similarity(first_expression(trace), self.data.expression),
            "answer_similarity": answer_similarity(value, self.data.answer),
        }

    @vf.reward(weight=1.0)
    async def shaped_reward(self, trace: vf.Trace) -> float:
        """(1 - shaping) * correct + shaping/2 * (the two similarities)."""
        s, shaping = self._scores(trace), self.config.shaping
        return (1 - shaping) * s["correct_answer"] + shaping / 2 * (s["expression_similarity"] + s["answer_similarity"])

    @vf.metric
    async def scores(self, trace: vf.Trace) -> dict[str, float]:
        calls = sum(len(m.tool_calls or []) for m in trace.assistant_messages)
        return {**self._scores(trace), "calculate_calls": float(calls)}


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


class ToolCalcConfig(vf.TasksetConfig):
    """The environment's args (`[[orchestrator.env]] args = {...}`)."""

    task: CalcTaskConfig = CalcTaskConfig()
    """Each task's config: `max_turns` and `shaping` below set it (an env server builds its tasks from it)."""

    split: Literal["train", "eval"] = "train"
    """Which stream of problems: "train", or "eval" (held out; `eval` and the orchestrator's evals set it)."""
    num_train_examples: int = Field(1000, ge=1)
    num_eval_examples: int = Field(100, ge=0)
    num_terms: int = Field(3, ge=2)
    max_value: int = Field(50, ge=1)
    seed: int = 0
    max_turns: int = Field(3, ge=1)
    """Model turns per rollout (tool calls and the answer)."""
    shaping: float = Field(0.0, ge=0.0, le=1.0)
    """The share of the reward moved to the two partial-credit scores."""
    instructions: str | None = DEFAULT_SYSTEM_PROMPT
    """The system prompt (None: none)."""
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()
    """Where the calculator's MCP server runs (a subprocess by default)."""

    @model_validator(mode="after")
    def _task_follows_args(self) -> ToolCalcConfig:
        self.task = self.task.model_copy(update={"max_turns": self.max_turns, "shaping": self.shaping})
        return self


class ToolCalcTaskset(vf.Taskset[CalcTask, ToolCalcConfig]):
    @classmethod
    def toolsets(cls, config: ToolCalcConfig) -> list[vf.Toolset]:
        return [Calculator(config.tools)]  # stateless: one server for all of a run's rollouts

    def load(self) -> Iterator[CalcTask]:
        c = self.config
        n = c.num_train_examples if c.split == "train" else c.num_eval_examples
        for i, (expr, result) in enumerate(make_problems(n, c.seed, c.split, c.num_terms, c.max_value)):
            data = CalcData(
                idx=i, prompt=f"What is {expr}?", system_prompt=c.instructions, expression=expr, answer=result
            )
            yield CalcTask(data, c.task)


__all__ = ["ToolCalcTaskset", "ToolCalcConfig", "CalcTask", "Calculator", "calculate", "safe_eval"]


def tool_specs() -> list[dict[str, Any]]:
    """The tools as the model sees them in an episode: the MCP server's listing, in OpenAI form (what the
    agent's chat program builds), so SFT prompts render as RL prompts do."""
    import asyncio

    from mcp.server.mcpserver import MCPServer

    server = MCPServer("tool-calc")
    Calculator(vf.ToolsetConfig()).register(server)
    listed = asyncio.run(server.list_tools())
    specs = [{"name": t.name, "description": t.description or "", "parameters": t.input_schema} for t in listed]
    return [{"type": "function", "function": spec} for spec in specs]


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
    tools = tool_specs()
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
