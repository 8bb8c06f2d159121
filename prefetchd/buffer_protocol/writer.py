"""Where a batch is written: begin, fill its slots, then commit or abort.

One writer for the daemon and for ``write_batch`` (tools, tests), so the spec and
its property tests exercise the path production takes::

    begin   controller  create eEEEEEE-sSSSSSSSS.tmp (O_EXCL, O_NOFOLLOW) beside the
                        final name and size it to the layout's file_len
    fill    workers     pwrite each image at its slot's offset; needs only the temp
                        path and the layout's offsets, so it runs in other processes
    commit  controller  pwrite labels and indices, then the header and metadata
                        last, then rename to the .batch name
    abort   controller  remove the temp file

The header is written at commit, not begin: ``replaced`` is known only once every
slot is filled, and a temp file without its magic can never be mistaken for a
batch.  Nothing is fsynced: the buffer is a tmpfs that a reboot empties anyway,
and a batch lost in a crash is rebuilt bit-identical from (epoch, step).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np

from prefetchd.buffer_protocol.batch import DTYPES, BatchLayout, temp_name

log = logging.getLogger(__name__)

_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# The fill and commit sides never create: a batch aborted meanwhile makes them fail, not leave a stray file.
_OPEN_FLAGS = os.O_WRONLY | os.O_NOFOLLOW


def create_exclusive(path: Path) -> int:
    """Create ``path`` for writing, never opening what is already there.

    Nothing should be: the sweep at start and every cancelled build delete their
    temp files.  A name that exists anyway was put there by someone else (with
    --group-access, a member of the group): a link planted there would make
    O_TRUNC cut, and the workers write into, a file the daemon never created.
    Unlinking removes only the name in our directory, not what it points to.
    """
    try:
        return os.open(path, _CREATE_FLAGS, 0o644)
    except FileExistsError:
        log.warning("%s exists though this daemon did not create it; removing the name and creating its own", path)
        path.unlink()
        return os.open(path, _CREATE_FLAGS, 0o644)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


@dataclass(frozen=True)
class PendingBatch:
    """A batch begun under its temp name; ``commit`` publishes it, ``abort`` removes it."""

    final: Path
    layout: BatchLayout

    @property
    def tmp(self) -> Path:
        return temp_name(self.final)

    @classmethod
    def begin(cls, final: str | os.PathLike[str], layout: BatchLayout) -> PendingBatch:
        """Create the temp file sized for ``layout``; on OSError nothing is left behind."""
        pending = cls(Path(final), layout)
        fd = create_exclusive(pending.tmp)
        try:
            os.ftruncate(fd, layout.file_len)
        except BaseException:
            pending.abort()
            raise
        finally:
            os.close(fd)
        return pending

    def slots(self) -> SlotFiller:
        """The fill side, opened in this process (a worker opens its own from the path)."""
        return SlotFiller(self.tmp, self.layout.tensors["images"].offset, self.layout.slot_bytes)

    def commit(self, labels: np.ndarray, indices: np.ndarray, *, epoch: int, step: int, seed: int,
               producer: str, replaced: int = 0) -> Path:
        """Write labels, indices and the header, and publish under the final name; aborts on any failure."""
        layout = self.layout
        try:
            fd = os.open(self.tmp, _OPEN_FLAGS)
            try:
                for name, array in (("labels", labels), ("indices", indices)):
                    data = np.ascontiguousarray(array, dtype=DTYPES["int64"]).tobytes()  # N * 8 bytes: copying is free
                    _pwrite_all(fd, memoryview(data), layout.tensors[name].offset)
                header = layout.encode_header(epoch=epoch, step=step, seed=seed, producer=producer, replaced=replaced)
                # The header goes last: a file without its magic is never mistaken for a batch.
                _pwrite_all(fd, memoryview(header), 0)
            finally:
                os.close(fd)
            os.rename(self.tmp, self.final)
        except BaseException:
            self.abort()
            raise
        return self.final

    def abort(self) -> None:
        self.tmp.unlink(missing_ok=True)


class SlotFiller:
    """Writes images into the slots of a begun batch, given only its temp path and where images go.

    Images go straight into the file with ``pwrite`` at the slot's offset: pixels never
    cross a pipe (see ``prefetchd.daemon.workers``).
    """

    def __init__(self, path: str | os.PathLike[str], images_offset: int, slot_bytes: int) -> None:
        self.path = path
        self.images_offset = images_offset
        self.slot_bytes = slot_bytes
        self._fd = os.open(path, _OPEN_FLAGS)

    def fill(self, slot: int, image: memoryview) -> None:
        """Write ``image`` (``slot_bytes`` bytes, C order) into ``slot``."""
        _pwrite_all(self._fd, image, self.images_offset + slot * self.slot_bytes)

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> SlotFiller:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def write_batch(
    path: str | os.PathLike[str],
    images: np.ndarray,
    labels: np.ndarray,
    indices: np.ndarray,
    *,
    epoch: int,
    step: int,
    seed: int,
    producer: str,
    replaced: int = 0,
) -> None:
    """Write a whole batch from arrays: begin, fill every slot, commit (abort on failure).

    The daemon takes the same steps with the fill spread over its workers.
    """
    if images.ndim != 4 or labels.shape != (len(images),) or indices.shape != (len(images),):
        raise ValueError(
            f"images must be N x H x W x C and labels, indices of length N; got {images.shape}, "
            f"{labels.shape}, {indices.shape}"
        )
    pending = PendingBatch.begin(path, BatchLayout.plan(*images.shape))
    try:
        data = np.ascontiguousarray(images, dtype=DTYPES["uint8"])
        with pending.slots() as slots:
            for slot, image in enumerate(data):
                slots.fill(slot, memoryview(image.reshape(-1)))  # flat uint8: a "B" view even when empty
    except BaseException:
        pending.abort()
        raise
    pending.commit(labels, indices, epoch=epoch, step=step, seed=seed, producer=producer, replaced=replaced)
