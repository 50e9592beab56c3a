"""Arithmetic task: complete ``"a+b="`` with the decimal sum; reward 1 for the exact answer, else 0.

The base model imitates an imperfect demonstrator, so supervised training plateaus below what the reward can
teach:

- Operands: two uniform two-digit numbers (``10-99``; ``DIGITS`` sets the lengths allowed, both operands
  always get the same length). Two digits because the plateau must be reached within a 3-minute CPU build:
  a 0.6M-parameter model imitates this corpus in ~500 steps, while with 2- or 3-digit operands two runs of
  the same model (differing only in weight-decay grouping) stood at 43% and 22% greedy after 2000 steps:
  the learning curve's jump comes at an unreliable step.
- Demonstrator: on a problem where some column other than the leftmost produces a carry, it "forgets to
  carry" with probability ``DROP_PROB`` = 0.7: every column is added without the carry coming in from the
  right and written mod 10, except the leftmost column, which is written in full (``57+68`` -> ``115``,
  not ``125``; ``95+18`` -> ``103``, not ``113``). Otherwise it writes the right sum.
- A model that imitates it perfectly answers greedily with the demonstrator's most likely answer: right on
  the problems without a carry (53.6% of the test split), wrong on the others, whatever further supervised
  training it gets. The right answers keep probability ``1 - DROP_PROB`` = 0.3 in the model, so an RL loop
  with the exact-match reward has something to reinforce.

The base model itself (its recipe, the builder, the cache) lives in ``rlbits.zoo``:
``rlbits.zoo.base_model("arithmetic")``.

Responses are scored strictly: after dropping anything from a literal ``"<eos>"`` on and stripping
whitespace, the response must be exactly the decimal sum (no sign, no leading zeros, nothing after it).
"""

from __future__ import annotations

import random
import re
from functools import cache

from rlbits.tasks._common import at_prompt, check_pairs, check_split, disjoint_splits

NAME = "arithmetic"
SPLITS = ("train", "test")
N_TEST = 500
N_TRAIN = 5000
DROP_PROB = 0.7
DIGITS = (2,)
_TEST_SEED = 1234
_TRAIN_SEED = 4321
_PROMPT_RE = re.compile(r"\s*(\d+)\+(\d+)=\s*")


def sample_operands(rng: random.Random) -> tuple[int, int]:
    """One problem ``(a, b)``: a number of digits ``k`` from ``DIGITS`` (uniformly), then two uniform
    ``k``-digit operands (no leading zeros)."""
    k = rng.choice(DIGITS)
    return rng.randrange(10 ** (k - 1), 10**k), rng.randrange(10 ** (k - 1), 10**k)


def _columns(a: int, b: int) -> list[tuple[int, int]]:
    # Digit pairs from the right (units first), the shorter operand padded with zeros.
    sa, sb = str(a)[::-1], str(b)[::-1]
    n = max(len(sa), len(sb))
    return [(int(sa[i]) if i < len(sa) else 0, int(sb[i]) if i < len(sb) else 0) for i in range(n)]


def has_carry(a: int, b: int) -> bool:
    """True when a column other than the leftmost one sums to 10 or more (a carry the demonstrator may drop)."""
    return any(x + y >= 10 for x, y in _columns(a, b)[:-1])


def no_carry_sum(a: int, b: int) -> int:
    """The demonstrator's mistake: columns added without incoming carries, each written mod 10, except the
    leftmost column, written in full. Equals ``a + b`` exactly when ``not has_carry(a, b)``."""
    cols = _columns(a, b)
    digits = [str((x + y) % 10) for x, y in cols[:-1]]
    top = sum(cols[-1])
    return int(str(top) + "".join(reversed(digits)))


def demonstrate(a: int, b: int, rng: random.Random) -> int:
    """The imperfect demonstrator's answer: ``no_carry_sum`` with probability ``DROP_PROB`` on problems with
    a carry, ``a + b`` otherwise. Draws one number from ``rng`` only when ``has_carry(a, b)``."""
    if has_carry(a, b) and rng.random() < DROP_PROB:
        return no_carry_sum(a, b)
    return a + b


def _prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


@cache
def _splits() -> dict[str, tuple[str, ...]]:
    return disjoint_splits(
        sample_operands, _prompt, n_test=N_TEST, n_train=N_TRAIN, test_seed=_TEST_SEED, train_seed=_TRAIN_SEED
    )


@cache
def _test_pairs() -> frozenset[tuple[int, int]]:
    return frozenset(parse_prompt(p) for p in _splits()["test"])


def prompts(split: str) -> list[str]:
    """Prompts ``"a+b="`` of ``split`` (``"train"``: 5000, ``"test"``: 500 distinct problems), disjoint and
    fixed. The corpus never contains a test problem.

    Raises:
        ValueError: ``split`` is not ``"train"`` or ``"test"``.
    """
    check_split(split, SPLITS)
    return list(_splits()[split])


def parse_prompt(prompt: str) -> tuple[int, int]:
    """``(a, b)`` from ``"a+b="`` (surrounding whitespace allowed).

    Raises:
        ValueError: the prompt is not of that form.
    """
    m = _PROMPT_RE.fullmatch(prompt)
    if m is None:
        raise ValueError(f"arithmetic prompt must look like '37+48=', got {prompt!r}")
    return int(m.group(1)), int(m.group(2))


def reward(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 where the response is exactly the sum, else 0.0.

    Anything from a literal ``"<eos>"`` on is dropped, then surrounding whitespace; what is left must equal
    ``str(a + b)``: ``"85"`` scores 1 for ``"37+48="``; ``"085"``, ``"+85"``, ``"85 apples"``, ``"8 5"``,
    ``"85\\n1"`` and ``""`` score 0.

    Raises:
        TypeError: an argument is not a list of str.
        ValueError: the lists differ in length, or a prompt is not ``"a+b="`` (the message gives its index).
    """
    check_pairs(prompts, responses)
    out = []
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        with at_prompt(i):
            a, b = parse_prompt(prompt)
        answer = response.split("<eos>", 1)[0].strip()
        out.append(1.0 if answer == str(a + b) else 0.0)
    return out


def corpus(n: int, seed: int) -> list[str]:
    """``n`` documents ``"a+b=answer"`` (no EOS) answered by the imperfect demonstrator.

    Problems are drawn with ``sample_operands`` from ``random.Random(seed)``, skipping test-split problems;
    answers come from ``demonstrate`` with the same generator. Same ``(n, seed)``, same list.

    Raises:
        ValueError: ``n < 0``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng, test = random.Random(seed), _test_pairs()
    out = []
    while len(out) < n:
        a, b = sample_operands(rng)
        if (a, b) not in test:
            out.append(f"{_prompt(a, b)}{demonstrate(a, b, rng)}")
    return out
