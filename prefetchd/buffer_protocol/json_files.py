"""The buffer's small JSON documents as files: how one is written (atomically, by rename; on a full
filesystem, in place) and read (bounded, its format and version checked, then field by field:
``checked_field``; status.json's many fields by ``status_fields``).  The documents are ``manifest``'s,
``progress``'s, ``job_request``'s and ``status``'s (its file ``status_file``'s); their file names are ``layout``'s."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from prefetchd.buffer_protocol.batch import VERSION
from prefetchd.buffer_protocol.errors import MAX_INT, ProtocolError, shown
from prefetchd.buffer_protocol.layout import DOCUMENT_KINDS, TEMP_MARK, at


MAX_DOCUMENT_LEN = 1 << 20
# A manifest holds the class names: 100,000 classes of two files each made one of 1.3 MB, which its own readers
# refused, so the trainer could not open the buffer and a restart of the job failed (a walk).  64 MiB holds the
# million integer labels a file list may have (11 bytes each) and ImageNet-21k's names many times over.
MAX_MANIFEST_LEN = 64 << 20
# A progress document is a few hundred bytes.  The daemon reads those of every consumer at each poll, and any member
# of a --group-access buffer's group may write them: 63 valid ones of 1 MiB (a list of numbers beside the position)
# took 110 ms each to parse (2-core EPYC) and slowed the daemon's loop from 1 s to 4.3 s.  At 4 KiB: 0.21 ms at most.
MAX_PROGRESS_LEN = 4096


def max_document_len(kind: str) -> int:
    """The most bytes a ``kind`` document may have (SPEC rule 2)."""
    return {"progress": MAX_PROGRESS_LEN, "manifest": MAX_MANIFEST_LEN}.get(kind, MAX_DOCUMENT_LEN)


def encode_json(doc: dict[str, Any]) -> bytes:
    """A document as its file holds it."""
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def write_json(path: Path, doc: dict[str, Any], dir_fd: int | None = None, mode: int | None = None) -> None:
    """Atomically replace ``path`` with ``doc`` (see ``replace_file``)."""
    replace_file(path, encode_json(doc), mode, dir_fd)


def replace_file(path: Path, data: bytes, mode: int | None = None, dir_fd: int | None = None) -> None:
    """Atomically replace ``path`` with ``data``: a temp name in the same directory, then a rename,
    so a reader sees the old file or the new one, never part of one.  ``mode``: the file's
    permission bits whatever the umask; without it, 0644 less the umask.  ``dir_fd``: the folder's
    fd, through which both names are looked up (``layout.at``); ``path`` is then what errors show."""
    os.close(replace_file_kept(path, data, mode, dir_fd))


def replace_file_kept(path: Path, data: bytes, mode: int | None = None, dir_fd: int | None = None) -> int:
    """``replace_file``, and an fd of the file written, open for writing, which the caller closes: whoever may rename
    the files of the folder may move that file elsewhere, and its writer still reaches it through that fd."""
    # pid + random suffix: two writers in one process (threads, two loaders) never share a temp file.
    tmp = path.with_name(f"{path.name}{TEMP_MARK}-{os.getpid()}-{secrets.token_hex(4)}")
    tmp_at, path_at = at(tmp, dir_fd), at(path, dir_fd)
    # O_EXCL: a name someone else planted (a link to a file of theirs) is never written through.
    fd = os.open(tmp_at, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    try:
        if mode is not None:
            os.fchmod(fd, mode)  # O_CREAT's mode is less the umask
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.replace(tmp_at, path_at, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        os.close(fd)
        # A writer that retries (a loader on a full tmpfs, every half second) must not leave a file each time.
        with contextlib.suppress(OSError):
            os.unlink(tmp_at, dir_fd=dir_fd)
        raise
    return fd


def rewrite_in_place(path: Path, data: bytes, kind: str, dir_fd: int | None = None) -> None:
    """Write ``data`` over the ``kind`` document at ``path`` (through ``dir_fd``: ``layout.at``), in the pages it has:
    for a full filesystem, where ``replace_file`` gets no page for a new file.  A tmpfs allocates nothing to overwrite
    a page a file has, so this goes through while ``data`` fits the file's pages (its ``st_blocks``); a shorter
    ``data`` is padded with spaces to the file's length, which JSON reads past and which keeps the pages for the
    next time.

    Not atomic: a reader may find the file half rewritten for the moment the write takes, a document it cannot
    parse, which readers of status.json take for one being replaced (``readable_status``).  Only a regular file of
    this user with one link that holds a ``kind`` document now is written: with --group-access a member of the
    buffer's group may have put a file of theirs, or a second name of another file, there, or renamed another of
    this user's files to that name (a batch that trainers have mapped, whose pages would change under them).
    OSError otherwise: ENOSPC where ``data`` does not fit."""
    # O_RDWR: what the file holds is read through the very fd written, never a name looked up again.
    fd = os.open(at(path, dir_fd), os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            raise PermissionError(errno.EPERM, f"not a regular file of uid {os.geteuid()} with one link; not "
                                  "written in place", str(path))
        if not _holds_document(fd, st, kind):
            raise PermissionError(errno.EPERM, f"holds no {kind} document; not written in place", str(path))
        room = st.st_blocks * 512  # st_blocks counts 512-byte units, whatever the filesystem's block size
        if len(data) > room:
            raise OSError(errno.ENOSPC, f"{len(data)} bytes do not fit the {room} its pages hold", str(path))
        padded = data.ljust(st.st_size, b" ")
        if os.pwrite(fd, padded, 0) != len(padded):  # a filesystem that allocates anew to overwrite (copy on write)
            raise OSError(errno.ENOSPC, "written in part only", str(path))
    finally:
        os.close(fd)


def _holds_document(fd: int, st: os.stat_result, kind: str) -> bool:
    """Whether the file open at ``fd`` (``st``: its fstat) is a ``kind`` document, as far as its format field says."""
    limit = max_document_len(kind)
    if st.st_size > limit:
        return False
    try:
        doc = json.loads(os.pread(fd, limit, 0))
    except (ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("format") == f"prefetchd.{kind}"


def open_regular(path: Path, flags: int, what: str, mode: int = 0o644, dir_fd: int | None = None) -> int:
    """Open ``path`` only if it is a regular file: not through a symlink (O_NOFOLLOW), and
    without waiting for a writer should it be a FIFO (O_NONBLOCK, then fstat).  ``mode``
    (less the umask) is that of a file O_CREAT creates.
    FileNotFoundError passes through, as FileExistsError does (with O_EXCL); any other problem is a ProtocolError.
    ``dir_fd``: the folder's fd, through which the name is looked up (``layout.at``)."""
    try:
        fd = os.open(at(path, dir_fd), flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except (FileNotFoundError, FileExistsError):
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ProtocolError(f"{path}: is a symbolic link, not {what}; the buffer holds no links, remove it") from None
        raise ProtocolError(f"{path}: cannot open {what} ({exc.strerror}); check the buffer's owner and "
                            "permissions (`ls -la` the buffer)") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ProtocolError(f"{path}: is not a regular file, so not {what}; remove it from the buffer")
    return fd


def read_json(path: Path, kind: str) -> dict[str, Any]:
    """Read a protocol document; FileNotFoundError passes through, anything malformed is a ProtocolError."""
    return read_json_stat(path, kind)[0]


def read_json_stat(path: Path, kind: str, dir_fd: int | None = None) -> tuple[dict[str, Any], os.stat_result]:
    """``read_json``, with the fstat of the file it read: who wrote that very file, not
    whatever a later look at the path would find after someone replaced it.  ``dir_fd``: as
    ``open_regular``'s."""
    if kind not in DOCUMENT_KINDS:
        raise ValueError(f"unknown document kind {kind!r}")
    fd = open_regular(path, os.O_RDONLY, f"a {kind} document", dir_fd=dir_fd)
    limit = max_document_len(kind)
    try:
        st = os.fstat(fd)
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ProtocolError(f"{path}: larger than {limit} bytes, not a {kind} document; delete it")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, absurd nesting or digit counts
        raise ProtocolError(f"{path}: not valid JSON ({exc}); delete it and let its writer recreate it") from None
    fmt = f"prefetchd.{kind}"
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ProtocolError(f"{path}: format is {shown(got)}, expected {fmt!r}; delete it and let its writer recreate it")
    if type(doc.get("version")) is not int or doc["version"] != VERSION:
        raise ProtocolError(
            f"{path}: written with buffer protocol version {shown(doc.get('version'))}, this prefetchd speaks "
            f"version {VERSION}; run prefetchd versions of one buffer protocol on both sides (`prefetchd --version` "
            "says which), or clear the buffer"
        )
    return doc, st


def read_optional(path: Path, kind: str, dir_fd: int | None = None) -> dict[str, Any] | None:
    """``read_json`` (through ``dir_fd`` where given), or None when the document has not been written yet."""
    try:
        return read_json_stat(path, kind, dir_fd)[0]
    except FileNotFoundError:
        return None


def checked_field(doc: dict[str, Any], key: str, kind: type, path: Path) -> Any:
    """``doc[key]`` where it is a ``kind``, else a ProtocolError naming ``path`` and the field.  An int must be
    non-negative and fit int64, a float be finite (an int is taken for one, as a float)."""
    value: Any = doc.get(key)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, bool) if kind is bool else isinstance(value, kind) and not isinstance(value, bool)
    # Python's JSON reader takes NaN and Infinity; a time of -Infinity became a trainer silent for inf
    # seconds, which status.json carried and its own readers refused.
    # An int past int64 (10**4000 in a progress file's read_batches) overflowed the daemon's float arithmetic.
    if not ok or (kind is int and not 0 <= value <= MAX_INT) or (kind is float and not math.isfinite(value)):
        what = {int: "non-negative int below 2**63", float: "finite number"}.get(kind, kind.__name__)
        got = f"is {shown(value)}" if key in doc else "is missing"  # not "is None" (a review)
        raise ProtocolError(f"{path}: field {key!r} {got}, expected a {what}")
    return value
