"""The buffer directory: fixed file names and the small JSON documents in it.

::

    <buffer>/
      daemon.lock                 flock()ed by the one daemon that owns the buffer; holds its pid
      manifest.json               what the daemon produces (written by the daemon)
      progress.json               next (epoch, step) the trainer needs (written by the trainer)
      progress.NAME.json          the same for consumer NAME, when several trainers share the buffer
      status.json                 fill, rates, errors, heartbeat (written by the daemon)
      job.json                    a job a trainer asks the daemon to produce (written by trainers)
      e000000-s00000000.batch     finished batches, named by (epoch, step)
      e000000-s00000001.tmp       a batch being built; never read
      rank-00001/                 with world_size > 1: one stream directory per rank, each holding
                                  that rank's manifest.json, progress.json and batches

Every JSON document carries ``format`` and ``version`` and is replaced
atomically (write a temp name in the same directory, then rename), so a reader
sees the old or the new document, never a mix.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from prefetchd.buffer_protocol.batch import VERSION
from prefetchd.buffer_protocol.errors import ProtocolError

# What the public functions take for a directory: a str as well as a Path.
Dir = str | os.PathLike[str]

LOCK_NAME = "daemon.lock"
MANIFEST_NAME = "manifest.json"
PROGRESS_NAME = "progress.json"
STATUS_NAME = "status.json"
JOB_NAME = "job.json"
DOCUMENT_KINDS = ("manifest", "progress", "status", "job")  # each document's format is prefetchd.<kind>
BATCH_SUFFIX = ".batch"
TEMP_MARK = ".tmp"
SPARE_PREFIX = "spare-"  # a consumed batch file kept for reuse (writer.SpareFiles)
MAX_DOCUMENT_LEN = 1 << 20
# A malformed job's job_id is echoed in its refusal only when it looks like one (JobRequest's
# are 12 hex digits); anything else could be a megabyte of control characters in a log.
JOB_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}", re.ASCII)
# A consumer waiting for a batch rewrites its progress file this often (same position, new
# time), so that a daemon tells a waiting consumer from a silent one (--consumer-timeout).
PROGRESS_REFRESH_SECONDS = 2.0

_BATCH_RE = re.compile(r"e(\d{6})-s(\d{8})\.batch", re.ASCII)
MAX_EPOCH = 10**6 - 1
MAX_STEP = 10**8 - 1
_TEMP_RE = re.compile(r"^(e\d{6}-s\d{8}\.tmp|spare-\d{8}\.tmp|.+\.json\.tmp-\d+-[0-9a-f]+)$")


# Several trainers (a sweep, an ensemble) may read one stream; each is a consumer with its own
# progress file.  The default consumer ("") keeps progress.json, so a single trainer names none.
DEFAULT_CONSUMER = ""
CONSUMER_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,32}", re.ASCII)
_NAMED_PROGRESS_RE = re.compile(r"progress\.([A-Za-z0-9_-]{1,32})\.json", re.ASCII)


def check_consumer(name: str) -> str:
    """``name`` if it may name a consumer ("" for the default one); ValueError saying why not."""
    if name == DEFAULT_CONSUMER or (isinstance(name, str) and CONSUMER_NAME_RE.fullmatch(name)):
        return name
    raise ValueError(f"consumer name {name!r}: use 1 to 32 letters, digits, '_' or '-' (e.g. 'trial-3'), "
                     "or leave it out for the default consumer")


def progress_name(consumer: str = DEFAULT_CONSUMER) -> str:
    """The progress file of ``consumer``: progress.json for the default one, progress.NAME.json otherwise."""
    return PROGRESS_NAME if check_consumer(consumer) == DEFAULT_CONSUMER else f"progress.{consumer}.json"


def consumer_of(file_name: str) -> str | None:
    """The consumer whose progress file is called ``file_name``; None for any other name."""
    if file_name == PROGRESS_NAME:
        return DEFAULT_CONSUMER
    m = _NAMED_PROGRESS_RE.fullmatch(file_name)
    return m[1] if m else None


def list_consumers(directory: Dir) -> list[str]:
    """The consumers with a progress file in ``directory`` (a stream directory), sorted."""
    if not os.path.isdir(directory):
        return []
    with os.scandir(directory) as entries:
        return sorted(c for e in entries if (c := consumer_of(e.name)) is not None)


STREAM_PREFIX = "rank-"
_STREAM_RE = re.compile(r"rank-\d{5}", re.ASCII)


def stream_dir(buffer: Dir, rank: int, world_size: int) -> Path:
    """Where rank ``rank``'s manifest, progress and batches live.

    One rank keeps the flat layout; with several, each rank has its own directory
    so trainers of different ranks never see each other's files.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    return Path(buffer) if world_size == 1 else Path(buffer) / f"{STREAM_PREFIX}{rank:05d}"


