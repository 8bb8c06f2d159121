"""Where a dataset's bytes live: the one place that opens and reads them.

A ``Storage`` reads a file named relative to a dataset's root, whole or a byte
range of it (a member of a packed shard).  Layouts (class folders, file lists,
shards) are written once against this seam and work wherever a storage exists.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Protocol


class ImageRefused(ValueError):
    """A file that is refused before decoding: not a regular file, or more pixels than allowed."""


class Storage(Protocol):
    def read(self, rel: str, offset: int = 0, size: int | None = None) -> bytearray:
        """``size`` bytes of ``rel`` from ``offset`` (``None``: the whole file), into a writable buffer."""
        ...


def read_bytes(path: Path | str) -> bytearray:
    """The whole file with one read, into a writable buffer that torch wraps without a copy.

    Only a regular file (or a link to one): O_NONBLOCK makes opening a FIFO return
    at once instead of waiting for a writer, and the fstat then refuses it."""
    with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb", buffering=0) as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            kind = "FIFO" if stat.S_ISFIFO(st.st_mode) else "socket" if stat.S_ISSOCK(st.st_mode) else "device"
            raise ImageRefused(f"{path} is a {kind}, not a regular file; remove it from the dataset")
        size = st.st_size
        data = bytearray(size)
        view = memoryview(data)
        got = 0
        while got < size:  # one read for a regular file; more only if it is being rewritten
            n = fh.readinto(view[got:])
            if not n:
                break
            got += n
        view.release()
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
                raise OSError(f"{path} ends at byte {offset + got}, inside the member at {offset} of {size} "
                              "bytes; the file was truncated or rewritten after it was indexed")
            got += n
    finally:
        view.release()
        os.close(fd)
    return data


class LocalStorage:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def read(self, rel: str, offset: int = 0, size: int | None = None) -> bytearray:
        path = self.root / rel
        return read_bytes(path) if size is None else read_range(path, offset, size)


def is_url(location: str) -> bool:
    """``s3://bucket/x`` and other fsspec URLs; a local path (even with a colon) is not one."""
    scheme, sep, _ = location.partition("://")
    return bool(sep) and scheme.isidentifier() and len(scheme) > 1


def storage_for(root: str) -> Storage:
    if is_url(root):
        from prefetchd.daemon.errors import DatasetError

        raise DatasetError(f"{root}: datasets in object storage are not supported yet; copy them to a local folder")
    return LocalStorage(root)
