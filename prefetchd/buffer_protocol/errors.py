"""The one error type of the buffer protocol, and how its messages quote a value."""

from __future__ import annotations

import datetime
import pwd
import sys

MAX_INT = 2**63 - 1  # every integer of the protocol's documents and metadata fits an int64
SHOWN_CHARS = 80


def shown(value: object) -> str:
    """``repr(value)``, cut short where longer than SHOWN_CHARS: a document's or a job's field may be megabytes
    (written by any member of a --group-access buffer's group), and the message quoting it goes to the log,
    status.json and whoever submitted the job."""
    try:
        text = _spelled(value)
    except ValueError:  # an int of more digits than Python writes out (sys.get_int_max_str_digits)
        return f"an integer of more than {sys.get_int_max_str_digits()} digits"
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS - 20]}... ({len(text)} characters)"


def _spelled(value: object) -> str:
    """A value as the TOML or JSON it was read from spells it where Python's repr would not (``true``, not
    ``True``; a TOML date as written, not ``datetime.datetime(...)``); anything else as its repr."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (datetime.date, datetime.time)):  # a TOML date, time or date-time
        return value.isoformat()
    return repr(value)


def user_name(uid: int | None) -> str:
    """``alice (uid 1001)`` for messages, or just the uid when it has no name (a trainer's container may not know
    the daemon's users)."""
    if uid is None:
        return "an unknown user"
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


class ProtocolError(ValueError):
    """A buffer file (batch, manifest, progress, lock) breaks the protocol.

    The message names the file, says what is wrong and what to do about it.
    """
