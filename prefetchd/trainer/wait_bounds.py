"""The bounds of a loader's waits, and how to lengthen them.

A :class:`BufferLoader` waits for two things: the manifest when it is created
(``manifest_wait``), and each batch file (``batch_waiter``, which meanwhile tells a
slow daemon from a stuck or a gone one).  Every wait is bounded by ``timeout``.
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path

from prefetchd.buffer_protocol.errors import shown
from prefetchd.buffer_protocol.layout import unfit_buffer_path

# How to wait longer, named for both ways in: prefetchd-train's flag and the loader's argument.
MORE_TIME = "pass a larger --timeout (prefetchd-train; timeout= of the loader)"
# The defaults of the waits, for BufferLoader, prefetchd-train's flags and the Lightning module alike.
DEFAULT_TIMEOUT = 120.0  # seconds for the manifest and for each batch, but one waiting on its storage (BatchWaiter)
DEFAULT_STALL_TIMEOUT = 60.0  # seconds without a heartbeat before a live daemon counts as stuck
DAEMON_GRACE = 5.0  # seconds with no daemon holding the lock before it counts as gone (a restart takes less)


def seconds(value: object) -> bool:
    """Whether ``value`` is a number of seconds (not a string from a config file, not a bool)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_timeout(timeout: object) -> float:
    """``timeout`` (the bound of each wait) as a float; ValueError naming it where it is none."""
    if not seconds(timeout) or not timeout > 0:  # type: ignore[operator]
        raise ValueError(f"timeout={timeout!r}: pass a positive number of seconds (math.inf: no limit)")
    return float(timeout)  # type: ignore[arg-type]


def buffer_path(buffer: object) -> Path:
    """``buffer`` (a daemon's --buffer) as an absolute path; TypeError or ValueError naming it where it cannot be
    one: BufferLoader(None) was "expected str, bytes or os.PathLike object", though bytes are refused, and ""
    was the folder the script ran in."""
    if not isinstance(buffer, (str, os.PathLike)) or not isinstance(os.fspath(buffer), str):
        raise TypeError(f"buffer={buffer!r:.60}: pass the daemon's --buffer folder as a str or pathlib.Path")
    path = os.path.expanduser(os.fspath(buffer))
    unfit = unfit_buffer_path(path)  # "" was the folder the script ran in
    if unfit is not None:
        raise ValueError(f"buffer={shown(os.fspath(buffer))}: {unfit}")  # cut short, as other messages quote values
    # Absolute: a notebook's later chdir must not move the buffer away from under the loader.
    return Path(path).absolute()


__all__ = ["DAEMON_GRACE", "DEFAULT_STALL_TIMEOUT", "DEFAULT_TIMEOUT", "MORE_TIME", "buffer_path", "check_timeout",
           "seconds"]
