"""The buffer's small JSON documents: how one is written (atomically, by rename) and read (bounded,
checked field by field), and the documents trainers and daemons exchange there: ``Manifest``,
``Progress`` and ``JobRequest``.  Their file names are ``layout``'s; ``status.json`` is ``status``'s."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import json
import math
import os
import re
import secrets
import stat
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefetchd.buffer_protocol.batch import VERSION
from prefetchd.buffer_protocol.errors import MAX_INT, ProtocolError, shown, user_name
from prefetchd.buffer_protocol.layout import (ACCEPTED_JOB_NAME, DEFAULT_CONSUMER, DOCUMENT_KINDS, JOB_NAME, MANIFEST_NAME,
                                             TEMP_MARK, TRAINER_FILE_MODE, Dir, at, check_owned, progress_name)


MAX_DOCUMENT_LEN = 1 << 20
# A progress document is a few hundred bytes.  The daemon reads those of every consumer at each poll, and any member
# of a --group-access buffer's group may write them: 63 valid ones of 1 MiB (a list of numbers beside the position)
# took 110 ms each to parse (2-core EPYC) and slowed the daemon's loop from 1 s to 4.3 s.  At 4 KiB: 0.21 ms at most.
MAX_PROGRESS_LEN = 4096


# A malformed job's job_id is echoed in its refusal only when it looks like one (JobRequest's
# are 12 hex digits); anything else could be a megabyte of control characters in a log.
JOB_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}", re.ASCII)


# What a manifest's split and channels may be (SPEC.md's Manifest table); the daemon's --split takes
# SPLITS.  The daemon writes 3 channels (it decodes a grayscale file to three equal ones), but a reader
# takes 1 as well, as SPEC does: the trainer has grayscale defaults for normalize=True.
SPLITS = ("train", "val")
CHANNELS = (3, 1)


# A consumer waiting for a batch rewrites its progress file this often (same position, new
# time), so that a daemon tells a waiting consumer from a silent one (--consumer-timeout).
PROGRESS_REFRESH_SECONDS = 2.0
# Whether a process of another pid namespace is there is asked of its lock, by taking it for a moment
# (microseconds): the daemon asks a consumer's lock file (ownership.consumer_held), a reader asks daemon.lock
# (ownership.daemon_owner).  Whoever takes such a lock and is refused tries again this long
# (ownership.take_lock) before it takes the holder for another trainer, or another daemon.
LOCK_RETRY_SECONDS = 0.5
# A writer of job.json renames its temp file into place as soon as it has written it (``replace_file``: microseconds
# apart), and a rename sets the file's ctime to the moment, where its mtime, which only its owner (or root) may set,
# stays when it was written.  Any member of a --group-access buffer's group may rename the files there (the folder
# is group-writable and not sticky): one that kept another user's job.json aside and renamed it back had the daemon
# run that old request again, as that user's.  A job.json put in place more than this long after it was written is
# refused (``JobRequest.read``); the margin is for a writer stalled between its write and its rename on a loaded box.
MAX_JOB_RENAME_SECONDS = 10.0
# The daemon's record of the job it accepted (job.accepted.json) is written and renamed into place at once, by the
# daemon (microseconds apart), and is never changed after: one its ctime puts this far past its mtime was renamed since
# (or its mode changed), and is not resumed (``JobRequest.recorded``).  A record replaced while the daemon runs is
# emptied through the fd it keeps (``JobInbox``), so only a record kept aside across a restart needs this check; a
# restart takes longer than this (the daemon's start alone, before it can accept another job to record).
MAX_RECORD_RENAME_SECONDS = 1.0


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
    if st.st_size > MAX_DOCUMENT_LEN:
        return False
    try:
        doc = json.loads(os.pread(fd, MAX_DOCUMENT_LEN, 0))
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
    limit = MAX_PROGRESS_LEN if kind == "progress" else MAX_DOCUMENT_LEN
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


def steps_per_epoch(samples: int, batch_size: int, drop_last: bool = False) -> int:
    """Batches in an epoch of ``samples``: the last one short where they do not divide, or,
    with ``drop_last``, left out (which samples it held changes from epoch to epoch with the
    shuffle)."""
    return samples // batch_size if drop_last else -(-samples // batch_size)


def batch_len(step: int, batch_size: int, samples: int) -> int:
    """Images in batch ``step`` of an epoch of ``samples``: the batch size, except for a short last batch
    (which ``drop_last`` leaves out)."""
    return min(batch_size, samples - step * batch_size)


def _field(doc: dict[str, Any], key: str, kind: type, path: Path) -> Any:
    value: Any = doc.get(key)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, bool) if kind is bool else isinstance(value, kind) and not isinstance(value, bool)
    # Python's JSON reader takes NaN and Infinity; a time of -Infinity became a trainer silent for inf
    # seconds, which status.json carried and its own readers refused.
    # An int past int64 (10**4000 in a progress file's read_batches) overflowed the daemon's float arithmetic.
    if not ok or (kind is int and not 0 <= value <= MAX_INT) or (kind is float and not math.isfinite(value)):
        what = {int: "non-negative int below 2**63", float: "finite number"}.get(kind, kind.__name__)
        raise ProtocolError(f"{path}: field {key!r} is {shown(value)}, expected a {what}")
    return value


def _one_of(doc: dict[str, Any], key: str, allowed: tuple[object, ...], path: Path) -> None:
    """Refuse ``doc[key]``, of its type already (``_field``), unless it is one of ``allowed``."""
    if doc[key] not in allowed:
        listed = " or ".join(repr(v) for v in allowed)
        raise ProtocolError(f"{path}: field {key!r} is {shown(doc[key])}, expected {listed}; delete it and restart the daemon")


def augmentation_text(options: Mapping[str, object]) -> str:
    """The manifest's ``augmentation``: ``name=value`` of each augmentation a job sets beyond the
    split's defaults, in the order given, joined by ``;`` ("" for none).  The names are `prefetchd
    start`'s options (``color_jitter`` is ``--color-jitter``) and the values as it takes them, so a
    reader can start the same job again (``augmentation_options``); floats are written exactly."""
    parts = []
    for name, value in options.items():
        text = exact_number(value) if isinstance(value, float) else str(value)
        if ";" in text or "=" in name:
            raise ValueError(f"augmentation {name}={text!r}: a name holds no '=' and a value no ';'")
        parts.append(f"{name}={text}")
    return ";".join(parts)


def augmentation_options(text: str) -> dict[str, str]:
    """``augmentation_text``'s options back, by `prefetchd start` option name: "color_jitter=0.4" is
    {"color_jitter": "0.4"}."""
    return dict(part.partition("=")[::2] for part in text.split(";") if part)


def exact_number(value: float) -> str:
    """``value`` as short as ``:g`` writes it where that is exact, else every digit it needs: 0.4 is
    "0.4" and 1.0 "1", but 1/3 "0.3333333333333333", not ``:g``'s "0.333333" (another value)."""
    text = f"{value:g}"
    return text if float(text) == value else repr(value)


@dataclass(frozen=True)
class Manifest:
    """What a daemon produces into a buffer.  Written once per job, read by trainers."""

    dataset_root: str
    fingerprint: str
    classes: list[str]
    num_samples: int
    split: str
    seed: int
    batch_size: int
    image_size: int
    samples_per_epoch: int
    steps_per_epoch: int
    epochs: int | None
    producer: str
    channels: int = 3
    rank: int = 0
    world_size: int = 1
    val_fraction: float | None = None
    # The augmentations beyond the split's defaults, as a canonical string ("" for none).
    augmentation: str = ""
    # Each epoch's short last batch left out: every batch holds batch_size images.
    drop_last: bool = False
    created: float = field(default_factory=time.time)
    # The daemon's batches name their stream (``job`` and ``rank`` in their metadata), and a reader refuses one
    # that does not: ``batch.not_of_stream``.  False where absent: a daemon before them, whose batches it reads
    # as ever (tests and tools that write batches without them leave it so).
    keyed_batches: bool = False

    # Fields whose change makes already written batches wrong for the new job.
    IDENTITY = (
        "fingerprint", "split", "seed", "batch_size", "image_size", "channels",
        "samples_per_epoch", "rank", "world_size", "val_fraction", "augmentation", "drop_last",
    )

    @functools.cached_property  # read at every progress write and read: a manifest never changes
    def job_key(self) -> str:
        """A short digest of the job's identity: the same for every run of one job (a restarted
        daemon), different for any other.  Progress documents carry it (``Progress.job``), so a
        daemon that replaced a job tells its trainer's position from a trainer of the old one."""
        identity = json.dumps([getattr(self, k) for k in self.IDENTITY], sort_keys=True)
        return hashlib.sha256(identity.encode()).hexdigest()[:16]

    def identity_diff(self, other: Manifest) -> list[str]:
        """Human-readable list of identity fields that differ from ``other``."""
        diff = [
            f"{k}: {getattr(other, k)!r} -> {getattr(self, k)!r}"
            for k in self.IDENTITY
            if getattr(self, k) != getattr(other, k)
        ]
        if self.fingerprint != other.fingerprint:  # a digest alone does not say which dataset, or that it changed
            what = (f"dataset {other.dataset_root} -> {self.dataset_root}" if self.dataset_root != other.dataset_root
                    else f"the files of {self.dataset_root} changed")
            diff = [f"{d} ({what})" if d.startswith("fingerprint:") else d for d in diff]
        return diff

    def to_doc(self) -> dict[str, Any]:
        return {"format": "prefetchd.manifest", "version": VERSION, **asdict(self)}

    @classmethod
    def from_doc(cls, doc: dict[str, Any], path: Path) -> Manifest:
        for key, kind in (
            ("dataset_root", str), ("fingerprint", str), ("classes", list), ("num_samples", int),
            ("split", str), ("seed", int), ("batch_size", int), ("image_size", int),
            ("samples_per_epoch", int), ("steps_per_epoch", int), ("producer", str),
            ("channels", int), ("rank", int), ("world_size", int), ("created", float),
        ):
            _field(doc, key, kind, path)
        _one_of(doc, "split", SPLITS, path)
        _one_of(doc, "channels", CHANNELS, path)
        if doc["batch_size"] < 1 or doc["image_size"] < 1 or doc["world_size"] < 1:
            raise ProtocolError(f"{path}: batch_size, image_size and world_size must be at least 1")
        if not all(isinstance(c, str) for c in doc["classes"]):
            raise ProtocolError(f"{path}: field 'classes' must be a list of class names")
        for flag in ("drop_last", "keyed_batches"):  # absent in manifests of daemons before them: False
            if flag in doc:
                _field(doc, flag, bool, path)
        samples, size = doc["samples_per_epoch"], doc["batch_size"]
        if doc["steps_per_epoch"] != steps_per_epoch(samples, size, doc.get("drop_last", False)):
            dropping = " with the short last batch left out" if doc.get("drop_last") else ""
            raise ProtocolError(
                f"{path}: steps_per_epoch {doc['steps_per_epoch']} does not match {samples} "
                f"samples in batches of {size}{dropping}; delete it and restart the daemon"
            )
        for key, kind in (("epochs", int), ("val_fraction", float), ("augmentation", str)):
            # null means "none" for epochs and val_fraction; augmentation is a string when present.
            if doc.get(key) is not None or (key == "augmentation" and key in doc):
                doc = {**doc, key: _field(doc, key, kind, path)}
        # epochs may be left out as val_fraction may: null, run on (a missing key was a TypeError).
        doc = {"epochs": None, **doc, "created": float(doc["created"])}
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in doc.items() if k in names})

    def write(self, buffer: Dir, dir_fd: int | None = None) -> None:
        """Write the manifest into ``buffer`` (through the folder's fd ``dir_fd`` where given: ``replace_file``)."""
        write_json(Path(buffer) / MANIFEST_NAME, self.to_doc(), dir_fd)

    @classmethod
    def read(cls, buffer: Dir) -> Manifest:
        """The manifest of stream folder ``buffer``: only one of the buffer's owner (``layout.check_owned``)."""
        path = Path(buffer) / MANIFEST_NAME
        doc, st = read_json_stat(path, "manifest")
        check_owned(path, st.st_uid, "manifests")
        return cls.from_doc(doc, path)


@dataclass(frozen=True, order=True)
class Progress:
    """The next (epoch, step) a consumer (trainer) needs; everything before it is consumed.

    ``wait_share`` (optional) is the fraction of the trainer's recent time spent
    waiting for batches, which the daemon reports as whether the GPU is fed.
    ``pid`` and ``time`` say which process wrote it and when (``write`` fills them
    in); the daemon tells from them whether the trainer is still there.  ``closed``:
    the consumer left (``BufferLoader.close``) and holds no batches while another
    reads, until it writes again.  ``job``: the ``Manifest.job_key`` of the job the position is in (None
    from writers that predate it); the daemon ignores a position in another job.
    ``read_batches``: the batches its writer consumed by reading them since its loader was made (a move by
    ``load_state_dict`` or ``set_epoch`` adds none), so that the daemon counts a jump over batches as no
    consumption (None from writers that predate it: the daemon counts every move forward).
    ``pid_namespace``: the writer's pid namespace (``pid_namespace()``, filled in by ``write``; None from
    writers that predate it or cannot read it), which says whether ``pid`` means anything to a reader.
    ``locked``: the writer holds the consumer's lock file (SPEC rule 9), by which a reader in another pid
    namespace tells whether it is still there (``ownership.writer_alive``).
    ``consumer`` picks the file (see :func:`progress_name`).
    """

    epoch: int
    step: int
    wait_share: float | None = field(default=None, compare=False)
    pid: int | None = field(default=None, compare=False)
    time: float | None = field(default=None, compare=False)
    closed: bool = field(default=False, compare=False)
    job: str | None = field(default=None, compare=False)
    read_batches: int | None = field(default=None, compare=False)
    pid_namespace: int | None = field(default=None, compare=False)
    locked: bool = field(default=False, compare=False)

    def write(self, buffer: Dir, consumer: str = DEFAULT_CONSUMER) -> Progress:
        """Replace the consumer's progress file with this position; the document as written (``pid``, ``time``
        and ``pid_namespace`` filled in), by which its writer tells that file from one written since."""
        written = dataclasses.replace(self, pid=os.getpid(), time=time.time(), pid_namespace=pid_namespace())
        doc: dict[str, Any] = {"format": "prefetchd.progress", "version": VERSION, "epoch": self.epoch,
                               "step": self.step, "pid": written.pid, "time": written.time}
        if written.pid_namespace is not None:
            doc["pid_namespace"] = written.pid_namespace
        if self.locked:
            doc["locked"] = True
        if self.wait_share is not None:
            doc["wait_share"] = round(self.wait_share, 4)
        if self.closed:
            doc["closed"] = True
        if self.job is not None:
            doc["job"] = self.job
        if self.read_batches is not None:
            doc["read_batches"] = self.read_batches
        write_json(Path(buffer) / progress_name(consumer), doc, mode=TRAINER_FILE_MODE)
        return written

    @classmethod
    def read(cls, buffer: Dir, consumer: str = DEFAULT_CONSUMER, dir_fd: int | None = None) -> Progress | None:
        """The consumer's progress (read through ``buffer``'s fd ``dir_fd`` where given), or None when it has
        not written one yet."""
        path = Path(buffer) / progress_name(consumer)
        doc = read_optional(path, "progress", dir_fd)
        if doc is None:
            return None
        share = doc.get("wait_share")
        if share is not None and not (isinstance(share, (int, float)) and not isinstance(share, bool) and 0 <= share <= 1):
            raise ProtocolError(f"{path}: field 'wait_share' is {shown(share)}, expected a fraction between 0 and 1")
        closed, locked = doc.get("closed", False), doc.get("locked", False)
        for key, flag in (("closed", closed), ("locked", locked)):
            if not isinstance(flag, bool):
                raise ProtocolError(f"{path}: field {key!r} is {shown(flag)}, expected true or false")
        # Optional for readers: documents of older writers have neither.
        pid = _field(doc, "pid", int, path) if doc.get("pid") is not None else None
        written = _field(doc, "time", float, path) if doc.get("time") is not None else None
        job = _field(doc, "job", str, path) if doc.get("job") is not None else None
        read = _field(doc, "read_batches", int, path) if doc.get("read_batches") is not None else None
        if read is not None and read < 0:
            raise ProtocolError(f"{path}: field 'read_batches' is {read}, expected a count of batches (0 or more)")
        namespace = _field(doc, "pid_namespace", int, path) if doc.get("pid_namespace") is not None else None
        return cls(_field(doc, "epoch", int, path), _field(doc, "step", int, path), share, pid, written, closed, job,
                   read, namespace, locked)


def pid_namespace() -> int | None:
    """This process's pid namespace: the inode number of ``/proc/self/ns/pid`` (what `lsns` lists); None
    where /proc does not say (no /proc, or one of another namespace that does not show this process).
    Asked at each use: a process may fork into a namespace it unshared (``unshare --pid --fork``)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


@dataclass(frozen=True)
class JobRequest:
    """A trainer's request that the daemon produce ``settings``.

    ``settings`` uses the names of `prefetchd start` flags with underscores
    (data, split, batch_size, ...); the daemon validates them and answers in
    status.json under ``job_result`` with the request's ``job_id``.

    ``owner`` is not in the document: it is the uid owning the job.json that was
    read (fstat of the opened file), which says who submitted it, since a writer
    creates its temp file and renames it into place.  None for a request not read
    from a buffer.  The daemon's copy of the request it accepted (``record``,
    ``job.accepted.json``) carries it, the file being the daemon's own.  ``written_ns``, not in the document
    either: that file's mtime (ns), when its owner wrote it, which no one else can set and a rename keeps; the
    daemon refuses a request older than one it answered (``JobInbox``).
    """

    settings: dict[str, Any]
    replace: bool = False
    job_id: str = field(default_factory=lambda: secrets.token_hex(6))
    submitted: float = field(default_factory=time.time)
    owner: int | None = None
    written_ns: int | None = None

    def write(self, buffer: Dir) -> None:
        write_json(Path(buffer) / JOB_NAME, self._doc(), mode=TRAINER_FILE_MODE)

    def _doc(self) -> dict[str, Any]:
        return {"format": "prefetchd.job", "version": VERSION, "settings": self.settings, "replace": self.replace,
                "job_id": self.job_id, "submitted": self.submitted}

    def record(self, buffer: Dir, dir_fd: int | None = None) -> int:
        """Keep this request, which the daemon accepted, as ``job.accepted.json``, with its submitter: the job a
        restarted daemon resumes (``recorded``).  job.json itself is no record of it: the next request, refused
        or not, replaces it.  Its ``owner`` field tells it from a request: this file is the daemon's own, and renamed
        to job.json (a member of the buffer's group may) it would pass for a request of the daemon's user (``read``
        refuses it).

        Returns an fd of the record, open for writing, through which the daemon empties it once it records no running
        job (``JobInbox``): a member may rename the record aside and back over a later one, and a restart then
        resumed the old job."""
        doc = {**self._doc(), "owner": self.owner}
        return replace_file_kept(Path(buffer) / ACCEPTED_JOB_NAME, encode_json(doc), dir_fd=dir_fd)

    @classmethod
    def recorded(cls, buffer: Dir) -> JobRequest | None:
        """The request the daemon last accepted (``record``); None when none is kept.  ProtocolError for a file
        that is not the daemon's own: any member of a --group-access buffer's group may put one there, and would
        have it resumed over the job another member's trainer reads; and for one renamed since it was written (its
        ctime past its mtime, as ``read`` tells a request put back): a member may keep the record of an old job
        aside and rename it back over the newer one."""
        path = Path(buffer) / ACCEPTED_JOB_NAME
        try:
            doc, st = read_json_stat(path, "job")
        except FileNotFoundError:
            return None
        except ProtocolError:
            with contextlib.suppress(OSError):
                if os.lstat(path).st_size == 0:
                    raise ProtocolError(f"{path}: is empty: the daemon empties its record of a job once that job ended "
                                        "or another replaced it, so this one was renamed away and back (any member of "
                                        "the buffer's group may rename the files there); it is not resumed") from None
            raise
        if st.st_uid != os.geteuid() or st.st_nlink != 1:
            raise ProtocolError(f"{path}: belongs to uid {st.st_uid} (or has {st.st_nlink} links), so the daemon "
                                f"(uid {os.geteuid()}) did not write it; remove it")
        # The daemon renames it into place as soon as it is written and never changes it after, but to empty it
        # through the fd it keeps (``JobInbox``), which a member's rename does not escape: one renamed since (kept
        # aside by a member and put back after a restart, which no fd outlives) would resume a job nobody asks for.
        late = (st.st_ctime_ns - st.st_mtime_ns) / 1e9
        if late > MAX_RECORD_RENAME_SECONDS:
            raise ProtocolError(f"{path}: written {when_written(st.st_mtime_ns)}, was renamed or changed {late:.1f} s "
                                "after the daemon wrote it: perhaps an old record put back (any member of the "
                                "buffer's group may rename the files there), which is not resumed; submit the job "
                                f"again: `prefetchd submit --buffer {path.parent} ...`")
        owner = _field(doc, "owner", int, path) if doc.get("owner") is not None else None
        return cls._from_doc(doc, path, owner)

    @classmethod
    def read(cls, buffer: Dir) -> JobRequest | None:
        """The request in ``buffer``'s job.json, None when there is none.  A malformed one is a
        ``BadJobRequest`` that carries the document's ``job_id`` where one can be read, so that
        the refusal reaches whoever submitted it.  So is one that others than its owner may have written: with
        more than one hard link, writable by others, or renamed into place long after it was written (an old
        request put back, ``MAX_JOB_RENAME_SECONDS``); and the daemon's record of a job (``record``) renamed there."""
        path = Path(buffer) / JOB_NAME
        try:
            doc, st = read_json_stat(path, "job")
        except FileNotFoundError:
            return None
        except ProtocolError as exc:  # not read at all (a link, not JSON, ...): no job_id to echo
            raise BadJobRequest(str(exc), None) from None
        job_id = doc.get("job_id")
        try:
            if st.st_nlink != 1:
                # A hard link to someone else's file would pass for a job that user wrote.
                raise ProtocolError(f"{path}: has {st.st_nlink} links, so its owner (uid {st.st_uid}) need not be "
                                    "who put it there; remove it and submit the job again")
            if st.st_mode & 0o022:  # anyone it is writable by could have written its request, or freshened its mtime
                raise ProtocolError(f"{path}: is writable by others than its owner, {user_name(st.st_uid)} (mode "
                                    f"{stat.S_IMODE(st.st_mode):04o}), so they may have written it; submit the job "
                                    f"with `prefetchd submit --buffer {path.parent} ...`, which writes it 0644")
            if "owner" in doc:  # only the daemon's record has it: a request the daemon's user never made
                raise ProtocolError(f"{path}: is the daemon's record of the job it accepted ({ACCEPTED_JOB_NAME}, "
                                    "which has an 'owner' field) renamed to a request (any member of the buffer's "
                                    "group may rename the files there), not a request; it is not run. Submit the job "
                                    f"with `prefetchd submit --buffer {path.parent} ...`")
            late = (st.st_ctime_ns - st.st_mtime_ns) / 1e9
            if late > MAX_JOB_RENAME_SECONDS:
                raise ProtocolError(put_back(path, st.st_uid, st.st_mtime_ns, f"was put in place {late:.0f} s after "
                                             "it was written (a writer renames it there at once; or it was moved in "
                                             "from elsewhere)"))
            return cls._from_doc(doc, path, st.st_uid, st.st_mtime_ns)
        except ProtocolError as exc:
            echoed = job_id if isinstance(job_id, str) and JOB_ID_RE.fullmatch(job_id) else None
            raise BadJobRequest(str(exc), echoed, st.st_uid if st.st_nlink == 1 else None) from None


    @classmethod
    def _from_doc(cls, doc: dict[str, Any], path: Path, owner: int | None, written_ns: int | None = None) -> JobRequest:
        settings = _field(doc, "settings", dict, path)
        for key, value in settings.items():
            if not isinstance(value, (str, int, float, bool)) and value is not None:
                raise ProtocolError(f"{path}: setting {shown(key)} is {shown(value)}; settings are strings, numbers, "
                                    "booleans or null")
        # A JSON boolean or absent: "replace": "no" was true, and replaced a job a trainer was reading.
        replace = _field(doc, "replace", bool, path) if doc.get("replace") is not None else False
        return cls(settings, replace, _field(doc, "job_id", str, path), _field(doc, "submitted", float, path),
                   owner=owner, written_ns=written_ns)


def put_back(path: Path, owner: int | None, mtime_ns: int, how: str) -> str:
    """The refusal of a job.json (``path``) that is an old request renamed back into place: whose it is, when it was
    written, ``how`` that shows, and how to have it run."""
    return (f"{path}: {user_name(owner)}'s request, written {when_written(mtime_ns)}, {how}: an old request renamed back "
            "(any member of the buffer's group may rename the files there), which is not run; to run it, submit it "
            f"again: `prefetchd submit --buffer {path.parent} ...`")


def when_written(mtime_ns: int) -> str:
    """When a file was written, for messages: "2025-03-01 14:02:07 (3725 s ago)"."""
    seconds = mtime_ns / 1e9
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(seconds))} ({time.time() - seconds:.0f} s ago)"


class BadJobRequest(ProtocolError):
    """A job.json that breaks the protocol.  ``job_id`` is the document's own (a short plain
    name: it is echoed in logs and status.json), or None where none could be read; ``owner``: who
    submitted it, as ``JobRequest.owner``, or None where that is not known.  Whoever writes job.json
    may give it another's job_id: its refusal is theirs, not that job's submitter's."""

    def __init__(self, message: str, job_id: str | None, owner: int | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.owner = owner
