"""The one error type of the buffer protocol."""

from __future__ import annotations


class ProtocolError(ValueError):
    """A buffer file (batch, manifest, progress, lock) breaks the protocol.

    The message names the file, says what is wrong and what to do about it.
    """
