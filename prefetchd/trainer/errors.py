"""Errors the trainer side raises when the buffer does not deliver.

A malformed file in the buffer is the protocol's business and raises
:class:`prefetchd.buffer_protocol.ProtocolError`; these are about waiting: the
daemon is slow, stuck or gone.  Every message names the buffer, what was waited
for and the command that fixes it.
"""

from __future__ import annotations


class LoaderError(RuntimeError):
    """The buffer loader cannot deliver the batch the trainer needs."""


class LoaderTimeout(LoaderError, TimeoutError):
    """A bounded wait (for the manifest or a batch) ran out."""


class DaemonGone(LoaderError):
    """No daemon owns the buffer and the batch the trainer needs is not there."""


class StateMismatch(LoaderError, ValueError):
    """A loader state (from a checkpoint) does not fit the buffer's job."""


__all__ = ["DaemonGone", "LoaderError", "LoaderTimeout", "StateMismatch"]
