"""Datasets wherever users keep them, behind one seam.

``open_dataset(location)`` recognizes the layout at ``location`` and indexes it
into a ``SampleIndex``; ``SampleReader(index).read(i)`` returns sample ``i``'s
encoded bytes from its storage.  The producer and workers see only these two,
so every layout gets the same determinism and bad-sample handling.

Layouts, tried in this order:
- packed shards: a folder holding ``prefetchd-index.npz`` (``shards.py``, written by `prefetchd pack`);
- a file list: ``location`` is a ``.csv``/``.tsv``/``.txt`` of ``path,label`` rows (``filelist.py``);
- class folders, as torchvision ImageFolder (``prefetchd.daemon.dataset``, cached by ``index_cache.py``).

Each works on a local path and under an object-storage URL (``s3://bucket/prefix``):
lists and shard indexes are read through the dataset's ``Storage``, class folders
under a URL are listed by ``objects.py`` and their index cached so that a restart
does not list again.
"""

from __future__ import annotations

import errno
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from prefetchd.access import cannot_read
from prefetchd.daemon.dataset import Progress, SampleIndex, no_progress, scan_class_folders
from prefetchd.daemon.errors import DatasetError
from prefetchd.daemon.sources.filelist import is_file_list, read_file_list
from prefetchd.daemon.sources.index_cache import cached_class_folders
from prefetchd.daemon.sources.shards import has_shard_index, read_member, read_shard_index
from prefetchd.daemon.sources.storage import FsspecStorage, Storage, StorageDenied, StorageUnavailable, storage_for
from prefetchd.locations import is_url


def open_dataset(location: str | Path, tick: Progress = no_progress, index_cache: Path | None = None,
                 refresh_index: bool = False) -> SampleIndex:
    """Index the dataset at ``location``; ``tick`` is told what was found so far now and then while that takes
    long (a walk of class folders; a file list or a pack's index is read at once).

    Class folders are cached in ``index_cache`` (locally: no cache when ``None``; under a
    URL: the default cache folder then); ``refresh_index`` rescans them even when the
    cache looks current."""
    location = str(location)
    try:
        storage = storage_for(location)  # an unsupported URL is refused here, before any listing
    except StorageDenied as exc:
        raise DatasetError(str(exc)) from None
    except StorageUnavailable as exc:  # a backend that connects as it is made (ftp://): a host that is not there
        raise DatasetError(f"cannot reach {location}: {exc}") from None
    if not is_url(location):
        try:
            os.stat(location)
        except OSError as exc:  # a missing root is each layout's to name; a loop would surface as a traceback
            if exc.errno == errno.ELOOP:
                raise DatasetError(f"{location}: {exc.strerror}: a symbolic link on the way leads round in a loop; "
                                   "name the dataset's own folder, file list or shards") from None
    try:
        return _open_layout(location, storage, tick, index_cache, refresh_index)
    except OSError as exc:
        if is_url(location):
            raise
        # A folder the daemon may enter but not list (mode 0711): its user's to fix, not a crash (a daemon
        # serving jobs that died on one would die again on the same job.json at every restart).
        denied = cannot_read(Path(exc.filename)) if exc.errno in (errno.EACCES, errno.EPERM) and exc.filename else None
        if denied is not None:  # the folder on the way that stops it, whose it is and what to do
            raise DatasetError(f"cannot index {location}: {denied}") from None
        raise DatasetError(f"cannot index {location}: {exc.filename or location}: {exc.strerror or exc}; give the user "
                           f"reading it (uid {os.geteuid()}) read access to the dataset's folders and files") from None


def _open_layout(location: str, storage: Storage, tick: Progress, index_cache: Path | None,
                 refresh_index: bool) -> SampleIndex:
    if is_file_list(location):
        return read_file_list(location)
    try:
        shards = has_shard_index(location)
    except StorageDenied as exc:  # no credentials, no bucket: say so, not "no shards"
        raise DatasetError(str(exc)) from None
    except StorageUnavailable as exc:  # the first read of any layout looks for a shard index
        raise DatasetError(f"cannot reach {location} (the first read looks for a `prefetchd pack` index, "
                           f"whatever the layout): {exc}") from None
    if shards:
        return read_shard_index(location)
    if isinstance(storage, FsspecStorage):
        from prefetchd.daemon.sources.objects import cached_url_class_folders

        return cached_url_class_folders(storage, index_cache, refresh_index, tick)
    if index_cache is not None and Path(location).is_dir():
        return cached_class_folders(Path(location), index_cache, refresh_index, tick)
    return scan_class_folders(Path(location), tick=tick)


class Read(Protocol):
    """A sample's read, started or done: its bytes, or its error, from ``result()`` (a ``Future``)."""

    def result(self) -> bytearray: ...


class ReadDone:
    """A read made already, as ``read_ahead`` hands them out with one reader: a ``Future``'s
    ``result()`` without the lock and condition a ``Future`` makes.  Over 128 reads of 97 KB
    files on this project's 2-core machine: 5.6-6.2 us per read above the plain reads with a
    ``Future`` each, 1.3-1.6 with this."""

    __slots__ = ("_data", "_error")

    def __init__(self, data: bytearray | None = None, error: Exception | None = None) -> None:
        self._data = data
        self._error = error

    def result(self) -> bytearray:
        if self._error is not None:
            raise self._error
        assert self._data is not None
        return self._data


class SampleReader:
    """Reads samples of one index; made once per worker process (storages may hold connections).

    With ``readers`` > 1, ``read_ahead`` keeps that many reads in flight on a
    thread pool (object storage: many small requests, each mostly waiting) and
    still yields them in the order asked."""

    def __init__(self, index: SampleIndex, readers: int = 1) -> None:
        self.index = index
        self.storage: Storage = storage_for(index.root)
        self.readers = readers
        self._pool: ThreadPoolExecutor | None = None

    def read(self, i: int) -> bytearray:
        if self.index.member_files is not None:
            return read_member(self.storage, self.index, i)
        return self.storage.read(self.index.file(i))

    def start(self, indices: Iterable[int]) -> list[Future[bytearray]]:
        """Queue a read of each of ``indices`` now (``readers`` run at once, in this order)."""
        pool = self._executor()
        return [pool.submit(self.read, i) for i in indices]

    def read_ahead(self, indices: Iterable[int]) -> Iterator[Read]:
        """``read(i)`` of each of ``indices`` in order, to be taken with ``result()``: futures, at most
        ``readers`` of them running; with one reader, each read made as it is asked for."""
        if self.readers <= 1:
            for i in indices:
                try:
                    done = ReadDone(self.read(i))
                except Exception as exc:
                    done = ReadDone(error=exc)
                yield done
            return
        pool = self._executor()
        pending: deque[Future[bytearray]] = deque()
        it = iter(indices)
        try:
            for i in it:
                pending.append(pool.submit(self.read, i))
                if len(pending) >= self.readers:
                    yield pending.popleft()
            while pending:
                yield pending.popleft()
        finally:
            for f in pending:
                f.cancel()

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(1, self.readers), thread_name_prefix="read")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


__all__ = ["Read", "ReadDone", "SampleIndex", "SampleReader", "is_url", "open_dataset"]
