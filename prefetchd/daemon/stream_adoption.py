"""The batches an earlier daemon of the same job left in a stream's folder: kept, but those that cannot be
trusted, and said once the windows decide which stay.

A part of :class:`~prefetchd.daemon.stream.Stream`, which sets what is declared here in its ``__init__``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from prefetchd.buffer_protocol import Manifest, ProtocolError, list_batches, map_batch, not_of_stream
from prefetchd.daemon.consumers import Consumer
from prefetchd.words import counted

log = logging.getLogger("prefetchd.daemon.stream")  # the stream's messages, as before this module was split off


class StreamAdoption:
    """What a :class:`~prefetchd.daemon.stream.Stream` makes of the batches an earlier daemon left."""

    # Set by Stream.__init__.
    dir: Path
    fd: int
    manifest: Manifest
    high: int
    cap: int
    limit: int
    published: dict[int, Path]
    holders: list[Consumer]
    _adopted: set[int]

    if TYPE_CHECKING:  # the stream's
        @property
        def rank(self) -> int: ...
        def g(self, key: tuple[int, int]) -> int: ...

    def adopt_published(self) -> None:
        """Keep the finished batches an earlier daemon of the same job left, but those with replaced
        samples: built while a file could not be read, and a file since mended (the fix a log line
        asks for) would make them differ from the batches built now.  Built again, each is what the
        data gives today.  Headers that do not parse go too, and batches that are not this stream's at
        their name's position (``not_of_stream``): a daemon before batches named their stream wrote none
        that are (this daemon's manifest says its batches do, and its trainers refuse one that does not), and
        a member of a --group-access buffer's group may rename another rank's batch, or one kept from an
        earlier job, to a name here while no daemon runs.  Each is read through the folder's fd, as
        everything else in it: a member may put a link to another folder in its place, and that folder's
        files would decide which batches stay."""
        redo = older = 0
        manifest = self.manifest
        for key, path in list_batches(self.dir, self.fd).items():
            try:
                meta = map_batch(path, self.fd).meta
            except (ProtocolError, FileNotFoundError):
                meta = None
            if meta is None or meta.replaced:
                redo += 1
            elif meta.job is None and meta.rank is None:
                older += 1
            elif (meta.epoch, meta.step) != key or not_of_stream(meta, manifest.job_key, manifest.rank, keyed=True):
                log.warning("%s holds epoch %d step %d of %s, where its name says epoch %d step %d of rank %d of job "
                            "%s: someone who may rename the buffer's files (a member of its group?) put it there; "
                            "building it again", path, meta.epoch, meta.step, meta.stream, *key, manifest.rank,
                            manifest.job_key)
            else:
                self.published[self.g(key)] = path
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path.name, dir_fd=self.fd)
        self._adopted = set(self.published)  # said by ``say_adopted`` once the windows decide which stay
        if redo:
            log.info("building %s of rank %d again: %s replaced samples or could not be read",
                     counted(redo, "kept batch"), self.rank, "it had" if redo == 1 else "they had")
        if older:
            log.info("building %s of rank %d again: written by a prefetchd before batches named their job and rank",
                     counted(older, "kept batch"), self.rank)

    def say_adopted(self) -> None:
        """Log how many adopted batches stay, once the controller deleted those no window holds: a
        restart with a lower --high-water than the earlier run's keeps fewer than it found."""
        if not self._adopted:
            return
        kept = len(self._adopted & self.published.keys())
        dropped = [g for g in self._adopted if g not in self.published]
        first = min((c.position for c in self.holders), default=self.limit)
        consumed = sum(g < first for g in dropped)
        why = []
        if len(dropped) > consumed:
            capped = self.cap < self.high * len(self.holders)  # --max-buffer-bytes shrank the windows
            why.append(f"{len(dropped) - consumed} beyond --high-water {self.high}"
                       + (f" and the --max-buffer-bytes cap of {counted(self.cap, 'batch')}" if capped else ""))
        if consumed:
            why.append(f"{consumed} already consumed")
        log.info("kept %s of rank %d, built earlier for the same job%s", counted(kept, "finished batch"),
                 self.rank, f" (deleted {', '.join(why)})" if why else "")
        self._adopted = set()