def owning_buffer(directory: Dir) -> Path:
    """The buffer whose daemon owns ``directory``: its parent for a rank's stream directory."""
    directory = Path(directory)
    if _STREAM_RE.fullmatch(directory.name) and (directory.parent / LOCK_NAME).exists():
        return directory.parent
    return directory


def batch_name(epoch: int, step: int) -> str:
    if not (0 <= epoch <= MAX_EPOCH and 0 <= step <= MAX_STEP):
        raise ValueError(f"epoch {epoch} / step {step} outside what a batch name holds (0-{MAX_EPOCH} / 0-{MAX_STEP})")
    return f"e{epoch:06d}-s{step:08d}{BATCH_SUFFIX}"


def spare_name(n: int) -> str:
    """The name of the daemon's ``n``-th spare: a consumed batch's file kept for a later batch (``writer.SpareFiles``)."""
    return f"{SPARE_PREFIX}{n:08d}{TEMP_MARK}"


def parse_batch_name(name: str) -> tuple[int, int] | None:
    m = _BATCH_RE.fullmatch(name)
    return (int(m[1]), int(m[2])) if m else None


def list_batches(buffer: Dir) -> dict[tuple[int, int], Path]:
    """Finished batch files in ``buffer`` by (epoch, step)."""
    found: dict[tuple[int, int], Path] = {}
    if not os.path.isdir(buffer):
        return found
    with os.scandir(buffer) as entries:
        for entry in entries:
            key = parse_batch_name(entry.name)
            # Only regular files: a directory, FIFO or link under a batch's name is never one,
            # and deleting it as a consumed batch would fail.
            if key is not None and entry.is_file(follow_symlinks=False):
                found[key] = Path(entry.path)
    return found


def list_temp_files(buffer: Dir) -> Iterator[Path]:
    """Leftovers of writes that never finished (a killed daemon's)."""
    with os.scandir(buffer) as entries:
        for entry in entries:
            # Not a directory: unlinking one fails, and a directory is nobody's half-written file.
            if TEMP_MARK in entry.name and _TEMP_RE.match(entry.name) and not entry.is_dir(follow_symlinks=False):
                yield Path(entry.path)


# -- JSON documents -----------------------------------------------------------


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Atomically replace ``path`` with ``doc`` (see ``replace_file``)."""
    replace_file(path, json.dumps(doc, indent=1, sort_keys=True).encode())


def replace_file(path: Path, data: bytes, mode: int | None = None) -> None:
    """Atomically replace ``path`` with ``data``: a temp name in the same directory, then a rename,
    so a reader sees the old file or the new one, never part of one.  ``mode``: the file's
    permission bits whatever the umask; without it, 0644 less the umask."""
    # pid + random suffix: two writers in one process (threads, two loaders) never share a temp file.
    tmp = path.with_name(f"{path.name}{TEMP_MARK}-{os.getpid()}-{secrets.token_hex(4)}")
    # O_EXCL: a name someone else planted (a link to a file of theirs) is never written through.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            if mode is not None:
                os.fchmod(fd, mode)  # O_CREAT's mode is less the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        # A writer that retries (a loader on a full tmpfs, every half second) must not leave a file each time.
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _open_regular(path: Path, flags: int, what: str, mode: int = 0o644) -> int:
    """Open ``path`` only if it is a regular file: not through a symlink (O_NOFOLLOW), and
    without waiting for a writer should it be a FIFO (O_NONBLOCK, then fstat).  ``mode``
    (less the umask) is that of a file O_CREAT creates.
    FileNotFoundError passes through; any other problem is a ProtocolError."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except FileNotFoundError:
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


