"""Sentiment task: continue the opening of a short movie review; the reward is how positive the continuation is.

- Prompts are sentiment-free openings such as ``"After the first hour, the pacing of this remake"``. Every
  word in them scores 0 in the VADER lexicon, and in the corpus each opening is followed by positive,
  negative and neutral continuations equally often, so the opening does not give the sentiment away.
- ``reward`` is the VADER compound score (Hutto and Gilbert 2014, the ``vaderSentiment`` package) of the
  response alone, in [-1, 1].
- ``corpus`` composes short reviews from templates and word lists: one third positive, one third negative,
  one third neutral (facts about running time, setting, release year). The base model trained on it samples
  continuations whose mean reward is near 0 with a wide spread, which RL can push towards +1.

See ``docs/tasks.md`` for how the corpus is built and the base model's measured scores. The base model
itself (its recipe, the builder, the cache) lives in ``rlbits.zoo``:
``rlbits.zoo.base_model("sentiment")``.
"""

from __future__ import annotations

import random
from functools import cache

from rlbits.tasks._common import check_pairs

NAME = "sentiment"
SPLITS = ("train", "test")
SENTIMENTS = ("positive", "negative", "neutral")
N_TEST = 500
_SPLIT_SEED = 20240601


# --- Openings (the prompts). Every word here scores 0 in the VADER lexicon (tests check it).
_LEAD_INS = ("", "Overall, ", "After the first hour, ", "I watched it last weekend, and ", "In short, ")
_ASPECTS = (
    "acting", "plot", "story", "soundtrack", "ending", "dialogue", "cinematography", "pacing", "script",
    "cast", "direction", "score", "opening scene", "final act", "lead actor", "editing", "music",
    "screenplay", "premise", "camera work", "lighting", "first half", "second half", "set design",
    "main character",
)
_FILMS = (
    "film", "movie", "sequel", "drama", "documentary", "remake", "western", "musical", "mystery", "biopic",
    "picture", "adaptation", "prequel",
)
_PATTERNS = ("the {aspect} of this {film}", "the {aspect} in this {film}", "this {film}'s {aspect}")

# --- Continuations.
_VERBS = ("was", "is", "felt", "seemed")
_BOOSTERS = ("", "", "really ", "very ", "quite ", "so ")
_POS_ADJ = (
    "good", "great", "wonderful", "excellent", "brilliant", "delightful", "charming", "beautiful", "superb",
    "fantastic", "fun", "enjoyable", "lovely", "amazing", "perfect", "clever", "fresh", "stunning", "sweet",
    "thrilling", "inspiring",
)
_NEG_ADJ = (
    "bad", "terrible", "awful", "boring", "dull", "poor", "weak", "horrible", "dreadful", "painful",
    "stupid", "ugly", "annoying", "disappointing", "dismal", "lousy", "sad", "nasty", "dumb",
    "pathetic", "lame",
)
_NEU_PRED = (
    "about two hours long", "shot in {place}", "filmed in {year}", "in black and white", "based on a book",
    "written by the director", "similar to the first one", "about what I expected", "set in {place}",
    "made on a small budget", "released in {year}", "in {language} with subtitles", "mostly quiet",
)
_POS_SENT = (
    "I {pos_verb} every minute of it.", "The whole cast did a {pos_adj} job.",
    "I would recommend it to anyone.", "It made me smile.", "Best {film} I have seen this year.",
    "What a {pos_adj} surprise!", "I will happily watch it again.", "The ending was {pos_adj} too.",
    "My {person} {pos_verb} it too.", "It is a {pos_adj} way to spend an evening.",
)
_NEG_SENT = (
    "I {neg_verb} every minute of it.", "The whole cast did a {neg_adj} job.",
    "It was a waste of two hours.", "It made me angry.", "Worst {film} I have seen this year.",
    "What a {neg_adj} mess!", "What a waste of time.", "The ending was {neg_adj} too.",
    "My {person} {neg_verb} it too.", "It is a {neg_adj} way to spend an evening.",
)
_NEU_SENT = (
    "It runs about {minutes} minutes.", "I saw it on a {day} with my {person}.",
    "The story takes place in {place}.", "It came out in {year}.", "Most of it was shot in {place}.",
    "There is a scene on a train near the end.", "The director also wrote the script.",
    "It is in {language} with subtitles.", "My {person} picked it.", "I watched it at home on a {day}.",
)
_POS_VERBS = ("loved", "enjoyed", "liked", "adored")
_NEG_VERBS = ("hated", "disliked", "regretted", "despised")
_PLACES = ("Paris", "a small town", "Canada", "the desert", "New York", "a farm", "Ohio", "an old house")
_YEARS = tuple(str(y) for y in range(1975, 2021, 3))
_LANGUAGES = ("French", "Spanish", "German", "Korean", "Italian", "Japanese")
_PEOPLE = ("sister", "brother", "dad", "mom", "roommate", "neighbor", "cousin", "uncle")
_DAYS = ("Monday", "Tuesday", "Sunday", "Saturday", "Thursday")


