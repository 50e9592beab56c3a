"""The errors of reward scoring, shared by ``score`` and the reward server's client.

``rlbits.rollout.score`` (which sends ``http(s)://`` rewards through ``RewardClient``) and
``rlbits.rollout.reward_client`` both raise these, so they live below both: the import graph runs
``reward_errors <- reward_client <- score <- reward_server`` with no cycle. Import them from
``rlbits.rollout.score`` (or ``rlbits``), where they are re-exported.
"""

from __future__ import annotations

from typing import Any

_SHOW = 80  # characters of a prompt or response quoted in an error message


class RewardError(RuntimeError):
    """A reward function, model or server failed while scoring a batch."""


class InvalidRewardError(RewardError, ValueError):
    """A reward source returned an unusable value: wrong length, not a number, or not finite."""


class RewardServerError(RewardError):
    """A reward server could not be reached, timed out, answered an HTTP error or broke the protocol.

    ``status`` is the HTTP status code, or None when no HTTP response came back (connection error, timeout).
    """

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def _cut(text: Any) -> str:
    text = str(text)
    return repr(text if len(text) <= _SHOW else text[: _SHOW - 3] + "...")


def describe_sample(index: int, prompt: str, response: str) -> str:
    """``sample INDEX (prompt='...', response='...')`` with both texts cut to 80 characters, for errors."""
    return f"sample {index} (prompt={_cut(prompt)}, response={_cut(response)})"


__all__ = ["InvalidRewardError", "RewardError", "RewardServerError", "describe_sample"]
