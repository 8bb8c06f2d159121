"""Local paths and object-storage URLs, for the daemon's datasets and the trainer's checkpoints.

A location is a local path or an fsspec URL (``s3://bucket/prefix``, ``gs://...``).
Both processes use this module, so neither imports the other.  fsspec and its
backends (s3fs, gcsfs) are imported only when a URL is used; credentials come
from the backend's standard environment and config files, never from ours.

Object-storage errors fall in three kinds: transient (connection errors,
timeouts, 5xx, throttling), retried by ``with_retries`` with exponential backoff
and jitter and raised as ``StorageUnavailable`` once the retries are spent;
access (no credentials, denied, no such bucket), raised as ``StorageDenied``
with what to do; and the rest (a missing object), raised as the backend raised them.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from prefetchd.throttle import Throttle

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRY_ATTEMPTS = 6  # 0.1 + 0.2 + 0.4 + 0.8 + 1.6 s (x0.5-1.5 jitter): ~3 s before a read gives up
RETRY_BASE_SECONDS = 0.1
RETRY_MAX_SECONDS = 5.0
# One outage fails every read in flight at once (16 per worker), and each retries 5 times: a line
# per retry was ~540 lines in 20 s of a 2-worker daemon.  A process logs one retry line per this
# many seconds and counts the others into the next; a read that gives up still raises
# StorageUnavailable ("still failing after 6 tries"), which its caller reports.
RETRY_LOG_SECONDS = 10.0
# Object-storage timeouts, set here rather than left to s3fs's (connect 5 s, read 15 s, as of s3fs 2026.9),
# which can change under us.  Connecting takes milliseconds in a region and under a second across the
# internet; 5 s is a SYN lost twice.  The read timeout is how long a socket may go without a byte: a
# GET's first byte comes in tens of milliseconds (hundreds under load), so 15 s of silence is a store
# that hangs, and the try ends to be retried on a new connection.  Each is per try (RETRY_ATTEMPTS).
CONNECT_TIMEOUT_SECONDS = 5.0
READ_TIMEOUT_SECONDS = 15.0
# Nothing above bounds a body that keeps trickling in (a byte every few seconds: measured, a 1000-byte
# answer at 5 bytes/s held a read 200 s).  A sample -- an image, a shard's member -- is a few MB at
# most; at 1 MB/s, slower than any link that can feed a decoder, that is seconds: a sample's read
# still going after a minute is ended and retried.  Not for checkpoints, whose GBs take minutes.
SAMPLE_READ_SECONDS = 60.0
# Exception type names of the backends' transient failures (botocore, aiohttp,
# urllib3); by name so that no backend has to be imported to classify them.
TRANSIENT_NAMES = frozenset({
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
    "ResponseStreamingError", "IncompleteReadError", "ClientPayloadError", "ServerDisconnectedError",
    "ClientOSError", "ServerTimeoutError", "ClientConnectorError", "IncompleteRead", "ProtocolError",
})
CREDENTIAL_NAMES = frozenset({"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                              "DefaultCredentialsError", "RefreshError"})
# Error codes of temporary credentials that ran out (S3 and STS: ExpiredToken, 400; other services:
# ExpiredTokenException, RequestExpired; S3: TokenRefreshRequired).  Not retried, as a denial is not:
# botocore reads static credentials (the environment's, ~/.aws/credentials) once per client and never
# again, and our clients live as long as the process, so the same expired token would be sent forever.
EXPIRED_CODES = frozenset({"ExpiredToken", "ExpiredTokenException", "RequestExpired", "TokenRefreshRequired"})
# Credentials that botocore renews before they expire, named in the advice on an expired token.
RENEWING_CREDENTIALS = ("an instance or container role, or a profile with role_arn or credential_process, which "
                        "botocore renews before they expire")
THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                            "TooManyRequestsException", "RequestTimeout", "ServiceUnavailable", "InternalError"})
TRANSIENT_ERRNOS = frozenset({errno.EBUSY, errno.EAGAIN, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED,
                              errno.ETIMEDOUT, errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH})

# Where botocore sends S3 requests when the environment moves the store (MinIO, a proxy), most specific first.
ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")

# The extra of ours that installs a backend, where we ship one.
EXTRAS = {"s3": "prefetchd[s3]", "s3a": "prefetchd[s3]"}


class LocationError(ValueError):
    """A URL that cannot be opened here: unknown protocol or its package missing."""


class StorageUnavailable(OSError):
    """Object storage kept failing with transient errors after every retry; trying again later may work."""


class StorageDenied(OSError):
    """Object storage refuses us (no credentials, access denied, no such bucket): retrying cannot help."""


def is_url(location: str) -> bool:
    """``s3://bucket/x`` and other fsspec URLs; a local path (even with a colon) is not one."""
    scheme, sep, _ = location.partition("://")
    return bool(sep) and scheme.isidentifier() and len(scheme) > 1


