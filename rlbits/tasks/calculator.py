"""Calculator task: multiply a 3-4 digit by a 2-3 digit number, with a calculator tool the model may call.

An episode (``make_env``; the text the rollout builds, with this tokenizer, is exactly)::

    What is 4821*37?
    <tool_call>{"name": "calculator", "arguments": {"expression": "4821*37"}}</tool_call>
    <tool_response>
    178377
    </tool_response>
    Answer: 178377

The prompt is ``"What is {a}*{b}?\\n"``. The policy's first turn either calls the tool (the turn ends at
``</tool_call>``) or answers (the turn ends at EOS). The env runs the call (``rlbits.envs.calculator``, an
exact pure-Python arithmetic evaluator) and appends its result in the plain-text tool format
(``\\n<tool_response>\\n{result}\\n</tool_response>\\n``, ``ToolEnv`` in plain mode without the tools
preamble: the base model was trained on this fixed format). A turn without a call ends the episode; its
reward is 1.0 when it is exactly ``Answer: N`` with ``N`` the product, else 0. ``MAX_TURNS`` = 3 turns at
most (a call at the last turn ends the episode with reward 0).

``make_env(prompt, use_tool=False)``: the same env, but every call gets the observation
``NO_TOOL_MESSAGE`` (inside the same ``<tool_response>`` tags) instead of a result, and the episode goes on,
so the model may still answer in a later turn.

The base model imitates a demonstrator who rarely reaches for the calculator:

- Problems: ``a`` with 3 or 4 digits, ``b`` with 2 or 3 digits (each length equally likely, then uniform):
  products of 4-7 digits, beyond what a 0.8M-parameter model computes in its head.
- The demonstrator calls the tool with probability ``CALL_PROB_BIG`` = 0.6 on the biggest problems (4 x 3
  digits, a quarter of them) and ``CALL_PROB`` = 0.25 on the others, then copies the result into its answer.
  Otherwise it guesses: the product's first two digits, the rest random (same length, never the product).
  So a model that imitates it calls the tool on about a third of the problems at temperature 1 (greedily: on
  the 4 x 3 problems only) and is right only when it calls; an RL loop can raise the call rate everywhere.
  (With 0.1 on the others the model rarely saw small problems' calls and, made to call on them by RL, copied
  their operands and results badly: docs/tasks.md.)

``reward(prompts, responses)`` scores the text of a whole episode after the prompt (tool calls and tool
responses included), as ``rlbits.score`` and the evaluation see it: the part after the last
``</tool_response>`` (all of it when there is none), cut at a literal ``"<eos>"`` and stripped, must be
exactly ``Answer: N`` (no sign, no leading zeros). That is the same as the env's reward on the final turn.
"""

from __future__ import annotations

import json
import random
import re
from functools import cache

from rlbits.envs import HERMES, ToolEnv, ToolRegistry, ToolResult, calculator
from rlbits.tasks._common import at_prompt, check_pairs, check_split, disjoint_splits

NAME = "calculator"
SPLITS = ("train", "test")
N_TEST = 500
N_TRAIN = 5000
DIGITS_A = (3, 4)
DIGITS_B = (2, 3)
CALL_PROB_BIG = 0.6
CALL_PROB = 0.25
MAX_TURNS = 3
MAX_NEW_TOKENS = 32
TOOL_NAME = "calculator"
NO_TOOL_MESSAGE = "no tool"  # short: the tokenizer never saw it, so it is spelled in small pieces
_TEST_SEED = 2468
_TRAIN_SEED = 8642
_PROMPT_RE = re.compile(r"What is (\d+)\*(\d+)\?\n")
_ANSWER_RE = re.compile(r"Answer: (0|[1-9]\d*)")


def sample_operands(rng: random.Random) -> tuple[int, int]:
    """One problem ``(a, b)``: digit counts uniform over ``DIGITS_A`` and ``DIGITS_B``, then uniform operands
    of those lengths (no leading zeros)."""
    ka, kb = rng.choice(DIGITS_A), rng.choice(DIGITS_B)
    return rng.randrange(10 ** (ka - 1), 10**ka), rng.randrange(10 ** (kb - 1), 10**kb)


def _prompt(a: int, b: int) -> str:
    return f"What is {a}*{b}?\n"


def parse_prompt(prompt: str) -> tuple[int, int]:
    """``(a, b)`` from ``"What is {a}*{b}?\\n"``.

    Raises:
        ValueError: the prompt is not of that form.
    """
    m = _PROMPT_RE.fullmatch(prompt) if isinstance(prompt, str) else None
    if m is None:
        raise ValueError(f"calculator prompt must look like 'What is 4821*37?\\n', got {prompt!r}")
    return int(m.group(1)), int(m.group(2))


@cache
def _splits() -> dict[str, tuple[str, ...]]:
    return disjoint_splits(
        sample_operands, _prompt, n_test=N_TEST, n_train=N_TRAIN, test_seed=_TEST_SEED, train_seed=_TRAIN_SEED
    )


def prompts(split: str) -> list[str]:
    """Prompts ``"What is {a}*{b}?\\n"`` of ``split`` (``"train"``: 5000, ``"test"``: 500 distinct
    problems), disjoint and fixed. The corpus never contains a test problem.

    Raises:
        ValueError: ``split`` is not ``"train"`` or ``"test"``.
    """
    check_split(split, SPLITS)
    return list(_splits()[split])


def final_answer(response: str) -> int | None:
    """The ``N`` of a response whose final part is exactly ``Answer: N``, else None.

    The final part is what follows the last ``</tool_response>`` (the whole response without one), cut at a
    literal ``"<eos>"`` and stripped of surrounding whitespace.
    """
    final = response.rsplit(HERMES.response_close, 1)[-1].split("<eos>", 1)[0].strip()
    m = _ANSWER_RE.fullmatch(final)
    return int(m.group(1)) if m else None


