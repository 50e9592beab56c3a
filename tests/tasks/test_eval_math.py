"""benchmarks/eval_math.py: the kind of a math problem (digits of its terms, operator) used to split accuracy."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rlbits.tasks import get_task

_SPEC = importlib.util.spec_from_file_location(
    "eval_math", Path(__file__).resolve().parents[2] / "benchmarks" / "eval_math.py"
)
eval_math = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(eval_math)


@pytest.mark.parametrize(
    "question, expected",
    [
        ("State the final answer to the following arithmetic problem: 4 - 4 =", "1-digit -"),
        ("State the final answer to the following arithmetic problem: 74 + 47 =", "2-digit +"),
        ("State the final answer to the following arithmetic problem: 7 + 47 =", "2-digit +"),
        ("State the final answer to the following arithmetic problem: 21 - 62 = ", "2-digit -"),
    ],
)
def test_kind_of_hand_made_questions(question, expected):
    assert eval_math.kind(question) == expected


@pytest.mark.parametrize("question", ["What is 2 * 3 =", "1 + 2 + 3", "no numbers here"])
def test_kind_rejects_other_questions(question):
    with pytest.raises(ValueError, match="not a two-term chain_sum question"):
        eval_math.kind(question)


@pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None, reason='needs the "real" extra')
def test_kind_agrees_with_the_answers_of_the_test_problems():
    # Reference: the terms read back from the kind's regex must give reasoning-gym's own answer.
    problems = get_task("math").problems("test")
    for entry in problems:
        a, op, b = eval_math._TERMS.search(entry["question"]).groups()
        assert int(a) + (int(b) if op == "+" else -int(b)) == int(entry["answer"])
        assert eval_math.kind(entry["question"]) == f"{max(len(a), len(b))}-digit {op}"
    kinds = {eval_math.kind(entry["question"]) for entry in problems}
    assert kinds == {"1-digit +", "1-digit -", "2-digit +", "2-digit -"}
