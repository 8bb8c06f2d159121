"""status.json: the daemon's account of itself, rewritten about once a second.

One typed document, written by :func:`write_status` and read by :func:`read_status`
only.  On disk it is flat, as `prefetchd status --json` shows it::

    {"format": "prefetchd.status", "version": 1,
     "pid": 4242, "pid_namespace": 4026531836, "state": "filling", "message": "", "heartbeat": 1700000000.5,
     "job_result": null, "running_job": null,     <- every state
     "producer": "0123456789ab", "progress": {...}, "rates": {...}, ...
                                                  <- only while a job is produced (Production)
    }

In code the fields every state has are :class:`Status`'s own, and those of a
running job are grouped in :attr:`Status.production` (None while the daemon waits
for a job or indexes one).  SPEC.md's "Status document" table lists every key.

status.json is writable by the buffer's group (``--group-access``), so the reader
treats it as untrusted: every field is checked for its type, ints are non-negative,
floats finite, and anything else is a :class:`ProtocolError` naming the field.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any, NoReturn

from prefetchd.buffer_protocol.batch import VERSION
from prefetchd.buffer_protocol.errors import MAX_INT, ProtocolError, shown
from prefetchd.buffer_protocol.json_files import encode_json, read_json_stat, replace_file, rewrite_in_place
from prefetchd.buffer_protocol.layout import STATUS_NAME, Dir, at, check_owned, owning_buffer
from prefetchd.buffer_protocol.progress import pid_namespace as this_pid_namespace

STATUS_FORMAT = "prefetchd.status"


class State(str, Enum):
    """What the daemon is doing; the order is the order `/metrics` lists them in.

    A str Enum rather than enum.StrEnum, which is 3.11+; ``__str__`` makes it format as its value.
    """

    WAITING_FOR_JOB = "waiting-for-job"  # no job yet: `prefetchd submit` gives it one
    STARTING = "starting"  # indexing the dataset, starting workers
    FILLING = "filling"  # producing towards the high-water mark
    FULL = "full"  # nothing to build: at the high-water mark, or above the low-water mark while trainers consume
    PAUSED_LOW_SPACE = "paused-low-space"  # the buffer's filesystem is short of space
    DONE = "done"  # every batch of the job's epochs is produced
    SWITCHING = "switching"  # replacing the job with the one in job.json
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"  # ``message`` says why

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True)
class TrainerStatus:
    """Whether the process that wrote progress.json is still there (SPEC rule 8).

    ``pid`` is the trainer's in its own pid namespace, ``pid_namespace`` (its progress document's): by it a reader
    tells whether ``pid`` names a process of its own (``ownership.writer_named``), whichever namespace the daemon
    is in.  None: a progress without it, or a daemon that predates the field.
    """

    pid: int | None
    alive: bool | None  # None: unknown (no progress yet, or one without a pid)
    progress_age_s: float | None
    pid_namespace: int | None = None

    @property
    def wrote(self) -> bool:
        """Whether a trainer wrote a progress file: it has a pid or a progress age (its writer predating ``pid``)."""
        return self.pid is not None or self.progress_age_s is not None


@dataclass(frozen=True)
class Position:
    """The (epoch, step) a trainer needs next, and its recent share of time spent waiting for data."""

    epoch: int
    step: int
    trainer_wait_share: float | None = None


@dataclass(frozen=True)
class ConsumerStatus:
    """One consumer of a stream (SPEC rule 9): the default one is named ""."""

    name: str
    progress: Position
    trainer: TrainerStatus
    holding: bool  # the daemon keeps batches for it (it is live, or no consumer is)
    window: int  # batches kept for it from its position; below high_water when the cap binds
    closed: bool = False  # it left (BufferLoader.close) and holds nothing until it writes again


@dataclass(frozen=True)
class StreamStatus:
    """One rank's stream; ``progress`` and ``trainer`` are the slowest holding consumer's."""

    rank: int
    trainer: TrainerStatus
    progress: Position
    waiting: int
    building: int
    progress_file: str = ""  # why the rank's progress.json was ignored; "" when it was not
    # Counters of what the log also says, so that tools and tests need not parse it (0 when absent:
    # a daemon of an earlier 0.1 build did not write them).
    vanished_batches: int = 0  # published batches whose files someone else removed (built again)
    progress_rejected: int = 0  # distinct problems with progress.json, each ignored
    progress_rewinds: int = 0  # times the trainer's position moved back
    consumers: tuple[ConsumerStatus, ...] = ()  # every consumer with a progress file; () when absent

    @property
    def no_trainer_yet(self) -> bool:
        """No progress file of this rank was ever read: ``progress`` is where the daemon starts, no trainer's."""
        return not self.consumers and not self.trainer.wrote

    @property
    def all_left(self) -> bool:
        """Every consumer closed its loader: its trainers finished (or stopped) rather than went away."""
        return bool(self.consumers) and all(c.closed for c in self.consumers)


