"""Where a dataset's bytes live: the one place that opens and reads them.

A ``Storage`` reads a file named relative to a dataset's root, whole or a byte
range of it (a member of a packed shard).  Layouts (class folders, file lists,
shards) are written once against this seam and work wherever a storage exists:
on a local filesystem (``LocalStorage``) or in object storage under an fsspec
URL (``FsspecStorage``: ``s3://bucket/prefix`` with s3fs, ``gs://`` with gcsfs).
A local read whose error says "try again" (``RETRY_LATER_ERRNOS``: EMFILE, ESTALE,
ETIMEDOUT...) is ``StorageUnavailable`` too, as an object store's outage is.

Object-storage errors are classified and retried in ``prefetchd.locations``
(shared with the trainer's checkpoints): ``StorageUnavailable`` after the
retries of transient errors are spent, ``StorageDenied`` when retrying cannot
help, and the backend's own errors (a missing object) otherwise.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from prefetchd import locations
from prefetchd.locations import (ENDPOINT_VARIABLES, TRANSIENT_ERRNOS, LocationError, StorageDenied, StorageUnavailable,
                                 filesystem, is_transient, is_url, with_retries)

T = TypeVar("T")
# Reads in flight per worker (and for `prefetchd pack`) from a URL: object storage answers each small object in
# tens of milliseconds, mostly waiting (see docs/SOURCES.md, "Object storage").
URL_READERS = 16


class ImageRefused(ValueError):
    """A file that is refused before decoding: not a regular file, or more pixels than allowed."""


class ShortRead(OSError):
    """A byte range past the end of its file: the file was cut short or rewritten after it was indexed.

    Carries the file's size and the range asked for, so that a caller who knows what the range
    was (a shard's member) can say so in its own words rather than wrap this message."""

    def __init__(self, name: str, file_size: int, offset: int, size: int) -> None:
        super().__init__(f"{name} is {file_size} bytes, too short for the {size} bytes at byte {offset} that "
                         "were to be read; it was cut short or rewritten after it was indexed")
        self.name, self.file_size, self.offset, self.size = name, file_size, offset, size


class Storage(Protocol):
    def read(self, rel: str, offset: int = 0, size: int | None = None) -> bytearray:
        """``size`` bytes of ``rel`` from ``offset`` (``None``: the whole file), into a writable buffer."""
        ...

    def sizes(self, rels: list[str]) -> dict[str, int]:
        """The size in bytes of each of ``rels`` that exists (a missing one is left out)."""
        ...

    def size(self, rel: str) -> int:
        """The size in bytes of ``rel`` (``FileNotFoundError`` where it is not there): one request in object
        storage, where ``sizes`` lists the root."""
        ...

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` is there: one request in object storage, where ``sizes`` lists the root."""
        ...

    def unusable(self) -> str | None:
        """Why nothing under the root can be read now, no sample's fault, in words after "the dataset root ROOT":
        gone, empty (unmounted, a prefix deleted), or not to be listed (its permission taken away: it was said
        "gone or empty" of a root that was there, a walk); None where it can be."""
        ...


def _kind(mode: int) -> str:
    """What a file that is not a regular file is, for the error that refuses it."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a file")


def read_bytes(path: Path | str) -> bytearray:
    """The whole file with one read, into a writable buffer that torch wraps without a copy.

    Only a regular file (or a link to one): O_NONBLOCK makes opening a FIFO return
    at once instead of waiting for a writer, and the fstat then refuses it.  Plain
    descriptor calls, no file object: this runs once per sample in every worker."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageRefused(f"{path} is {_kind(st.st_mode)}, not a regular file; remove it from the dataset")
        size = st.st_size
        data = bytearray(size)
        view = memoryview(data)
        got = 0
        while got < size:  # one read for a regular file; more only if it is being rewritten
            n = os.readv(fd, [view[got:]])
            if not n:
                break
            got += n
        view.release()
    finally:
        os.close(fd)
    if got < size:
        del data[got:]
    return data


def read_range(path: Path | str, offset: int, size: int) -> bytearray:
    """``size`` bytes at ``offset`` with positioned reads; a short file is an error naming it."""
    data = bytearray(size)
    view = memoryview(data)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        got = 0
        while got < size:
            n = os.preadv(fd, [view[got:]], offset + got)
            if not n:
                raise ShortRead(str(path), os.fstat(fd).st_size, offset, size)
            got += n
    finally:
        view.release()
        os.close(fd)
    return data


# Local read errors that say "try again", not "this file is bad": the process's or the system's
# limits (EMFILE, ENFILE, ENOMEM, ENOBUFS), a network filesystem's server or link (ESTALE: the
# file was replaced on the server and a fresh lookup finds it; ETIMEDOUT, ENOTCONN: a FUSE mount
# whose daemon went away) or an interrupted call.  Replacing the sample would build another batch
# for the same (seed, epoch, step) than the next run builds; the batch waits instead.  EIO, ENOENT,
# EACCES and the rest are about the file, and replace it as an undecodable image is replaced.
RETRY_LATER_ERRNOS = TRANSIENT_ERRNOS | {  # the network's (an object store's too), and the filesystem's
    errno.EINTR, errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.ENOLCK, errno.ESTALE, errno.ENOTCONN,
    errno.ENETDOWN, errno.EHOSTDOWN,
}
_RETRY_LATER_HINTS = {
    errno.EMFILE: "the daemon's open-file limit is reached: raise it (LimitNOFILE= in its unit, ulimit -n)",
    errno.ENFILE: "the system's open-file table is full (fs.file-max)",
    errno.ESTALE: "a stale NFS handle: the file was replaced on the server",
}


def retry_later(path: str, exc: OSError) -> StorageUnavailable:
    """``exc`` from reading ``path``, said as the failure of the filesystem it is: the batch waits."""
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    hint = _RETRY_LATER_HINTS.get(exc.errno or 0, "the filesystem's failure, not the file's")
    return StorageUnavailable(f"cannot read {path}: {exc.strerror or exc} ({code}; {hint}); the batch is built again "
                              "with the same samples once reads work")


class LocalStorage:
    def __init__(self, root: str | Path) -> None:
        self.root = str(root)  # joined as a string per sample: a Path costs a worker ~5 us

    def read(self, rel: str, offset: int = 0, size: int | None = None) -> bytearray:
        path = os.path.join(self.root, rel)  # an absolute rel (a file list's) stays as it is
        try:
            return read_bytes(path) if size is None else read_range(path, offset, size)
        except OSError as exc:
            if exc.errno in RETRY_LATER_ERRNOS:
                raise retry_later(path, exc) from exc
            raise

    def sizes(self, rels: list[str]) -> dict[str, int]:
        """The size of each of ``rels`` that exists."""
        found = {}
        for rel in rels:
            try:
                found[rel] = os.stat(os.path.join(self.root, rel)).st_size
            except FileNotFoundError:
                continue
        return found

    def size(self, rel: str) -> int:
        return os.stat(os.path.join(self.root, rel)).st_size

    def exists(self, rel: str) -> bool:
        return os.path.exists(os.path.join(self.root, rel))

    def unusable(self) -> str | None:
        try:
            with os.scandir(self.root) as entries:
                return "is empty (unmounted?)" if next(entries, None) is None else None
        except FileNotFoundError:
            return "is gone (unmounted?)"
        except OSError as exc:
            return f"cannot be listed ({exc.strerror or exc}; its permissions changed?)"


class FsspecStorage:
    """A dataset under an fsspec URL; pickles as its URL, so each worker process opens its own filesystem.

    The filesystem is made on first use in each process (an async backend's
    event loop and connections must not cross a fork) and shared by that
    process's reader threads: fsspec runs their requests concurrently on one loop.
    """

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._fs: Any = None
        self._root = ""
        self._pid = -1
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"])  # type: ignore[misc]

    def _open(self) -> tuple[Any, str]:
        with self._lock:
            if self._fs is None or self._pid != os.getpid():
                try:
                    # A backend may connect as it is made (ftp://): its failures are retried and said as a read's.
                    self._fs, self._root = with_retries(f"connecting to {self.url}", lambda: filesystem(self.url),
                                                        self.url)
                    if hasattr(self._fs, "max_concurrency"):
                        # s3fs asks for the size (a HEAD) before every whole-object read to split
                        # big ones; for small images that doubles the round trips.
                        self._fs.max_concurrency = 1
                except LocationError as exc:
                    from prefetchd.daemon.errors import DatasetError

                    raise DatasetError(str(exc)) from None
                self._pid = os.getpid()
            return self._fs, self._root

    @property
    def fs(self) -> Any:
        return self._open()[0]

    def path(self, rel: str = "") -> str:
        """The backend's path of ``rel`` (bucket/prefix/rel for s3)."""
        root = self._open()[1]
        return f"{root}/{rel}" if rel else root

    def endpoint(self) -> str:
        """The server this URL's requests go to, as the backend resolved it; "" where it names none.

        The same ``s3://bucket/prefix`` on MinIO and on AWS, or on staging and production, is
        different data.  For S3 this is the client's own endpoint: AWS_ENDPOINT_URL_S3,
        AWS_ENDPOINT_URL or the config file's ``endpoint_url``, else AWS's for the region --
        whatever botocore chose, rather than our reading of the same settings."""
        fs = self.fs
        client = fs.s3 if hasattr(type(fs), "s3") else None  # s3fs's botocore client, made here if not yet
        found = getattr(getattr(client, "meta", None), "endpoint_url", None)
        if found is None:  # another backend: an endpoint passed to it, if any
            options = getattr(fs, "storage_options", {}) or {}
            found = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
        return str(found or "").rstrip("/")

    def url_of(self, rel: str) -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def call(self, what: str, fn: Callable[[], T]) -> T:
        return with_retries(what, fn, self.url)

    def _bounded(self) -> dict[str, float]:
        """The keyword that ends a sample's read after ``SAMPLE_READ_SECONDS`` (fsspec's sync wrapper cancels
        it), for an async backend; a sync one takes no such keyword."""
        return {"timeout": locations.SAMPLE_READ_SECONDS} if getattr(self.fs, "async_impl", False) else {}

    def read(self, rel: str, offset: int = 0, size: int | None = None) -> bytearray:
        path, url = self.path(rel), self.url_of(rel)
        if size is None:
            data = self.call(f"reading {url}", lambda: self.fs.cat_file(path, **self._bounded()))
        else:
            try:
                # Keywords: s3fs puts version_id between path and start.
                data = self.call(f"reading {url} bytes {offset}-{offset + size}",
                                 lambda: self.fs.cat_file(path, start=offset, end=offset + size, **self._bounded()))
            except (FileNotFoundError, StorageDenied, StorageUnavailable):
                raise
            except OSError:
                # A range that starts past the end is an error of the store's own (S3: 416, "the requested
                # range is not satisfiable", as EINVAL): a ShortRead if the object is too short for it.
                self._check_size(path, url, offset, size)
                raise
            if len(data) < size:
                self._check_size(path, url, offset, size)
                raise ShortRead(url, offset + len(data), offset, size)  # longer again by now: the size the read saw
        return bytearray(data)

    def _check_size(self, path: str, url: str, offset: int, size: int) -> None:
        """``ShortRead`` if the object ends before ``offset + size``; one more request, made only when a
        ranged read failed or came back short."""
        found = int(self.call(f"sizing {url}", lambda: self.fs.size(path)))
        if found < offset + size:
            raise ShortRead(url, found, offset, size) from None

    def sizes(self, rels: list[str]) -> dict[str, int]:
        """The size of each of ``rels`` that exists, from one listing of the root (not a request each)."""
        root = self.path()
        listed = self.call(f"listing {self.url}", lambda: self.fs.ls(root, detail=True, refresh=True))
        wanted = {self.path(rel): rel for rel in rels}
        return {wanted[e["name"]]: int(e["size"]) for e in listed if e.get("name") in wanted}

    def size(self, rel: str) -> int:
        path = self.path(rel)
        return int(self.call(f"sizing {self.url_of(rel)}", lambda: self.fs.size(path)))

    def exists(self, rel: str) -> bool:
        path = self.path(rel)
        return bool(self.call(f"checking {self.url_of(rel)}", lambda: self.fs.exists(path)))

    def unusable(self) -> str | None:
        root = self.path()
        try:  # refresh: the listing cached at indexing would say the objects are still there
            listed = self.call(f"listing {self.url}", lambda: self.fs.ls(root, detail=False, refresh=True))
        except FileNotFoundError:
            listed = []
        return None if listed else "is gone or empty (deleted?)"


# The least a ranged file reads at once: an archive's directory (at its end) and small members in one read (one GET
# under a URL), a big member in few.  A 1.28 M-sample shard index, the files packed skipped, is 56 MB in ~15 reads.
RANGE_READ_BYTES = 4 << 20


class RangedFile(io.RawIOBase):
    """File ``rel`` of ``storage`` as a seekable file whose reads are the storage's ranged reads: for a
    reader that seeks to the parts it wants (zipfile, of an ``.npz``), which are all that is read.

    Its last ``RANGE_READ_BYTES`` are read when it is opened: an archive's directory, which zipfile
    reads first, and which it takes for no zip at all where reading it fails.  Each read is its own
    (an open and a ``pread``, a GET): a file replaced between two is seen in parts of both, which a
    zip's per-member names and CRC-32s refuse as a damaged archive."""

    def __init__(self, storage: Storage, rel: str) -> None:
        super().__init__()
        self.storage, self.rel, self.pos = storage, rel, 0
        self.size = storage.size(rel)
        self.tail_at = max(0, self.size - RANGE_READ_BYTES)
        self.tail = storage.read(rel, self.tail_at, self.size - self.tail_at) if self.size else bytearray()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        pos = offset + {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        if pos < 0:
            raise OSError(errno.EINVAL, f"seek to byte {pos} of {self.rel}")
        self.pos = pos
        return pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.size - self.pos))
        if n:
            at = self.pos - self.tail_at
            with memoryview(buffer) as view:
                view.cast("B")[:n] = self.tail[at:at + n] if at >= 0 else self.storage.read(self.rel, self.pos, n)
            self.pos += n
        return n


def open_ranged(storage: Storage, rel: str) -> io.BufferedReader:
    """``RangedFile``, its small reads gathered into reads of ``RANGE_READ_BYTES``."""
    return io.BufferedReader(RangedFile(storage, rel), RANGE_READ_BYTES)


# One per URL and process: making an S3 client loads botocore's data (~0.5 s), and
# indexing asks for the storage of the same root several times.  Keyed by the endpoint
# the environment names too: the same URL on another endpoint is another store.
_URL_STORAGES: dict[tuple[str, tuple[str | None, ...]], FsspecStorage] = {}


def storage_for(root: str) -> Storage:
    """The storage of a dataset root: ``FsspecStorage`` for a URL (its backend is checked here), else local."""
    if is_url(root):
        url = root.rstrip("/")
        key = (url, tuple(os.environ.get(name) for name in ENDPOINT_VARIABLES))
        storage = _URL_STORAGES.get(key)
        if storage is None:
            storage = FsspecStorage(url)
            storage.fs  # an unknown protocol or a missing package is refused now, with what to install
            _URL_STORAGES[key] = storage
        return storage
    return LocalStorage(root)


__all__ = ["FsspecStorage", "ImageRefused", "LocalStorage", "Storage", "StorageDenied", "StorageUnavailable",
           "is_transient", "is_url", "storage_for", "with_retries"]
