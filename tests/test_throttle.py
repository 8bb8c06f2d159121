"""The throttle behind the retry and failed-build lines: one per interval, the next one counting the rest."""

from __future__ import annotations

import threading
import time

import pytest

from prefetchd.throttle import Throttle


def test_one_line_per_interval_and_the_next_one_counts_those_held_back() -> None:
    throttle = Throttle(1.0)
    assert throttle.let_through() == 0  # the first of an outage: at once, nothing held back yet
    assert [throttle.let_through() for _ in range(5)] == [None] * 5
    time.sleep(1.05)
    assert throttle.let_through() == 5
    assert throttle.let_through() is None


def test_threads_share_it_and_no_line_is_lost_from_the_count() -> None:
    throttle = Throttle(3600.0)
    seen: list[int | None] = []
    lock = threading.Lock()

    def hammer() -> None:
        for _ in range(1000):
            got = throttle.let_through()
            with lock:
                seen.append(got)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen.count(0) == 1 and seen.count(None) == 3999
    throttle._last = time.monotonic() - 3601  # an hour later
    assert throttle.let_through() == 3999


def test_log_says_how_many_lines_it_held_back(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    logger = logging.getLogger("prefetchd.test_throttle")
    throttle = Throttle(3600.0)
    with caplog.at_level(logging.DEBUG, logger=logger.name):
        for k in range(3):
            throttle.log(logger, logging.WARNING, "read %d failed", k, others="other read")
        throttle._last = time.monotonic() - 3601
        throttle.log(logger, logging.WARNING, "read %d failed", 3, others="other read", scope=" of this process")
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said == [(logging.WARNING, "read 0 failed"), (logging.DEBUG, "read 1 failed"), (logging.DEBUG, "read 2 failed"),
                    (logging.WARNING, "read 3 failed (2 other reads of this process since the last such line, not logged)")]
