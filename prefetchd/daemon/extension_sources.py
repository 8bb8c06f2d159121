"""The C extension's sources and their digest.

setup.py builds the digest into the extension (``SOURCE_DIGEST``), and ``jpeg_crop`` compares it with that of
the sources beside it: an extension built from other sources, as a checkout's `git pull` leaves the one `pip
install -e .` built, had every worker call functions it lacked, and the daemon stopped blaming the images (a
walk: "are these files images? Remove the ones that are not").  Standard library only: setup.py loads this file
by itself, where the package's dependencies may not be installed yet.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SOURCES = ("_cropjpeg.c", "_resample.c", "_resample.h")


def source_digest(folder: Path) -> str | None:
    """The first 16 hex digits of the SHA-256 of the extension's sources in ``folder``, in ``SOURCES`` order; None
    where one is not there (an install that leaves them out: nothing to compare with)."""
    digest = hashlib.sha256()
    for name in SOURCES:
        try:
            digest.update((folder / name).read_bytes())
        except OSError:
            return None
    return digest.hexdigest()[:16]


__all__ = ["SOURCES", "source_digest"]
