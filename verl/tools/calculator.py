"""The built-in ``calculator`` tool: arithmetic on numbers only, read by ``ast``, never by ``eval``.

Allowed: integer and decimal literals, ``+ - * / // % **``, unary ``+ -`` and parentheses. Anything else (names,
calls, attributes, strings, comparisons ...) is refused with a message naming it. Sizes are bounded so a model
cannot make the trainer compute forever: at most 200 characters, exponents up to 64, results up to 1e30.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e30

SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 37*412"}},
                       "required": ["expression"], "additionalProperties": False},
    },
}

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message is what the model sees."""


def calculator(expression: str) -> str:
    """The value of ``expression`` as text: an integer when the value is whole, else up to 12 significant digits."""
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse '{expression}' as arithmetic") from None
    return format_number(_evaluate(tree.body))


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        try:
            value = _BINARY[type(node.op)](left, right)
        except (OverflowError, ZeroDivisionError) as exc:
            raise CalculatorError(str(exc)) from None
        if isinstance(value, complex):
            raise CalculatorError("the result is not a real number")
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise CalculatorError(f"'{ast.unparse(node)}' is not arithmetic on numbers")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"the result is larger than {MAX_MAGNITUDE:g}")
    return value


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.12g}"