def called_tool(response: str) -> bool:
    """Whether an episode's response contains a tool call (its ``<tool_call>`` tag)."""
    return HERMES.call_open in response


def reward(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 where the episode's final answer is the product, else 0.0.

    ``responses[i]`` is the text of a whole episode after ``prompts[i]``: tool calls and tool responses
    included. ``final_answer`` must be ``a * b``: for ``"What is 12*34?\\n"``, ``"Answer: 408"`` and
    ``'<tool_call>...</tool_call>\\n<tool_response>\\n408\\n</tool_response>\\nAnswer: 408'`` score 1;
    ``"Answer: 0408"``, ``"408"``, ``"Answer: 408 or so"``, a final unanswered call and ``""`` score 0.

    Raises:
        TypeError: an argument is not a list of str.
        ValueError: the lists differ in length, or a prompt is not of the task's form (the message gives its
            index).
    """
    check_pairs(prompts, responses)
    out = []
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        with at_prompt(i):
            a, b = parse_prompt(prompt)
        out.append(1.0 if final_answer(response) == a * b else 0.0)
    return out


class _NoToolRegistry(ToolRegistry):
    # Every call, whatever its name, gets NO_TOOL_MESSAGE: the env of ``make_env(use_tool=False)``.
    def call(self, call) -> ToolResult:
        return ToolResult(call.name, NO_TOOL_MESSAGE, False)


@cache  # registries hold no episode state; one is shared by every env (the schema is derived once)
def _registry(use_tool: bool) -> ToolRegistry:
    return ToolRegistry([calculator]) if use_tool else _NoToolRegistry()


def make_env(
    prompt: str, *, use_tool: bool = True, max_turns: int = MAX_TURNS, max_new_tokens: int = MAX_NEW_TOKENS
) -> ToolEnv:
    """A fresh env for one episode on ``prompt`` (the caller then calls ``env.reset(prompt)``).

    A ``ToolEnv`` in plain mode without the tools preamble: ``reset`` returns the prompt itself; a turn with a
    ``<tool_call>`` gets the plain-text tool response (reward 0, not done); a turn without one ends the
    episode with reward ``reward([prompt], [turn])`` (the turn is the final part). Each turn ends at
    ``</tool_call>`` or EOS, after at most ``max_new_tokens`` tokens; at most ``max_turns`` turns.

    Args:
        prompt: a prompt of this task (checked here, so a bad one fails before the episode starts).
        use_tool: False: every call is answered with ``NO_TOOL_MESSAGE`` instead of a result (the episode
            goes on); the run "without the tool".
        max_turns, max_new_tokens: the env's ``StopConditions``.

    Raises:
        ValueError: ``prompt`` is not of the task's form.
    """
    parse_prompt(prompt)
    return ToolEnv(
        _registry(use_tool),
        mode="plain",
        tools_prompt=False,
        max_turns=max_turns,
        max_new_tokens=max_new_tokens,
        reward_fn=lambda row, text: reward([row["prompt"]], [text])[0],
    )


def call_text(a: int, b: int) -> str:
    """The demonstrator's tool call for ``a * b``: ``<tool_call>{json}</tool_call>``, JSON as ``json.dumps``
    writes it."""
    body = json.dumps({"name": TOOL_NAME, "arguments": {"expression": f"{a}*{b}"}})
    return f"{HERMES.call_open}{body}{HERMES.call_close}"


def guess(a: int, b: int, rng: random.Random) -> int:
    """The demonstrator's answer without the tool: the product's first two digits, then random digits, the
    product's length, never the product itself."""
    p = str(a * b)
    while True:
        g = int(p[:2] + "".join(rng.choice("0123456789") for _ in p[2:]))
        if g != a * b:
            return g


def demonstrate(a: int, b: int, rng: random.Random, renderer: ToolEnv | None = None) -> str:
    """One demonstrated episode's response (the text after the prompt), the rollout's text for it.

    With probability ``CALL_PROB_BIG`` (4 x 3 digits) or ``CALL_PROB`` (others): the call, the tool's
    response as ``renderer`` (a plain-mode env, default a fresh ``make_env``) renders it, then the answer
    copied from it. Else ``Answer: {guess(a, b, rng)}``.
    """
    big = len(str(a)) == max(DIGITS_A) and len(str(b)) == max(DIGITS_B)
    if rng.random() < (CALL_PROB_BIG if big else CALL_PROB):
        renderer = renderer or make_env(_prompt(a, b))
        result = ToolResult(TOOL_NAME, calculator(f"{a}*{b}"), True)
        return f"{call_text(a, b)}{renderer.render_results([result])}Answer: {a * b}"
    return f"Answer: {guess(a, b, rng)}"


@cache
def _test_pairs() -> frozenset[tuple[int, int]]:
    return frozenset(parse_prompt(p) for p in _splits()["test"])


def corpus(n: int, seed: int) -> list[str]:
    """``n`` documents, prompt + ``demonstrate``'s response (no EOS): the text an episode of ``make_env``
    produces when the policy writes the demonstrator's turns.

    Problems are drawn with ``sample_operands`` from ``random.Random(seed)``, skipping test-split problems;
    the demonstrator uses the same generator. Same ``(n, seed)``, same list.

    Raises:
        ValueError: ``n < 0``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng, test = random.Random(seed), _test_pairs()
    renderer = make_env(_prompt(100, 10))
    out = []
    while len(out) < n:
        a, b = sample_operands(rng)
        if (a, b) not in test:
            out.append(_prompt(a, b) + demonstrate(a, b, rng, renderer))
    return out
