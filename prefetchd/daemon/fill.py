"""A task's samples decoded and augmented straight into their batch slots (``run_task``): in a
local worker (``workers``) or on a Ray worker (``prefetchd.daemon.remote``), the same code, so the
same bytes.

Each image goes into its slot (``SlotFiller``).  In a batch file whose pages all exist (a spare's)
the task's slots are mapped and the resize writes each image straight into its slot (with colour
jitter or a hook, the result is copied in); a fresh file gets each image with ``pwrite``.  It is the
fill side of the batch writer (``prefetchd.buffer_protocol.writer``): the controller begins the batch
and commits it once every slot is filled.  A Ray worker's images go into an array instead
(``SlotSink``), which the bridge process writes into the file.

A sample that cannot be decoded is replaced by the next member of the split that can (a pure
function of the index, so the batch stays deterministic and full); the controller logs and counts
the replacement.  So is a sample that killed the workers that decoded it (``Task.crashed``), without
being read again.  What no replacement can help fails the task instead (``tasks.NOT_THE_SAMPLES_FAULT``).

With ``readers`` > 1 a worker keeps that many sample reads in flight on threads (object storage:
many small requests, each mostly waiting) while it decodes in order, so the output does not depend
on which read finishes first.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Protocol

import numpy as np

from prefetchd.buffer_protocol import SlotFiller
from prefetchd.daemon.dataset import APPLE_DOUBLE_PREFIX, SampleIndex, apple_double_advice
from prefetchd.daemon.jpeg_crop import CleanFiles, TrackedFile
from prefetchd.daemon.sampler import sample_rng
from prefetchd.daemon.sources import Read, SampleReader
from prefetchd.daemon.sources.storage import StorageUnavailable, storage_for
from prefetchd.daemon.tasks import (CRASHED_REASON, MISSING_REASONS, NOT_THE_SAMPLES_FAULT, UNREADABLE_REASONS,
                                    Filled, SampleUnrecoverable, Task, WorkerJob, WriteFailed, task_slots)
from prefetchd.daemon.transforms import StageTimes, augment_bytes
from prefetchd.daemon.whereabouts import begin
from prefetchd.locations import is_url
from prefetchd.words import counted

MAX_REPLACEMENT_TRIES = 16

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
        begin(task_id, candidate)
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
            if isinstance(exc, OSError) and (gone := _dataset_gone(job.index.root, exc)) is not None:
                # Not the sample's fault: the build waits for the dataset (retried each second, said in the log
                # and status), as for an object store's outage, rather than replace every sample and stop the job.
                raise StorageUnavailable(f"{name}: {_reason(exc, name)}; the dataset root {job.index.root} {gone}: "
                                         "the batches wait for it to come back") from exc
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


def _dataset_gone(root: str, exc: OSError) -> str | None:
    """Why ``exc``, a sample's read error, is the dataset's, in words after "the dataset root ROOT": its root no
    longer there, or empty (a mount that went away, or its bare mount point; under a URL, a prefix deleted,
    perhaps to be uploaded again), or not to be listed; None where it is the sample's."""
    if is_url(root) and not isinstance(exc, FileNotFoundError):
        return None  # the store's own errors are classified where it is read
    try:
        return storage_for(root).unusable()
    except OSError:  # the store cannot say now: the sample is judged as it was read
        return None


def _why_none_decoded(index: SampleIndex, failures: Sequence[tuple[int, str]]) -> str:
    """The likeliest cause of a run of samples none of which decoded, from their failures."""
    if any(os.path.basename(index.name(sample)).startswith(APPLE_DOUBLE_PREFIX) for sample, _ in failures):
        return f"files named '._*' are macOS metadata, not images: {apple_double_advice(index.root)}"
    if all(reason.startswith(MISSING_REASONS + UNREADABLE_REASONS) for _, reason in failures):
        # A restart indexes it again: --reset alone kept a bucket's cached listing, and stopped again (a walk).
        return ("is the dataset readable, and all still there? Files gone since it was indexed: start again with "
                "--reset, and with --refresh-index too where its listing is cached (object storage)")
    if all(reason.startswith(CRASHED_REASON) for _, reason in failures):
        # Good images, where a --transform hook ends its worker (os._exit, a signal): "remove the ones that are not
        # images" sent the user to delete them (a walk of hooks).
        return ("each ended the worker decoding it: a decoder that crashes on such files, or a --transform hook "
                "that ends its process (os._exit, a signal); run one file through the hook by hand to tell")
    return "are these files images? Remove the ones that are not (or that are damaged)"


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
