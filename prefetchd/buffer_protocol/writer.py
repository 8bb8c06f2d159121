"""Where a batch is written: begin, fill its slots, then commit or abort.

One writer for the daemon and for ``write_batch`` (tools, tests), so the spec and
its property tests exercise the path production takes::

    begin   controller  create eEEEEEE-sSSSSSSSS.tmp (O_EXCL, O_NOFOLLOW) beside the
                        final name and size it to the layout's file_len
    fill    workers     write each image into its slot: through a mapping where the file's
                        pages are all there (a spare's), else with pwrite; needs only the
                        temp path, the file's identity and the layout's offsets, so it runs
                        in other processes
    commit  controller  pwrite labels and indices, then the header and metadata
                        last, then rename to the .batch name
    abort   controller  remove the temp file

The controller's steps take the folder's fd (``dir_fd``), through which the daemon names
every file of a stream (``layout.at``): a member of a --group-access buffer's group may
swap a ``rank-*`` folder for a link, and a path looked up again would follow it.

A consumed batch file that no other process has open or mapped can be kept as a spare
(``SpareFiles``) and renamed to the next temp name of its size instead of creating one:
rewriting pages a tmpfs already holds is cheaper than having it allocate, charge and
later free new ones.  Begin then zeroes every byte of the spare that fill and commit do
not write (the header page, padding), so that the batch has the bytes of one built in a
fresh file and a temp file never carries a batch's magic.

The header is written at commit, not begin: ``replaced`` is known only once every
slot is filled, and a temp file without its magic can never be mistaken for a
batch.  Nothing is fsynced: the buffer is a tmpfs that a reboot empties anyway,
and a batch lost in a crash is rebuilt bit-identical from (epoch, step).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import mmap
import os
import signal
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np

from prefetchd.buffer_protocol.batch import DTYPES, BatchLayout, temp_name
from prefetchd.buffer_protocol.layout import at, spare_name

log = logging.getLogger(__name__)

_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# The fill and commit sides never create: a batch aborted meanwhile makes them fail, not leave a stray file.
# O_NONBLOCK: a file someone renamed over a temp name while holding a lease on it (a member of a --group-access
# buffer's group may) would block the open until the kernel breaks the lease (lease-break-time, 45 s), past the
# service's watchdog; it is EWOULDBLOCK at once instead, and the batch is retried.
_OPEN_FLAGS = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FILL_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a shared writable mapping needs it readable
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux


def create_exclusive(path: Path, dir_fd: int | None = None) -> int:
    """Create ``path`` (in the folder of ``dir_fd``: ``at``) for writing, never opening what is already there.

    Nothing should be: the sweep at start and every cancelled build delete their
    temp files.  A name that exists anyway was put there by someone else (with
    --group-access, a member of the group): a link planted there would make
    O_TRUNC cut, and the workers write into, a file the daemon never created.
    Unlinking removes only the name in our directory, not what it points to.
    """
    name = at(path, dir_fd)
    try:
        return os.open(name, _CREATE_FLAGS, 0o644, dir_fd=dir_fd)
    except FileExistsError:
        log.warning("%s exists though this daemon did not create it; removing the name and creating its own", path)
        os.unlink(name, dir_fd=dir_fd)
        return os.open(name, _CREATE_FLAGS, 0o644, dir_fd=dir_fd)


def _unlink(path: Path, dir_fd: int | None) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(at(path, dir_fd), dir_fd=dir_fd)


def _file_id(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _zero_outside_tensors(fd: int, layout: BatchLayout) -> None:
    """Zero what no fill or commit writes (the header page, the padding after each tensor), as
    in a fresh file: a spare's earlier batch may have had another layout of the same length."""
    start = 0
    for spec in sorted(layout.tensors.values(), key=lambda t: t.offset):
        if spec.offset > start:
            _pwrite_all(fd, memoryview(bytes(spec.offset - start)), start)
        start = spec.offset + spec.length
    if layout.file_len > start:
        _pwrite_all(fd, memoryview(bytes(layout.file_len - start)), start)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class RoomNotYet(Exception):
    """A batch that fits no spare wants fresh pages the filesystem has not got yet: the spares the room
    check counted as that room are still mapped by a trainer, a moment after it consumed them.  Begun
    anyway, its workers met ENOSPC on a full tmpfs (several daemons sharing one); the caller tries
    again shortly instead."""


