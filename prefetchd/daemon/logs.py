"""How the daemon's processes log: one format for the controller and its workers.

Configured only in entry points: ``prefetchd`` commands (``setup_logging``) and each
worker process (``run_logged``).  A worker is forked from the forkserver, which never
configured logging, so without this its warnings went out through logging's "last
resort" handler as bare messages, without the time, level and logger every other
line has (and without journald's priority under systemd).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefetchd.throttle import Throttle
from prefetchd.words import one_line

log = logging.getLogger(__name__)
# status.json is rewritten every second: a full filesystem would log a line each time.
_STATUS_LINES = Throttle(60.0)


# The lines ``log_once`` has let through, by logger, message and arguments.
_SAID_ONCE: set[tuple[str, str, tuple[Any, ...]]] = set()


def log_once(logger: logging.Logger, level: int, message: str, *args: Any) -> None:
    """Log ``message % args`` the first time this process would, not again: what a daemon serving jobs finds
    anew at each job start (the same machine-sized defaults, the same buffer open to other users) was said at
    every one (a soak)."""
    key = (logger.name, message, args)
    if key not in _SAID_ONCE:
        _SAID_ONCE.add(key)
        logger.log(level, message, *args)


class OneLineFormatter(logging.Formatter):
    """Each record's message on one line (``one_line``); a traceback after it keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = one_line(record.message)
        return super().formatMessage(record)


class JournalFormatter(OneLineFormatter):
    """sd-daemon(3) priority prefixes, so journald files each line under its level;
    no timestamp, journald adds its own."""

    PRIORITIES = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

    def format(self, record: logging.LogRecord) -> str:
        return f"<{self.PRIORITIES.get(record.levelno, 6)}>{super().format(record)}"


def setup_logging(level: str | int) -> None:
    """Log to stderr at ``level`` ("info", or a ``logging`` level number), as journald or a terminal wants it."""
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("JOURNAL_STREAM"):  # set by systemd when stderr goes to the journal
        handler.setFormatter(JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    number = getattr(logging, level.upper()) if isinstance(level, str) else level
    # Debug is prefetchd's own: the libraries' (watchdog's three lines per status.json write, Pillow's PNG chunks in
    # every worker) buried it, 30 lines each 10 s of an idle daemon (a walk); their warnings still show.
    logging.basicConfig(level=max(number, logging.INFO), handlers=[handler])
    logging.getLogger("prefetchd").setLevel(number)


def run_logged(level: int, main: Callable[..., Any], *args: Any) -> None:
    """A child process's target: ``main(*args)``, logging as its parent does at ``level``."""
    setup_logging(level)
    main(*args)


def status_unwritten(buffer: Path, exc: OSError) -> None:
    """Warn that ``buffer``'s status.json could not be rewritten: at most once a minute while it lasts."""
    _STATUS_LINES.log(log, logging.WARNING, "cannot write status to %s: %s; `prefetchd status` shows the last one "
                      "written", buffer, exc.strerror or exc, others="other failed write")


__all__ = ["JournalFormatter", "OneLineFormatter", "run_logged", "setup_logging", "status_unwritten"]
