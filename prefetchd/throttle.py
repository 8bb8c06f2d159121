"""A line for a failure that repeats, at most once per interval: the ones held back in between are
counted, for the next line that is let through to say how many it stands for.

One outage fails many reads or builds at once, and each retries: a line for each buries the log.
"""

from __future__ import annotations

import logging
import threading
import time

from prefetchd.words import counted


class Throttle:
    """Lets one line through per ``seconds``, for all threads of the process."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._last: float | None = None
        self._held = 0

    def let_through(self) -> int | None:
        """None: hold this line back (it is counted); else how many were held back since the last one."""
        now = time.monotonic()
        with self._lock:
            if self._last is not None and now - self._last < self.seconds:
                self._held += 1
                return None
            held, self._held, self._last = self._held, 0, now
            return held

    def log(self, logger: logging.Logger, level: int, message: str, *args: object, others: str,
            scope: str = "") -> None:
        """``message % args`` at ``level`` when let through, saying how many were held back since (counted
        as ``others``, "other retry" say, then ``scope``); at DEBUG when held back itself."""
        held = self.let_through()
        if held is None:
            logger.debug(message, *args)
            return
        note = f" ({counted(held, others)}{scope} since the last such line, not logged)" if held else ""
        logger.log(level, message + "%s", *args, note)


__all__ = ["Throttle"]
