"""How much of the buffer's filesystem the controller's batches take, and what is left: the sizes of batch files
(planned once per length), the bytes the streams' batches hold, and the free space once the builds in flight are
filled; and the pause for space that holds production at the --min-free-mb floor until there is room again.  The
controller (``producer.Producer``) asks it before each batch, and its status reports it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from prefetchd.buffer_protocol import BatchLayout
from prefetchd.daemon.buffer_dir import free_bytes, pause_message
from prefetchd.daemon.mounts import BASE_PAGE_BYTES, taken_bytes
from prefetchd.daemon.sampler import batch_len
from prefetchd.daemon.stream import Stream


class BufferSpace:
    """The space of ``buffer``'s filesystem as ``streams``' batches of ``batch_size`` images of ``image_size``
    pixels use it, above a floor of ``min_free`` bytes."""

    def __init__(self, buffer: Path, streams: Sequence[Stream], batch_size: int, image_size: int,
                 min_free: int, unit: int = BASE_PAGE_BYTES) -> None:
        """``unit``: the bytes by which a file's space grows there (``mounts.allocation_unit``): every file length
        is counted as the space it takes."""
        self.buffer = buffer
        self.streams = streams
        self.batch_size = batch_size
        self.image_size = image_size
        self.min_free = min_free
        self.unit = unit
        self._layouts: dict[int, BatchLayout] = {}  # by batch length: layout
        # A pause for space: from the first batch held back at the floor until the filesystem has room above it
        # again (``room_again``), however many batches are built in spares meanwhile.
        self.paused = False

    def layout(self, stream: Stream, g: int) -> BatchLayout:
        """The layout of ``stream``'s batch ``g``: an epoch's short last batch is a smaller file.  Planned once per
        batch length (the full one and an epoch's short last one): the status sums every waiting batch's file
        each second, and planning each again took 3.8 ms a second for 8 ranks of 64 waiting batches (0.4 ms now)."""
        size = batch_len(stream.key(g)[1], self.batch_size, stream.manifest.samples_per_epoch)
        layout = self._layouts.get(size)
        if layout is None:
            layout = self._layouts[size] = BatchLayout.plan(size, self.image_size, self.image_size)
        return layout

    def held_bytes(self) -> int:
        """Bytes of the batches waiting and being built, each file's own length: counted as full batches, an
        epoch's short last ones made the buffer and the free space together more than a small tmpfs holds (36.8 MiB
        in it and 35.2 MiB free on 64 MiB)."""
        return (sum(self.taken(b.layout.file_len) for s in self.streams for b in s.building.values())
                + sum(self.taken(self.layout(s, g).file_len) for s in self.streams for g in s.published))

    def taken(self, file_len: int) -> int:
        """The space a file of ``file_len`` bytes takes on the buffer's filesystem."""
        return taken_bytes(file_len, self.unit)

    def left_free(self, file_len: int) -> int:
        """Free bytes of the buffer's filesystem once the batches being built in fresh files are filled (a spare's
        pages are there already) and one more of ``file_len`` bytes is, in fresh pages too."""
        pending = sum(self.taken(b.layout.file_len) for s in self.streams for b in s.building.values()
                      if not b.pending.reused)
        return free_bytes(self.buffer) - pending - self.taken(file_len)

    def shortage(self, file_len: int, spare_bytes: int) -> str | None:
        """Why the next batch, of ``file_len`` bytes, must wait (the pause's message, ``pause_message``): the free
        space once it is built falls below the floor; None where it may be built.  A spare (``spare_bytes`` in
        all) counts as free, as the consumed batch it was would: a batch begun in one takes no new page, one begun
        in fresh pages is begun once spares are deleted for the room they were counted as (``room_wanted``,
        ``SpareFiles.release``), and spares beyond the room the cap leaves are deleted (SpareFiles.fit, .take)."""
        free = self.left_free(file_len) + spare_bytes
        if free >= self.min_free:
            return None
        return pause_message(self.buffer, free, self.held_bytes(), self.taken(file_len), self.min_free)

    def room_wanted(self, file_len: int) -> int:
        """The bytes the filesystem lacks above the floor for a batch of ``file_len`` bytes in fresh pages: what
        spares are deleted for where it fits none (0: no lack)."""
        return max(0, self.min_free - self.left_free(file_len))

    def pause(self) -> bool:
        """Production waits for space; whether that begins a pause: one shortage, one pause, not one for each
        batch built in a spare meanwhile."""
        begun, self.paused = not self.paused, True
        return begun

    def room_again(self, file_len: int) -> int | None:
        """End a pause once the filesystem itself has room above the floor for the batches being built and one
        more of ``file_len`` bytes (0: none is due), its free space alone: spares do not count here; the free
        bytes then, else None (no pause, or no room yet).  A consumed batch's spare lets one batch be built in it
        while the tmpfs is as full as before: counted as the end of the pause, every batch the trainer read was
        logged as "resumed" and then "paused" again."""
        if not self.paused:
            return None
        free = self.left_free(file_len)
        if free < self.min_free:
            return None
        self.paused = False
        return free


__all__ = ["BufferSpace"]
