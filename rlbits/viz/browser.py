"""A rollout browser for Jupyter (ipywidgets): page through ``samples.jsonl`` of a run, or a batch.

    RolloutBrowser("runs/default")            # a run dir, or a samples.jsonl path, or a list of dicts
    RolloutBrowser(batch, tokenizer=tok, key="advantages")   # a batch: tokens coloured by a per-token key

Multi-turn episodes (an episode batch from ``generate_episodes``, or logged rows with ``turns``) are drawn
turn by turn (``rlbits.viz.episodes``): a header with the number of turns, the stop reason and the reward,
then each turn's separator (turn number, its reward), its action and the observation after it, greyed.

Controls: a step slider (rows logged at that step; run files only), a text filter (substring of prompt or
response), the sort order (as logged, reward high to low, low to high) and a page slider.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rlbits.rollout.multiturn import episode_turns
from rlbits.viz.dashboard import samples_table
from rlbits.viz.episodes import episode_header, episode_html, turns_html
from rlbits.viz.tokens import tokens_html

SORTS = ("as logged", "reward: high to low", "reward: low to high")


def read_samples(source: str | Path) -> list[dict[str, Any]]:
    """The rows of ``samples.jsonl`` (``source`` is the file or the run directory holding it).

    Raises FileNotFoundError naming the path if there is no such file."""
    path = Path(source)
    if path.is_dir():
        path = path / "samples.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist; pass a run directory with samples.jsonl, the file, a list of dicts or a batch"
        )
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def batch_rows(batch: Any, tokenizer: Any = None, key: str | None = None) -> list[dict[str, Any]]:
    """One dict per row of a batch: ``prompt``, ``response`` (text), ``response_html`` (the tokens coloured
    by ``key``, when given), and every [B] tensor (``rewards``, ``group``, ...) as a number.

    An episode batch (``turn_index``) adds ``stop_reason``, ``turns`` (``episode_turns``, when a
    ``tokenizer`` is given) and always ``response_html``: ``episode_html``, turn by turn."""
    keys = set(batch.keys())
    episodes = "turn_index" in keys
    num_rows = batch.batch_size[0]
    rows = []
    for i in range(num_rows):
        row: dict[str, Any] = {"row": i}
        if "prompt_text" in keys:
            row["prompt"] = batch["prompt_text"][i]
        if episodes:
            row["response_html"] = episode_html(batch, i, key, tokenizer=tokenizer)
            if "stop_reason" in keys:
                row["stop_reason"] = str(batch["stop_reason"][i])
            if tokenizer is not None:
                row["turns"] = episode_turns(batch, i, tokenizer)
        elif key is not None:
            row["response_html"] = tokens_html(batch, key, i, tokenizer=tokenizer)
        if "response_text" in keys:
            row["response"] = batch["response_text"][i]
        for k in sorted(keys):
            value = batch[k] if k not in ("prompt_text", "response_text") else None
            if isinstance(value, torch.Tensor) and value.dim() == 1:
                row[k] = value[i].item()
        if "rewards" in row:
            row["reward"] = row.pop("rewards")
        rows.append(row)
    return rows


def is_episode(row: Mapping[str, Any]) -> bool:
    """Whether a sample row is a multi-turn episode (it has ``turns`` or ``num_turns``)."""
    return "turns" in row or "num_turns" in row


def episodes_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """An HTML table of episode rows, one per row: where it comes from (``step``, ``split``, ``row``), the
    prompt, and the episode: ``episode_header`` then its turns (``response_html`` for a batch row, else
    ``turns_html`` of its logged ``turns``, else its ``response`` text)."""
    if not rows:
        return "<i>no samples</i>"
    cell = "style='text-align:left;vertical-align:top;font-family:monospace'"
    body = []
    for r in rows:
        where = " ".join(f"{k} {html.escape(str(r[k]))}" for k in ("step", "split", "row") if k in r)
        if "response_html" in r:
            episode = r["response_html"]
        elif "turns" in r:
            episode = turns_html(r["turns"])
        else:
            episode = html.escape(str(r.get("response", ""))).replace("\n", "<br>")
        prompt = html.escape(str(r.get("prompt", ""))).replace("\n", "<br>")
        body.append(
            f"<tr><td {cell}>{where}</td><td {cell}>{prompt}</td><td {cell}>{episode_header(r)}{episode}</td></tr>"
        )
    head = "".join(f"<th style='text-align:left'>{c}</th>" for c in ("sample", "prompt", "episode"))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


class RolloutBrowser:
    """Browse decoded rollouts: from a run (``samples.jsonl``), a list of dicts, or a batch TensorDict.

    Args:
        source: run directory, path of a ``samples.jsonl``, list of dicts (``prompt``, ``response``,
            ``reward``, optional ``step``), or a batch with ``prompt_text``/``response_text``.
        tokenizer, key: for a batch, colour each response's tokens by the per-token ``key``.
        page_size: rows per page.

    Attributes: ``rows`` (all rows), ``step``, ``filter``, ``sort``, ``page`` (the widgets), ``table``
    (the HTML), ``widget`` (the whole box); ``visible()`` returns the rows on screen.

    Raises:
        FileNotFoundError: a path without ``samples.jsonl``.
        ValueError: ``key`` given for a source that is not a batch.
    """

    def __init__(
        self, source: Any, *, tokenizer: Any = None, key: str | None = None, page_size: int = 10
    ) -> None:
        import ipywidgets as widgets

        if key is not None and isinstance(source, (str, Path, Sequence)):
            raise ValueError("key= colours the tokens of a batch; samples.jsonl rows hold text only")
        if isinstance(source, (str, Path)):
            rows = read_samples(source)
        elif isinstance(source, Sequence):
            rows = [dict(r) for r in source]
        else:
            rows = batch_rows(source, tokenizer, key)
        self.rows = rows
        self.page_size = page_size
        steps = sorted({r["step"] for r in rows if "step" in r})
        self.step = widgets.SelectionSlider(options=["all", *steps], value=steps[-1] if steps else "all",
                                            description="step", continuous_update=False)
        self.step.layout.display = None if steps else "none"
        self.filter = widgets.Text(
            placeholder="text in prompt or response", description="filter", continuous_update=False
        )
        self.sort = widgets.Dropdown(options=SORTS, value=SORTS[0], description="sort")
        self.page = widgets.IntSlider(min=0, max=0, value=0, description="page")
        self.count = widgets.HTML()
        self.table = widgets.HTML()
        for w in (self.step, self.filter, self.sort):
            w.observe(self._refresh_all, names="value")
        self.page.observe(self._refresh, names="value")
        self.widget = widgets.VBox(
            [
                widgets.HBox([self.step, self.filter]),
                widgets.HBox([self.sort, self.page, self.count]),
                self.table,
            ]
        )
        self._refresh_all()

    def matching(self) -> list[dict[str, Any]]:
        """The rows at the chosen step that pass the filter, in the chosen order."""
        rows = self.rows
        if self.step.value != "all":
            rows = [r for r in rows if r.get("step") == self.step.value]
        needle = self.filter.value.strip().lower()
        if needle:
            rows = [r for r in rows if needle in f"{r.get('prompt', '')} {r.get('response', '')}".lower()]
        if self.sort.value != SORTS[0]:
            rows = sorted(
                rows, key=lambda r: r.get("reward", float("nan")), reverse=self.sort.value == SORTS[1]
            )
        return rows

    def visible(self) -> list[dict[str, Any]]:
        """The rows on the current page."""
        start = self.page.value * self.page_size
        return self.matching()[start : start + self.page_size]

    def _refresh_all(self, _change: Any = None) -> None:
        n = len(self.matching())
        self.page.max = max(0, (n - 1) // self.page_size)
        self.page.value = 0
        self._refresh()

    def _refresh(self, _change: Any = None) -> None:
        rows = self.visible()
        self.count.value = f"{len(self.matching())} rows"
        if any(is_episode(r) for r in rows):
            self.table.value = episodes_table(rows)
            return
        shown = [{k: v for k, v in r.items() if k != "response_html"} for r in rows]
        html_table = samples_table(shown)
        if rows and "response_html" in rows[0]:
            # Replace the plain response column by the coloured tokens.
            body = "".join(
                f"<tr><td>{r['row']}</td><td>{r.get('reward', '')}</td><td>{r['response_html']}</td></tr>"
                for r in rows
            )
            html_table = (
                f"<table><tr><th>row</th><th>reward</th><th>response tokens</th></tr>{body}</table>"
                + html_table
            )
        self.table.value = html_table

    def _repr_mimebundle_(self, **kwargs: Any):
        return self.widget._repr_mimebundle_(**kwargs)


__all__ = ["RolloutBrowser", "batch_rows", "episodes_table", "is_episode", "read_samples"]
