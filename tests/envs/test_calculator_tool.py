"""The exact calculator tool (``rlbits.envs.calculator_tool.calculator``): exact answers, and what it refuses."""

from __future__ import annotations

import pytest

from rlbits.envs.calculator_tool import calculator


@pytest.mark.parametrize(
    "expr,want",
    [
        ("123456789 * 987654321", "121932631112635269"),
        ("2**100", str(2**100)),
        ("(7 + 5) * -3", "-36"),
        ("10 / 5", "2"),
        ("7 / 2", "3.5"),
        ("17 // 5", "3"),
        ("17 % 5", "2"),
        ("99999999999999999999 + 1", "100000000000000000000"),
    ],
)
def test_calculator_exact(expr, want):
    assert calculator(expr) == want


@pytest.mark.parametrize(
    "expr,error,match",
    [
        ("__import__('os').system('true')", ValueError, "not allowed"),
        ("open('x')", ValueError, "not allowed"),
        ("9**9**9", ValueError, "digits"),
        ("1 / 0", ZeroDivisionError, "division by zero"),
        ("2 +", ValueError, "not an arithmetic expression"),
        ("'a' * 3", ValueError, "not allowed"),
        ("1 << 100000", ValueError, "not supported"),
    ],
)
def test_calculator_refuses(expr, error, match):
    with pytest.raises(error, match=match):
        calculator(expr)