@dataclass(frozen=True)
class Rates:
    samples_per_s: float
    consumed_batches_per_s: float


@dataclass(frozen=True)
class Quantiles:
    """Per-sample seconds of one stage over the recent samples."""

    p50: float
    p90: float
    p99: float


@dataclass(frozen=True)
class Totals:
    batches: int
    samples: int
    consumed_batches: int


@dataclass(frozen=True)
class BadFile:
    path: str
    reason: str


@dataclass(frozen=True)
class Errors:
    replaced_samples: int
    undecodable_files: int  # all of them; ``undecodable`` lists the first few
    undecodable: tuple[BadFile, ...]
    worker_restarts: int
    write_failures: int
    progress_file: str  # the streams' progress_file problems, joined by "; "
    low_space_pauses: int = 0  # times production paused because the buffer's filesystem ran short
    vanished_batches: int = 0  # the streams' counters, summed
    progress_rejected: int = 0
    progress_rewinds: int = 0
    worker_hangs: int = 0  # workers killed because one image took longer than --task-timeout (in worker_restarts too)


@dataclass(frozen=True)
class RemoteNode:
    """What one node of the Ray cluster built (``--ray``)."""

    node: str  # host name and the start of Ray's node id
    images: int
    slices: int  # tasks: a slice of a batch each
    images_per_s: float  # over the last ~10 s
    latency_p50_s: float  # a slice's median seconds from submission to its result, recently


@dataclass(frozen=True)
class RemoteStatus:
    """Batches built on a Ray cluster beside the local workers (``--ray``)."""

    address: str  # as given to --ray
    connected: bool
    cluster_nodes: int  # alive nodes, as the cluster last reported them
    cluster_cpus: int  # CPUs of the alive nodes that get slices: all but the unfit ones
    in_flight: int  # slices submitted and not yet back
    images: int  # images built on the cluster since the job started
    slices: int
    retries: int  # slices submitted again after their worker or node was lost
    stragglers: int  # slices started again because they took far longer than the median
    disconnects: int  # times the cluster was lost (its slices then went to the local workers)
    message: str  # why it is not connected, or, connected, why no node gets slices; or ""
    copied_bytes: int = 0  # pixels copied from the object store into batch files
    copy_seconds: float = 0.0  # the time those copies took (copied_bytes / copy_seconds: the copy rate)
    nodes: tuple[RemoteNode, ...] = ()
    unfit_nodes: tuple[str, ...] = ()  # "node: why" for each alive node that gets no slices (cannot read --data)


@dataclass(frozen=True)
class JobResult:
    """The daemon's answer to the last job.json (SPEC rule 5)."""

    job_id: str | None  # None: job.json was unreadable
    accepted: bool
    reason: str
    time: float
    # Who submitted it: the uid owning the job.json answered (JobRequest.owner); None where it could not be read,
    # and from a daemon of an earlier 0.1 build.
    submitter: int | None = None


@dataclass(frozen=True)
class RunningJob:
    """The submitted job the daemon starts or produces (SPEC rule 5), from its start until it ends or another
    replaces it.  ``Status.job_result`` answers the latest job.json instead: a request refused meanwhile, or one
    of the same job ("already producing this job"), leaves this one running."""

    job_id: str
    submitter: int | None  # the uid owning the job.json it came from (JobRequest.owner); None: not known
    submitted: float  # the request's ``submitted``: time.time() when its submitter wrote it
    answer: str  # the daemon's answer accepting it ("producing ROOT for USER ..."); "" while it starts


