"""The one error type of the buffer protocol, and how its messages quote a value."""

from __future__ import annotations

import pwd
import sys

MAX_INT = 2**63 - 1  # every integer of the protocol's documents and metadata fits an int64
SHOWN_CHARS = 80


def shown(value: object) -> str:
    """``repr(value)``, cut short where longer than SHOWN_CHARS: a document's or a job's field may be megabytes
    (written by any member of a --group-access buffer's group), and the message quoting it goes to the log,
    status.json and whoever submitted the job."""
    try:
        text = repr(value)
    except ValueError:  # an int of more digits than Python writes out (sys.get_int_max_str_digits)
        return f"an integer of more than {sys.get_int_max_str_digits()} digits"
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS - 20]}... ({len(text)} characters)"


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
