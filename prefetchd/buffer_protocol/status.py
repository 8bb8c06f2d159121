"""status.json: the daemon's account of itself, rewritten about once a second; the document's types.

One typed document, written by ``status_file.write_status`` and read by ``status_file.read_status``
only.  On disk it is flat, as `prefetchd status --json` shows it::

    {"format": "prefetchd.status", "version": 1,
     "pid": 4242, "pid_namespace": 4026531836, "state": "filling", "message": "", "heartbeat": 1700000000.5,
     "job_result": null, "running_job": null,     <- every state
     "producer": "0123456789ab", "progress": {...}, "rates": {...}, ...
                                                  <- only while a job is produced (Production)
    }

In code the fields every state has are :class:`Status`'s own, and those of a
running job are grouped in :attr:`Status.production` (None while the daemon waits
for a job or indexes one); :meth:`Status.to_doc` flattens them as written.  SPEC.md's
"Status document" table lists every key.

status.json is writable by the buffer's group (``--group-access``), so the reader
treats it as untrusted: ``status_fields`` checks every field for its type, ints are non-negative,
floats finite, and anything else is a :class:`ProtocolError` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from typing import Any, ClassVar

from prefetchd.buffer_protocol.batch import VERSION
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
    # Workers killed because one image took longer than --task-timeout, or their start than --worker-start-timeout
    # (in worker_restarts too).
    worker_hangs: int = 0


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

    # How ``message`` begins once the cluster is given up for the job (its Ray workers cannot start), rather
    # than lost and tried again: ``prefetchd status`` says so in a word of its own.
    GIVEN_UP: ClassVar[str] = "given up for this job"

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
class WorkerStall:
    """A local worker of the daemon has made no progress for a while (or not got ready since it started), or a
    slice at its Ray cluster has not: the daemon kills that worker (cancels that slice, killing its Ray worker)
    once ``timeout`` seconds have passed since ``since`` and builds its tasks on another, so a trainer waits on
    rather than time out before that (SPEC).  The longest such stall, where there are several."""

    since: float  # time.time() when the worker last made progress (or started)
    timeout: float  # the seconds of no progress at which the daemon kills it: its --task-timeout, or
    starting: bool  # ... not ready yet: its --worker-start-timeout
    reason: str  # the daemon's words: the worker's pid, the batch and the file, or the step of its start


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
    # Set while a worker has made no progress past the daemon's note of it; None when absent (an earlier 0.1 build).
    worker_stall: WorkerStall | None = None

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
