"""One response's tokens coloured by a per-token quantity: advantage, KL, logprob, value, ...

``plot_tokens(batch, "advantages", row=3, tokenizer=tok)`` returns a matplotlib figure; ``tokens_html``
gives the same colouring as HTML (the rollout browser uses it). By default only action tokens
(``action_mask`` True) are drawn: padding and tool tokens carry no per-token quantity (docs/design.md, "The
batch"). ``tokens="response"`` draws every response token (``response_mask``): the observation tokens of a
multi-turn episode (tool calls' results, env answers: attended to, never trained on) then show in italics on
a dashed grey frame, so ``plot_tokens(batch, batch["action_mask"].float(), tokens="response")`` draws the
mask itself.
"""

from __future__ import annotations

import html
from typing import Any

import torch

from rlbits.viz.plots import _pyplot

# Token labels: make whitespace visible without changing the layout much.
_SHOW = {"\n": "\\n", "\t": "\\t"}


def token_labels(token_ids: list[int], tokenizer: Any = None) -> list[str]:
    """One label per token id: ``tokenizer.decode([id])`` (newlines shown as ``\\n``), or the id itself."""
    if tokenizer is None:
        return [str(t) for t in token_ids]
    out = []
    for t in token_ids:
        text = tokenizer.decode([t])
        for raw, shown in _SHOW.items():
            text = text.replace(raw, shown)
        out.append(text if text else f"<{t}>")
    return out


def row_values(
    batch: Any, key: str | torch.Tensor, row: int, tokens: str = "action"
) -> tuple[list[int], list[float]]:
    """Response token ids and ``key``'s values of ``row``, on its action tokens only (``tokens="action"``)
    or on every real response token (``tokens="response"``: ``response_mask``, which a batch without one
    reads as ``action_mask``, docs/batch.md).

    ``key`` is a batch key holding a [B, R] tensor, or a [B, R] tensor computed by the caller (e.g.
    ``kl_penalty(...)``). Raises KeyError (unknown key), IndexError (bad row) or ValueError (wrong shape,
    or ``tokens`` not ``"action"`` / ``"response"``).
    """
    responses = batch["responses"]
    num_rows, length = responses.shape
    if not -num_rows <= row < num_rows:
        raise IndexError(f"row {row} is out of range for a batch of {num_rows} rows")
    if isinstance(key, str):
        if key not in batch.keys():
            raise KeyError(f"the batch has no key {key!r}; per-token keys it has: "
                           f"{sorted(k for k in batch.keys() if _is_per_token(batch[k], responses))}")
        values = batch[key]
    else:
        values = key
    if not isinstance(values, torch.Tensor) or tuple(values.shape) != (num_rows, length):
        shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(
            f"plot_tokens needs a per-token [B, R] = [{num_rows}, {length}] quantity; got {shape}"
        )
    mask = drawn_mask(batch, row, tokens)
    ids = responses[row].cpu()[mask].tolist()
    vals = values[row].detach().float().cpu()[mask].tolist()
    return ids, vals


def drawn_mask(batch: Any, row: int, tokens: str = "action") -> torch.Tensor:
    """[R] bool on CPU: the tokens of ``row`` that ``tokens`` selects (``"action"``: ``action_mask``;
    ``"response"``: ``response_mask``, else ``action_mask``). Raises ValueError for another ``tokens``."""
    if tokens not in ("action", "response"):
        raise ValueError(f"tokens must be 'action' or 'response', got {tokens!r}")
    key = "response_mask" if tokens == "response" and "response_mask" in batch.keys() else "action_mask"
    return batch[key][row].bool().cpu()


def observation_flags(batch: Any, row: int, tokens: str = "action") -> list[bool]:
    """For each token ``row_values(batch, key, row, tokens)`` returns: True where it is an observation (in
    the response but not an action: a tool's or env's tokens, not trained on)."""
    mask = drawn_mask(batch, row, tokens)
    return (~batch["action_mask"][row].bool().cpu())[mask].tolist()


def _is_per_token(value: Any, responses: torch.Tensor) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and tuple(value.shape) == tuple(responses.shape)
        and value.is_floating_point()
    )


def color_scale(values: list[float], cmap: str | None = None, center: float | None = None):
    """A ``ScalarMappable`` for ``values``: diverging and centred (at ``center``, default 0) when the values
    straddle 0 or a centre is given, else sequential (``viridis``) over their range."""
    import matplotlib as mpl
    from matplotlib import colors

    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    if center is None and lo < 0 < hi:
        center = 0.0
    if center is not None:
        half = max(abs(lo - center), abs(hi - center)) or 1.0
        norm = colors.Normalize(center - half, center + half)
        cmap = cmap or "RdBu"
    else:
        norm = colors.Normalize(lo, hi if hi > lo else lo + 1.0)
        cmap = cmap or "viridis"
    return mpl.cm.ScalarMappable(norm=norm, cmap=cmap)