def inside(path: str, root: str) -> bool:
    """``path`` is ``root`` or below it, by whole path components (``/data2`` is not in ``/data``)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def normalize(location: str | os.PathLike[str], base: Path | None = None) -> str:
    """A URL verbatim (less a trailing slash); a local path with ``~`` expanded, made absolute against ``base`` or the
    cwd, tidied (``.``, ``//``, a trailing slash), and resolved where a ``..`` in it may follow a link."""
    text = os.fspath(location)
    if is_url(text):
        return text.rstrip("/") if not text.endswith("://") else text
    path = Path(text).expanduser()
    if not path.is_absolute():
        path = (base or Path.cwd()) / path
    if ".." in path.parts:
        # "link/.." is the folder above where the link leads, as the kernel takes it: normpath dropped both
        # lexically and named another folder (ImageFolder read the path, start said "does not exist"; a walk).
        return os.path.realpath(path)
    return os.path.normpath(path)


def temp_file(folder: str | os.PathLike[str], prefix: str, suffix: str = "") -> tuple[int, str]:
    """A new file of a random name in ``folder`` (0600), opened for writing: its fd and its path, joined as given.
    Not tempfile.mkstemp, whose path back is os.path.abspath'd: in a folder "link/.." that names lexically
    another folder than the kernel made the file in, and the unlink or rename after failed ("No such file or
    directory", a walk with odd paths)."""
    path = os.path.join(folder, f"{prefix}{secrets.token_hex(6)}{suffix}")
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), path


def probe_folder(folder: Path, name: str) -> None:
    """Create and remove a hidden file named after ``name`` in the local ``folder``: whether a file
    can be written there, asked before the work that would write it.  OSError says why not."""
    fd, probe = temp_file(folder, f".{name}.probe-")
    os.close(fd)
    os.unlink(probe)


def missing_folder(flag: str, path: Path) -> str | None:
    """Why ``flag``'s file ``path`` cannot be written where its folder does not exist; None where it does.

    A missing folder is refused rather than created: a typo in it would otherwise make folders
    anywhere the command may write (as root, anywhere at all)."""
    folder = path.parent
    if folder.exists():  # a file there is not "missing": writing into it says what it is
        return None
    return f"{flag} {path}: the folder {folder} does not exist; create it first, or pass a path in an existing folder"


def protocol(url: str) -> str:
    return url.partition("://")[0]


def filesystem(url: str) -> tuple[Any, str]:
    """A fresh fsspec filesystem for ``url`` and the path within it.

    Fresh (not fsspec's per-process instance cache) because its async backends
    hold an event loop and connections that must not cross a fork, and because a
    cached instance keeps stale listings.
    """
    proto = protocol(url)
    try:
        import fsspec
        from fsspec.registry import known_implementations
    except ImportError:
        raise LocationError(f"{url}: reading URLs needs fsspec: pip install '{EXTRAS.get(proto, 'fsspec')}'") from None
    if proto not in known_implementations and proto not in fsspec.available_protocols():
        raise LocationError(f"{url}: unknown protocol {proto!r}; fsspec knows "
                            f"{', '.join(sorted(fsspec.available_protocols()))}")
    options: dict[str, Any] = {"skip_instance_cache": True}
    if proto in ("s3", "s3a"):
        # Retries are ours (with backoff, jitter and a log line); botocore's own
        # would multiply them and hide the outage.
        options["config_kwargs"] = {"retries": {"total_max_attempts": 1}, "connect_timeout": CONNECT_TIMEOUT_SECONDS,
                                    "read_timeout": READ_TIMEOUT_SECONDS}
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        hint = f"pip install '{EXTRAS[proto]}'" if proto in EXTRAS else known_implementations.get(proto, {}).get("err", str(exc))
        raise LocationError(f"{url}: {proto}:// needs a package that is not installed: {hint}") from None
    if proto in ("s3", "s3a"):
        fs.retries = 1  # s3fs's own retry loop (a class attribute, not an option), for the same reason
    return fs, str(path).rstrip("/")


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
        # socket.gaierror: a host name that does not resolve (a typo, or DNS down), which ftp:// meets when it connects
        # and aiohttp as its ClientConnectorDNSError, a ClientConnectorError by its bases: retried, then said.
        if (isinstance(e, (ConnectionError, TimeoutError, asyncio.TimeoutError, socket.gaierror))
                or any(cls.__name__ in TRANSIENT_NAMES for cls in type(e).__mro__)):
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
    for e in _chain(exc):  # before the PermissionError that s3fs makes of them, ahead in the chain
        code = _status(e)[1]
        message = str((getattr(e, "response", None) or {}).get("Error", {}).get("Message", "")) or str(e)
        restart = "restart the daemon (prefetchd-train, for its checkpoints): credentials are read once, at start"
        if code in EXPIRED_CODES:
            return (f"{url}: the temporary credentials expired ({code}: {message}); refresh them (a new "
                    f"AWS_SESSION_TOKEN with its key, or ~/.aws/credentials) and {restart}; or use {RENEWING_CREDENTIALS}")
        if code == "InvalidToken":
            return (f"{url}: the session token is not valid ({code}: {message}); AWS_SESSION_TOKEN (or "
                    "aws_session_token) must come with the same temporary credentials as AWS_ACCESS_KEY_ID: set the "
                    f"three from one source and {restart}")
    for e in _chain(exc):
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


def _endpoint() -> str:
    """Where the store was looked for, when the environment moved it (a local S3 server, a proxy)."""
    url = next((os.environ[name] for name in ENDPOINT_VARIABLES if os.environ.get(name)), None)
    return f" at {url} (AWS_ENDPOINT_URL)" if url else ""


_retry_log = Throttle(RETRY_LOG_SECONDS)  # the retry lines of this process, all its threads


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
                                         f"({type(exc).__name__}: {exc}); is the object store reachable{_endpoint()}?") from exc
            delay = min(RETRY_MAX_SECONDS, RETRY_BASE_SECONDS * 2**attempt) * random.uniform(0.5, 1.5)
            _retry_log.log(log, logging.WARNING, "%s: %s: %s; retry %d of %d in %.2f s", what, type(exc).__name__,
                           exc, attempt + 1, attempts - 1, delay, others="other retry", scope=" of this process")
            time.sleep(delay)
    raise AssertionError("unreachable")
