"""The bounds of a loader's waits, and how to lengthen them.

A :class:`BufferLoader` waits for two things: the manifest when it is created
(``manifest_wait``), and each batch file (``batch_waiter``, which meanwhile tells a
slow daemon from a stuck or a gone one).  Every wait is bounded by ``timeout``.
"""

from __future__ import annotations

# How to wait longer, named for both ways in: prefetchd-train's flag and the loader's argument.
MORE_TIME = "pass a larger --timeout (prefetchd-train; timeout= of the loader)"
# The defaults of the waits, for BufferLoader, prefetchd-train's flags and the Lightning module alike.
DEFAULT_TIMEOUT = 120.0  # seconds for the manifest and for each batch, but one waiting on its storage (BatchWaiter)
DEFAULT_STALL_TIMEOUT = 60.0  # seconds without a heartbeat before a live daemon counts as stuck
DAEMON_GRACE = 5.0  # seconds with no daemon holding the lock before it counts as gone (a restart takes less)


__all__ = ["DAEMON_GRACE", "DEFAULT_STALL_TIMEOUT", "DEFAULT_TIMEOUT", "MORE_TIME"]
