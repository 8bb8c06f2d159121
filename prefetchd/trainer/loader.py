"""Where a batch is read: batch files in the buffer -> tensors on the trainer's device.

A :class:`BufferLoader` walks the (epoch, step) positions of the daemon's job in
order.  For each one it waits for the finished batch file, maps it (zero-copy
numpy views over a private mapping, see ``buffer_protocol.map_batch``, looked up
in the stream folder the loader checked and opened when it started, see
``batch_waiter.BatchWaiter``) and hands out a :class:`Batch`:

    images   NCHW, channels_last strides (the file's HWC bytes, permuted for free);
             float32 normalised with the ImageNet statistics, or raw uint8
    labels   int64 [N], on the device
    indices  int64 [N], on the CPU (sample i is ``ImageFolder(root).samples[i]``)

Progress (``progress.json``, read by the daemon, which deletes every batch
before it; written by ``prefetchd.trainer.progress_file``) is the trainer's side
of flow control:

- it is written when iteration starts and by ``load_state_dict``, so a trainer
  restarted at an older position makes the daemon regenerate from there;
- the job's end (every epoch of a job with ``epochs`` consumed) is written only by
  a loader that read the job's last batch, or that continues (``load_state_dict``)
  one whose progress file says it did: the daemon takes that position for the job
  done and ends it, which a loader put there by a state saved at the end (a finished
  run's checkpoint, loaded to validate or to train more epochs) has no say in.  It
  reads nothing and leaves the progress file as it was;
- a loader that may not write it is refused when it is made (``NoAccess``), and one
  whose writes fail later goes on for a while and then stops, saying why (``AccessLost``
  for a permission lost; ``prefetchd.trainer.progress_file``);
- after a batch is handed over, progress moves past it only when the consumer
  asks for the next batch, when the epoch's iterator is exhausted or when the
  loader is closed, so the file the consumer may still be reading is not
  deleted under it.

On a CUDA device the batch goes through ``prefetchd.trainer.gpu`` (``pin``):
a pinned staging ring or a page-locked mapping, copied on a side stream and
converted on the device, with the next ``prefetch`` batches already on their way
while the consumer works on this one.  There a batch counts as consumed only
once the consumer has come back for the next one *and* its copy has completed,
so progress.json may trail the position by a batch the copy engine still reads.

Several trainers may read one buffer (a sweep, an ensemble): each passes its own
``consumer`` name and writes ``progress.NAME.json`` instead; the daemon keeps every
batch until no consumer's window holds it.  A named consumer starts, unless told
where, at the oldest batch still in the buffer; while it waits for a batch it
rewrites its progress file every ``PROGRESS_REFRESH_SECONDS`` so that the daemon
sees it is there, and ``close()`` marks the file closed so that it holds nothing.
A loader still open when the interpreter exits closes then, and one collected unclosed (made in a
function that returned) says in its progress file that it left (``prefetchd.trainer.leaving``).

Waiting for the manifest is ``prefetchd.trainer.manifest_wait``; for each batch, and
telling a slow daemon from a stuck or a gone one, ``prefetchd.trainer.batch_waiter``; a
job replaced under the loader, ``prefetchd.trainer.job_watch``; the copies to the device in
flight, ``prefetchd.trainer.device_path``; what a loader says as it leaves,
``prefetchd.trainer.leaving``; checking a mapped batch
and normalising it, ``prefetchd.trainer.tensors``; the checkpoint state,
``prefetchd.trainer.resume``.

The loader is not thread-safe; use one per consumer thread and buffer.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from prefetchd.buffer_protocol import (
    DEFAULT_CONSUMER,
    Manifest,
    MappedBatch,
    Progress,
    ProtocolError,
    check_consumer,
    list_batches,
)
from prefetchd.trainer.batch import Batch, WaitMeter
from prefetchd.trainer.batch_waiter import BatchWaiter
from prefetchd.trainer.errors import LoaderError, LoaderTimeout, StateMismatch
from prefetchd.trainer.device_path import DevicePath
from prefetchd.trainer.gpu import PIN_MODES, Backend, CudaBackend, DeviceFeeder, PinMode
from prefetchd.trainer.job_watch import JobWatch
from prefetchd.trainer.leaving import Where, close_at_exit, say_left, unread_end
from prefetchd.trainer.manifest_wait import wait_for_manifest
from prefetchd.trainer.progress_file import ProgressFile
from prefetchd.trainer.resume import is_count, loader_state, resume_position
from prefetchd.trainer.tensors import IMAGENET_MEAN, IMAGENET_STD, check_statistics, mismatch, normalization, to_batch
from prefetchd.trainer.wait_bounds import DAEMON_GRACE, DEFAULT_STALL_TIMEOUT, DEFAULT_TIMEOUT
from prefetchd.words import counted

logger = logging.getLogger(__name__)

DeviceLike = str | torch.device


class _EpochIterator:
    """The rest of one epoch; ends early when the loader is re-iterated, rewound or closed."""

    def __init__(self, loader: BufferLoader, generation: int, epoch: int) -> None:
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


class BufferLoader:
    """Iterate over the batches a prefetchd daemon writes into ``buffer``.

    Each ``iter(loader)`` yields the rest of the current epoch (from
    :attr:`position` to the last step) and leaves the loader at step 0 of the
    next epoch, so ``for epoch ...: for images, labels in loader:`` works as with
    a DataLoader.  When the manifest limits the job to ``epochs`` epochs,
    iterating past them yields nothing; ``load_state_dict`` refuses positions
    beyond the end.  Starting a new iteration, ``load_state_dict`` and
    ``close`` end any iterator handed out before.

    Args:
        buffer: the daemon's ``--buffer`` directory.
        device: where images and labels go ("cpu", "cuda", "cuda:1", a torch.device).
        normalize: float32 images scaled to [0, 1] and standardised per channel
            (ImageNet statistics unless ``mean``/``std`` are given); False gives
            the raw uint8 images.
        timeout: seconds to wait for the manifest at construction, and for each batch;
            while the daemon beats and its status says its builds of this stream's
            rank wait for the dataset's storage (``storage_wait``), or that one of its
            workers is stalled, which it kills at its --task-timeout (``worker_stall``),
            counted from the last look that found it so (an outage waits with the
            daemon, however long; a stall, until the daemon's bound ends it).
        daemon_grace: seconds a missing batch is waited for while no daemon owns
            the buffer before :class:`DaemonGone` is raised.
        stall_timeout: seconds without a heartbeat (the daemon rewrites
            ``status.json`` about once a second, also while its workers are busy
            and while it indexes the dataset) after which a daemon that owns the
            buffer but has not delivered the batch waited for counts as stuck:
            :class:`DaemonStuck` is raised.  A daemon that is slow but alive
            keeps beating and is never called stuck; one that has written no
            heartbeat yet (starting) is given ``stall_timeout`` from when the
            loader first saw it.  None disables the check; ``timeout`` still
            bounds every wait.
        mean, std: per-channel statistics for ``normalize`` (in [0, 1] units).
        pin: how batches reach a CUDA device (see ``prefetchd.trainer.gpu``):
            "staging" copies each mapped batch into a ring of pinned buffers and
            from there to the device on a side stream; "register" page-locks the
            mapped file itself (no host copy, but a driver call per batch that
            on an H200 made it 7x slower than "staging": docs/GPU.md); "none"
            copies straight from the mapping on the consumer's stream
            (``non_blocking=True``, which from pageable memory means: the driver
            stages the bytes through its own pinned buffer and the call returns
            once the mapping has been read, while the transfer and the conversion
            finish in stream order), one batch at a time with nothing copied ahead.
            "auto" (the default) is "staging" on CUDA and "none" on the CPU, where
            it is the only choice.
        prefetch: with "staging" or "register", how many batches after the one
            handed out are already being copied (those whose files exist).
        consumer: this trainer's name among several reading the same buffer
            (1-32 of ``A-Za-z0-9_-``); it writes ``progress.NAME.json``.  None: the
            default consumer, ``progress.json``, as a single trainer does.
        start: (epoch, step) to begin at; ``load_state_dict`` moves it later.  Default:
            (0, 0) for the default consumer, the oldest batch still in the buffer for
            a named one (it joins where the others are).

    Raises :class:`NoAccess` when this user may not write its progress file in ``buffer``
    (a buffer of another user that it may only read, a --group-access buffer whose group may
    not write, a read-only mount): the daemon would never learn what it consumed; iterating raises
    :class:`AccessLost` (a ``NoAccess`` and a ``LoaderError``) once that right, lost mid-run, has
    stayed lost for ``PROGRESS_WRITE_GRACE`` seconds.
    """

    def __init__(
        self,
        buffer: str | os.PathLike[str],
        device: DeviceLike = "cpu",
        normalize: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        daemon_grace: float = DAEMON_GRACE,
        stall_timeout: float | None = DEFAULT_STALL_TIMEOUT,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        pin: PinMode = "auto",
        prefetch: int = 1,
        consumer: str | None = None,
        start: tuple[int, int] | None = None,
    ) -> None:
        if pin not in PIN_MODES:
            raise ValueError(f"pin={pin!r}: expected one of {', '.join(map(repr, PIN_MODES))}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch={prefetch!r}: pass a non-negative number of batches")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout={timeout!r}: pass a positive number of seconds (math.inf: no limit)")
        if not daemon_grace >= 0:
            raise ValueError(f"daemon_grace={daemon_grace!r}: pass a non-negative number of seconds")
        if stall_timeout is not None and not stall_timeout > 0:
            raise ValueError(f"stall_timeout={stall_timeout!r}: pass a positive number of seconds, or None to disable")
        check_statistics(normalize, mean, std)
        self._consumer = check_consumer(consumer if consumer is not None else DEFAULT_CONSUMER)
        # Absolute: a notebook's later chdir must not move the buffer away from under the loader.
        self._buffer = Path(buffer).expanduser().absolute()
        if isinstance(device, int) and not isinstance(device, bool) and not torch.cuda.is_available():
            # BufferLoader(buffer, 64): DataLoader's second argument is the batch size, ours the device.
            raise ValueError(f"device={device!r}: the second argument is the device (a CUDA index here), and CUDA is "
                             "not available; the batch size is the daemon's (`prefetchd start --batch-size`)")
        self._device = torch.device(device)
        if self._device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} but CUDA is not available here; pass device='cpu'")
        self._timeout = float(timeout)
        self._manifest = wait_for_manifest(self._buffer, self._timeout)
        self._job = JobWatch(self._buffer, self._manifest)
        self._normalized = (normalization(mean, std, self._manifest.channels, self._buffer, self._device)
                            if normalize else None)
        if self._device.type != "cuda" and pin not in ("auto", "none"):  # before the consumer is taken
            raise ValueError(
                f"pin={pin!r} needs a CUDA device, but device={str(device)!r}; pass pin='auto' or leave it out"
            )
        self._waiter = BatchWaiter(self._buffer, self._manifest, self._timeout, float(daemon_grace),
                                   float(stall_timeout) if stall_timeout is not None else None)
        try:
            self._at = Where(*self._start_position(start))
            self._progress = ProgressFile(self._buffer, self._consumer, self._manifest.job_key)
        except BaseException:  # a loader that was never made holds no folder open (a mount it was refused on can go)
            self._waiter.close()
            raise
        self._waits = WaitMeter()
        self._generation = 0
        self._closed = False
        self._device_path: DevicePath | None = None  # on a CUDA device: the copies in flight
        self._pin: PinMode = "none"
        # Asked while a wait for a batch goes on; True ends it with StopRequested, the position unchanged.
        self.stop_requested: Callable[[], bool] | None = None
        if self._device.type == "cuda":
            mode = "staging" if pin == "auto" else pin
            if mode != "none":
                try:
                    self._attach_feeder(CudaBackend(self._device), mode, prefetch)
                except BaseException:  # a loader that was never made holds no consumer, nor its folder open
                    self._progress.release()
                    self._waiter.close()
                    raise
        # Made last, so that at exit it runs before the feeder's and the lock's finalizers (newest first).
        # It holds what says the loader left, never the loader: a loader dropped without close() is collected.
        self._exit_close = weakref.finalize(self, close_at_exit, weakref.ref(self), os.getpid(), self._progress,
                                            self._at, self._waits, self._manifest.epochs)

    def _attach_feeder(self, backend: Backend, mode: PinMode, prefetch: int) -> None:
        """Send batches through a :class:`DeviceFeeder` on ``backend`` (also how tests fake CUDA)."""
        if mode != "staging" and mode != "register":
            raise ValueError(f"pin={mode!r}: a device feeder does 'staging' or 'register'")
        m = self._manifest
        scale, shift = self._normalized or (None, None)
        feeder = DeviceFeeder(
            backend,
            mode,
            batch_size=m.batch_size,
            image_shape=(m.image_size, m.image_size, m.channels),
            scale=scale,
            shift=shift,
            # One slot for each batch ahead, one for the batch in use, one whose copy may not
            # have been confirmed yet; a slot is waited for only when the ring comes round.
            ring=prefetch + 2,
        )
        self._device_path = DevicePath(feeder, prefetch, m)
        self._pin = mode
        # A loader dropped without close() must still unpin before its mappings are unmapped.
        self._release_feeder = weakref.finalize(self, feeder.close_quietly)

    def _start_position(self, start: tuple[int, int] | None) -> tuple[int, int]:
        if start is not None:
            return resume_position({"epoch": start[0], "step": start[1], "fingerprint": self._manifest.fingerprint},
                                   self._manifest, self._buffer)
        if self._consumer == DEFAULT_CONSUMER:
            return (0, 0)
        # Join where the others are: the oldest batch the daemon still holds.
        waiting = list_batches(self._buffer, self._waiter.fd)
        return min(waiting) if waiting else (0, 0)

    # -- read-only views ---------------------------------------------------------

    @property
    def buffer(self) -> Path:
        return self._buffer

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def manifest(self) -> Manifest:
        return self._manifest

    @property
    def classes(self) -> list[str]:
        return list(self._manifest.classes)

    @property
    def stall_timeout(self) -> float | None:
        """Seconds without a daemon heartbeat before a wait raises :class:`DaemonStuck`; None: never."""
        return self._waiter.stall

    @property
    def pin(self) -> PinMode:
        """How batches reach the device: "staging", "register" or "none"."""
        return self._pin

    @property
    def consumer(self) -> str:
        """This loader's consumer name; "" for the default consumer (progress.json)."""
        return self._consumer

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, step) of the next batch to be delivered."""
        return (self._at.epoch, self._at.step)

    @property
    def batch_size(self) -> int:
        """Images per batch, as the daemon builds them (the last of an epoch may hold fewer: ``drop_last``)."""
        return self._manifest.batch_size

    @property
    def drop_last(self) -> bool:
        """Whether the daemon leaves out each epoch's short last batch (``prefetchd start --drop-last``)."""
        return self._manifest.drop_last

    def __len__(self) -> int:
        return self._manifest.steps_per_epoch

    def __repr__(self) -> str:
        return (
            f"BufferLoader({str(self._buffer)!r}, device={str(self._device)!r}, normalize={self._normalized is not None}, "
            f"pin={self._pin!r}, position={self.position}, steps_per_epoch={len(self)})"
        )

    # -- iteration ---------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        self._check_open()
        self._generation += 1
        self._publish()
        return _EpochIterator(self, self._generation, self._at.epoch)

    def _next(self, generation: int, epoch: int) -> Batch | None:
        """The batch at the current position, or None when ``epoch``'s iterator is over."""
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
        # only when the consumer comes back (see the module docstring).
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

    def _consumed_until(self) -> tuple[int, int]:
        """The position progress.json may name: handed-out batches still being copied are not consumed."""
        position = (self._at.epoch, self._at.step)
        return position if self._device_path is None else self._device_path.consumed_until(position)

    def _publish(self, force: bool = False, closed: bool = False) -> None:
        position = self._consumed_until()
        if self._unread_end(position):
            # Not this loader's to announce (the module docstring): only leaving is said, where it was written.
            if not closed or self._progress.published is None:
                return
            position = self._progress.published
        # Counted, not taken from the position: a jump (load_state_dict, set_epoch) reads nothing.
        read = self._at.handed_out - (len(self._device_path.handed) if self._device_path is not None else 0)
        self._progress.publish(position, self._waits.share(), force=force, closed=closed, read_batches=read)

    def _unread_end(self, position: tuple[int, int]) -> bool:
        """Whether ``position`` is the job's end and this loader got there without reading its last batch."""
        return unread_end(position, self._at, self._manifest.epochs)

    def _check_progress(self) -> None:
        """While waiting: write the progress file again where it does not name this loader's position,
        or is due for a refresh (``ProgressFile.stale``)."""
        self._job.check()  # a position written back into a job that replaced ours would mislead its daemon
        if self._progress.stale():
            self._publish(force=True)

    def _check_open(self) -> None:
        if self._closed:
            raise LoaderError(f"the BufferLoader for {self._buffer} is closed; create a new one")

    # -- resume ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where to resume: the (epoch, step) of the next batch, and the job it belongs to."""
        return loader_state(self._manifest, self._at.epoch, self._at.step)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict`) and tell the daemon to produce from there.

        Raises StateMismatch when the state belongs to another dataset or job (a
        different seed, batch size, split ... would give different batches) or
        points past the job's end.  A state at the job's end (saved after its last
        epoch) is taken with a warning: there is nothing left to read, and the daemon
        is not told so (its job would end, for this trainer and any other that reads
        it: see the module docstring); unless the progress file says the trainer it
        continues read the last batch (it died before asking for the next one), whose
        end this loader then says.
        """
        self._move(state)
        if self._unread_end(self.position):  # the progress file read once, only at the end
            if self._last_batch_handed_before():
                self._at.read_to_end = True  # the loader it continues read the job's last batch: the end is said
            else:
                logger.warning(
                    "%s: the loader state is at the end of the job's %s: there is nothing left to read, and "
                    "iterating yields no batch. To train more epochs, restart the daemon with a larger --epochs (the "
                    "job is the same otherwise) and load the state again; to train again from epoch 0, do not load it",
                    self._buffer, counted(self._manifest.epochs or 0, "epoch"))
        self._publish()

    def _last_batch_handed_before(self) -> bool:
        """Whether this consumer's progress file says the job's last batch was handed out: it names the last
        step (its trainer died after reading that batch, before asking for the next one, with a state saved at
        the end) or the end.  Not a fresh run's file, which is elsewhere or absent."""
        try:
            found = Progress.read(self._buffer, self._consumer)
        except (ProtocolError, OSError):
            return False
        if found is None or found.job not in (None, self._manifest.job_key):
            return False
        epochs, steps = self._manifest.epochs or 0, self._manifest.steps_per_epoch
        return (found.epoch, found.step) >= (epochs - 1, steps - 1)

    def _move(self, state: Mapping[str, Any]) -> None:
        """Go to ``state``'s position, ending the iterators handed out before; progress.json is left alone."""
        self._check_open()
        epoch, step = resume_position(state, self._manifest, self._buffer)
        if self._device_path is not None:
            self._device_path.drain()
        if (epoch, step) != (self._at.epoch, self._at.step):
            self._at.read_to_end = False
        self._at.epoch, self._at.step = epoch, step
        self._generation += 1

    def set_epoch(self, epoch: int) -> None:
        """Go to the first batch of ``epoch``, as ``DistributedSampler.set_epoch`` does for a sampler.

        A script that resumes by epoch (``for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch)``) gets that epoch's batches, bit-identical to an
        uninterrupted run's: progress.json moves there when the next iteration starts
        (not at once: a mid-epoch resume, below, would have the daemon read step 0
        first, take it for a rewind and delete the batches it kept for this trainer,
        SPEC rule 8), and the daemon regenerates from there if it has moved on.  Called at the top of every epoch of an
        uninterrupted run it changes nothing.  It always restarts the epoch, so a
        mid-epoch resume calls ``load_state_dict`` *after* ``set_epoch`` for the
        epoch it resumes into: ``set_epoch`` names the epoch, ``load_state_dict``
        the batch, and the later call wins.
        """
        if not is_count(epoch):
            raise ValueError(f"set_epoch({epoch!r}): pass a non-negative integer epoch (counted from 0)")
        epochs = self._manifest.epochs
        if epochs is not None and epoch > epochs:  # said for this call, not as a checkpoint's state would be
            raise StateMismatch(
                f"set_epoch({epoch}) is past the end of the job of {self._buffer}: it has {counted(epochs, 'epoch')} "
                f"(counted from 0, so set_epoch({epochs}) is its end, an empty epoch); loop over range({epochs}), or "
                "restart the daemon with a larger --epochs")
        # The same checks and the same repositioning as a checkpoint taken at that epoch's start.
        self._move({**self.state_dict(), "epoch": epoch, "step": 0})

    # -- lifecycle ---------------------------------------------------------------

    def close(self) -> None:
        """Mark the batch handed over last as consumed, say in the progress file that this consumer left,
        end all iterators and release the pinned host memory of the device path.

        A loader still open when the interpreter exits (a script's end, also by an uncaught exception, as
        a ``with`` block would on it) is closed then, so that the daemon says the trainer left, not that
        it went away; one whose process is killed is not, and is gone to the daemon."""
        if self._closed:
            return
        if self._device_path is not None:  # its page-locked staging ring goes now, not when the loader is collected
            self._device_path.drain()
            self._release_feeder()
            self._device_path = None
        try:
            # It leaves: the daemon stops holding batches for it while another consumer reads, until it
            # writes again, and does not take a trainer that finished for one that went away.
            say_left(self._progress, self._at, self._waits, self._manifest.epochs)
        except LoaderError as exc:
            logger.warning("closing %s: %s", self._buffer, exc)
        self._closed = True
        self._progress.release()
        self._waiter.close()
        self._generation += 1
        self._exit_close.detach()

    def __enter__(self) -> BufferLoader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

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


__all__ = ["Batch", "BufferLoader", "IMAGENET_MEAN", "IMAGENET_STD"]
