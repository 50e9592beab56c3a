"""Guess-the-number task: find a secret number from 1 to 16 with higher / lower answers, in few turns.

An episode (``make_env``; the text the rollout builds is exactly)::

    Game 4821: guess my number from 1 to 16.
    8
    higher
    12
    lower
    10

The prompt is ``"Game {id}: guess my number from 1 to 16.\\n"``; the secret is a fixed function of the prompt
(``secret``: a SHA-256 of it, so episodes are reproducible and no model can infer it from the id). Each
policy turn is one line, the guess ``N\\n`` (the turn ends at the newline, or EOS); the env answers ``higher\\n``
(the secret is larger), ``lower\\n`` or, for a line that is not a guess in range, ``INVALID_MESSAGE`` (after a
newline when the turn ended without one, at EOS or ``max_new_tokens``). A right
guess ends the episode (no observation); so does the ``MAX_TURNS``-th (8th) turn.

Reward, per turn (``StepResult.reward``): 1.0 for the right guess, ``-TURN_COST`` (-0.1) for every other
turn, so an episode solved at turn ``t`` sums to ``1 - 0.1 (t - 1)`` and an unsolved one to -0.8. Fewer
turns, more reward: the loops' signal that "the mean number of turns to solve falls"; placed on each turn's
last token, the cost sits on the turn that wasted a guess. Binary search solves every game in at most 5
turns (3.375 on average over the 16 secrets).

The base model imitates an imperfect demonstrator: each turn, with probability ``IGNORE_PROB`` = 0.3 it
ignores the feedback (a uniform pick among the numbers it has not guessed yet), else it picks uniformly among
the numbers consistent with the answers so far. It solves most games, in clearly more turns than binary
search, and sometimes not within 8 turns.

``reward(prompts, responses)`` replays the response (the text of a whole episode after the prompt, the env's
answers included) through the env and sums its rewards, so ``rlbits.score`` and the evaluation agree with the
rollout's per-turn rewards; ``play(prompt, response)`` also gives the turns and whether it solved.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from rlbits.envs import Observation, StepResult, StopConditions
from rlbits.tasks._common import at_prompt, check_pairs, check_split

NAME = "guess_number"
SPLITS = ("train", "test")
LOW, HIGH = 1, 16
N_TEST = 500
N_TRAIN = 5000
GAME_IDS = range(1000, 10000)  # four-digit game ids: the prompt's only varying part
MAX_TURNS = 8
MAX_NEW_TOKENS = 4
TURN_COST = 0.1
SOLVED_REWARD = 1.0
IGNORE_PROB = 0.3
INVALID_MESSAGE = f"invalid: write one number from {LOW} to {HIGH}\n"
_TEST_SEED = 1357
_TRAIN_SEED = 7531


def _prompt(game_id: int) -> str:
    return f"Game {game_id}: guess my number from {LOW} to {HIGH}.\n"


def parse_prompt(prompt: str) -> int:
    """The game id of ``"Game {id}: guess my number from 1 to 16.\\n"``.

    Raises:
        ValueError: the prompt is not of that form.
    """
    head, sep, tail = prompt.partition(": ") if isinstance(prompt, str) else ("", "", "")
    game = head.removeprefix("Game ")
    if not (sep and head.startswith("Game ") and game.isdigit() and tail == _prompt(0).partition(": ")[2]):
        raise ValueError(f"guess_number prompt must look like {_prompt(4821)!r}, got {prompt!r}")
    return int(game)


def secret(prompt: str) -> int:
    """The number to guess in the game of ``prompt``: ``LOW + sha256(prompt) mod (HIGH - LOW + 1)``.

    Raises:
        ValueError: the prompt is not of the task's form.
    """
    parse_prompt(prompt)
    digest = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    return LOW + digest % (HIGH - LOW + 1)


@cache
def _splits() -> dict[str, tuple[str, ...]]:
    ids = list(GAME_IDS)
    test = random.Random(_TEST_SEED).sample(ids, N_TEST)
    rest = sorted(set(ids) - set(test))
    train = random.Random(_TRAIN_SEED).sample(rest, N_TRAIN)
    return {"test": tuple(map(_prompt, test)), "train": tuple(map(_prompt, train))}


def prompts(split: str) -> list[str]:
    """Prompts of ``split`` (``"train"``: 5000, ``"test"``: 500 games with distinct ids), disjoint and fixed.
    The corpus never plays a test game.

    Raises:
        ValueError: ``split`` is not ``"train"`` or ``"test"``.
    """
    check_split(split, SPLITS)
    return list(_splits()[split])


def parse_guess(action_text: str) -> int | None:
    """The ``N`` of a turn ``"N"`` (cut at a literal ``"<eos>"``, surrounding whitespace ignored), ``N`` a
    decimal from ``LOW`` to ``HIGH`` without leading zeros; None for anything else."""
    number = action_text.split("<eos>", 1)[0].strip()
    if not number.isdecimal() or not number.isascii() or str(int(number)) != number:
        return None
    return int(number) if LOW <= int(number) <= HIGH else None


class GuessNumberEnv:
    """One game (``rlbits.envs.Env``): ``reset(prompt)`` fixes the secret and returns the prompt; each
    ``step`` answers one guess (see the module docstring). ``info`` holds ``guess`` (None for an invalid
    turn), ``turn``, ``solved``.

    Attributes:
        stop: turns end at ``"\\n"`` or EOS, after at most ``max_new_tokens`` tokens; ``max_turns`` turns.
    """

    def __init__(self, *, max_turns: int = MAX_TURNS, max_new_tokens: int = MAX_NEW_TOKENS):
        self.stop = StopConditions(stop_strings=("\n",), max_new_tokens=max_new_tokens, max_turns=max_turns)
        self.secret: int | None = None
        self.turns = 0

    def reset(self, prompt: str | Mapping[str, Any]) -> Observation:
        """Start the game of ``prompt`` (a string or a row with a ``"prompt"`` string).

        Raises:
            ValueError: the prompt is not of the task's form.
        """
        text = prompt.get("prompt") if isinstance(prompt, Mapping) else prompt
        self.secret, self.turns = secret(text), 0
        return Observation(text=text)

    def step(self, action_text: str, action_ids: Sequence[int] | None = None) -> StepResult:
        """Answer one turn: 1.0 and done for the secret, else ``-TURN_COST`` with ``higher`` / ``lower`` /
        ``INVALID_MESSAGE`` (done, without an observation, at the last turn). A turn that does not end with a
        newline (cut by EOS or ``max_new_tokens``) gets a newline before the answer.

        Raises:
            RuntimeError: ``step`` before ``reset``.
        """
        if self.secret is None:
            raise RuntimeError("GuessNumberEnv.step called before reset")
        self.turns += 1
        guess = parse_guess(action_text)
        info = {"guess": guess, "turn": self.turns, "solved": guess == self.secret}
        if guess == self.secret:
            return StepResult(Observation(), SOLVED_REWARD, True, info)
        if self.turns >= self.stop.max_turns:
            return StepResult(Observation(), -TURN_COST, True, {**info, "stop_reason": "max_turns"})
        if guess is None:
            text = INVALID_MESSAGE
        else:
            text = "higher\n" if self.secret > guess else "lower\n"
        # A turn cut by EOS or max_new_tokens has no newline: the answer starts a new line, so every turn of
        # the episode's text ends at a newline and ``play`` finds the same turns.
        newline = "" if action_text.endswith("\n") else "\n"
        return StepResult(Observation(text=newline + text), -TURN_COST, False, info)


def make_env(
    prompt: str, *, max_turns: int = MAX_TURNS, max_new_tokens: int = MAX_NEW_TOKENS
) -> GuessNumberEnv:
    """A fresh env for one game on ``prompt`` (the caller then calls ``env.reset(prompt)``).

    Raises:
        ValueError: ``prompt`` is not of the task's form.
    """
    parse_prompt(prompt)
    return GuessNumberEnv(max_turns=max_turns, max_new_tokens=max_new_tokens)


@dataclass(frozen=True)
class Outcome:
    """A replayed episode: ``reward`` (the env's rewards summed), ``turns`` (policy turns played),
    ``solved``, and ``rest`` (response text the env never saw: after the episode ended, or a last turn cut
    without its newline)."""

    reward: float
    turns: int
    solved: bool
    rest: str = ""


def play(prompt: str, response: str) -> Outcome:
    """Replay ``response`` (an episode's text after ``prompt``) through a fresh env.

    Each turn is the text up to and including the next ``"\\n"`` (or the rest of the text, which is how a
    turn cut by EOS or ``max_new_tokens`` ends); the env's observation must follow it verbatim, else the text
    is not an episode of this env and the replay stops there (the rest goes to ``Outcome.rest``, reward as
    far as it got). A turn that left no text (EOS at once, decoded without specials) cannot be seen: the
    replay agrees with the env's rewards except for such a turn at the very end of an episode.

    Raises:
        ValueError: the prompt is not of the task's form.
    """
    env = make_env(prompt)
    env.reset(prompt)
    total, pos, done, turns, solved = 0.0, 0, False, 0, False
    while not done and pos < len(response):
        end = response.find("\n", pos)
        end = len(response) if end == -1 else end + 1
        result = env.step(response[pos:end])
        total, turns, solved, done, pos = (
            total + result.reward,
            turns + 1,
            result.info["solved"],
            result.done,
            end,
        )
        obs = result.observation.text
        if not response.startswith(obs, pos):
            break
        pos += len(obs)
    return Outcome(round(total, 10), turns, solved, response[pos:])


def reward(prompts: list[str], responses: list[str]) -> list[float]:
    """The sum of the env's per-turn rewards over each episode, by ``play``: ``1 - 0.1 (t - 1)`` for a game
    solved at turn ``t``, ``-0.1`` per turn played for one not solved (an empty response: 0).

    Raises:
        TypeError: an argument is not a list of str.
        ValueError: the lists differ in length, or a prompt is not of the task's form (the message gives its
            index).
    """
    check_pairs(prompts, responses)
    out = []
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        with at_prompt(i):
            out.append(play(prompt, response).reward)
    return out


def demonstrate(prompt: str, rng: random.Random) -> str:
    """One game played by the imperfect demonstrator (see the module docstring): the episode's text after
    ``prompt``, as the env renders it."""
    env = make_env(prompt)
    env.reset(prompt)
    lo, hi, tried, text = LOW, HIGH, set(), ""
    while True:
        if rng.random() < IGNORE_PROB:
            pool = [n for n in range(LOW, HIGH + 1) if n not in tried]
        else:
            pool = [n for n in range(lo, hi + 1) if n not in tried]
        guess = rng.choice(pool)
        tried.add(guess)
        action = f"{guess}\n"
        result = env.step(action)
        text += action + result.observation.text
        if result.done:
            return text
        if result.observation.text == "higher\n":
            lo = max(lo, guess + 1)
        else:
            hi = min(hi, guess - 1)


@cache
def _test_ids() -> frozenset[int]:
    return frozenset(map(parse_prompt, _splits()["test"]))


def corpus(n: int, seed: int) -> list[str]:
    """``n`` documents, prompt + ``demonstrate``'s game (no EOS), on games whose id is not in the test split
    (ids drawn uniformly from ``GAME_IDS`` with ``random.Random(seed)``, which the demonstrator also uses).
    Same ``(n, seed)``, same list.

    Raises:
        ValueError: ``n < 0``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng, test = random.Random(seed), _test_ids()
    out = []
    while len(out) < n:
        game = rng.choice(GAME_IDS)
        if game not in test:
            out.append(_prompt(game) + demonstrate(_prompt(game), rng))
    return out