def read_json_stat(path: Path, kind: str) -> tuple[dict[str, Any], os.stat_result]:
    """``read_json``, with the fstat of the file it read: who wrote that very file, not
    whatever a later look at the path would find after someone replaced it."""
    if kind not in DOCUMENT_KINDS:
        raise ValueError(f"unknown document kind {kind!r}")
    fd = _open_regular(path, os.O_RDONLY, f"a {kind} document")
    try:
        st = os.fstat(fd)
        data = os.read(fd, MAX_DOCUMENT_LEN + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_DOCUMENT_LEN:
        raise ProtocolError(f"{path}: larger than {MAX_DOCUMENT_LEN} bytes, not a {kind} document; delete it")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, absurd nesting or digit counts
        raise ProtocolError(f"{path}: not valid JSON ({exc}); delete it and let its writer recreate it") from None
    fmt = f"prefetchd.{kind}"
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ProtocolError(f"{path}: format is {got!r}, expected {fmt!r}; delete it and let its writer recreate it")
    if type(doc.get("version")) is not int or doc["version"] != VERSION:
        raise ProtocolError(
            f"{path}: written with buffer protocol version {doc.get('version')!r}, this prefetchd speaks "
            f"version {VERSION}; run the same prefetchd version on both sides, or clear the buffer"
        )
    return doc, st


def read_optional(path: Path, kind: str) -> dict[str, Any] | None:
    """``read_json``, or None when the document has not been written yet."""
    try:
        return read_json(path, kind)
    except FileNotFoundError:
        return None


def steps_per_epoch(samples: int, batch_size: int, drop_last: bool = False) -> int:
    """Batches in an epoch of ``samples``: the last one short where they do not divide, or,
    with ``drop_last``, left out (which samples it held changes from epoch to epoch with the
    shuffle)."""
    return samples // batch_size if drop_last else -(-samples // batch_size)


def _field(doc: dict[str, Any], key: str, kind: type, path: Path) -> Any:
    value: Any = doc.get(key)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, bool) if kind is bool else isinstance(value, kind) and not isinstance(value, bool)
    if not ok or (kind is int and value < 0):
        raise ProtocolError(f"{path}: field {key!r} is {value!r}, expected a {'non-negative ' if kind is int else ''}{kind.__name__}")
    return value


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
        if doc["batch_size"] < 1 or doc["image_size"] < 1 or doc["world_size"] < 1:
            raise ProtocolError(f"{path}: batch_size, image_size and world_size must be at least 1")
        if not all(isinstance(c, str) for c in doc["classes"]):
            raise ProtocolError(f"{path}: field 'classes' must be a list of class names")
        if "drop_last" in doc:  # absent in manifests of daemons before it: False
            _field(doc, "drop_last", bool, path)
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

    def write(self, buffer: Dir) -> None:
        write_json(Path(buffer) / MANIFEST_NAME, self.to_doc())

    @classmethod
    def read(cls, buffer: Dir) -> Manifest:
        path = Path(buffer) / MANIFEST_NAME
        return cls.from_doc(read_json(path, "manifest"), path)


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
    ``consumer`` picks the file (see :func:`progress_name`).
    """

    epoch: int
    step: int
    wait_share: float | None = field(default=None, compare=False)
    pid: int | None = field(default=None, compare=False)
    time: float | None = field(default=None, compare=False)
    closed: bool = field(default=False, compare=False)
    job: str | None = field(default=None, compare=False)

    def write(self, buffer: Dir, consumer: str = DEFAULT_CONSUMER) -> None:
        doc: dict[str, Any] = {"format": "prefetchd.progress", "version": VERSION, "epoch": self.epoch,
                               "step": self.step, "pid": os.getpid(), "time": time.time()}
        if self.wait_share is not None:
            doc["wait_share"] = round(self.wait_share, 4)
        if self.closed:
            doc["closed"] = True
        if self.job is not None:
            doc["job"] = self.job
        write_json(Path(buffer) / progress_name(consumer), doc)

    @classmethod
    def read(cls, buffer: Dir, consumer: str = DEFAULT_CONSUMER) -> Progress | None:
        """The consumer's progress, or None when it has not written one yet."""
        path = Path(buffer) / progress_name(consumer)
        doc = read_optional(path, "progress")
        if doc is None:
            return None
        share = doc.get("wait_share")
        if share is not None and not (isinstance(share, (int, float)) and not isinstance(share, bool) and 0 <= share <= 1):
            raise ProtocolError(f"{path}: field 'wait_share' is {share!r}, expected a fraction between 0 and 1")
        closed = doc.get("closed", False)
        if not isinstance(closed, bool):
            raise ProtocolError(f"{path}: field 'closed' is {closed!r}, expected true or false")
        # Optional for readers: documents of older writers have neither.
        pid = _field(doc, "pid", int, path) if doc.get("pid") is not None else None
        written = _field(doc, "time", float, path) if doc.get("time") is not None else None
        job = _field(doc, "job", str, path) if doc.get("job") is not None else None
        return cls(_field(doc, "epoch", int, path), _field(doc, "step", int, path), share, pid, written, closed, job)


