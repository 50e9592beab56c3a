"""An exact calculator tool: ``calculator(expression)`` evaluates arithmetic by walking the ``ast`` (numbers,
``+ - * / // % **`` and parentheses); it never calls ``eval``. Integers stay exact up to ``MAX_RESULT_DIGITS``
digits. Plain Python: it needs no sandbox (docs/envs.md)."""

from __future__ import annotations

import ast
import math
import operator

MAX_EXPRESSION_CHARS = 1000
MAX_RESULT_DIGITS = 4000

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def _check_size(x):
    if isinstance(x, int) and x.bit_length() > MAX_RESULT_DIGITS * 3.33:
        raise ValueError(f"result has more than {MAX_RESULT_DIGITS} digits")
    return x


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _eval(node.operand)
        return v if isinstance(node.op, ast.UAdd) else -v
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Div):
            if b == 0:
                raise ZeroDivisionError("division by zero")
            if isinstance(a, int) and isinstance(b, int) and a % b == 0:
                return a // b  # exact integer division stays an integer
            return a / b
        if isinstance(node.op, ast.Pow):
            if isinstance(b, int) and isinstance(a, int) and b >= 0:
                if abs(a) > 1 and b * math.log2(abs(a)) > MAX_RESULT_DIGITS * 3.33:
                    raise ValueError(f"result has more than {MAX_RESULT_DIGITS} digits")
            elif abs(b) > 1e4:
                raise ValueError("exponent too large")
            return _check_size(a**b)
        op = _BINARY.get(type(node.op))
        if op is None:
            raise ValueError(f"operator {type(node.op).__name__} is not supported")
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and b == 0:
            raise ZeroDivisionError("division by zero")
        return _check_size(op(a, b))
    raise ValueError(f"{type(node).__name__} is not allowed (only numbers, + - * / // % ** and parentheses)")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Integers are exact at any size up to 4000 digits; / of two integers gives an integer when it divides
    exactly, else a decimal. Supports + - * / // % ** and parentheses.

    Args:
        expression: The arithmetic expression, for example "123456789 * 987654321".
    """
    if not isinstance(expression, str):
        raise TypeError(f"calculator: expression must be a str, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"calculator: expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"calculator: not an arithmetic expression: {expression!r} ({e.msg})") from None
    value = _eval(tree)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)
