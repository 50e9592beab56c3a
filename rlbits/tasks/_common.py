"""Pieces the task modules share: the argument checks of ``prompts`` and ``reward``, and disjoint train/test
problem splits."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Hashable, Iterator, Sequence


def check_split(split: str, splits: Sequence[str]) -> None:
    """The argument check of every task's ``prompts(split)``.

    Raises:
        ValueError: ``split`` is not one of ``splits``.
    """
    if split not in splits:
        raise ValueError(f"split must be one of {', '.join(map(repr, splits))}, got {split!r}")


@contextlib.contextmanager
def at_prompt(i: int) -> Iterator[None]:
    """Re-raise a ``ValueError`` from the block as ``ValueError("prompts[i]: ...")``: which prompt of a
    ``reward`` call was bad."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"prompts[{i}]: {e}") from None


def check_pairs(prompts: list[str], responses: list[str]) -> None:
    """The argument check of every task's ``reward(prompts, responses)``.

    Raises:
        TypeError: an argument is not a list (or tuple) of str (the message names the first bad index).
        ValueError: the lists differ in length.
    """
    for name, value in (("prompts", prompts), ("responses", responses)):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a list of str, got {type(value).__name__}")
        bad = next((i for i, x in enumerate(value) if not isinstance(x, str)), None)
        if bad is not None:
            raise TypeError(f"{name} must be a list of str; {name}[{bad}] is {type(value[bad]).__name__}")
    if len(prompts) != len(responses):
        raise ValueError(
            f"prompts and responses must have the same length, got {len(prompts)} and {len(responses)}"
        )


def disjoint_splits(
    sample: Callable[[random.Random], Hashable],
    render: Callable[..., str],
    *,
    n_test: int,
    n_train: int,
    test_seed: int,
    train_seed: int,
) -> dict[str, tuple[str, ...]]:
    """``{"test": ..., "train": ...}``: ``n_test`` distinct problems drawn with ``sample`` from a
    ``random.Random(test_seed)``, then ``n_train`` distinct ones from ``random.Random(train_seed)`` that are
    not test problems, each rendered as ``render(*problem)``, in the order drawn (fixed by the seeds)."""
    test_rng, train_rng = random.Random(test_seed), random.Random(train_seed)
    test: dict[Hashable, None] = {}
    while len(test) < n_test:
        test[sample(test_rng)] = None
    train: dict[Hashable, None] = {}
    while len(train) < n_train:
        problem = sample(train_rng)
        if problem not in test:
            train[problem] = None
    return {"test": tuple(render(*p) for p in test), "train": tuple(render(*p) for p in train)}
