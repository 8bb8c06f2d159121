"""What the controller and the bridge process say to each other over their pipe (see ``prefetchd.daemon.remote``).

The bridge sends a ``Report`` every ``REPORT_SECONDS`` (one that sends none for ``pool.SILENT_SECONDS`` is
taken for a lost cluster), and for each slice it was given one answer: ``Done``, ``Returned``,
``Hung``, ``Died`` or ``Cancelled``; besides, ``StartDied`` for each Ray worker that died before its first
image, ``StartHung`` for each slice it submitted again because it had not begun in --worker-start-timeout, and
``Note`` for a line of the daemon's log.  The controller sends a ``Task`` to build, a ``Cancel``
for the slices of a build it dropped, and None: stop.  All are plain picklable values: the bridge is a
process of the daemon's box, started by ``RemotePool`` (``pool.py``) with the pipe's other end.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefetchd.daemon.tasks import Filled, WriteFailed

REPORT_SECONDS = 1.0  # the bridge reports the cluster's nodes and CPUs this often


# -- messages from the bridge to the controller --------------------------------


@dataclass(frozen=True)
class Stalled:
    """The slice at the cluster that has gone longest without progress, once that is long enough to be said
    (``worker_health.stall_noted_after`` of --task-timeout; of --worker-start-timeout for one not begun yet), as a
    local worker's stall is: the controller says it in the status (its message and ``worker_stall``), so that a
    trainer waits on until the bridge hands the slice back (``Hung``) or submits it again (``StartHung``) rather
    than give up first."""

    task_id: int
    sample: int | None  # the one it is on, where it is built an item at a time (``SliceCopy.track``), else None
    # time.monotonic() when it last moved on (began, or began an item; not begun: when it was submitted): the bridge
    # is a process of the daemon's box, and CLOCK_MONOTONIC is one clock for all of its processes, so the
    # controller counts the seconds itself.
    moved: float
    starting: bool = False  # not begun (queued at Ray, or its Ray worker starting): --worker-start-timeout bounds it


@dataclass(frozen=True)
class Report:
    """The cluster as the bridge sees it; ``connected`` False: it could not connect and exits."""

    connected: bool
    nodes: int = 0  # alive
    cpus: int = 0  # of the alive nodes that get slices: all but the unfit ones
    message: str = ""
    unfit: tuple[str, ...] = ()  # "node: why" for each alive node that cannot build slices
    stalled: Stalled | None = None


@dataclass(frozen=True)
class Done:
    """A slice the cluster built; its pixels are in the temp file already (unless ``result`` failed)."""

    result: Filled | WriteFailed
    node: str
    latency: float  # seconds from the first submission to the result
    copied: tuple[int, float]  # (bytes, seconds) of the copy from the object store into the batch file
    retries: int  # submissions after the first because a worker or node was lost
    straggler: bool  # it was started a second time


@dataclass(frozen=True)
class Returned:
    """A slice the cluster could not build (its workers kept dying): the controller queues it again."""

    task_id: int
    reason: str
    retries: int


@dataclass(frozen=True)
class Hung:
    """A slice that made no progress at the cluster for --task-timeout: its Ray tasks were cancelled, their
    workers killed (``ray.cancel(force=True)``), and the controller judges it as a local worker's hang.
    ``sample``: the one it was on, where the slice was built an item at a time (it had hung or killed
    its worker before), else None."""

    task_id: int
    sample: int | None
    seconds: float  # since it last moved on (began, or began an item)
    retries: int


@dataclass(frozen=True)
class Died:
    """A slice whose Ray worker died while it built the item of ``sample`` (the slice was built an item at
    a time, having killed a worker before): the controller counts that death on the file, as a local
    worker's (``CRASHES_TO_BLAME``), and queues the slice again."""

    task_id: int
    sample: int
    how: str  # the Ray error's name: WorkerCrashedError, OutOfMemoryError (Ray's memory monitor), ...
    retries: int


@dataclass(frozen=True)
class StartDied:
    """A Ray worker died before the first image of what it ran: before a slice began (in the worker's start:
    importing prefetchd, torch or the --transform hook's module; loading the job), or, for a slice built an item
    at a time, before its first sample; or running a node's probe (``task_id`` None).  No file is to blame, so
    the bridge submits the slice again as ever (``_again``); the controller counts these deaths
    (``WorkerHealth.ray_start_died``): where the cluster's workers all die so, the local workers build alone
    (``RemotePool.give_up``), or with none the job stops, instead of the slices going round for good.  Not for a
    node's death (Ray's NodeDiedError): that is a node leaving."""

    task_id: int | None
    how: str  # the Ray error's name: WorkerCrashedError, OutOfMemoryError, ...
    text: str  # the first line of Ray's message
    node: str = ""  # the node's label, for a probe (pinned to it); "" for a slice (not known where it ran)


@dataclass(frozen=True)
class StartHung:
    """A slice that had not begun --worker-start-timeout after it was submitted: queued at Ray all that while, or
    its Ray worker's start never returned (importing the --transform hook's module, or reading the job's probe
    samples of --data, on a hung mount there).  The bridge cancelled it, killing that Ray worker
    (``ray.cancel(force=True)``), and submitted it again; the controller counts it as a local worker's start
    that hangs is counted (``WorkerHealth.ray_start_hung``): where the slice never begins, the job stops
    instead of holding its batch for good."""

    task_id: int
    seconds: float  # since it was submitted (the latest of its copies, a straggler's second one)


@dataclass(frozen=True)
class Cancelled:
    """Slices of a cancelled build (``Cancel``) that the bridge forgot: nothing of them was written into the
    batch's temp file, nor will be.  Each is answered once: with ``Done`` (or ``Returned``) where that went
    first, else with this, at once."""

    task_ids: tuple[int, ...]


@dataclass(frozen=True)
class Note:
    """A line for the daemon's log (the bridge has no logging set up of its own)."""

    level: int
    text: str


# -- messages from the controller to the bridge --------------------------------
# (besides a ``Task`` to build, and None: stop)


@dataclass(frozen=True)
class Cancel:
    """The controller cancelled a build (a rewind, or a failed write): its slices that it sent the bridge and
    has no answer for.

    The controller unlinks the build's temp file once every slice of it is answered, and a later build of
    the same batch creates a file of the same name; so the bridge answers each slice it still holds with
    ``Cancelled`` and never writes it after that.  A slice it answered already (``Done``: written, or
    ``Returned``) is not answered again: the controller drops that answer as the build's."""

    task_ids: tuple[int, ...]


# -- a Ray error in a message's words


def last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1][:300] if text else type(exc).__name__


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


__all__ = ["REPORT_SECONDS", "Cancel", "Cancelled", "Died", "Done", "Hung", "Note", "Report", "Returned", "Stalled",
           "StartDied", "StartHung", "first_line", "last_line"]
