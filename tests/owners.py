"""A daemon owning a buffer, faked for the tests of its readers: daemon.lock naming a pid, and held.

A live daemon holds daemon.lock while its pid is in it, and readers take the pid for the buffer's daemon only
while the file is locked (SPEC rule 4): a fake that only writes a pid is a daemon that died (the kernel let go
of its lock), or one of another pid namespace that died before it said so.  flock locks belong to the open
file, so this process holding one makes a reader's shared lock on another descriptor, its own included, refused.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefetchd.buffer_protocol.layout import LOCK_NAME


@contextmanager
def owned(buffer: Path, pid: int | None = None) -> Iterator[Path]:
    """``buffer``'s daemon.lock (made if missing) naming ``pid`` (this process by default) and held with
    flock(LOCK_EX) by this process until the block ends, as a daemon holds it while it runs; yields the lock
    file's path, for a test to write another pid into it or set its mtime."""
    lock = Path(buffer) / LOCK_NAME
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a test that holds it already is a mistake: said at once
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid() if pid is None else pid}\n".encode(), 0)
        yield lock
    finally:
        os.close(fd)


__all__ = ["owned"]
