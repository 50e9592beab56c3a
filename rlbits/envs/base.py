"""The environment interface: what a multi-turn episode talks to between the policy's turns.

An episode starts with ``env.reset(prompt_or_row)``, which returns the first :class:`Observation` (the prompt
the policy continues). The policy then samples one turn until a stop condition in ``env.stop``
(:class:`StopConditions`: a stop string such as ``</tool_call>``, EOS, or ``max_new_tokens``), and the rollout
calls ``env.step(action_text, action_ids)``, which returns a :class:`StepResult`: the observation to append
(text, or token ids to append verbatim), the reward of that turn, and whether the episode is over. The rollout
also ends an episode after ``stop.max_turns`` turns.

One env object serves one episode (like verl's per-trajectory tool instance and OpenRLHF's agent instance), so
it may keep state between turns. Everything here is plain Python: no torch, no tensors. ``step_all`` steps the
envs of a batch concurrently with a bounded pool. How this maps onto verl, NeMo-RL, TRL, OpenRLHF and torchrl:
``docs/envs.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class StopConditions:
    """When the policy's turn ends and when the episode ends, as the env declares them.

    Attributes:
        stop_strings: the turn ends once the decoded text of the turn ends with one of these (e.g.
            ``("</tool_call>",)``); the stop string is part of the action.
        stop_on_eos: the turn (and, unless the env says otherwise, the episode) ends at the tokenizer's EOS.
        max_new_tokens: at most this many sampled tokens a turn.
        max_turns: at most this many policy turns an episode; the rollout ends the episode after the last one.
    """

    stop_strings: tuple[str, ...] = ()
    stop_on_eos: bool = True
    max_new_tokens: int = 256
    max_turns: int = 1

    def __post_init__(self):
        if isinstance(self.stop_strings, str):
            raise TypeError(
                f"StopConditions.stop_strings must be a tuple of strings, got the str {self.stop_strings!r}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(
                f"StopConditions.stop_strings must be non-empty strings, got {self.stop_strings!r}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"StopConditions.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_turns < 1:
            raise ValueError(f"StopConditions.max_turns must be >= 1, got {self.max_turns}")


@dataclass(frozen=True)
class Observation:
    """What the env shows the policy: ``text``, or ``token_ids`` when the env tokenises it itself.

    When ``token_ids`` is set the rollout appends exactly those ids (token-exact, like the policy's own
    tokens); otherwise it tokenises ``text`` without special tokens. Either way observation tokens are not
    actions (``action_mask`` False).
    """

    text: str = ""
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class StepResult:
    """What ``Env.step`` returns for one policy turn.

    Attributes:
        observation: appended after the action (empty when ``done``).
        reward: the reward of this turn (a float; the rollout puts it on the turn's last action token or sums
            the turns into a sequence reward).
        done: the episode is over (a final answer, a solved task, an unrecoverable state).
        info: anything to log (tool names, errors, timings); plain Python values.
    """

    observation: Observation = Observation()
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    """One episode's environment. See the module docstring for the protocol."""

    stop: StopConditions

    def reset(self, prompt: str | Mapping[str, Any]) -> Observation:
        """Start an episode from a prompt string or a dataset row; return the first observation."""
        ...

    def step(self, action_text: str, action_ids: Sequence[int] | None = None) -> StepResult:
        """React to one policy turn (its decoded text and, when the rollout has them, its sampled ids)."""
        ...


def map_ordered(fn: Callable[[Any], Any], items: Sequence[Any], max_workers: int) -> list[Any]:
    """``[fn(x) for x in items]`` run on a pool of at most ``max_workers`` threads, results in input order.

    An exception in ``fn`` is re-raised here (callers that must not crash catch inside ``fn``).

    Raises:
        ValueError: ``max_workers < 1``.
    """
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    items = list(items)
    if not items:
        return []
    if max_workers == 1 or len(items) == 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items))) as pool:
        return list(pool.map(fn, items))


def step_all(
    envs: Sequence[Env],
    actions: Sequence[str],
    action_ids: Sequence[Sequence[int] | None] | None = None,
    *,
    max_workers: int = 8,
) -> list[StepResult]:
    """Step every env of a batch with its action, at most ``max_workers`` at a time; results in batch order.

    Tool calls are I/O or subprocess bound, so threads suffice. ``envs``, ``actions`` and ``action_ids`` (when
    given) have one entry per episode.

    Raises:
        ValueError: the lengths differ, or ``max_workers < 1``.
    """
    if len(envs) != len(actions) or (action_ids is not None and len(action_ids) != len(envs)):
        raise ValueError(
            f"step_all: {len(envs)} envs, {len(actions)} actions"
            + ("" if action_ids is None else f", {len(action_ids)} action_ids")
            + ": need one of each per episode"
        )
    ids = action_ids if action_ids is not None else [None] * len(envs)
    return map_ordered(lambda i: envs[i].step(actions[i], ids[i]), range(len(envs)), max_workers)
