"""prefetchd.words: counts in messages read as English."""

from __future__ import annotations

import pytest

from prefetchd.words import counted


@pytest.mark.parametrize(("count", "noun", "expected"), [
    (1, "shard", "1 shard"), (2, "shard", "2 shards"), (0, "epoch", "0 epochs"),
    (1, "unreadable file", "1 unreadable file"), (3, "unreadable file", "3 unreadable files"),
    (2, "retry", "2 retries"), (2, "day", "2 days"),
    (1, "class", "1 class"), (2, "class", "2 classes"), (2, "batch", "2 batches"), (2, "box", "2 boxes"),
])
def test_counted_nouns_are_plural_unless_one(count: int, noun: str, expected: str) -> None:
    assert counted(count, noun) == expected
