"""Worker processes: decode and augment samples straight into their batch slots.

The controller sends a worker tasks over its own pipe: a batch file under
construction and a list of (slot, sample index).  The worker writes each image
into its slot (``SlotFiller``) — pixels never cross a pipe and are never pickled —
and answers with the labels and indices it used.  In a batch file whose pages all
exist (a spare's) the task's slots are mapped and the resize writes each image
straight into its slot (with colour jitter or a hook, the result is copied in); a
fresh file gets each image with ``pwrite``.  It is the fill side of the batch writer
(``prefetchd.buffer_protocol.writer``): the controller begins the batch and
commits it once every slot is filled.

A sample that cannot be decoded is replaced by the next member of the split
that can (a pure function of the index, so the batch stays deterministic and
full); the controller logs and counts the replacement.  So is a sample that
killed the workers that decoded it (``Task.crashed``), without being read again.  A failing user
transform hook is not a bad image: it stops the daemon with the hook's error.
Neither is storage that cannot be reached (the batch is retried later): an
object store's outage, a dataset root gone, or a local read error that says
"try again" (``RETRY_LATER_ERRNOS``: EMFILE, ESTALE...); nor a store that
refuses us (the job stops with what to do).

A worker says where it is, in a few words of shared memory (``Whereabouts``): the task and the
sample it is on, a count of its moves, and before it is ready the step of its start
(``START_STEPS``).  The controller reads them to tell a worker that hangs (a read that never
returns, a hook that loops, a start that never ends) from one that is slow, and to name the file.

With ``readers`` > 1 a worker keeps that many sample reads in flight on
threads (object storage: many small requests, each mostly waiting) while it
decodes in order, so the output does not depend on which read finishes first.
It also starts the reads of the task queued behind the current one, so that a
task's first read does not wait, unoverlapped, for the decode of the one before.

Each worker runs its kernels with one thread (torch's too, where a job needs
torch): k workers on k cores, each kernel single-threaded, is the fastest
arrangement for many small images and keeps workers from fighting over cores.

Workers are processes, not threads of the controller.  decode_jpeg and the
resize release the GIL, so threads scale too, but less: the Python around the
kernels (header parse, box draws, bookkeeping) holds it.  Measured on this
project's 2-core machine (shared with other jobs, so medians of 8 alternating
rounds of 100 ImageNet-like JPEGs per worker, RandomResizedCrop 224 + flip):
1 process 354 img/s, 2 processes 681 (x1.92); 1 thread 360, 2 threads 633
(x1.76).  Processes also keep a crashing decoder away from the controller.
Their cost is memory: a spawned worker that imports torch + torchvision holds
~370 MiB of private memory and needs seconds to start; forked from a
forkserver that preloaded them (``forkserver_preload``) it holds ~13 MiB and starts in
0.1 s (same machine, CUDA wheels of torch 2.14 / torchvision 0.29).  With the C
extension most jobs need neither (``transforms.needed_modules``).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from PIL import Image

from prefetchd.buffer_protocol import SlotFiller
from prefetchd.daemon.dataset import APPLE_DOUBLE_PREFIX, SampleIndex, apple_double_advice
from prefetchd.daemon.jpeg_crop import CleanFiles, TrackedFile
from prefetchd.daemon.sampler import sample_rng
from prefetchd.daemon.sources import Read, SampleReader
from prefetchd.daemon.sources.shards import ShardChanged
from prefetchd.daemon.sources.storage import StorageDenied, StorageUnavailable, storage_for
from prefetchd.daemon.decode import DEFAULT_MAX_IMAGE_PIXELS
from prefetchd.daemon.errors import BadDataError, ConfigError, DaemonError, DatasetError
from prefetchd.daemon.hook import HookError, load_hook
from prefetchd.daemon.plan import AugmentOptions
from prefetchd.daemon.transforms import StageTimes, augment_bytes, needed_modules, preload
from prefetchd.locations import is_url
from prefetchd.words import counted

if TYPE_CHECKING:
    from prefetchd.daemon.config import DaemonConfig

log = logging.getLogger(__name__)

MAX_REPLACEMENT_TRIES = 16


class Whereabouts:
    """Where a local worker is, for the controller's hang check (``pool.WorkerPool.stalled``): four words of
    shared memory the worker writes and the controller only reads::

        [0] moves   bumped when the worker begins a task and each sample of it (each replacement tried too);
                    -1 until it is ready for its first task (a hook's module, torch, imported)
        [1] task    the id of the task it is on
        [2] sample  the sample it is on; -1 before the task's first
        [3] step    until it is ready, what it does to get there: an index into ``START_STEPS``

    No lock: a read torn between the worker's writes is of a worker that moves, which is no hang."""

    MOVES, TASK, SAMPLE, STEP = range(4)
    INITIAL = (-1, -1, -1, 0)  # not ready, no task, no sample, step 0 (``START_STEPS``)

    def __init__(self, cells: Any) -> None:
        self.cells = cells  # a RawArray('q', INITIAL) from the pool's multiprocessing context

    @property
    def moves(self) -> int:
        return int(self.cells[self.MOVES])

    @property
    def ready_yet(self) -> bool:
        return self.moves >= 0

    @property
    def task(self) -> int:
        return int(self.cells[self.TASK])

    @property
    def sample(self) -> int:
        return int(self.cells[self.SAMPLE])

    @property
    def step(self) -> int:
        return int(self.cells[self.STEP])

    def starting(self, step: int) -> None:
        """The worker, not ready yet, goes on to ``step`` of ``START_STEPS``."""
        self.cells[self.STEP] = step

    def ready(self) -> None:
        self.cells[self.MOVES] = 0

    def begin(self, task: int, sample: int = -1) -> None:
        """The worker begins ``sample`` of ``task`` (-1: the task itself); the move is written last."""
        self.cells[self.TASK] = task
        self.cells[self.SAMPLE] = sample
        self.cells[self.MOVES] += 1


# START_STEPS: what a local worker does before it is ready for its first task (``Whereabouts.step``), in order: the
# controller names the step a worker that does not get ready is stuck on (``start_step``).  Each may hang where
# nothing else would: a hook's module that blocks when imported, torch imported from a hung filesystem, an object
# store's client.
START_FORKED, START_IMPORTS, START_HOOK, START_STORAGE = range(4)


def start_step(job: WorkerJob, step: int) -> str:
    """What a worker of ``job`` does at ``step`` of its start, as the log and the status say it."""
    if step == START_IMPORTS:
        modules = needed_modules(job.augment)
        return f"importing {' and '.join(modules)}" if modules else "setting up its decoder"
    if step == START_HOOK:
        module = (job.augment.transform or "").partition(":")[0]
        return f"importing the --transform hook's module {module}"
    if step == START_STORAGE:
        return f"opening the dataset's storage ({job.index.root})"
    return "starting: made by the worker server, it has not begun the worker's code"


# This process's, in a local worker (``worker_main``); None elsewhere (a Ray worker, the bridge, a test).
_whereabouts: Whereabouts | None = None


# Whom each sample a thread begins is told to (``tell_begun``): a Ray slice built an item at a time (``remote.task``),
# whose Ray worker writes no whereabouts.  Per thread: a build a cancellation left behind tells none of a later one's.
_told = threading.local()


def _begin(task: int, sample: int = -1) -> None:
    if _whereabouts is not None:
        _whereabouts.begin(task, sample)
    tell: Callable[[int], None] | None = getattr(_told, "tell", None)
    if tell is not None and sample >= 0:
        tell(sample)


def tell_begun(tell: Callable[[int], None] | None) -> None:
    """Have each sample that this thread's tasks begin, a replacement tried too, handed to ``tell`` before it is
    read (None: to nobody), as a local worker's whereabouts say it."""
    _told.tell = tell


@dataclass(frozen=True)
class WorkerJob:
    """Everything a worker needs, sent once when it starts (arrays, not per-sample objects)."""

    index: SampleIndex
    members: np.ndarray
    image_size: int
    train: bool
    seed: int
    augment: AugmentOptions = field(default_factory=AugmentOptions)
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    readers: int = 1  # sample reads in flight per worker

    @classmethod
    def from_config(cls, index: SampleIndex, members: np.ndarray, cfg: DaemonConfig) -> WorkerJob:
        return cls(index, members, cfg.image_size, cfg.split == "train", cfg.seed, AugmentOptions(
            color_jitter=cfg.color_jitter, scale_jitter=cfg.scale_jitter_bounds, transform=cfg.transform),
            cfg.max_image_pixels, cfg.readers or 1)


@dataclass(frozen=True)
class Task:
    task_id: int
    path: str  # the batch's temp file
    images_offset: int
    slot_bytes: int
    epoch: int
    items: tuple[tuple[int, int], ...]  # (slot, sample index)
    file_id: tuple[int, int] | None = None  # the temp file's (st_dev, st_ino): only that file is written (SlotFiller)
    # (sample, reason) of the samples known to kill the worker that decodes them (``worker_health``): each is
    # failed for that reason, unread, where it comes up, as if its decode had failed, so it is replaced alike.
    crashed: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class Filled:
    """A finished task: per slot the sample actually written and its label."""

    task_id: int
    slots: tuple[tuple[int, int, int], ...]  # (slot, sample index used, label)
    # (sample, reason) of samples that were replaced: the sample, not its name, which the controller words
    # as it shows it (BadSamples), with what the workers do not hold
    failures: tuple[tuple[int, str], ...]
    seconds: float
    # Per slot, in the order of ``slots``: seconds spent reading, decoding,
    # augmenting and writing it (read/decode include the tries of replaced samples;
    # writing is the copy into the slot, none where the resize wrote the slot itself).
    timings: tuple[tuple[float, float, float, float], ...] = ()


@dataclass(frozen=True)
class WriteFailed:
    """The task did not complete.  Not fatal (None): the batch file itself could not be
    written (ENOSPC, deleted after a rewind) and the batch is retried later.  Fatal:
    the error the job stops with, since retrying cannot help: the job's data
    (BadDataError: no sample near the failing one decodes; DatasetError: the store
    refuses access, or the shards changed under the daemon), its settings (ConfigError: the transform hook failed), or a bug
    (DaemonError)."""

    task_id: int
    reason: str
    fatal: type[DaemonError] | None = None
    failures: tuple[tuple[int, str], ...] = ()  # (sample, reason) of those that failed before it stopped
    storage: bool = False  # not fatal because the dataset's storage failed (StorageUnavailable): it waits for that
    # SampleUnrecoverable's: the last ``run`` failures are a sample and those tried after it, none of which decoded;
    # the controller words ``reason`` again from them (``none_decoded``), naming the files packed samples were
    # packed from, which the workers do not hold.
    run: int = 0


class SampleUnrecoverable(RuntimeError):
    """No sample near a failing one decodes; ``failures``: (sample, reason) of each that failed in the task,
    the last ``run`` of them the failing one and those tried after it (``WriteFailed.run``)."""

    def __init__(self, message: str, failures: tuple[tuple[int, str], ...] = (), run: int = 0) -> None:
        super().__init__(message)
        self.failures = failures
        self.run = run


# The errors that are not the sample's fault, so no replacement sample can help: the fatal error each
# stops the job as (see ``WriteFailed``), or None where the batch is retried later (the store may come back).
NOT_THE_SAMPLES_FAULT: dict[type[Exception], type[DaemonError] | None] = {
    StorageUnavailable: None, HookError: ConfigError, StorageDenied: DatasetError, ShardChanged: DatasetError,
}
_NOT_THE_SAMPLES_FAULT = tuple(NOT_THE_SAMPLES_FAULT)


def _produce(job: WorkerJob, reader: SampleReader, epoch: int, index: int, failures: list[tuple[int, str]],
             times: StageTimes, first: Read | None, clean: CleanFiles | None,
             into: np.ndarray | None = None, task_id: int = -1,
             crashed: Mapping[int, str] | None = None) -> tuple[int, np.ndarray]:
    """Decode ``index`` (its bytes from ``first`` when read ahead) or, failing that, its deterministic
    replacements; into ``into`` where given (the slot: each try overwrites what a failed one left).
    ``crashed``: samples failed unread, with their reason (``Task.crashed``)."""
    tries = min(MAX_REPLACEMENT_TRIES, len(job.members))  # past the split's end it wraps: each sample once
    for k, candidate in enumerate(_candidates(job, index)):
        if crashed and candidate in crashed:
            failures.append((candidate, crashed[candidate]))
            continue
        _begin(task_id, candidate)
        name = job.index.name(candidate)
        rng = None
        if job.train:
            rng = sample_rng(job.seed, epoch, candidate)
        elif job.augment.transform is not None:  # val draws nothing; its hook's stream is the same every epoch
            rng = sample_rng(job.seed, 0, candidate)
        try:
            t0 = time.perf_counter()
            data = first.result() if k == 0 and first is not None else reader.read(candidate)
            times.read += time.perf_counter() - t0
            return candidate, augment_bytes(data, name, job.image_size, job.train, rng, job.augment, times,
                                            job.max_pixels, TrackedFile(clean, candidate) if clean is not None else None,
                                            into)
        except _NOT_THE_SAMPLES_FAULT:
            raise
        except Exception as exc:  # any read or decoder failure replaces the sample; the reason is reported
            if isinstance(exc, OSError) and _dataset_gone(job.index.root, exc):
                # Not the sample's fault: the build waits for the dataset (retried each second, said in the log
                # and status), as for an object store's outage, rather than replace every sample and stop the job.
                raise StorageUnavailable(f"{name}: {_reason(exc, name)}; the dataset root {job.index.root} is gone "
                                         f"or empty ({'deleted?' if is_url(job.index.root) else 'unmounted?'}): the "
                                         "batches wait for it to come back") from exc
            failures.append((candidate, _reason(exc, name)))
    raise SampleUnrecoverable(none_decoded(job.index, len(job.members), failures[-tries:], job.index.name),
                              tuple(failures), tries)


def none_decoded(index: SampleIndex, split: int, run: Sequence[tuple[int, str]], name: Callable[[int], str]) -> str:
    """Why the job stops when none of ``run`` decoded: (sample, reason) of a sample of a ``split``-sample
    split and of each tried after it, in order.  ``name`` words a sample: ``index.name`` in a worker; in
    the controller ``BadSamples.shown``, which adds the file a packed sample was packed from."""
    others = "no other sample of the split" if len(run) == 1 else (
        f"the {counted(len(run) - 1, 'sample')} after it" + (", the whole split," if len(run) == split else ""))
    return (f"sample {run[0][0]} and {others} could not be decoded (last: {name(run[-1][0])}: {run[-1][1]}); a "
            f"sample is replaced by one of the next {MAX_REPLACEMENT_TRIES - 1} that decodes, and none did: "
            + _why_none_decoded(index, run))


def _candidates(job: WorkerJob, index: int) -> Iterator[int]:
    """The samples ``_produce`` tries for ``index``, in order: ``index``, then the split's next ones
    (wrapping past its end), ``MAX_REPLACEMENT_TRIES`` in all at most."""
    pos = int(np.searchsorted(job.members, index))
    for k in range(min(MAX_REPLACEMENT_TRIES, len(job.members))):
        yield int(job.members[(pos + k) % len(job.members)]) if k else index


def replaced_before(job: WorkerJob, index: int, used: int) -> list[int]:
    """The samples ``_produce`` tried for ``index``, and could not use, before ``used``: none when it
    used ``index`` itself.  The same walk, so the same samples wherever the slot was built."""
    return list(itertools.takewhile(lambda candidate: candidate != used, _candidates(job, index)))


def _dataset_gone(root: str, exc: OSError) -> bool:
    """Whether ``exc``, a sample's read error, is the dataset's: its root no longer there, or empty (a mount
    that went away, or its bare mount point; under a URL, a prefix deleted, perhaps to be uploaded again)."""
    if is_url(root) and not isinstance(exc, FileNotFoundError):
        return False  # the store's own errors are classified where it is read
    try:
        return storage_for(root).is_empty()
    except OSError:  # the store cannot say now: the sample is judged as it was read
        return False


def _why_none_decoded(index: SampleIndex, failures: Sequence[tuple[int, str]]) -> str:
    """The likeliest cause of a run of samples none of which decoded, from their failures."""
    if any(os.path.basename(index.name(sample)).startswith(APPLE_DOUBLE_PREFIX) for sample, _ in failures):
        return f"files named '._*' are macOS metadata, not images: {apple_double_advice(index.root)}"
    if all(reason.startswith(MISSING_REASONS + UNREADABLE_REASONS) for _, reason in failures):
        return "is the dataset readable, and all still there?"
    return "are these files images? Remove the ones that are not (or that are damaged)"


# How ``_reason`` begins for a file that is not there (or a folder on its path), and for one that is there but
# cannot be read: the controller words those as missing and unreadable rather than undecodable (BadSamples).
MISSING_REASONS = ("FileNotFoundError", "NotADirectoryError")
UNREADABLE_REASONS = ("PermissionError", "IsADirectoryError")
# How the reason of a file that killed the workers decoding it begins (``worker_health``, ``Task.crashed``).
CRASHED_REASON = "crashed its worker"


def _reason(exc: Exception, name: str) -> str:
    """Why sample ``name`` could not be used, for the log and status, which show the path beside it:
    not again inside it ("x.jpg: FileNotFoundError: [Errno 2] ...: 'x.jpg'")."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        return f"{type(exc).__name__}: {exc.strerror}"
    return f"{type(exc).__name__}: {str(exc).removeprefix(name + ': ').removeprefix(name + ' ')}"


class SlotSink(Protocol):
    """Where a task's images go: the batch file's slots (``SlotFiller``), or an array a remote
    task returns (``prefetchd.daemon.remote``), which the bridge process writes into the file."""

    def slot(self, slot: int) -> memoryview | None:
        """The slot's own bytes, writable, for the image to be made in place; None: ``fill`` it."""
        ...

    def fill(self, slot: int, image: memoryview) -> None: ...


def run_task(job: WorkerJob, task: Task, reader: SampleReader | None = None,
             reads: list[Future[bytearray]] | None = None, sink: SlotSink | None = None,
             clean: CleanFiles | None = None) -> Filled | WriteFailed:
    """Fill ``task``'s slots; ``reads``: its samples' reads, already started (``SampleReader.start``);
    ``sink``: where the images go, by default the slots of the batch file at ``task.path``;
    ``clean``: the files this process (and its pool) has decoded to the end without a warning."""
    reader = reader or SampleReader(job.index, job.readers)
    if sink is not None:
        return _fill(job, task, reader, reads, sink, clean)
    try:
        batch = SlotFiller(task.path, task.images_offset, task.slot_bytes, task_slots(task), task.file_id)
    except OSError as exc:
        return WriteFailed(task.task_id, f"cannot open {task.path}: {exc.strerror}")
    with batch:
        return _fill(job, task, reader, reads, batch, clean)


def _fill(job: WorkerJob, task: Task, reader: SampleReader, reads: list[Future[bytearray]] | None,
          sink: SlotSink, clean: CleanFiles | None) -> Filled | WriteFailed:
    start = time.perf_counter()
    slots: list[tuple[int, int, int]] = []
    timings: list[tuple[float, float, float, float]] = []
    failures: list[tuple[int, str]] = []
    ahead: Iterator[Read] = iter(reads) if reads is not None else reader.read_ahead(index for _slot, index in task.items)
    crashed = dict(task.crashed)
    shape = (job.image_size, job.image_size, 3)
    if task.slot_bytes != math.prod(shape):  # the job and the batch's layout disagree: no sample can fit
        raise SampleUnrecoverable(f"slots of {task.slot_bytes} bytes for {job.image_size} x {job.image_size} x 3 images")
    for (slot, index), read in zip(task.items, ahead):
        times = StageTimes()
        target = sink.slot(slot)
        # The slot itself where the sink has one: the resize writes the file's pages, no copy after.
        into = np.frombuffer(target, np.uint8).reshape(shape) if target is not None else None
        used, image = _produce(job, reader, task.epoch, index, failures, times, read, clean, into, task.task_id,
                               crashed)
        t0 = time.perf_counter()
        if image is not into:  # a size x size x 3 array (augment_bytes; a hook's shape is checked): it fits
            try:
                sink.fill(slot, memoryview(image.data).cast("B"))
            except OSError as exc:
                return WriteFailed(task.task_id, f"cannot write {task.path}: {exc.strerror}")
        del into, image, target  # no view of the mapping outlives the task (SlotFiller.close)
        timings.append((times.read, times.decode, times.augment, time.perf_counter() - t0))
        slots.append((slot, used, int(job.index.labels[used])))
    return Filled(task.task_id, tuple(slots), tuple(failures), time.perf_counter() - start, tuple(timings))


def task_slots(task: Task) -> range:
    """The slots ``task`` fills, first to last (a task's are consecutive): what its filler maps."""
    slots = [slot for slot, _index in task.items]
    return range(min(slots), max(slots) + 1) if slots else range(0)


def failure_of(task_id: int, exc: Exception) -> WriteFailed:
    """What a task that raised ``exc`` reports: retry later, or stop the job (see ``WriteFailed``)."""
    for cause, error in ((SampleUnrecoverable, BadDataError), *NOT_THE_SAMPLES_FAULT.items()):
        if isinstance(exc, cause):
            return WriteFailed(task_id, str(exc), fatal=error, failures=getattr(exc, "failures", ()),
                               storage=isinstance(exc, StorageUnavailable), run=getattr(exc, "run", 0))
    # A bug: report it with where it happened instead of dying silently.
    trace = "".join(traceback.format_exception(exc))  # ``exc``'s own, wherever this is called
    return WriteFailed(task_id, f"worker {os.getpid()} failed:\n{trace}", fatal=DaemonError)


def prepare_process(job: WorkerJob) -> None:
    """Set up a process that runs ``job``'s tasks: a local worker, or a Ray worker on any node."""
    # augment() applies the job's max_image_pixels before decoding; Pillow's own
    # limit would refuse, with its own words, images the user allowed.
    Image.MAX_IMAGE_PIXELS = None
    preload(job.augment)  # first: a job that imports torch has it by the time threads are limited
    limit_threads()
    keep_heap()


def forkserver_preload() -> list[str]:
    """What the worker server imports once, so that the workers it forks share these pages instead
    of importing their own copies (see the module docstring): the worker code and what augmenting
    needs without options (a job's colour jitter or hook imports the rest in each worker)."""
    return ["prefetchd.daemon.workers", *needed_modules()]


# glibc's mallopt parameters, and the values of its dynamic mmap threshold at its ceiling.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_HEAP_SETTINGS = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 64 << 20), (_M_TOP_PAD, 16 << 20))


def keep_heap() -> None:
    """Keep the heap's pages instead of handing them back to the kernel and faulting them in again.

    Every image allocates its file's bytes, the decoded box (100 KB to a few MB) and the
    resized output (150 KB at 224 x 224).  glibc starts by mapping anything over 128 KB
    afresh (page faults on every touch, munmap on free) and trims the heap top as soon as
    a large block there is freed; it raises those thresholds only as it sees larger blocks
    freed.  Set at once to the ceiling that adaptation reaches (32 MiB mapped, 64 MiB
    trimmed) and with 16 MiB of padding per heap extension, the worker reuses its pages.
    Measured on the 2-core EPYC (photos, 2 workers, consumer on the same cores, 3
    alternating 8 s runs against the code without it): the workers' CPU per image 0.92 ->
    0.89 ms and 1980-2083 -> 2107-2139 img/s, for 1 MiB more RSS per worker.  Not glibc (musl): nothing to do."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    for param, value in _HEAP_SETTINGS:
        mallopt(param, value)


def limit_threads() -> None:
    """One compute thread per worker process (see the module docstring).

    torch is not imported for this: a worker whose job the C extension resizes never imports it
    (``transforms.needed_modules``; ``prepare_process`` preloads it before this where the job needs
    it).  One that imports it later, for a JPEG the crop-aware decoder refuses, reads
    OMP_NUM_THREADS then."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch = sys.modules.get("torch")
    if torch is None:
        return
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # only possible before any inter-op work; a fresh worker has done none
        pass


def worker_main(conn: Connection, job: WorkerJob, clean: CleanFiles | None = None, where: Any = None) -> None:
    """A local worker's loop; ``where``: its ``Whereabouts`` cells, which the controller watches."""
    global _whereabouts
    # Ctrl-C reaches the whole process group; the controller alone decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    whereabouts = Whereabouts(where) if where is not None else None
    step: Callable[[int], None] = whereabouts.starting if whereabouts is not None else (lambda _step: None)
    # Each step of the start is said, and the start timed as a whole (--worker-start-timeout, ``worker_health``): one
    # that never ends (a hook's module that blocks when imported) is killed and another started in its place.
    step(START_IMPORTS)
    prepare_process(job)
    if job.augment.transform is not None:
        step(START_HOOK)  # now, not in the first image: a hang there is the hook's import, not that image's
        with contextlib.suppress(HookError):  # its first call raises it again, and the job stops with it
            load_hook(job.augment.transform)
    step(START_STORAGE)
    reader = SampleReader(job.index, job.readers)
    if whereabouts is not None:
        _whereabouts = whereabouts
        whereabouts.ready()
    queued: deque[tuple[Task, list[Future[bytearray]] | None]] = deque()
    stopping = False
    while True:
        # The next task now, and with readers the one after it if the controller queued it
        # already, so that its reads run while this one decodes.  None (stop) or a closed
        # pipe ends the loop once what was received is done, as when tasks came one by one.
        while not stopping and (not queued or (job.readers > 1 and len(queued) < 2 and _ready(conn))):
            try:
                got = conn.recv()
            except (EOFError, OSError):  # the controller went away (killed: the pipe may be reset)
                got = None
            if got is None:
                stopping = True
            else:
                queued.append((got, reader.start(i for _slot, i in got.items) if job.readers > 1 else None))
        if not queued:
            return
        task, reads = queued.popleft()
        _begin(task.task_id)
        try:
            result: Filled | WriteFailed = run_task(job, task, reader, reads, clean=clean)
        except Exception as exc:
            result = failure_of(task.task_id, exc)
        try:
            conn.send(result)
        except OSError:  # a SIGKILLed controller: nobody to answer, and no traceback for its successor's log
            return


def _ready(conn: Connection) -> bool:
    try:
        return conn.poll(0)
    except (EOFError, OSError):
        return True  # recv() then sees the end and stops
