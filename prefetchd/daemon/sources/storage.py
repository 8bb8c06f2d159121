"""Where a dataset's bytes live: the one place that opens and reads them.

A ``Storage`` reads a file named relative to a dataset's root, whole or a byte
range of it (a member of a packed shard).  Layouts (class folders, file lists,
shards) are written once against this seam and work wherever a storage exists:
on a local filesystem (``LocalStorage``) or in object storage under an fsspec
URL (``FsspecStorage``: ``s3://bucket/prefix`` with s3fs, ``gs://`` with gcsfs).

Object-storage errors fall in three kinds: transient (connection errors,
timeouts, 5xx, throttling), retried here with exponential backoff and jitter
and raised as ``StorageUnavailable`` once the retries are spent; access
(no credentials, denied, no such bucket), raised as ``StorageDenied`` with what
to do; and the rest (a missing object), raised as the backend raised them.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

from prefetchd.locations import LocationError, filesystem, is_url, protocol

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRY_ATTEMPTS = 6  # 0.1 + 0.2 + 0.4 + 0.8 + 1.6 s (x0.5-1.5 jitter): ~3 s before a read gives up
RETRY_BASE_SECONDS = 0.1
RETRY_MAX_SECONDS = 5.0
# Exception type names of the backends' transient failures (botocore, aiohttp,
# urllib3); by name so that no backend has to be imported to classify them.
TRANSIENT_NAMES = frozenset({
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
    "ResponseStreamingError", "IncompleteReadError", "ClientPayloadError", "ServerDisconnectedError",
    "ClientOSError", "ServerTimeoutError", "ClientConnectorError", "IncompleteRead", "ProtocolError",
})
CREDENTIAL_NAMES = frozenset({"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                              "DefaultCredentialsError", "RefreshError"})
THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                            "TooManyRequestsException", "RequestTimeout", "ServiceUnavailable", "InternalError"})
TRANSIENT_ERRNOS = frozenset({errno.EBUSY, errno.EAGAIN, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED,
                              errno.ETIMEDOUT, errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH})


class ImageRefused(ValueError):
    """A file that is refused before decoding: not a regular file, or more pixels than allowed."""


class StorageUnavailable(OSError):
    """Object storage kept failing with transient errors after every retry; trying again later may work."""


class StorageDenied(OSError):
    """Object storage refuses us (no credentials, access denied, no such bucket): retrying cannot help."""


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


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _status(exc: BaseException) -> tuple[int | None, str]:
    """(HTTP status, error code) of a botocore ClientError or a gcsfs HttpError; (None, "") otherwise."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        meta = response.get("ResponseMetadata") or {}
        err = response.get("Error") or {}
        status = meta.get("HTTPStatusCode")
        return (int(status) if status is not None else None), str(err.get("Code", ""))
    code = getattr(exc, "code", None)
    return (code if isinstance(code, int) and 100 <= code < 600 else None), ""


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: a connection failure, a timeout, a 5xx or a throttling answer; never 4xx or credentials."""
    for e in _chain(exc):
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, StorageDenied)):
            return False
        if type(e).__name__ in CREDENTIAL_NAMES:
            return False
        status, code = _status(e)
        if status is not None or code:
            return code in THROTTLE_CODES or status in (408, 429) or (status is not None and status >= 500)
        if isinstance(e, (ConnectionError, TimeoutError, asyncio.TimeoutError)) or type(e).__name__ in TRANSIENT_NAMES:
            return True
        if isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS:
            return True
    return False


def access_problem(exc: BaseException, url: str) -> str | None:
    """What to tell the user when ``exc`` means we may not read ``url`` at all; None for other errors."""
    proto = protocol(url)
    for e in _chain(exc):
        name = type(e).__name__
        if name in CREDENTIAL_NAMES:
            where = ("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE with ~/.aws/credentials, or an "
                     "instance role)" if proto in ("s3", "s3a") else f"the {proto} library's standard credentials")
            return (f"{url}: no credentials found for {proto}:// ({e}); set {where} in the daemon's environment; "
                    "prefetchd reads credentials only from the storage library's standard environment and files")
        status, code = _status(e)
        if code == "NoSuchBucket" or "bucket does not exist" in str(e).lower():
            bucket = url.partition("://")[2].split("/", 1)[0]
            return (f"{url}: bucket {bucket!r} does not exist (or this endpoint does not have it); check the URL "
                    "and the endpoint (AWS_ENDPOINT_URL)")
        if isinstance(e, PermissionError) or status == 403 or code in ("AccessDenied", "InvalidAccessKeyId",
                                                                       "SignatureDoesNotMatch"):
            return (f"{url}: access denied ({e}); the credentials in the daemon's environment may not read it: "
                    "check the key, the bucket policy and the URL")
    return None


def with_retries(what: str, call: Callable[[], T], url: str, attempts: int = RETRY_ATTEMPTS) -> T:
    """``call()``, retried on transient errors with exponential backoff and jitter.

    Jitter keeps the workers that one outage hit from retrying in lockstep."""
    for attempt in range(attempts):
        try:
            return call()
        except Exception as exc:
            problem = access_problem(exc, url)
            if problem is not None:
                raise StorageDenied(problem) from exc
            if not is_transient(exc):
                raise
            if attempt == attempts - 1:
                raise StorageUnavailable(f"{what}: still failing after {attempts} tries "
                                         f"({type(exc).__name__}: {exc}); is the object store reachable?") from exc
            delay = min(RETRY_MAX_SECONDS, RETRY_BASE_SECONDS * 2**attempt) * random.uniform(0.5, 1.5)
            log.warning("%s: %s: %s; retry %d of %d in %.2f s", what, type(exc).__name__, exc, attempt + 1,
                        attempts - 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


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
                    self._fs, self._root = filesystem(self.url)
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

    def url_of(self, rel: str) -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def call(self, what: str, fn: Callable[[], T]) -> T:
        return with_retries(what, fn, self.url)

    def read(self, rel: str, offset: int = 0, size: int | None = None) -> bytearray:
        path, url = self.path(rel), self.url_of(rel)
        if size is None:
            data = self.call(f"reading {url}", lambda: self.fs.cat_file(path))
        else:
            # Keywords: s3fs puts version_id between path and start.
            data = self.call(f"reading {url} bytes {offset}-{offset + size}",
                             lambda: self.fs.cat_file(path, start=offset, end=offset + size))
            if len(data) < size:
                raise OSError(f"{url} ends at byte {offset + len(data)}, inside the member at {offset} of {size} "
                              "bytes; the object was truncated or rewritten after it was indexed")
        return bytearray(data)


def storage_for(root: str) -> Storage:
    """The storage of a dataset root: ``FsspecStorage`` for a URL (its backend is checked here), else local."""
    if is_url(root):
        storage = FsspecStorage(root)
        storage.fs  # an unknown protocol or a missing package is refused now, with what to install
        return storage
    return LocalStorage(root)
