"""How a loader leaves: the last progress it writes as it closes, or once it is collected unclosed.

A :class:`~prefetchd.trainer.loader.BufferLoader` closed (``close()``, a ``with`` block, the interpreter's exit)
writes its progress file a last time, marked closed, so that the daemon says its trainer left rather than went
away, and holds nothing for it.  One collected unclosed (made in a function that returned) does the same from a
finalizer that holds what it needs, never the loader (``close_at_exit``).
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefetchd.trainer.batch import WaitMeter
from prefetchd.trainer.errors import LoaderError
from prefetchd.trainer.progress_file import ProgressFile

if TYPE_CHECKING:
    from prefetchd.trainer.loader import BufferLoader

logger = logging.getLogger("prefetchd.trainer.loader")  # the loader's messages, as before this module was split off


@dataclass
class Where:
    """A loader's position and what it read, kept apart from the loader so that the progress file can say
    the loader left after it was collected (``close_at_exit``)."""

    epoch: int
    step: int
    read_to_end: bool = False  # the loader handed out the job's last batch since it last moved
    handed_out: int = 0  # since the loader was made; less those still being copied: progress' read_batches


def unread_end(position: tuple[int, int], at: Where, epochs: int | None) -> bool:
    """Whether ``position`` is the job's end and the loader got there without reading its last batch."""
    return epochs is not None and position[0] >= epochs and not at.read_to_end


def say_left(progress: ProgressFile, at: Where, waits: WaitMeter, epochs: int | None) -> None:
    """Write the progress file a last time, marked closed, every batch handed out counted as consumed (the
    loader's at ``at``; its job has ``epochs``): the daemon then says the trainer left, and holds nothing for
    it.  Nothing where the loader never wrote it; LoaderError where this write fails, or where it never wrote it
    because its writes failed (``ProgressFile.untold``): the daemon was not told.

    Nothing either where another loader of this consumer wrote the file since (``another_wrote``): one that
    replaced this one (a notebook's cell run again while the first loader was still referenced), whose file it
    is now.  Closed at the interpreter's exit after that one had read the job to its end, the superseded loader
    wrote its own old position back, and the daemon of an --epochs job never finished (a walk of the API)."""
    if progress.published is None:
        untold = progress.untold()
        if untold is not None:
            raise LoaderError(untold)
        return
    if progress.another_wrote():
        return
    position = (at.epoch, at.step)
    if unread_end(position, at, epochs):  # not this loader's to announce (loader_progress.py's docstring)
        position = progress.published
    progress.publish(position, waits.share(), force=True, closed=True, read_batches=at.handed_out)


def close_at_exit(ref: weakref.ReferenceType[BufferLoader], pid: int, progress: ProgressFile, at: Where,
                   waits: WaitMeter, epochs: int | None) -> None:
    """Close a loader still open when the interpreter exits, or say in its progress file that it left once it is
    collected unclosed (a ``weakref.finalize``, which atexit runs for a loader still there; it holds what
    ``say_left`` needs, never the loader): a script that ends without ``close()``, also one whose loader
    was made in a function that returned (``def main(): ...``), leaves as one that closed, rather than
    looking like a trainer that went away.  A trainer killed (SIGKILL, a segfault, ``os._exit``) runs
    no atexit, and the daemon still sees it gone.

    Collected, it writes only where the progress file is still the one it wrote last (``written_since``).  On
    the device path it counts the batches handed out as consumed without waiting for their copies, as close()
    does after it: the feeder's own finalizer keeps their host memory until they are done, whenever it runs, and
    the daemon deleting those batches takes nothing from under them.  A staging copy reads its pinned slot, the
    file having been copied into it before the batch was handed out; pin='register' reads the file's mapping,
    whose pages an unlink leaves in place and which the daemon does not reuse as a spare while it is mapped
    (SPEC rule 1's lease)."""
    loader = ref()
    if os.getpid() != pid:  # a forked child's copy
        return
    if not progress.buffer.is_dir():  # removed meanwhile: no daemon to tell; the loader's finalizers let go
        return
    try:
        if loader is not None:
            loader.close()
            return
        try:
            # Nor where the file is gone or unreadable since: a collected loader recreates nothing.
            if not progress.written_since():
                say_left(progress, at, waits, epochs)
        finally:
            progress.release()
    except Exception as exc:  # nothing is left to raise it to; the daemon may take the trainer for gone
        logger.warning("closing the BufferLoader for %s at exit: %s", progress.buffer, exc)


__all__ = ["Where", "close_at_exit", "say_left", "unread_end"]
