"""Worker processes: decode and augment samples straight into their batch slots.

The controller sends a worker tasks over its own pipe: a batch file under
construction and a list of (slot, sample index).  The worker writes each
image's bytes at the slot's offset with ``pwrite`` — pixels never cross a pipe
and are never pickled — and answers with the labels and indices it used.

A sample that cannot be decoded is replaced by the next member of the split
that can (a pure function of the index, so the batch stays deterministic and
full); the controller logs and counts the replacement.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np

from prefetchd.daemon.dataset import SampleIndex
from prefetchd.daemon.sampler import sample_rng
from prefetchd.daemon.transforms import augment

log = logging.getLogger(__name__)

MAX_REPLACEMENT_TRIES = 16


@dataclass(frozen=True)
class WorkerJob:
    """Everything a worker needs, sent once when it starts (arrays, not per-sample objects)."""

    index: SampleIndex
    members: np.ndarray
    image_size: int
    train: bool
    seed: int


@dataclass(frozen=True)
class Task:
    task_id: int
    path: str  # the batch's temp file
    images_offset: int
    slot_bytes: int
    epoch: int
    items: tuple[tuple[int, int], ...]  # (slot, sample index)


@dataclass(frozen=True)
class Filled:
    """A finished task: per slot the sample actually written and its label."""

    task_id: int
    slots: tuple[tuple[int, int, int], ...]  # (slot, sample index used, label)
    failures: tuple[tuple[str, str], ...]  # (path, reason) of samples that were replaced
    seconds: float


@dataclass(frozen=True)
class WriteFailed:
    """The task did not complete.  Not fatal: the batch file itself could not be
    written (ENOSPC, deleted after a rewind) and the batch is retried later.
    Fatal: no sample near the failing one decodes, so retrying cannot help."""

    task_id: int
    reason: str
    fatal: bool = False


class SampleUnrecoverable(RuntimeError):
    pass


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _produce(job: WorkerJob, epoch: int, index: int, failures: list[tuple[str, str]]) -> tuple[int, np.ndarray]:
    """Decode ``index`` or, failing that, its deterministic replacements."""
    pos = int(np.searchsorted(job.members, index))
    for k in range(MAX_REPLACEMENT_TRIES):
        candidate = int(job.members[(pos + k) % len(job.members)]) if k else index
        path = job.index.path(candidate)
        rng = sample_rng(job.seed, epoch, candidate) if job.train else None
        try:
            return candidate, augment(path, job.image_size, job.train, rng)
        except Exception as exc:  # any decoder failure replaces the sample; the reason is reported
            failures.append((str(path), f"{type(exc).__name__}: {exc}"))
    raise SampleUnrecoverable(
        f"sample {index} and the {MAX_REPLACEMENT_TRIES - 1} samples after it could not be decoded "
        f"(last: {failures[-1][0]}: {failures[-1][1]}); is the dataset readable?"
    )


def run_task(job: WorkerJob, task: Task) -> Filled | WriteFailed:
    start = time.perf_counter()
    slots: list[tuple[int, int, int]] = []
    failures: list[tuple[str, str]] = []
    try:
        fd = os.open(task.path, os.O_WRONLY | os.O_NOFOLLOW)
    except OSError as exc:
        return WriteFailed(task.task_id, f"cannot open {task.path}: {exc.strerror}")
    try:
        for slot, index in task.items:
            used, image = _produce(job, task.epoch, index, failures)
            if image.nbytes != task.slot_bytes:
                raise SampleUnrecoverable(f"{job.index.path(used)}: produced {image.shape}, expected {task.slot_bytes} bytes")
            try:
                _pwrite_all(fd, memoryview(image.data).cast("B"), task.images_offset + slot * task.slot_bytes)
            except OSError as exc:
                return WriteFailed(task.task_id, f"cannot write {task.path}: {exc.strerror}")
            slots.append((slot, used, int(job.index.labels[used])))
    finally:
        os.close(fd)
    return Filled(task.task_id, tuple(slots), tuple(failures), time.perf_counter() - start)


def worker_main(conn: Connection, job: WorkerJob) -> None:
    # Ctrl-C reaches the whole process group; the controller alone decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the controller went away
            return
        if task is None:
            return
        try:
            result: Filled | WriteFailed = run_task(job, task)
        except SampleUnrecoverable as exc:
            result = WriteFailed(task.task_id, str(exc), fatal=True)
        except Exception:  # a bug: report it with where it happened instead of dying silently
            result = WriteFailed(task.task_id, f"worker {os.getpid()} failed:\n{traceback.format_exc()}", fatal=True)
        conn.send(result)
