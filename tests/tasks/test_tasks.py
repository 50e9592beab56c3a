"""Built-in tasks: registry, splits, rewards, corpora and the carry-dropping demonstrator."""

import collections
import random
import re

import pytest

from rlbits.tasks import TASKS, arithmetic, get_task, sentiment

# The tasks with a generated corpus and a base model built here; the real-data tasks (imdb, math) are tested in
# tests/tasks/test_real_tasks.py.
SYNTHETIC = ("arithmetic", "sentiment")

# --- registry


def test_get_task_returns_modules():
    assert get_task("sentiment") is sentiment
    assert get_task("arithmetic") is arithmetic
    assert sorted(TASKS) == ["arithmetic", "calculator", "guess_number", "imdb", "math", "sentiment"]


def test_get_task_unknown_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown task 'chess'; valid tasks: 'arithmetic', 'calculator', 'guess_number', 'imdb', 'math', 'sentiment'"):
        get_task("chess")


@pytest.mark.parametrize("name", SYNTHETIC)
def test_task_interface(name):
    task = get_task(name)
    for fn in ("prompts", "reward", "corpus"):
        assert callable(getattr(task, fn))


# --- splits


@pytest.mark.parametrize("name", SYNTHETIC)
def test_splits_disjoint_deterministic_and_distinct(name):
    task = get_task(name)
    train, test = task.prompts("train"), task.prompts("test")
    assert len(test) == task.N_TEST and len(train) > len(test)
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert not set(train) & set(test)
    assert task.prompts("train") == train and task.prompts("test") == test
    # Mutating the returned list must not change the task's split.
    train.clear()
    assert task.prompts("train")


@pytest.mark.parametrize("name", SYNTHETIC)
def test_unknown_split(name):
    with pytest.raises(ValueError, match=r"split must be one of 'train', 'test', got 'valid'"):
        get_task(name).prompts("valid")


def test_split_sizes_and_fixed_values():
    assert len(sentiment.prompts("train")) == 4375
    assert len(arithmetic.prompts("train")) == arithmetic.N_TRAIN == 5000
    # Pinned so an accidental change of the split (which would invalidate reported scores) is caught.
    assert arithmetic.prompts("test")[:3] == ["24+10=", "84+14=", "22+55="]
    assert sentiment.prompts("test")[0] == "I watched it last weekend, and the editing of this documentary"


# --- reward errors (both tasks)


@pytest.mark.parametrize("name", SYNTHETIC)
def test_reward_length_mismatch(name):
    task = get_task(name)
    p = task.prompts("test")[:2]
    with pytest.raises(ValueError, match=r"prompts and responses must have the same length, got 2 and 1"):
        task.reward(p, ["x"])


@pytest.mark.parametrize("name", SYNTHETIC)
def test_reward_type_errors(name):
    task = get_task(name)
    with pytest.raises(TypeError, match="responses must be a list of str"):
        task.reward(["1+1="], "2")
    with pytest.raises(TypeError, match="prompts must be a list of str"):
        task.reward([1], ["2"])


# --- sentiment


def test_sentiment_reward_hand_cases():
    p = ["The plot of this film"] * 4
    r = sentiment.reward(
        p, [" was wonderful. I loved it.", " was terrible. I hated it.", " is in French.", ""]
    )
    assert r[0] > 0.5 and r[1] < -0.5 and r[2] == 0.0 and r[3] == 0.0
    assert all(-1.0 <= x <= 1.0 for x in r)
    # Only the response is scored, and text after <eos> is ignored.
    assert sentiment.reward(["I loved this great film"], [" was in French."]) == [0.0]
    assert sentiment.reward(p[:1], [" was in French.<eos> great!"]) == [0.0]


def test_sentiment_reward_is_vader_compound():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    vader = SentimentIntensityAnalyzer()
    texts = sentiment.corpus(30, seed=3)
    assert sentiment.reward(texts, texts) == [vader.polarity_scores(t)["compound"] for t in texts]


def test_sentiment_prompts_carry_no_sentiment():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    vader = SentimentIntensityAnalyzer()
    for p in sentiment.prompts("train") + sentiment.prompts("test"):
        assert vader.polarity_scores(p)["compound"] == 0.0, p


def test_sentiment_corpus_deterministic_and_from_train_openings():
    a, b = sentiment.corpus(300, seed=7), sentiment.corpus(300, seed=7)
    assert a == b and a != sentiment.corpus(300, seed=8)
    assert sentiment.corpus(0, seed=7) == []
    openings = sentiment.prompts("train")
    test = sentiment.prompts("test")
    for doc in a:
        assert any(doc.startswith(o + " ") for o in openings)
        assert not any(doc.startswith(t + " ") for t in test)
    with pytest.raises(ValueError, match="n must be >= 0"):
        sentiment.corpus(-1, seed=0)


def test_sentiment_corpus_balanced():
    docs = sentiment.corpus(3000, seed=0)
    rewards = sentiment.reward(docs, docs)
    counts = collections.Counter((r > 0) - (r < 0) for r in rewards)
    # Sentiments cycle exactly; every positive/negative template scores on its side of 0, neutral ones 0.
    assert counts == {1: 1000, -1: 1000, 0: 1000}
    pos = [r for r in rewards if r > 0]
    neg = [r for r in rewards if r < 0]
    # Magnitudes balance, so a model that imitates the corpus scores about 0 on average.
    assert abs(sum(rewards) / len(rewards)) < 0.05
    assert abs(sum(pos) / len(pos) + sum(neg) / len(neg)) < 0.1


def _opening(doc: str) -> str:
    # Continuations start with one of these verbs, which no opening contains as a word.
    return re.split(r" (?:was|is|felt|seemed) ", doc, maxsplit=1)[0]