@dataclass(frozen=True)
class JobRequest:
    """A trainer's request that the daemon produce ``settings``.

    ``settings`` uses the names of `prefetchd start` flags with underscores
    (data, split, batch_size, ...); the daemon validates them and answers in
    status.json under ``job_result`` with the request's ``job_id``.

    ``owner`` is not in the document: it is the uid owning the job.json that was
    read (fstat of the opened file), which says who submitted it, since a writer
    creates its temp file and renames it into place.  None for a request not read
    from a buffer.
    """

    settings: dict[str, Any]
    replace: bool = False
    job_id: str = field(default_factory=lambda: secrets.token_hex(6))
    submitted: float = field(default_factory=time.time)
    owner: int | None = None

    def write(self, buffer: Dir) -> None:
        write_json(Path(buffer) / JOB_NAME, {"format": "prefetchd.job", "version": VERSION, "settings": self.settings,
                                       "replace": self.replace, "job_id": self.job_id, "submitted": self.submitted})

    @classmethod
    def read(cls, buffer: Dir) -> JobRequest | None:
        """The request in ``buffer``'s job.json, None when there is none.  A malformed one is a
        ``BadJobRequest`` that carries the document's ``job_id`` where one can be read, so that
        the refusal reaches whoever submitted it."""
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
            settings = _field(doc, "settings", dict, path)
            for key, value in settings.items():
                if not isinstance(value, (str, int, float, bool)) and value is not None:
                    raise ProtocolError(f"{path}: setting {key!r} is {value!r}; settings are strings, numbers, "
                                        "booleans or null")
            return cls(settings, bool(doc.get("replace")), _field(doc, "job_id", str, path),
                       _field(doc, "submitted", float, path), owner=st.st_uid)
        except ProtocolError as exc:
            echoed = job_id if isinstance(job_id, str) and JOB_ID_RE.fullmatch(job_id) else None
            raise BadJobRequest(str(exc), echoed) from None


class BadJobRequest(ProtocolError):
    """A job.json that breaks the protocol.  ``job_id`` is the document's own (a short plain
    name: it is echoed in logs and status.json), or None where none could be read."""

    def __init__(self, message: str, job_id: str | None) -> None:
        super().__init__(message)
        self.job_id = job_id


# -- ownership ----------------------------------------------------------------


class BufferBusy(ProtocolError):
    """Another live daemon owns the buffer."""


