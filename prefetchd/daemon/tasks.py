"""What travels between the controller and a worker: the job, each task, and the answer.

The controller sends a worker its job once (``WorkerJob``), then tasks over its own pipe (``Task``; a
Ray worker gets them through ``prefetchd.daemon.remote``): a batch file under construction and a list
of (slot, sample index).  A local worker writes each image into its slot (``fill.run_task``) — pixels
never cross its pipe and are never pickled — and answers with the labels and indices it used
(``Filled``), or with why the task did not complete (``WriteFailed``).

A sample that cannot be used fails no task: it is replaced (``fill``), and the answer names it with
its reason, which the controller words as missing, unreadable or undecodable (``MISSING_REASONS``,
``UNREADABLE_REASONS``, ``CRASHED_REASON``).  What fails a task is what no replacement can help
(``NOT_THE_SAMPLES_FAULT``, ``failure_of``).  A failing user transform hook is not a bad image: it
stops the daemon with the hook's error.  Neither is storage that cannot be reached (the batch is
retried later): an object store's outage, a dataset root gone, or a local read error that says "try
again" (``RETRY_LATER_ERRNOS``: EMFILE, ESTALE...); nor a store that refuses us (the job stops with
what to do).
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from prefetchd.daemon.dataset import SampleIndex
from prefetchd.daemon.sources.shards import ShardChanged
from prefetchd.daemon.sources.storage import StorageDenied, StorageUnavailable
from prefetchd.daemon.decode import DEFAULT_MAX_IMAGE_PIXELS
from prefetchd.daemon.errors import BadDataError, ConfigError, DaemonError, DatasetError
from prefetchd.daemon.hook import HookError
from prefetchd.daemon.plan import AugmentOptions

if TYPE_CHECKING:
    from prefetchd.daemon.config import DaemonConfig


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


# How ``fill._reason`` begins for a file that is not there (or a folder on its path), and for one that is there but
# cannot be read: the controller words those as missing and unreadable rather than undecodable (BadSamples).
MISSING_REASONS = ("FileNotFoundError", "NotADirectoryError")
UNREADABLE_REASONS = ("PermissionError", "IsADirectoryError")
# How the reason of a file that killed the workers decoding it begins (``worker_health``, ``Task.crashed``).
CRASHED_REASON = "crashed its worker"


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