@dataclass(frozen=True)
class PendingBatch:
    """A batch begun under its temp name; ``commit`` publishes it, ``abort`` removes it.

    ``dir_fd``: the folder's fd, through which every name is looked up (``at``); ``file_id``: the temp
    file's (st_dev, st_ino), which whoever fills or commits it checks (``SlotFiller``): the workers open it
    by its path, and write only into the file begun here."""

    final: Path
    layout: BatchLayout
    reused: bool = False  # begun in a spare: its pages are already the file system's
    dir_fd: int | None = None
    file_id: tuple[int, int] | None = None

    @property
    def tmp(self) -> Path:
        return temp_name(self.final)

    @classmethod
    def begin(cls, final: str | os.PathLike[str], layout: BatchLayout, spares: SpareFiles | None = None,
              dir_fd: int | None = None, room_wanted: Callable[[], int] | None = None,
              spare_only: bool = False) -> PendingBatch:
        """Create the temp file sized for ``layout`` (from one of ``spares`` where one is at least its
        size); on OSError nothing is left behind.  A fresh file where ``room_wanted()`` says the
        filesystem lacks bytes for its pages (the room check counted the spares as that room) is
        begun once deleting spares has made it (``SpareFiles.release``); RoomNotYet where it has not.
        ``spare_only``: in a spare or not at all (RoomNotYet): a filesystem below its floor, where no
        deletion of spares makes the room, and one that deleted them all left none to build in."""
        final = Path(final)
        tmp = temp_name(final)
        fd = spares.take(layout.file_len, tmp, dir_fd, or_fresh=not spare_only) if spares is not None else None
        reused = fd is not None
        if spare_only and not reused:
            raise RoomNotYet(tmp)
        if spares is not None and not reused and room_wanted is not None:
            wanted = room_wanted()
            if wanted > 0:
                spares.release(wanted)
                if room_wanted() > 0:  # asked again: the spares a trainer maps freed nothing yet
                    raise RoomNotYet(tmp)
        try:
            if fd is None:
                fd = create_exclusive(tmp, dir_fd)
                os.ftruncate(fd, layout.file_len)
            else:
                _zero_outside_tensors(fd, layout)
            file_id = _file_id(os.fstat(fd))
        except BaseException:
            _unlink(tmp, dir_fd)
            raise
        finally:
            if fd is not None:
                os.close(fd)
        return cls(final, layout, reused, dir_fd, file_id)

    def slots(self) -> SlotFiller:
        """The fill side, opened in this process (a worker opens its own from the path)."""
        images = self.layout.tensors["images"]
        return SlotFiller(self.tmp, images.offset, self.layout.slot_bytes, range(images.shape[0]), self.file_id)

    def commit(self, labels: np.ndarray, indices: np.ndarray, *, epoch: int, step: int, seed: int,
               producer: str, replaced: int = 0, job: str | None = None, rank: int | None = None) -> Path:
        """Write labels, indices and the header, and publish under the final name; aborts on any failure.
        ``job``, ``rank``: the stream's (``BatchLayout.encode_header``)."""
        layout = self.layout
        try:
            fd = os.open(at(self.tmp, self.dir_fd), _OPEN_FLAGS, dir_fd=self.dir_fd)
            try:
                _check_file(os.fstat(fd), self.file_id, self.tmp)
                for name, array in (("labels", labels), ("indices", indices)):
                    data = np.ascontiguousarray(array, dtype=DTYPES["int64"]).tobytes()  # N * 8 bytes: copying is free
                    _pwrite_all(fd, memoryview(data), layout.tensors[name].offset)
                header = layout.encode_header(epoch=epoch, step=step, seed=seed, producer=producer, replaced=replaced,
                                              job=job, rank=rank)
                # The header goes last: a file without its magic is never mistaken for a batch.
                _pwrite_all(fd, memoryview(header), 0)
            finally:
                os.close(fd)
            os.rename(at(self.tmp, self.dir_fd), at(self.final, self.dir_fd), src_dir_fd=self.dir_fd,
                      dst_dir_fd=self.dir_fd)
        except BaseException:
            self.abort()
            raise
        return self.final

    def abort(self) -> None:
        _unlink(self.tmp, self.dir_fd)