def test_sentiment_openings_independent_of_sentiment():
    # Each opening is followed by every sentiment: the prompt cannot give the sentiment away.
    docs = sentiment.corpus(6000, seed=1)
    rewards = sentiment.reward(docs, docs)
    first_word = collections.defaultdict(collections.Counter)
    for doc, r in zip(docs, rewards, strict=True):
        first_word[doc.split(" ")[0]][(r > 0) - (r < 0)] += 1
    for word, c in first_word.items():
        assert set(c) == {-1, 0, 1}, word
    for film in ("film", "movie", "western", "prequel"):
        signs = {
            (r > 0) - (r < 0) for doc, r in zip(docs, rewards, strict=True) if f" {film}" in _opening(doc)
        }
        assert signs == {-1, 0, 1}, film


def test_sentiment_continuation_unknown():
    with pytest.raises(ValueError, match="sentiment must be one of"):
        sentiment.continuation("angry", random.Random(0))


# --- arithmetic


def test_arithmetic_reward_hand_cases():
    p = ["37+48="] * 10
    responses = ["85", " 85\n", "85<eos>", "85<eos>garbage", "085", "+85", "85 apples", "8 5", "86", ""]
    assert arithmetic.reward(p, responses) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert arithmetic.reward(["0+0=", "999+999="], ["0", "1998"]) == [1.0, 1.0]


def test_arithmetic_reward_bad_prompt_names_index():
    with pytest.raises(
        ValueError, match=r"prompts\[1\]: arithmetic prompt must look like '37\+48=', got '3\*4='"
    ):
        arithmetic.reward(["1+1=", "3*4="], ["2", "12"])


def _reference_no_carry(a: int, b: int) -> int:
    # Independent reference: pad both to the same width, add column by column from the left.
    w = max(len(str(a)), len(str(b)))
    sa, sb = str(a).zfill(w), str(b).zfill(w)
    top = str(int(sa[0]) + int(sb[0]))
    rest = "".join(str((int(x) + int(y)) % 10) for x, y in zip(sa[1:], sb[1:], strict=True))
    return int(top + rest)


def _reference_carries(a: int, b: int) -> bool:
    # A carry leaves some column but the leftmost one iff the units..second-leftmost columns overflow.
    w = max(len(str(a)), len(str(b)))
    return any((a // 10**i) % 10 + (b // 10**i) % 10 >= 10 for i in range(w - 1))


def test_no_carry_sum_hand_cases():
    assert arithmetic.no_carry_sum(57, 68) == 115
    assert arithmetic.no_carry_sum(95, 8) == 93
    assert arithmetic.no_carry_sum(5, 8) == 13  # one column: written in full
    assert arithmetic.no_carry_sum(999, 1) == 990
    assert arithmetic.no_carry_sum(12, 34) == 46


def test_demonstrator_matches_reference():
    rng = random.Random(0)
    for _ in range(3000):
        a, b = arithmetic.sample_operands(rng)
        assert arithmetic.has_carry(a, b) == _reference_carries(a, b)
        assert arithmetic.no_carry_sum(a, b) == _reference_no_carry(a, b)
        assert (arithmetic.no_carry_sum(a, b) == a + b) == (not arithmetic.has_carry(a, b))


def test_demonstrator_drop_rate():
    rng = random.Random(0)
    carry = [
        (a, b)
        for a, b in (arithmetic.sample_operands(rng) for _ in range(20000))
        if arithmetic.has_carry(a, b)
    ]
    drops = sum(arithmetic.demonstrate(a, b, rng) != a + b for a, b in carry)
    # Binomial(n, 0.7): 5 standard deviations.
    n = len(carry)
    assert abs(drops / n - arithmetic.DROP_PROB) < 5 * (0.21 / n) ** 0.5
    # Without a carry it is always right and draws nothing from the generator.
    state = rng.getstate()
    assert arithmetic.demonstrate(12, 34, rng) == 46
    assert rng.getstate() == state


def test_arithmetic_corpus_deterministic_excludes_test_and_follows_demonstrator():
    docs = arithmetic.corpus(5000, seed=0)
    assert docs == arithmetic.corpus(5000, seed=0) and docs != arithmetic.corpus(5000, seed=1)
    test = set(arithmetic.prompts("test"))
    right = wrong = 0
    for doc in docs:
        prompt, answer = doc.split("=")
        prompt += "="
        assert prompt not in test
        a, b = arithmetic.parse_prompt(prompt)
        if int(answer) == a + b:
            right += 1
        else:
            assert int(answer) == _reference_no_carry(a, b) and _reference_carries(a, b)
            wrong += 1
    assert 0.25 < wrong / len(docs) < 0.45


def test_arithmetic_operands_two_digits_uniform():
    rng = random.Random(0)
    pairs = [arithmetic.sample_operands(rng) for _ in range(20000)]
    counts = collections.Counter(a for a, _ in pairs) + collections.Counter(b for _, b in pairs)
    assert sorted(counts) == list(range(10, 100))
    assert all(300 < c < 600 for c in counts.values())  # 40000 draws over 90 values: 444 expected


def test_arithmetic_operands_same_length(monkeypatch):
    monkeypatch.setattr(arithmetic, "DIGITS", (2, 3))
    rng = random.Random(0)
    pairs = [arithmetic.sample_operands(rng) for _ in range(4000)]
    assert all(len(str(a)) == len(str(b)) for a, b in pairs)
    assert {len(str(a)) for a, _ in pairs} == {2, 3}


def test_test_split_no_carry_fraction():
    # The greedy ceiling of a model that imitates the demonstrator (documented in docs/tasks.md).
    pairs = [arithmetic.parse_prompt(p) for p in arithmetic.prompts("test")]
    assert sum(not _reference_carries(a, b) for a, b in pairs) / len(pairs) == 0.536
