"""Multi-turn episodes as HTML, turn by turn: the policy's actions, then the observation after each turn
(a tool's response, an env's answer) greyed and in italics, since it is attended to but never trained on.

- ``turns_html(turns)``: the turns of a logged sample (``samples.jsonl``'s ``turns``, ``episode_turns``).
- ``episode_html(batch, row)``: the tokens of an episode batch row (``generate_episodes``), each turn's
  action tokens coloured by a per-token key as ``tokens_html`` colours them.
- ``episode_header(row)``: the line above an episode: turns, stop reason, reward.

Each turn opens with a separator naming the turn (0-based, as ``turn_index``) and its reward. The rollout
browser and the dashboard's samples table use these.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlbits.viz.tokens import color_scale, token_labels

ACTION_STYLE = "font-family:monospace;white-space:pre-wrap"
OBSERVATION_STYLE = (
    "font-family:monospace;white-space:pre-wrap;background:#ececec;color:#6e6e6e;font-style:italic"
)
TURN_STYLE = "border-top:1px solid #b0b0b0;margin-top:2px;font-size:85%;color:#555"


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else html.escape(str(value))


def turn_header(turn: int, reward: float | None) -> str:
    """The separator opening a turn: ``turn N`` and its reward (when known), as a ``div``."""
    text = f"turn {turn}" + (f" · reward {_number(float(reward))}" if reward is not None else "")
    return f'<div class="rlbits-turn" data-turn="{int(turn)}" style="{TURN_STYLE}">{text}</div>'


def episode_header(row: Mapping[str, Any]) -> str:
    """``N turns · stop: REASON · reward R`` for a sample row with ``num_turns`` / ``stop_reason`` /
    ``reward`` (each part only when the row has it), as a ``div``."""
    parts = []
    if "num_turns" in row:
        parts.append(f"{int(row['num_turns'])} turn{'s' if int(row['num_turns']) != 1 else ''}")
    if "stop_reason" in row:
        parts.append(f"stop: {html.escape(str(row['stop_reason']))}")
    if row.get("reward") is not None:
        parts.append(f"reward {_number(float(row['reward']))}")
    return f'<div class="rlbits-episode" style="font-weight:bold">{" · ".join(parts)}</div>'


def turns_html(turns: Sequence[Mapping[str, Any]]) -> str:
    """The turns of one episode, each a ``turn_header``, the action text (``span.rlbits-action``) and the
    observation text (``span.rlbits-observation``, greyed; left out when empty).

    ``turns`` holds dicts with ``turn``, ``action``, ``observation`` and ``reward`` (the rows of
    ``rlbits.rollout.multiturn.episode_turns``, as logged in ``samples.jsonl``). Raises KeyError naming a
    missing field."""
    parts = []
    for t in turns:
        missing = [k for k in ("turn", "action", "observation") if k not in t]
        if missing:
            raise KeyError(
                f"a turn needs 'turn', 'action' and 'observation'; this one lacks {missing}: {t!r}"
            )
        parts.append(turn_header(t["turn"], t.get("reward")))
        parts.append(
            f'<span class="rlbits-action" style="{ACTION_STYLE}">{html.escape(str(t["action"]))}</span>'
        )
        if t["observation"]:
            parts.append(
                f'<span class="rlbits-observation" title="observation: not trained on" '
                f'style="{OBSERVATION_STYLE}">{html.escape(str(t["observation"]))}</span>'
            )
    return "".join(parts)


def episode_html(
    batch: Any,
    row: int,
    key: str | torch.Tensor | None = None,
    *,
    tokenizer: Any = None,
    cmap: str | None = None,
) -> str:
    """The response tokens of episode ``row`` as HTML, turn by turn: a ``turn_header`` (with the turn's
    reward, the sum of ``turn_rewards`` over the turn), the action tokens (``span.rlbits-action``, coloured
    by ``key``'s value as ``tokens_html`` colours them when ``key`` is given; the value in the tooltip), then
    the observation tokens (``span.rlbits-observation``, greyed, no value). Padding is left out.

    Args:
        batch: an episode batch (``generate_episodes``): ``responses``, ``action_mask``, ``turn_index`` and
            ``turn_rewards`` [B, R].
        row: which episode.
        key: a batch key of a [B, R] tensor, or such a tensor; None: the action tokens uncoloured.
        tokenizer: decodes each token for its label; without one the labels are the token ids.
        cmap: as ``tokens_html``.

    Raises:
        KeyError: the batch lacks one of the keys above, or ``key``.
        IndexError: ``row`` is out of range. ValueError: ``key``'s tensor is not [B, R].
    """
    from matplotlib import colors

    missing = [k for k in ("responses", "action_mask", "turn_index", "turn_rewards") if k not in batch.keys()]
    if missing:
        raise KeyError(f"episode_html needs an episode batch (generate_episodes); it lacks {missing}")
    responses = batch["responses"]
    num_rows, length = responses.shape
    if not -num_rows <= row < num_rows:
        raise IndexError(f"row {row} is out of range for a batch of {num_rows} rows")
    values = None
    if key is not None:
        if isinstance(key, str) and key not in batch.keys():
            raise KeyError(f"the batch has no key {key!r}")
        values = batch[key] if isinstance(key, str) else key
        if not isinstance(values, torch.Tensor) or tuple(values.shape) != (num_rows, length):
            raise ValueError(
                f"episode_html needs a per-token [B, R] = [{num_rows}, {length}] quantity for key"
            )
        values = values[row].detach().float().cpu().tolist()
    ids = responses[row].cpu().tolist()
    actions = batch["action_mask"][row].bool().cpu().tolist()
    turns = batch["turn_index"][row].cpu().tolist()
    rewards = batch["turn_rewards"][row].float().cpu().tolist()
    labels = token_labels(ids, tokenizer)
    scale = None
    if values is not None:
        scale = color_scale([v for v, a, t in zip(values, actions, turns, strict=True) if a and t >= 0], cmap)
    turn_rewards: dict[int, float] = {}
    for t, r in zip(turns, rewards, strict=True):
        if t >= 0:
            turn_rewards[t] = turn_rewards.get(t, 0.0) + r
    parts, current = [], None
    for j, (label, is_action, turn) in enumerate(zip(labels, actions, turns, strict=True)):
        if turn < 0:
            continue
        if turn != current:
            parts.append(turn_header(turn, turn_rewards[turn]))
            current = turn
        text = html.escape(label)
        if not is_action:
            parts.append(f'<span class="rlbits-observation" title="observation: not trained on" '
                         f'style="{OBSERVATION_STYLE}">{text}</span>')
        elif scale is not None:
            rgba = scale.to_rgba(values[j])
            ink = "black" if sum(rgba[:3]) / 3 > 0.5 else "white"
            parts.append(f'<span class="rlbits-action" title="{values[j]:.4g}" style="{ACTION_STYLE};'
                         f'background:{colors.to_hex(rgba)};color:{ink};padding:0 1px">{text}</span>')
        else:
            parts.append(f'<span class="rlbits-action" style="{ACTION_STYLE}">{text}</span>')
    return "".join(parts)


__all__ = ["episode_header", "episode_html", "turn_header", "turns_html"]