def plot_tokens(
    batch: Any,
    key: str | torch.Tensor = "advantages",
    row: int = 0,
    *,
    tokenizer: Any = None,
    width: int = 60,
    cmap: str | None = None,
    center: float | None = None,
    title: str | None = None,
    tokens: str = "action",
):
    """Draw the action tokens of response ``row``, each on a box coloured by its value of ``key``.

    Args:
        batch: a batch TensorDict (docs/design.md) with ``responses`` and ``action_mask`` [B, R].
        key: a batch key of a [B, R] float tensor (``advantages``, ``logprobs``, ``values``, ...) or such a
            tensor itself (``rlbits.kl_penalty(...)``).
        row: which response.
        tokenizer: decodes each token for its label; without one the labels are the token ids.
        width: characters per line before wrapping.
        cmap, center: colour map and centre; by default values of both signs get a diverging map centred
            at 0 (red < 0 < blue), others the sequential ``viridis`` over their range.
        title: axes title; default ``"KEY, row ROW"`` and the prompt text when the batch has it.
        tokens: ``"action"`` (default) draws the action tokens; ``"response"`` every response token, the
            observation tokens (not actions) in italics on a dashed grey frame, with ``key``'s value there
            (0 for a per-token column the batch zeroes off actions).

    Returns:
        The ``Figure``. Its first axes holds one ``Text`` per drawn token, in order (label: the token;
        ``get_gid()``: ``"VALUE"``; box colour: ``fig.colorbar_mappable.to_rgba(value)``; an observation's
        label is italic); the colour bar is ``fig.axes[1]``.

    Raises:
        KeyError, IndexError, ValueError: as ``row_values``.
    """
    plt = _pyplot()
    ids, vals = row_values(batch, key, row, tokens)
    observed = observation_flags(batch, row, tokens)
    labels = token_labels(ids, tokenizer)
    scale = color_scale(vals, cmap, center)
    # Lay the tokens out in a monospace grid of `width` characters per line.
    places, x, y = [], 0, 0
    for label in labels:
        n = max(len(label), 1) + 1
        if x and x + n > width:
            x, y = 0, y + 1
        places.append((x, y))
        x += n
    lines = y + 1
    fig, ax = plt.subplots(figsize=(max(4.0, 0.13 * width), 0.9 + 0.38 * lines))
    for (px, py), label, value, obs in zip(places, labels, vals, observed, strict=True):
        frame = dict(edgecolor="0.45", linestyle="--", linewidth=1.0) if obs else dict(edgecolor="none")
        text = ax.text(px, py, label, family="monospace", fontsize=10, va="center", ha="left",
                       style="italic" if obs else "normal",
                       bbox=dict(boxstyle="square,pad=0.15", facecolor=scale.to_rgba(value), **frame))
        text.set_gid(repr(value))
    ax.set_xlim(-0.5, width + 0.5)
    ax.set_ylim(lines - 0.5, -0.5)
    ax.axis("off")
    name = key if isinstance(key, str) else "value"
    if title is None:
        title = f"{name}, row {row}"
        if "prompt_text" in batch.keys():
            title += f" - prompt: {batch['prompt_text'][row]!r}"
    ax.set_title(title, fontsize=10, loc="left")
    fig.colorbar(scale, ax=ax, orientation="vertical", fraction=0.03, pad=0.01, label=name)
    fig.colorbar_mappable = scale
    return fig


def tokens_html(
    batch: Any, key: str | torch.Tensor, row: int, *, tokenizer: Any = None, cmap: str | None = None
) -> str:
    """The action tokens of ``row`` as HTML spans coloured as ``plot_tokens`` colours them (value in the
    tooltip)."""
    from matplotlib import colors

    ids, vals = row_values(batch, key, row)
    scale = color_scale(vals, cmap)
    spans = []
    for label, value in zip(token_labels(ids, tokenizer), vals, strict=True):
        rgba = scale.to_rgba(value)
        ink = "black" if sum(rgba[:3]) / 3 > 0.5 else "white"
        spans.append(f'<span title="{value:.4g}" style="background:{colors.to_hex(rgba)};color:{ink};'
                     f'font-family:monospace;white-space:pre;padding:0 1px">{html.escape(label)}</span>')
    return "".join(spans)


__all__ = [
    "color_scale",
    "drawn_mask",
    "observation_flags",
    "plot_tokens",
    "row_values",
    "token_labels",
    "tokens_html",
]
