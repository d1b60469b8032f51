"""Dev/test splits: disjoint by construction, and the guard raises on overlap."""
import random

import pytest

from research import data
from research.core.splits import (SplitOverlapError, Splits, canonical_key, check_disjoint,
                                  split_of, take)


def test_split_of_is_a_function_of_the_item_and_salt():
    keys = [f"item {i}" for i in range(2000)]
    splits = [split_of(k, "t") for k in keys]
    assert splits == [split_of(k, "t") for k in keys]  # deterministic
    frac = splits.count("dev") / len(splits)
    assert 0.45 < frac < 0.55
    assert 0.2 < [split_of(k, "t", 0.25) for k in keys].count("dev") / len(keys) < 0.3
    assert [split_of(k, "u") for k in keys] != splits  # the salt matters


def test_take_from_two_seeds_never_shares_an_item():
    # a small item space: two seeds draw many of the same items, yet no split shares one
    def stream(seed):
        rng = random.Random(seed)
        while True:
            yield (rng.randint(0, 9), rng.randint(0, 9))
    dev = take(stream(1000), "dev", 30, salt="pairs")
    test = take(stream(0), "test", 30, salt="pairs")
    assert len(set(dev)) == 30 and len(set(test)) == 30
    assert not set(dev) & set(test)
    check_disjoint(dev, test, what="pairs")  # no raise


def test_take_errors_when_the_split_is_too_small():
    with pytest.raises(ValueError, match="found .* of the 50 requested 'dev' items"):
        take(iter(range(40)), "dev", 50, salt="x")
    with pytest.raises(ValueError, match="split must be one of"):
        take(iter(range(4)), "val", 1, salt="x")
    with pytest.raises(ValueError, match="salt"):
        split_of("a", "")
    with pytest.raises(TypeError, match="key must be a str"):
        split_of(3, "x")


def test_guard_raises_on_overlap_and_names_the_item():
    with pytest.raises(SplitOverlapError, match=r"1 item\(s\) are in both the dev and the "
                                                r"test split, e.g. 'b'"):
        check_disjoint(["a", "b"], ["b", "c"], what="prompts")
    with pytest.raises(SplitOverlapError):
        Splits("prompts", dev=(("x", True),), test=(("y", True), ("x", True)))
    with pytest.raises(ValueError, match="the test split is empty"):
        Splits("prompts", dev=("a",), test=())
    s = Splits("prompts", dev=("a",), test=("b",))
    assert s["dev"] == ("a",) and s["test"] == ("b",)
    assert canonical_key((1, "+")) == "(1, '+')"


def test_text_splits_are_disjoint_and_cover_the_heldout_text():
    data.check_text_splits()
    dev, test = data.topic_names("dev"), data.topic_names("test")
    assert dev and test and not set(dev) & set(test)
    assert sorted(dev + test) == sorted(data.topic_names("heldout"))
    assert not set(data.topic_names("calibration")) & set(dev + test)
    # both halves are big enough to score on (characters of prose)
    assert min(len(data.corpus_text("dev")), len(data.corpus_text("test"))) > 20_000