@dataclass(frozen=True)
class StorageWait:
    """The daemon's builds wait for the dataset's storage: an object store that does not answer after its
    retries, a local root gone (unmounted).  Nothing is wrong with the data or the daemon, and the
    batches come once the storage is back, so a trainer waits on rather than time out (SPEC)."""

    since: float  # time.time() the longest wait of the ranks that hold it began: the earliest of ranks_since
    reason: str  # the latest failure, as the status's message says it
    # The ranks whose failed batches hold the wait, sorted: only their loaders wait on.  None: every rank's
    # (a daemon of an earlier 0.1 build did not say which, and its wait was the whole daemon's).
    ranks: tuple[int, ...] | None = None
    # Beside ``ranks``, one each: when that rank's wait began (one rank's batches may fail minutes after
    # another's).  None: ``since`` for each (a daemon of an earlier 0.1 build kept one time).
    ranks_since: tuple[float, ...] | None = None

    def since_of(self, rank: int) -> float | None:
        """When the builds of rank ``rank`` began to wait; None when none of its batches holds the wait."""
        if self.ranks is None:
            return self.since
        if rank not in self.ranks:
            return None
        return self.ranks_since[self.ranks.index(rank)] if self.ranks_since is not None else self.since


@dataclass(frozen=True)
class Production:
    """The fields of a daemon producing a job; for one rank ``progress`` and ``trainer`` are its stream's."""

    producer: str
    started: float
    progress: Position
    trainer: TrainerStatus
    streams: tuple[StreamStatus, ...]
    waiting: int
    building: int
    high_water: int
    low_water: int
    batch_bytes: int
    buffer_bytes: int
    free_bytes: int
    workers: int
    workers_cpu_percent: float
    rates: Rates
    stages: Mapping[str, Quantiles]  # stage name (read, decode, augment, write) -> quantiles; empty at first
    totals: Totals
    errors: Errors
    remote: RemoteStatus | None = None  # None without --ray
    # Set from a build's failure to read the dataset until a batch is published; None when absent
    # (a daemon of an earlier 0.1 build did not write it).
    storage_wait: StorageWait | None = None

    # How `prefetchd status` and systemd's status line say where the trainers are: from these, alike.
    @property
    def no_trainer_yet(self) -> bool:
        """No trainer of any rank has written progress: ``progress`` is where the daemon starts."""
        return not self.trainer.wrote and all(s.no_trainer_yet for s in self.streams)

    @property
    def all_left(self) -> bool:
        """Every consumer of every rank closed its loader."""
        with_consumers = [s for s in self.streams if s.consumers]
        return bool(with_consumers) and all(s.all_left for s in with_consumers)