class DaemonLock:
    """One daemon per buffer: an flock on ``daemon.lock`` that holds the owner's pid.

    The kernel drops an flock when its holder dies, so a SIGKILLed daemon never
    leaves a stale lock behind.

    The file is ``LOCK_MODE`` (less the umask): readers need its pid (``daemon_pid``), nobody
    but the owner writes it, and nobody runs it.  flock(2) needs only a read-only descriptor, so
    whoever may read the file can also hold the lock and keep a daemon from starting: with
    --group-access that is any member of the buffer's group (systemd/README.md, "who it runs as").
    """

    LOCK_MODE = 0o644

    def __init__(self, buffer: Dir) -> None:
        self.path = Path(buffer) / LOCK_NAME
        self._fd: int | None = None
        self._directory: tuple[int, int] | None = None  # (st_dev, st_ino) of the buffer when locked

    def acquire(self) -> None:
        fd = _open_regular(self.path, os.O_RDWR | os.O_CREAT, "the daemon's lock file", self.LOCK_MODE)
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_nlink != 1:
            os.close(fd)
            # Another user's file (or a hard link to one) would get our pid written into it.
            raise ProtocolError(f"{self.path}: belongs to uid {st.st_uid} or has {st.st_nlink} links, so this "
                                f"daemon (uid {os.geteuid()}) did not create it; remove it, or pick another --buffer")
        if stat.S_IMODE(st.st_mode) & ~self.LOCK_MODE:
            # One made by an older daemon (0777 less the umask: group-writable under UMask=0007).
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & self.LOCK_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise BufferBusy(self._held_by(daemon_pid(self.path.parent))) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        directory = os.stat(self.path.parent)
        self._directory = (directory.st_dev, directory.st_ino)

    def _held_by(self, pid: int | None) -> str:
        buffer = self.path.parent
        if pid is not None:
            return (f"{buffer}: buffer is owned by a running daemon (pid {pid}); stop it with "
                    f"`prefetchd stop --buffer {buffer}` or pick another --buffer")
        # No live pid in the file: whoever holds the flock is no prefetchd daemon (a daemon
        # writes its pid right after it takes the lock and empties the file just before it lets go).
        return (f"{buffer}: {self.path} is locked by a process that is not a running prefetchd daemon (pid "
                "unknown: the file names no live daemon; any user who can read the file can lock it); find it "
                f"with `fuser -v {self.path}` and end it, or pick another --buffer")

    def lost(self) -> str | None:
        """Why this lock no longer keeps the buffer to its holder, or None while it does: ``daemon.lock``
        was removed, or the buffer directory removed or replaced (``rm -rf`` and ``mkdir``, another
        buffer moved there), so the path's lock is another file, which another daemon may take."""
        assert self._fd is not None, "acquire() first"
        buffer = self.path.parent
        try:
            there = os.stat(self.path)
            mine = os.fstat(self._fd)
            if (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
                return None  # the file locked, so the directory it is in: nothing else decides
            what = f"{LOCK_NAME} was removed and made again"
        except FileNotFoundError:
            what = f"{LOCK_NAME} was removed"
        except OSError:
            return None  # cannot tell now (EACCES, ENOMEM): asked again at the next look
        # Only to say what happened: a directory's inode number is not stable on every filesystem (overlayfs).
        try:
            directory = os.stat(buffer)
        except FileNotFoundError:
            return f"{buffer}: the buffer directory was removed"
        except OSError:
            return f"{buffer}: {what}"
        replaced = (directory.st_dev, directory.st_ino) != self._directory
        return f"{buffer}: " + ("the buffer directory was replaced by another" if replaced else what)

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def alive_since(pid: int, since: float) -> bool:
    """Whether process ``pid`` exists, is no zombie and was started by ``since`` (a time.time()).

    The start time rules out a pid the kernel reused for another process after the
    one that wrote ``since`` (a lock, a progress file) died.  A process of another
    user counts as alive when it exists, also where /proc hides it (hidepid, systemd's
    ProtectProc=invisible: the service's sandbox), so its start time cannot be read.
    """
    try:
        return _started_by(pid, since)
    except psutil.AccessDenied:
        return True


def _started_by(pid: int, since: float) -> bool:
    """``pid`` is a live process (a zombie has released its locks already) started by ``since``;
    psutil.AccessDenied is left to the caller."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        started: float = proc.create_time()
    except psutil.ZombieProcess:
        return False
    except psutil.NoSuchProcess:
        return _hidden(pid)
    # create_time() is derived from boot time and jiffies: a second of slack.
    return started <= since + 1.0


def _hidden(pid: int) -> bool:
    """A pid /proc does not show that the kernel still has: signal 0 checks that it exists, and
    fails with EPERM for another user's process, where ESRCH says it is gone."""
    if pid <= 0:  # kill(0, ...) and kill(-1, ...) address process groups
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True
    except (ProcessLookupError, OverflowError):
        return False
    return True  # ours to signal, yet not in /proc: it appeared as psutil looked (a zombie is ZombieProcess)


def daemon_pid(buffer: Dir) -> int | None:
    """Pid of the live daemon owning ``buffer``, or None.

    Reads the pid the owner wrote and checks that process exists and is older
    than the lock file, which rules out a pid reused after the owner died.
    For a rank's stream directory the owner is the parent buffer's daemon.
    """
    path = owning_buffer(buffer) / LOCK_NAME
    try:
        fd = _open_regular(path, os.O_RDONLY, "the daemon's lock file")
    except (OSError, ProtocolError):  # missing, or not a lock a daemon made: nobody owns the buffer
        return None
    try:
        text = os.read(fd, 64).decode("ascii", "replace").strip()
        mtime = os.fstat(fd).st_mtime
    finally:
        os.close(fd)
    if not text.isdigit():
        return None
    pid = int(text)
    try:
        return pid if _started_by(pid, mtime) else None
    except psutil.AccessDenied:
        return None