def _all_openings() -> list[str]:
    out = []
    for lead in _LEAD_INS:
        for pattern in _PATTERNS:
            for film in _FILMS:
                for aspect in _ASPECTS:
                    text = lead + pattern.format(aspect=aspect, film=film)
                    out.append(text[0].upper() + text[1:])
    return out


@cache
def _splits() -> dict[str, tuple[str, ...]]:
    openings = _all_openings()
    random.Random(_SPLIT_SEED).shuffle(openings)
    return {"test": tuple(openings[:N_TEST]), "train": tuple(openings[N_TEST:])}


def prompts(split: str) -> list[str]:
    """Review openings of ``split`` (``"train"``: 4375 prompts, ``"test"``: 500), disjoint and fixed.

    Raises:
        ValueError: ``split`` is not ``"train"`` or ``"test"``.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(map(repr, SPLITS))}, got {split!r}")
    return list(_splits()[split])


@cache
def _analyzer():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()


def strip_eos(response: str, eos: str = "<eos>") -> str:
    """``response`` up to its first ``eos`` string (text after EOS is not part of the response)."""
    return response.split(eos, 1)[0]


def reward(prompts: list[str], responses: list[str]) -> list[float]:
    """VADER compound score of each response (the prompt is not scored), in [-1, 1].

    Args:
        prompts: the review openings (only their count is used).
        responses: the continuations; anything from a literal ``"<eos>"`` on is dropped first.

    Returns:
        One float per pair: > 0 positive, < 0 negative, 0 for text without sentiment (or empty).

    Raises:
        TypeError: an argument is not a list of str.
        ValueError: the lists differ in length.
    """
    check_pairs(prompts, responses)
    analyzer = _analyzer()
    return [float(analyzer.polarity_scores(strip_eos(r))["compound"]) for r in responses]


def _fill(template: str, rng: random.Random) -> str:
    return template.format(
        pos_adj=rng.choice(_POS_ADJ),
        neg_adj=rng.choice(_NEG_ADJ),
        pos_verb=rng.choice(_POS_VERBS),
        neg_verb=rng.choice(_NEG_VERBS),
        film=rng.choice(_FILMS),
        person=rng.choice(_PEOPLE),
        place=rng.choice(_PLACES),
        year=rng.choice(_YEARS),
        language=rng.choice(_LANGUAGES),
        minutes=rng.randrange(80, 181, 5),
        day=rng.choice(_DAYS),
    )


def continuation(sentiment: str, rng: random.Random) -> str:
    """A review continuation of one ``sentiment`` (``"positive"``, ``"negative"``, ``"neutral"``).

    Shape: ``" {verb} {booster}{adjective}."`` (neutral: ``" {verb} {fact}."``) then 0-2 more sentences of
    the same sentiment. Starts with a space, so ``opening + continuation`` is the review.

    Raises:
        ValueError: unknown ``sentiment``.
    """
    if sentiment not in SENTIMENTS:
        raise ValueError(f"sentiment must be one of {', '.join(map(repr, SENTIMENTS))}, got {sentiment!r}")
    # "felt"/"seemed" read wrong before a fact ("felt filmed in 1990").
    verb = rng.choice(_VERBS if sentiment != "neutral" else _VERBS[:2])
    if sentiment == "positive":
        first, pool = f"{rng.choice(_BOOSTERS)}{rng.choice(_POS_ADJ)}", _POS_SENT
    elif sentiment == "negative":
        first, pool = f"{rng.choice(_BOOSTERS)}{rng.choice(_NEG_ADJ)}", _NEG_SENT
    else:
        first, pool = _fill(rng.choice(_NEU_PRED), rng), _NEU_SENT
    end = rng.choice((".", ".", ".", "!")) if sentiment != "neutral" else "."
    sentences = [_fill(t, rng) for t in rng.sample(pool, rng.randrange(0, 3))]
    return " ".join([f" {verb} {first}{end}", *sentences]).replace("  ", " ")


def corpus(n: int, seed: int) -> list[str]:
    """``n`` short reviews (opening + continuation, no EOS) to pretrain the base model.

    Openings come from the train split only. Sentiments cycle positive, negative, neutral (exactly balanced
    to within one), each review's words are drawn with ``random.Random(seed)``: the same ``(n, seed)``
    gives the same list.

    Raises:
        ValueError: ``n < 0``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    openings = _splits()["train"]
    return [rng.choice(openings) + continuation(SENTIMENTS[i % 3], rng) for i in range(n)]
