"""The calculator: arithmetic evaluated without executing code, served to rollouts as an MCP tool.

`safe_eval` parses the expression with `ast` and walks it node by node, so names, calls, attributes and
anything else that is not a number or an arithmetic operator are refused. `Calculator` is the v1 Toolset
(`calculate`); verifiers starts it as `python -m tool_calc.calculator`.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

import verifiers.v1 as vf

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


class Calculator(vf.Toolset[vf.ToolsetConfig]):
    """The `calculate` tool, served to each rollout over MCP."""

    TOOL_PREFIX = None  # the tool is `calculate`, not `calculator_calculate`

    @vf.tool
    def calculate(self, expression: str) -> str:
        """Evaluate arithmetic (numbers, + - * / // % ** and parentheses, e.g. "37 * 12 + 5"); returns the result."""
        try:
            return calculate(expression)
        except ValueError as e:
            return f"Error: {e}"


if __name__ == "__main__":
    Calculator.run()
