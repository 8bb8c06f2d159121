"""prefetchd.words: counts in messages read as English."""

from __future__ import annotations

import pytest

from prefetchd.words import agreeing, all_epochs, binary_size, counted, moment


@pytest.mark.parametrize(("count", "noun", "expected"), [
    (1, "shard", "1 shard"), (2, "shard", "2 shards"), (0, "epoch", "0 epochs"),
    (1, "unreadable file", "1 unreadable file"), (3, "unreadable file", "3 unreadable files"),
    (2, "retry", "2 retries"), (2, "day", "2 days"),
    (1, "class", "1 class"), (2, "class", "2 classes"), (2, "batch", "2 batches"), (2, "box", "2 boxes"),
])
def test_counted_nouns_are_plural_unless_one(count: int, noun: str, expected: str) -> None:
    assert counted(count, noun) == expected


@pytest.mark.parametrize(("n", "expected"), [
    (0, "0 bytes"), (1, "1 byte"), (200, "200 bytes"), (1023, "1023 bytes"), (1024, "1.0 KiB"),
    (48 * 2**10, "48.0 KiB"), (12 * 2**20, "12.0 MiB"), (1.5 * 2**30, "1.5 GiB"),
])
def test_a_size_is_said_in_the_unit_that_shows_it(n: float, expected: str) -> None:
    """Never "0.0 MiB" or "0.0 KiB": below a KiB, bytes."""
    assert binary_size(n) == expected


def test_agreeing_words_follow_the_count() -> None:
    assert [agreeing(n, "is", "are") for n in (0, 1, 2)] == ["are", "is", "are"]


def test_all_epochs_of_a_one_epoch_job_read_as_english() -> None:
    """"the trainers consumed all 1 epoch" read wrong (the demo's one-epoch run, docs walk)."""
    assert [all_epochs(n) for n in (1, 90)] == ["the 1 epoch", "all 90 epochs"]


def test_a_moment_no_calendar_holds_is_said_as_its_number() -> None:
    """A job.json's "submitted": 1e300, written by hand, is finite and so read; `prefetchd status` showing it
    died of OverflowError (a review)."""
    assert moment(1e300) == "time 1e+300 (out of range)"
    assert moment(0.0)[:4] in ("1970", "1969")  # local time of the epoch