@dataclass(frozen=True)
class Status:
    """status.json.

    ``pid_namespace``: the writer's pid namespace, by which a reader of another one (a trainer in another
    container sharing the tmpfs) knows that ``pid`` names no process of its own (SPEC rule 8).  A Status is
    made by the daemon that writes it, so it is this process's by default; None where /proc does not say,
    and read from a daemon that predates the field.
    """

    pid: int
    state: State
    heartbeat: float  # time.time() when written
    message: str = ""
    job_result: JobResult | None = None
    production: Production | None = None
    pid_namespace: int | None = field(default_factory=this_pid_namespace)
    # None while the daemon waits for a job, and while it runs the job it was started with (its own --data).
    running_job: RunningJob | None = None
    # False: read from a daemon of an earlier 0.1 build, whose status has no running_job, so that whether a
    # submitted job runs, and which, is not known (not written: every document written now has the key).
    running_job_known: bool = True

    @property
    def remote(self) -> RemoteStatus | None:
        """The Ray cluster's part of the production; None without --ray or while no job runs."""
        return self.production.remote if self.production is not None else None

    def to_doc(self) -> dict[str, Any]:
        """The document as written: flat, the production's fields beside the common ones."""
        doc: dict[str, Any] = {
            "format": STATUS_FORMAT, "version": VERSION, "pid": self.pid, "state": str(self.state),
            "message": self.message, "heartbeat": self.heartbeat, "job_result": _plain(self.job_result),
        }
        if self.running_job_known:
            doc["running_job"] = _plain(self.running_job)
        if self.pid_namespace is not None:
            doc["pid_namespace"] = self.pid_namespace
        if self.production is not None:
            doc.update(_plain(self.production))
        return doc

    @classmethod
    def from_doc(cls, doc: dict[str, Any], path: Path) -> Status:
        """Check and convert a document read_json has accepted (format and version are checked there)."""
        top = _Fields(doc, path)
        job = top.optional_map("job_result")
        running = top.optional_map("running_job")  # absent from a daemon of an earlier 0.1 build
        production = None
        if "progress" in doc:  # absent while waiting for a job and while starting one
            production = Production(
                producer=top.text("producer"),
                started=top.num("started"),
                progress=_position(top.map("progress")),
                trainer=_trainer(top.map("trainer")),
                streams=tuple(_stream(s) for s in top.maps("streams")),
                waiting=top.nat("waiting"),
                building=top.nat("building"),
                high_water=top.nat("high_water"),
                low_water=top.nat("low_water"),
                batch_bytes=top.nat("batch_bytes"),
                buffer_bytes=top.nat("buffer_bytes"),
                free_bytes=top.nat("free_bytes"),
                workers=top.nat("workers"),
                workers_cpu_percent=top.num("workers_cpu_percent"),
                rates=_rates(top.map("rates")),
                stages={name: _quantiles(q) for name, q in top.map("stages").items_as_maps()},
                totals=_totals(top.map("totals")),
                errors=_errors(top.map("errors")),
                remote=_remote(remote) if (remote := top.optional_map("remote")) is not None else None,
                storage_wait=_storage_wait(wait) if (wait := top.optional_map("storage_wait")) is not None else None,
            )
        return cls(
            pid=top.nat("pid"),
            state=top.state("state"),
            heartbeat=top.num("heartbeat"),
            message=top.text("message", default=""),
            job_result=JobResult(job.optional_text("job_id"), job.flag("accepted"), job.text("reason"), job.num("time"),
                                 job.optional_nat("submitter")) if job is not None else None,
            production=production,
            pid_namespace=top.optional_nat("pid_namespace"),
            running_job=RunningJob(running.text("job_id"), running.optional_nat("submitter"), running.num("submitted"),
                                   running.text("answer")) if running is not None else None,
            running_job_known="running_job" in doc,
        )