def _check_file(st: os.stat_result, file_id: tuple[int, int] | None, path: str | os.PathLike[str]) -> None:
    """Refuse to write the file of ``st`` (its fstat) unless it is the one ``file_id`` names (where one is
    given): the temp file the daemon began, not one a replaced folder holds under its name."""
    if file_id is not None and _file_id(st) != file_id:
        raise PermissionError(errno.EPERM, "not the file begun for this batch (its folder was replaced?); "
                              "refusing to write it", os.fspath(path))


class SlotFiller:
    """Writes images into the slots of a begun batch, given only its temp path and where images go.

    Pixels never cross a pipe (see ``prefetchd.daemon.fill``): each image goes straight into
    the file.  Into a file whose pages all exist already (a spare's, ``SpareFiles``; a fresh file
    has none yet), through a shared mapping of the slots to fill (``slots``; by default every slot
    the file holds): ``fill`` copies an image in, and a worker's resize writes its image into
    ``slot(i)`` itself.  Into a fresh file, with ``pwrite``: a page a full tmpfs cannot allocate
    is then ENOSPC, which the daemon retries, where through a mapping it would be a SIGBUS.  In a
    worker's loop on this project's 2-core machine, ``pwrite`` of a 224 x 224 image into a
    spare's pages took 50-75 us (the page cache's work for each of its 37 pages), the resize
    writing the mapped slot itself next to nothing, and mapping a task's slots ~3 us per image.
    Allocating a fresh file's pages first (``posix_fallocate``) to map it too cost more than it
    saved: 56 us per image against 28-41 with ``pwrite`` (``docs/BENCHMARKS.md``, "Images made
    in their slots").

    The file must be a regular file of this user, long enough for the slots, and where ``file_id``
    is given the file it names (``PendingBatch``): a name planted in a group-writable buffer, a
    replaced folder's file, or a file cut short, is an OSError, never a crash.
    """

    def __init__(self, path: str | os.PathLike[str], images_offset: int, slot_bytes: int,
                 slots: range | None = None, file_id: tuple[int, int] | None = None) -> None:
        self.path = path
        self.images_offset = images_offset
        self.slot_bytes = slot_bytes
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._base = 0
        self._fd = os.open(path, _FILL_FLAGS)
        try:
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise PermissionError(errno.EPERM, "not a regular file of this user; refusing to write it", os.fspath(path))
            _check_file(st, file_id, path)
            if slots is None:
                slots = range(max(0, st.st_size - images_offset) // slot_bytes if slot_bytes else 0)
            self.slots = slots
            start = images_offset + slots.start * slot_bytes
            end = images_offset + slots.stop * slot_bytes
            if end > st.st_size:
                raise OSError(errno.EINVAL, f"{st.st_size} bytes hold no slots {slots.start}-{slots.stop - 1} "
                              f"of {slot_bytes} bytes at {images_offset}", os.fspath(path))
            # Mapped only where every page is allocated (st_blocks: 512-byte units), so never a SIGBUS.
            if end > start and st.st_blocks * 512 >= st.st_size:
                self._base = start - start % mmap.ALLOCATIONGRANULARITY
                # MAP_POPULATE: the pages' entries in one call, not a fault per page on first write.
                self._map = mmap.mmap(self._fd, end - self._base, flags=mmap.MAP_SHARED | _POPULATE,
                                      offset=self._base)
                self._view = memoryview(self._map)
        except BaseException:
            os.close(self._fd)
            raise

    def slot(self, slot: int) -> memoryview | None:
        """``slot``'s bytes in the mapped file, writable: an image made there needs no ``fill``; None
        where the file is not mapped (a fresh one).  Release every view of it before ``close``."""
        if slot not in self.slots:
            raise IndexError(f"slot {slot} is not among slots {self.slots.start}-{self.slots.stop - 1} of {self.path}")
        if self._view is None:
            return None
        start = self.images_offset + slot * self.slot_bytes - self._base
        return self._view[start:start + self.slot_bytes]

    def fill(self, slot: int, image: memoryview) -> None:
        """Write ``image`` (``slot_bytes`` bytes, C order) into ``slot``."""
        if len(image) != self.slot_bytes:
            raise ValueError(f"an image of {len(image)} bytes for a slot of {self.slot_bytes}")
        target = self.slot(slot)
        if target is None:
            _pwrite_all(self._fd, image, self.images_offset + slot * self.slot_bytes)
            return
        with target:
            target[:] = image

    def close(self) -> None:
        """Close the file and unmap the slots (a spare's write lease needs no mapping left:
        ``SpareFiles``).  Where a view of them is still held (an error's traceback), the mapping
        goes with its last view."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        view, mapped, self._view, self._map = self._view, self._map, None, None
        try:
            if view is not None:
                view.release()
            if mapped is not None:
                mapped.close()
        except BufferError:
            pass

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
    job: str | None = None,
    rank: int | None = None,
) -> None:
    """Write a whole batch from arrays: begin, fill every slot, commit (abort on failure).

    The daemon takes the same steps with the fill spread over its workers.  ``job``, ``rank``: the stream's
    (its manifest's ``job_key`` and ``rank``); without them the batch is one of a daemon before them.
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
    pending.commit(labels, indices, epoch=epoch, step=step, seed=seed, producer=producer, replaced=replaced, job=job,
                   rank=rank)


class SpareFiles:
    """Consumed batch files kept, renamed out of the way, for the next batches of their size.

    The controller renames a consumed batch to a spare name at once (no reader opens it by
    its batch name after that).  A spare is reused only while no other process has it open
    or mapped: ``take`` first takes a write lease on it, which the kernel grants only when no
    other open file exists on it, mappings included.  A trainer still holding a batch (a
    tensor over its mapping, kept past the next step) keeps its pages as they were: its spare
    is passed over while it is among the newest, and deleted instead of reused after that
    (``retire``).  That is checked when the spare is wanted, not when the batch is consumed: a
    training loop still holds the batch it asks past while the loader reports it consumed.
    Measured on the 2-core EPYC (128 slots of 224 x 224 x 3, /dev/shm): writing into fresh
    tmpfs pages 0.053 ms per image, into a spare's 0.030, and freeing a consumed file's pages,
    paid by whoever drops the last reference, 0.017 ms.  A spare also has every page already,
    so its slots are mapped and made in place (``SlotFiller``).
    """

    HANDED_PAST = 2  # the newest spares a trainer may still map for a moment (``retire``)

    def __init__(self) -> None:
        self._names = itertools.count()
        self._files: list[tuple[int, Path, int | None]] = []  # (size, path, its folder's fd: ``at``), oldest first
        self._room = 1 << 30  # until the first fit()
        self.enabled = _ignore_lease_breaks()

    def __len__(self) -> int:
        return len(self._files)

    @property
    def bytes(self) -> int:
        """What the spares hold: space a batch begun in one of them needs no more of (or that
        deleting them frees, once no trainer maps them: ``release``)."""
        return sum(size for size, _, _ in self._files)

    def has(self, size: int) -> bool:
        """Whether a spare to build a batch of ``size`` bytes in is kept (``take`` may still pass it over while a
        trainer maps it)."""
        return any(spare_size >= size for spare_size, _, _ in self._files)

    def release(self, wanted: int) -> None:
        """Delete spares nobody else has open or mapped (whose pages go at once), oldest first, until
        they come to ``wanted`` bytes or none is left: room for a batch begun in fresh pages, which
        the room check counted them as.  Kept, a full tmpfs had no page for that batch (one of
        another size than the spares, an epoch's short last one; or one begun while the spares of
        its size were still mapped), and its workers met ENOSPC."""
        for entry in list(self._files):
            if wanted <= 0:
                return
            size, spare, dir_fd = entry
            if _unshared(spare, dir_fd):
                self._files.remove(entry)
                _unlink(spare, dir_fd)
                wanted -= size

    def retire(self, path: Path, dir_fd: int | None = None) -> None:
        """Keep the consumed batch ``path`` (in the folder of ``dir_fd``: ``at``) as a spare (delete it where
        spares cannot be kept).  The fd must stay open while the spare is kept (``fit(0)`` drops them all)."""
        if not self.enabled:
            _unlink(path, dir_fd)
            return
        spare = path.with_name(spare_name(next(self._names)))
        try:
            os.rename(at(path, dir_fd), at(spare, dir_fd), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            size = os.stat(at(spare, dir_fd), dir_fd=dir_fd, follow_symlinks=False).st_size
        except FileNotFoundError:
            return
        except OSError:
            _unlink(path, dir_fd)
            return
        self._files.append((size, spare, dir_fd))
        # The spare this one pushed past the HANDED_PAST newest: if a trainer still maps it, it keeps
        # that batch; deleted (its pages stay the trainer's), so that ``bytes`` does not count it as
        # room.  Looked at once: a spare nobody maps never gets a reader again (none opens spares).
        if len(self._files) > self.HANDED_PAST:
            aged = self._files[-1 - self.HANDED_PAST]
            if not _unshared(aged[1], aged[2]):
                self._files.remove(aged)
                _unlink(aged[1], aged[2])

    def take(self, size: int, tmp: Path, dir_fd: int | None = None, or_fresh: bool = True) -> int | None:
        """A spare of ``size`` bytes or more that nobody else has open or mapped, renamed to ``tmp``,
        cut to ``size`` and opened for writing: the newest such, whose pages the caches are likeliest to
        hold still.  A larger one (an epoch's short last batch in a full one's file) gives back the pages
        past ``size``: on a tmpfs below its floor it was the batch no spare fitted, and it waited.
        None when there is none: the caller creates a fresh file, and the oldest spares go if it
        would take their room.

        Newest first keeps the files a steady stream writes to few, the batches in flight and a
        spare or two: one core filling tasks into 2 files in turn paid 4-9 % less CPU per image than
        into 16 (the bench's high-water mark) or 20, where oldest first cycled through all of them
        (docs/BENCHMARKS.md, "Newest spare first").

        A spare still in use is passed over (it is among the ``HANDED_PAST`` newest: ``retire``
        deletes older ones a trainer keeps).  ``or_fresh``: the caller begins a fresh file where this
        finds none, which takes a spare's place; else (``PendingBatch.begin``'s ``spare_only``) nothing
        is begun and every spare stays: trimmed for each try, the one a trainer let go of was deleted
        while it waited for the batch to be built in it."""
        # Its own size first: a larger one cut to it no longer fits a full batch.
        for entry in sorted(reversed(self._files), key=lambda e: e[0] != size):
            spare_size, spare, spare_dir_fd = entry
            if spare_size < size or not _unshared(spare, spare_dir_fd):
                continue
            self._files.remove(entry)
            fd = None
            try:
                os.rename(at(spare, spare_dir_fd), at(tmp, dir_fd), src_dir_fd=spare_dir_fd, dst_dir_fd=dir_fd)
                fd = os.open(at(tmp, dir_fd), _OPEN_FLAGS, dir_fd=dir_fd)
                if spare_size > size:
                    os.ftruncate(fd, size)
            except OSError:  # someone removed or replaced it: create a fresh file instead
                if fd is not None:
                    os.close(fd)
                _unlink(spare, spare_dir_fd)
                _unlink(tmp, dir_fd)
                break
            self._room -= 1  # the batch takes the spare's place
            return fd
        if or_fresh:
            self._room -= 1  # the fresh file takes a place a spare could have kept
            self._trim()
        return None

    def fit(self, room: int) -> None:
        """Keep no more spares than ``room``, the files the buffer's cap leaves room for beside its
        batches, from now until the next call (each batch begun takes one place): oldest go first."""
        self._room = room
        self._trim()

    def _trim(self) -> None:
        while len(self._files) > max(0, self._room):
            _size, spare, dir_fd = self._files.pop(0)
            _unlink(spare, dir_fd)


def _unshared(path: Path, dir_fd: int | None) -> bool:
    """True if ``path`` is a regular file with one name and no other open file (or mapping) on it."""
    try:
        fd = os.open(at(path, dir_fd), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)  # EAGAIN while anyone else has it open or mapped
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        st = os.fstat(fd)
    except OSError:  # shared, or leases unsupported here (fs.leases-enable = 0, another file system)
        return False
    finally:
        os.close(fd)
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def _ignore_lease_breaks() -> bool:
    """Let spares be kept in this process: ignore SIGIO, which the kernel sends to a lease holder
    when someone opens its file during the microseconds the lease is held (its default would end
    the process).  False where that cannot be done: not the main thread, or SIGIO in use."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGIO) not in (signal.SIG_DFL, signal.SIG_IGN):
        return False
    signal.signal(signal.SIGIO, signal.SIG_IGN)
    return True
