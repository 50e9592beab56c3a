"""A rollout browser for Jupyter (ipywidgets): page through ``samples.jsonl`` of a run, or a batch.

    RolloutBrowser("runs/default")            # a run dir, or a samples.jsonl path, or a list of dicts
    RolloutBrowser(batch, tokenizer=tok, key="advantages")   # a batch: tokens coloured by a per-token key

Controls: a step slider (rows logged at that step; run files only), a text filter (substring of prompt or
response), the sort order (as logged, reward high to low, low to high) and a page slider.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlbits.viz.dashboard import samples_table
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
    """One dict per row of a batch: ``prompt``, ``response`` (text, or tokens coloured by ``key`` as HTML),
    and every [B] tensor (``rewards``, ``group``, ...) as a number."""
    keys = set(batch.keys())
    num_rows = batch.batch_size[0]
    rows = []
    for i in range(num_rows):
        row: dict[str, Any] = {"row": i}
        if "prompt_text" in keys:
            row["prompt"] = batch["prompt_text"][i]
        if key is not None:
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
                                            description="step", continuous_update=False)  # fmt: skip
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


__all__ = ["RolloutBrowser", "batch_rows", "read_samples"]
