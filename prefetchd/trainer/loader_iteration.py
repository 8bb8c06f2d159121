"""How a loader reads an epoch: each batch waited for, checked, handed out, and the position moved past it.

A :class:`~prefetchd.trainer.loader.BufferLoader` walks the (epoch, step) positions of the daemon's job in
order.  For each one it waits for the finished batch file, maps it (zero-copy
numpy views over a private mapping, see ``buffer_protocol.map_batch``, looked up
in the stream folder the loader checked and opened when it started, see
``batch_waiter.BatchWaiter``) and hands out a :class:`Batch`:

    images   NCHW, channels_last strides (the file's HWC bytes, permuted for free);
             float32 normalised with the ImageNet statistics, or raw uint8
    labels   int64 [N], on the device
    indices  int64 [N], on the CPU (sample i is ``ImageFolder(root).samples[i]``)

Each ``iter(loader)`` is an :class:`_EpochIterator` over the rest of the current epoch, which ends early
once the loader is iterated again, moved (``loader_resume.py``) or closed.

A part of :class:`~prefetchd.trainer.loader.BufferLoader`, which sets what is declared here in its
``__init__``; when the progress file moves past a batch handed out is ``loader_progress.py``'s.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from prefetchd.buffer_protocol import Manifest, MappedBatch, ProtocolError
from prefetchd.trainer.batch import Batch, WaitMeter
from prefetchd.trainer.batch_waiter import BatchWaiter
from prefetchd.trainer.device_path import DevicePath
from prefetchd.trainer.errors import LoaderError, LoaderTimeout
from prefetchd.trainer.job_watch import JobWatch
from prefetchd.trainer.leaving import Where
from prefetchd.trainer.progress_file import ProgressFile
from prefetchd.trainer.tensors import mismatch, to_batch


class _EpochIterator:
    """The rest of one epoch; ends early when the loader is re-iterated, rewound or closed."""

    def __init__(self, loader: LoaderIteration, generation: int, epoch: int) -> None:
        self._loader = loader
        self._generation = generation
        self._epoch = epoch
        self._done = False

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Batch:
        if self._done:
            raise StopIteration
        batch = self._loader._next(self._generation, self._epoch)
        if batch is None:
            self._done = True
            raise StopIteration
        return batch


class LoaderIteration:
    """The epochs a :class:`~prefetchd.trainer.loader.BufferLoader` hands out, batch by batch."""

    # Set by BufferLoader.__init__.
    _buffer: Path
    _device: torch.device
    _manifest: Manifest
    _job: JobWatch
    _normalized: tuple[torch.Tensor, torch.Tensor] | None
    _waiter: BatchWaiter
    _at: Where
    _progress: ProgressFile
    _waits: WaitMeter
    _generation: int
    _closed: bool
    _busy: threading.Lock
    _device_path: DevicePath | None
    stop_requested: Callable[[], bool] | None

    if TYPE_CHECKING:  # its progress' (loader_progress.py) and its resume's (loader_resume.py)
        def _publish(self, force: bool = False, closed: bool = False) -> None: ...
        def _check_progress(self) -> None: ...
        def _say_if_starting_over(self) -> None: ...

    def __iter__(self) -> Iterator[Batch]:
        with self._alone():  # a new epoch iterator ends the one another thread fetches from, mid-batch
            self._check_open()
            self._generation += 1
            self._say_if_starting_over()
            self._publish()
            return _EpochIterator(self, self._generation, self._at.epoch)

    def _next(self, generation: int, epoch: int) -> Batch | None:
        """The batch at the current position, or None when ``epoch``'s iterator is over."""
        with self._alone():
            return self._fetch(generation, epoch)

    @contextlib.contextmanager
    def _alone(self) -> Iterator[None]:
        """Hold the loader for this thread; LoaderError where another thread is at it (the loader is not
        thread-safe)."""
        if not self._busy.acquire(blocking=False):
            raise LoaderError(
                f"{self._buffer}: another thread is fetching a batch from this BufferLoader: a loader is not "
                "thread-safe (two threads at once handed a batch out twice and skipped another); iterate it from "
                "one thread, or give each thread its own loader with a consumer= name of its own")
        try:
            yield
        finally:
            self._busy.release()

    def _fetch(self, generation: int, epoch: int) -> Batch | None:
        if generation != self._generation or self._closed:
            return None
        # The consumer is back for more, so the batch handed over last is done with.
        self._publish()
        if self._at.epoch != epoch or self._past_end():
            return None
        if self._at.step >= self._manifest.steps_per_epoch:
            # Only reachable with an empty epoch (steps_per_epoch == 0).
            self._at.epoch, self._at.step = self._at.epoch + 1, 0
            self._at.read_to_end = self._past_end()
            self._publish()
            return None
        asked = time.monotonic()
        # Counted while it goes on: the progress file rewritten during the wait says the trainer waits.
        self._waits.begin(asked)
        try:
            key = (self._at.epoch, self._at.step)
            if self._device_path is None:
                batch = to_batch(self._checked_batch(*key), *key, self._device, self._normalized)
            else:
                batch = self._device_path.next(key, self._checked_batch, self._checked_if_there)
        finally:  # a wait that ended in an error (a timeout, a stop) was time spent waiting all the same
            self._waits.add(asked, time.monotonic())
        self._at.handed_out += 1
        # Handed over: the position moves now (state_dict reflects it), progress.json
        # only when the consumer comes back (see loader_progress.py).
        self._at.step += 1
        if self._at.step >= self._manifest.steps_per_epoch:
            self._at.epoch, self._at.step = self._at.epoch + 1, 0
        self._at.read_to_end = self._past_end()
        return batch

    def _past_end(self) -> bool:
        epochs = self._manifest.epochs
        return epochs is not None and self._at.epoch >= epochs

    def _checked_batch(self, epoch: int, step: int) -> MappedBatch:
        """Batch (epoch, step), waited for and checked (``_check``)."""
        mapped = self._wait_for_batch(epoch, step)
        self._check(mapped, epoch, step)
        return mapped

    def _checked_if_there(self, epoch: int, step: int) -> MappedBatch:
        """Batch (epoch, step) where its file is there already (FileNotFoundError where not), checked: the device
        path starts its copy ahead."""
        mapped = self._waiter.map_if_there(epoch, step)
        self._check(mapped, epoch, step)
        return mapped

    def _check_open(self) -> None:
        if self._closed:
            raise LoaderError(f"the BufferLoader for {self._buffer} is closed; create a new one")

    def _wait_for_batch(self, epoch: int, step: int) -> MappedBatch:
        try:
            return self._waiter.wait(epoch, step, self._check_progress, self.stop_requested)
        except LoaderTimeout as exc:
            # The waiter judges the daemon; a daemon that was never told the position builds nothing new.
            failing = self._progress.failing()
            if failing is None:
                raise
            raise LoaderTimeout(f"{exc}. But the daemon may not know this loader needs that batch: {failing}") from None

    def _check(self, mapped: MappedBatch, epoch: int, step: int) -> None:
        """Raise ProtocolError unless ``mapped`` is batch (epoch, step) of this loader's job;
        JobReplaced where the daemon serves another job now (its batches reuse the file names)."""
        # After the mapping: a batch mapped while the manifest still named our job is ours. And before a
        # mismatch is blamed on the file: a batch of the job that replaced ours differs from the manifest we hold.
        self._job.check()
        # Whether its batches must name their stream, as the manifest there now says: a daemon of an earlier
        # prefetchd, restarted on the job, writes batches that name none.
        problem = mismatch(mapped, epoch, step, self._manifest, self._buffer, keyed=self._job.keyed)
        if problem is not None:
            raise ProtocolError(problem)


__all__ = ["LoaderIteration"]