def write_status(buffer: Dir, status: Status, dir_fd: int | None = None) -> None:
    """Replace ``buffer``'s status.json atomically with ``status`` (through the buffer folder's fd ``dir_fd``
    where given: ``layout.at``).

    On a full filesystem there is no page for a new file: the document is written over the one there, in that
    file's own pages, which a tmpfs overwrites without allocating (``rewrite_in_place``).  So a daemon restarted
    on a full tmpfs says at once that it is the buffer's (its pid, its state, its heartbeat), where the earlier
    daemon's document would have stayed and a waiting trainer taken the new daemon for stuck.  Where it does not
    fit those pages (a document grown past them), or the file is no status document of the daemon's own, the
    file gets the time as its mtime instead, which takes no space and which readers count as the heartbeat (SPEC
    rule 8), and the OSError is raised."""
    path = Path(buffer) / STATUS_NAME
    data = encode_json(status.to_doc())  # once: on a full filesystem it is written over the file there too
    try:
        replace_file(path, data, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        try:
            rewrite_in_place(path, data, "status", dir_fd)
            return
        except OSError:
            pass
        with contextlib.suppress(OSError):
            os.utime(at(path, dir_fd), dir_fd=dir_fd, follow_symlinks=False)
        raise


def read_status(buffer: Dir) -> Status | None:
    """The status of the daemon owning ``buffer`` (a rank's stream directory reads its parent's);
    None before the first is written; ProtocolError when it is malformed, or not the daemon's: only the
    owner of the buffer's folder writes its status.json, and a member of a --group-access buffer's group
    may rename a file of theirs to that name (a pid, a state, a `running_job.submitter` of their choosing).
    Its heartbeat is the later of the document's and the file's mtime (``write_status`` on a full
    filesystem)."""
    path = owning_buffer(Path(buffer)) / STATUS_NAME
    try:
        doc, st = read_json_stat(path, "status")
        check_owned(path, st.st_uid, "status (it writes its own within a second)")
    except FileNotFoundError:
        return None
    status = Status.from_doc(doc, path)
    return replace(status, heartbeat=st.st_mtime) if st.st_mtime > status.heartbeat + 1.0 else status


def readable_status(buffer: Dir) -> Status | None:
    """``read_status``, None where it cannot be read (being replaced, or damaged: judged as if absent)."""
    try:
        return read_status(buffer)
    except (OSError, ProtocolError):
        return None


# -- checking a document ------------------------------------------------------


def _plain(value: Any) -> Any:
    """Dataclasses, tuples and mappings as the JSON types they are written as."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, State):
        return value.value
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


_STATE_NAMES = tuple(s.value for s in State)


class _Fields:
    """Typed access to one JSON object of the document; errors name the file and the dotted field."""

    def __init__(self, value: Any, path: Path, where: str = "") -> None:
        if not isinstance(value, dict):
            self._fail(path, where.rstrip(".") or "the document", value, "an object")
        self.doc: dict[str, Any] = value
        self.path = path
        self.where = where

    @staticmethod
    def _fail(path: Path, name: str, value: Any, expected: str) -> NoReturn:
        raise ProtocolError(
            f"{path}: field {name!r} is {shown(value)}, expected {expected}; the daemon rewrites status.json about once a "
            "second, so if this stays, another program or another prefetchd version writes it: check who can write the buffer"
        )

    def fail(self, key: str, value: Any, expected: str) -> NoReturn:
        self._fail(self.path, self.where + key, value, expected)

    def _get(self, key: str, check: Any, expected: str, optional: bool = False) -> Any:
        value = self.doc.get(key)
        if (value is None and optional) or check(value):
            return value
        self.fail(key, value, expected)

    def nat(self, key: str) -> int:
        return int(self._get(key, lambda v: type(v) is int and 0 <= v <= MAX_INT, "a non-negative integer"))

    def count(self, key: str) -> int:
        """A counter; 0 when absent (counters added within a version)."""
        return self.nat(key) if key in self.doc else 0

    def optional_nat(self, key: str) -> int | None:
        value = self._get(key, lambda v: type(v) is int and 0 <= v <= MAX_INT, "a non-negative integer or null",
                          optional=True)
        return None if value is None else int(value)

    def num(self, key: str) -> float:
        return float(self._get(key, _is_finite, "a finite number"))

    def optional_num(self, key: str) -> float | None:
        value = self._get(key, _is_finite, "a finite number or null", optional=True)
        return None if value is None else float(value)

    def text(self, key: str, default: str | None = None) -> str:
        if default is not None and key not in self.doc:
            return default
        return str(self._get(key, lambda v: isinstance(v, str), "a string"))

    def optional_text(self, key: str) -> str | None:
        value = self._get(key, lambda v: isinstance(v, str), "a string or null", optional=True)
        return None if value is None else str(value)

    def flag(self, key: str) -> bool:
        return bool(self._get(key, lambda v: isinstance(v, bool), "true or false"))

    def optional_flag(self, key: str) -> bool | None:
        value = self._get(key, lambda v: isinstance(v, bool), "true, false or null", optional=True)
        return None if value is None else bool(value)

    def state(self, key: str) -> State:
        names = ", ".join(_STATE_NAMES)
        return State(self._get(key, lambda v: v in _STATE_NAMES, f"one of {names}"))

    def map(self, key: str) -> _Fields:
        return _Fields(self.doc.get(key), self.path, f"{self.where}{key}.")

    def optional_map(self, key: str) -> _Fields | None:
        return None if self.doc.get(key) is None else self.map(key)

    def maps(self, key: str) -> list[_Fields]:
        items = self._get(key, lambda v: isinstance(v, list), "a list")
        return [_Fields(item, self.path, f"{self.where}{key}[{i}].") for i, item in enumerate(items)]

    def texts(self, key: str) -> tuple[str, ...]:
        """A list of strings; empty when absent (lists added within a version)."""
        if key not in self.doc:
            return ()
        return tuple(self._get(key, lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                               "a list of strings"))

    def optional_nats(self, key: str) -> tuple[int, ...] | None:
        """A list of non-negative integers; None when absent or null (a list added within a version: the
        caller says what its absence means)."""
        value = self._get(key, lambda v: isinstance(v, list) and all(type(x) is int and x >= 0 for x in v),
                          "a list of non-negative integers or null", optional=True)
        return None if value is None else tuple(int(x) for x in value)

    def optional_nums(self, key: str) -> tuple[float, ...] | None:
        """A list of finite numbers; None when absent or null (as ``optional_nats``)."""
        value = self._get(key, lambda v: isinstance(v, list) and all(_is_finite(x) for x in v),
                          "a list of finite numbers or null", optional=True)
        return None if value is None else tuple(float(x) for x in value)

    def items_as_maps(self) -> list[tuple[str, _Fields]]:
        return [(k, _Fields(v, self.path, f"{self.where}{k}.")) for k, v in self.doc.items()]


def _is_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _position(f: _Fields) -> Position:
    share = f.optional_num("trainer_wait_share")
    if share is not None and not 0.0 <= share <= 1.0:
        f.fail("trainer_wait_share", share, "a fraction between 0 and 1")
    return Position(f.nat("epoch"), f.nat("step"), share)


def _trainer(f: _Fields) -> TrainerStatus:
    return TrainerStatus(f.optional_nat("pid"), f.optional_flag("alive"), f.optional_num("progress_age_s"),
                         f.optional_nat("pid_namespace"))


def _stream(f: _Fields) -> StreamStatus:
    return StreamStatus(f.nat("rank"), _trainer(f.map("trainer")), _position(f.map("progress")),
                        f.nat("waiting"), f.nat("building"), f.text("progress_file", default=""),
                        f.count("vanished_batches"), f.count("progress_rejected"), f.count("progress_rewinds"),
                        tuple(_consumer(c) for c in f.maps("consumers")) if "consumers" in f.doc else ())


def _consumer(f: _Fields) -> ConsumerStatus:
    return ConsumerStatus(f.text("name"), _position(f.map("progress")), _trainer(f.map("trainer")),
                          f.flag("holding"), f.nat("window"), f.flag("closed") if "closed" in f.doc else False)


def _rates(f: _Fields) -> Rates:
    return Rates(f.num("samples_per_s"), f.num("consumed_batches_per_s"))


def _quantiles(f: _Fields) -> Quantiles:
    return Quantiles(f.num("p50"), f.num("p90"), f.num("p99"))


def _totals(f: _Fields) -> Totals:
    return Totals(f.nat("batches"), f.nat("samples"), f.nat("consumed_batches"))


def _errors(f: _Fields) -> Errors:
    return Errors(
        replaced_samples=f.nat("replaced_samples"),
        undecodable_files=f.nat("undecodable_files"),
        undecodable=tuple(BadFile(b.text("path"), b.text("reason")) for b in f.maps("undecodable")),
        worker_restarts=f.nat("worker_restarts"),
        write_failures=f.nat("write_failures"),
        progress_file=f.text("progress_file", default=""),
        low_space_pauses=f.count("low_space_pauses"),
        vanished_batches=f.count("vanished_batches"),
        progress_rejected=f.count("progress_rejected"),
        progress_rewinds=f.count("progress_rewinds"),
        worker_hangs=f.count("worker_hangs"),
    )


def _storage_wait(f: _Fields) -> StorageWait:
    ranks, since = f.optional_nats("ranks"), f.optional_nums("ranks_since")
    if since is not None and (ranks is None or len(since) != len(ranks)):
        f.fail("ranks_since", list(since), f"one time for each of ranks {None if ranks is None else list(ranks)}")
    return StorageWait(since=f.num("since"), reason=f.text("reason"), ranks=ranks, ranks_since=since)


def _remote(f: _Fields) -> RemoteStatus:
    return RemoteStatus(
        address=f.text("address"), connected=f.flag("connected"), cluster_nodes=f.nat("cluster_nodes"),
        cluster_cpus=f.nat("cluster_cpus"), in_flight=f.nat("in_flight"), images=f.nat("images"),
        slices=f.nat("slices"), retries=f.nat("retries"), stragglers=f.nat("stragglers"),
        disconnects=f.nat("disconnects"), message=f.text("message"), copied_bytes=f.nat("copied_bytes"),
        copy_seconds=f.num("copy_seconds"),
        nodes=tuple(RemoteNode(n.text("node"), n.nat("images"), n.nat("slices"), n.num("images_per_s"),
                               n.num("latency_p50_s")) for n in f.maps("nodes")),
        unfit_nodes=f.texts("unfit_nodes"),
    )
