"""Where a batch is read: batch files in the buffer -> tensors on the trainer's device.

A :class:`BufferLoader` walks the (epoch, step) positions of the daemon's job in
order.  For each one it waits for the finished batch file, maps it (zero-copy
numpy views over a private mapping, see ``buffer_protocol.map_batch``) and hands
out a :class:`Batch`:

    images   NCHW, channels_last strides (the file's HWC bytes, permuted for free);
             float32 normalised with the ImageNet statistics, or raw uint8
    labels   int64 [N], on the device
    indices  int64 [N], on the CPU (sample i is ``ImageFolder(root).samples[i]``)

Progress (``progress.json``, read by the daemon, which deletes every batch
before it) is the trainer's side of flow control:

- it is written when iteration starts and by ``load_state_dict``, so a trainer
  restarted at an older position makes the daemon regenerate from there;
- after a batch is handed over, progress moves past it only when the consumer
  asks for the next batch, when the epoch's iterator is exhausted or when the
  loader is closed, so the file the consumer may still be reading is not
  deleted under it;
- the same position is not written twice in a row, except while waiting for a batch,
  when the file is refreshed every ``PROGRESS_REFRESH_SECONDS`` (SPEC rule 9).

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

Waiting for the manifest and for each batch, and telling a slow daemon from a
stuck or a gone one, is ``prefetchd.trainer.liveness``; the checkpoint state is
``prefetchd.trainer.resume``.

The loader is not thread-safe; use one per consumer thread and buffer.
"""

from __future__ import annotations

import errno
import logging
import os
import time
import weakref
from collections import deque
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
    alive_since,
    batch_name,
    check_consumer,
    list_batches,
    map_batch,
    progress_name,
)
from prefetchd.buffer_protocol.layout import PROGRESS_REFRESH_SECONDS
from prefetchd.trainer.batch import Batch, WaitMeter
from prefetchd.trainer.errors import LoaderError, StateMismatch
from prefetchd.trainer.gpu import PIN_MODES, Backend, CudaBackend, DeviceFeeder, PinMode, Transfer
from prefetchd.trainer.liveness import BatchWaiter, JobWatch, wait_for_manifest
from prefetchd.trainer.resume import is_count, loader_state, resume_position
from prefetchd.words import counted

logger = logging.getLogger(__name__)

# This process's loaders, to say when two open ones read one buffer as one consumer: the check against other
# trainers' progress writes passes over this process's own pid.
_LOADERS: weakref.WeakSet[BufferLoader] = weakref.WeakSet()

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# One-channel data: the mean of the three ImageNet channels, as torchvision's
# grayscale recipes use.
GRAY_MEAN = (0.449,)
GRAY_STD = (0.226,)

# progress.json may fail to be written for a while (a full tmpfs): the loader keeps delivering
# the batches that are there and retries; only a failure that lasts this long is an error.
_PROGRESS_WRITE_GRACE = 30.0
ALONE_CHECK_SECONDS = 1.0  # how often a publish reads the progress file first, for another trainer's writes

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
        timeout: seconds to wait for the manifest at construction, and for each batch.
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
    """

    def __init__(
        self,
        buffer: str | os.PathLike[str],
        device: DeviceLike = "cpu",
        normalize: bool = True,
        timeout: float = 120.0,
        *,
        daemon_grace: float = 5.0,
        stall_timeout: float | None = 60.0,
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
        if not normalize and (mean is not None or std is not None):
            raise ValueError("mean= and std= apply only with normalize=True, which normalize=False turns off; "
                             "leave them out, or normalize")
        if (mean is None) != (std is None):  # one of a dataset's statistics beside ImageNet's other is neither's
            raise ValueError("mean= and std= go together: pass both, or neither for the defaults (ImageNet's)")
        if (mean is not None and not all(0 <= m <= 1 for m in mean)) or (std is not None and not all(s <= 1 for s in std)):
            # The images become float in [0, 1] first, as after torchvision's ToTensor: 0-255 values shift everything.
            raise ValueError(f"mean={mean!r}, std={std!r}: pass them in [0, 1] units, as torchvision's Normalize "
                             "takes them after ToTensor (0-255 values: divide them by 255)")
        self._consumer = check_consumer(consumer if consumer is not None else DEFAULT_CONSUMER)
        # Absolute: a notebook's later chdir must not move the buffer away from under the loader.
        self._buffer = Path(buffer).expanduser().absolute()
        self._progress_path = self._buffer / progress_name(self._consumer)
        if isinstance(device, int) and not isinstance(device, bool) and not torch.cuda.is_available():
            # BufferLoader(buffer, 64): DataLoader's second argument is the batch size, ours the device.
            raise ValueError(f"device={device!r}: the second argument is the device (a CUDA index here), and CUDA is "
                             "not available; the batch size is the daemon's (`prefetchd start --batch-size`)")
        self._device = torch.device(device)
        if self._device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} but CUDA is not available here; pass device='cpu'")
        self._non_blocking = self._device.type == "cuda"
        self._normalize = normalize
        self._timeout = float(timeout)
        self._manifest = wait_for_manifest(self._buffer, self._timeout)
        self._job = JobWatch(self._buffer, self._manifest)
        self._waiter = BatchWaiter(self._buffer, self._manifest, self._timeout, float(daemon_grace),
                                   float(stall_timeout) if stall_timeout is not None else None)
        self._scale, self._shift = self._normalization(mean, std)
        self._epoch, self._step = self._start_position(start)
        self._published: tuple[int, int] | None = None
        self._published_at = 0.0  # time.monotonic() of the last progress write
        self._next_alone_check = 0.0  # when _publish next reads the progress file for another trainer's writes
        self._publish_failing_since: float | None = None
        self._waits = WaitMeter()
        self._generation = 0
        self._closed = False
        if any(o._buffer == self._buffer and o._consumer == self._consumer and not o._closed for o in _LOADERS):
            logger.warning(
                "%s: another BufferLoader of this process reads it as %s and is still open. Two loaders take turns "
                "at one progress file, and the daemon builds again the batches each moves back to; close the other "
                "first (loader.close(), or a with block), or give each a consumer= of its own", self._buffer,
                "the default consumer" if self._consumer == DEFAULT_CONSUMER else f"consumer {self._consumer!r}")
        _LOADERS.add(self)
        self._feeder: DeviceFeeder | None = None
        self._prefetch = 0
        self._ahead: deque[Transfer] = deque()  # started, not yet handed out: consecutive positions
        self._handed: deque[Transfer] = deque()  # handed out, copy not yet known to be complete
        self._pin: PinMode = "none"
        # Asked while a wait for a batch goes on; True ends it with StopRequested, the position unchanged.
        self.stop_requested: Callable[[], bool] | None = None
        if self._device.type == "cuda":
            mode = "staging" if pin == "auto" else pin
            if mode != "none":
                self._attach_feeder(CudaBackend(self._device), mode, prefetch)
        elif pin not in ("auto", "none"):
            raise ValueError(
                f"pin={pin!r} needs a CUDA device, but device={str(device)!r}; pass pin='auto' or leave it out"
            )

    def _attach_feeder(self, backend: Backend, mode: PinMode, prefetch: int) -> None:
        """Send batches through a :class:`DeviceFeeder` on ``backend`` (also how tests fake CUDA)."""
        if mode != "staging" and mode != "register":
            raise ValueError(f"pin={mode!r}: a device feeder does 'staging' or 'register'")
        m = self._manifest
        self._feeder = DeviceFeeder(
            backend,
            mode,
            batch_size=m.batch_size,
            image_shape=(m.image_size, m.image_size, m.channels),
            scale=self._scale,
            shift=self._shift,
            # One slot for each batch ahead, one for the batch in use, one whose copy may not
            # have been confirmed yet; a slot is waited for only when the ring comes round.
            ring=prefetch + 2,
        )
        self._prefetch = prefetch
        self._pin = mode
        # A loader dropped without close() must still unpin before its mappings are unmapped.
        weakref.finalize(self, self._feeder.close_quietly)

    def _start_position(self, start: tuple[int, int] | None) -> tuple[int, int]:
        if start is not None:
            return resume_position({"epoch": start[0], "step": start[1], "fingerprint": self._manifest.fingerprint},
                                   self._manifest, self._buffer)
        if self._consumer == DEFAULT_CONSUMER:
            return (0, 0)
        # Join where the others are: the oldest batch the daemon still holds.
        waiting = list_batches(self._buffer)
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
        return (self._epoch, self._step)

    def __len__(self) -> int:
        return self._manifest.steps_per_epoch

    def __repr__(self) -> str:
        return (
            f"BufferLoader({str(self._buffer)!r}, device={str(self._device)!r}, normalize={self._normalize}, "
            f"pin={self._pin!r}, position={self.position}, steps_per_epoch={len(self)})"
        )

    # -- iteration ---------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        self._check_open()
        self._generation += 1
        self._publish()
        return _EpochIterator(self, self._generation, self._epoch)

    def _next(self, generation: int, epoch: int) -> Batch | None:
        """The batch at the current position, or None when ``epoch``'s iterator is over."""
        if generation != self._generation or self._closed:
            return None
        # The consumer is back for more, so the batch handed over last is done with.
        self._publish()
        if self._epoch != epoch or self._past_end():
            return None
        if self._step >= self._manifest.steps_per_epoch:
            # Only reachable with an empty epoch (steps_per_epoch == 0).
            self._epoch, self._step = self._epoch + 1, 0
            self._publish()
            return None
        asked = time.monotonic()
        if self._feeder is None:
            batch = self._to_batch(self._wait_for_batch(self._epoch, self._step))
        else:
            batch = self._next_on_device(self._feeder)
        self._waits.add(asked, time.monotonic())
        # Handed over: the position moves now (state_dict reflects it), progress.json
        # only when the consumer comes back (see the module docstring).
        self._step += 1
        if self._step >= self._manifest.steps_per_epoch:
            self._epoch, self._step = self._epoch + 1, 0
        return batch

    def _past_end(self) -> bool:
        epochs = self._manifest.epochs
        return epochs is not None and self._epoch >= epochs

    # -- the device path -----------------------------------------------------------

    def _next_on_device(self, feeder: DeviceFeeder) -> Batch:
        key = (self._epoch, self._step)
        transfer = self._take_ahead(key)
        if transfer is None:
            mapped = self._wait_for_batch(*key)
            self._check(mapped, *key)
            transfer = feeder.start(mapped, key)
        images, labels = feeder.hand_out(transfer)
        self._handed.append(transfer)
        # Double buffering: the next batch's copy overlaps the consumer's work on this one.
        self._fill_ahead(feeder, key)
        return Batch(
            images=images, labels=labels, indices=transfer.indices, epoch=key[0], step=key[1],
            replaced=transfer.replaced,
        )

    def _take_ahead(self, key: tuple[int, int]) -> Transfer | None:
        if self._ahead and self._ahead[0].key == key:
            return self._ahead.popleft()
        self._drain(self._ahead)  # started for positions the consumer no longer asks for
        return None

    def _fill_ahead(self, feeder: DeviceFeeder, key: tuple[int, int]) -> None:
        """Start the copies of the next ``prefetch`` batches whose files are already there."""
        last = self._ahead[-1].key if self._ahead else key
        while len(self._ahead) < self._prefetch:
            epoch, step = last[0], last[1] + 1
            if step >= self._manifest.steps_per_epoch:
                epoch, step = epoch + 1, 0
            epochs = self._manifest.epochs
            if epochs is not None and epoch >= epochs:
                return
            try:
                mapped = map_batch(self._buffer / batch_name(epoch, step))
                self._check(mapped, epoch, step)
            except (FileNotFoundError, ProtocolError, ValueError):
                # Not produced yet, or broken: its own turn waits for it or reports it.
                return
            self._ahead.append(feeder.start(mapped, (epoch, step)))
            last = (epoch, step)

    def _consumed_until(self) -> tuple[int, int]:
        """The position progress.json may name: handed-out batches still being copied are not consumed."""
        position = (self._epoch, self._step)
        if self._feeder is None:
            return position
        while self._handed and self._feeder.finish(self._handed[0], wait=False):
            self._handed.popleft()
        return min(position, self._handed[0].key) if self._handed else position

    def _drain(self, transfers: deque[Transfer]) -> None:
        while transfers:
            transfer = transfers.popleft()
            if self._feeder is not None:
                self._feeder.finish(transfer, wait=True)

    def _publish(self, force: bool = False, closed: bool = False) -> None:
        position = self._consumed_until()
        if position == self._published and not force:
            return
        now = time.monotonic()
        if self._published is not None and now >= self._next_alone_check:
            # A trainer that never waits never reaches _check_progress: look here too, once a second at most.
            self._next_alone_check = now + ALONE_CHECK_SECONDS
            try:
                self._check_alone(Progress.read(self._buffer, self._consumer))
            except (ProtocolError, OSError):
                pass  # unreadable: overwritten below, and a wait looks again
        try:
            Progress(*position, wait_share=self._waits.share(), closed=closed,
                     job=self._manifest.job_key).write(self._buffer, self._consumer)
        except OSError as exc:
            now = time.monotonic()
            if self._publish_failing_since is None:
                self._publish_failing_since = now
            if now - self._publish_failing_since < _PROGRESS_WRITE_GRACE:
                # Left unpublished, so the next call tries again.
                logger.warning("cannot write %s (%s); trying again", self._progress_path, exc.strerror or exc)
                return
            fix = {errno.EISDIR: "remove the directory that took its name",
                   errno.ENOSPC: "free space on the buffer's filesystem (what else fills it?)",
                   errno.EACCES: "give this user write access to the buffer (its group, with --group-access)"}.get(
                exc.errno or 0, "check that the buffer directory exists, is writable and has free space")
            raise LoaderError(
                f"{self._progress_path}: cannot write it ({exc.strerror or exc}) for "
                f"{_PROGRESS_WRITE_GRACE:g} s; the daemon needs it to know what to produce and delete: {fix}"
            ) from exc
        self._publish_failing_since = None
        self._published = position
        self._published_at = time.monotonic()

    def _check_progress(self) -> None:
        """While waiting: make the progress file name this loader's position again if it does not,
        and refresh it every PROGRESS_REFRESH_SECONDS.

        Someone else rewound or damaged it (or our last write failed), and the daemon now
        builds other batches than the one this loader waits for; it would wait until its timeout.
        The refresh tells a daemon serving several consumers that this one waits rather than
        went silent (a silent consumer stops holding batches after --consumer-timeout).
        """
        self._job.check()  # a position written back into a job that replaced ours would mislead its daemon
        try:
            current = Progress.read(self._buffer, self._consumer)
        except (ProtocolError, OSError):
            current = None
        if current is not None and (current.epoch, current.step) == self._published:
            if time.monotonic() - self._published_at >= PROGRESS_REFRESH_SECONDS:
                self._publish(force=True)
            return
        if self._published is not None:
            self._check_alone(current)
            logger.warning("%s names %s, not this loader's position %s; writing it again",
                           self._progress_path, current and (current.epoch, current.step), self._published)
        self._publish(force=True)

    def _check_alone(self, current: Progress | None) -> None:
        """Raise when ``current``, this consumer's progress as read, was written by another trainer that is
        still there and has not left.  Two trainers taking turns at one consumer's progress each make the
        daemon build the other's batches, and the first to finish ends the daemon's job under the other."""
        if current is None or current.pid in (None, os.getpid()) or current.closed or current.time is None \
                or not alive_since(current.pid, current.time):
            return
        mine = f"epoch {self._published[0]} step {self._published[1]}" if self._published else "its start"
        raise LoaderError(
            f"{self._progress_path}: another trainer (pid {current.pid}) reads {self._buffer} as "
            f"{'the default consumer' if not self._consumer else 'consumer ' + repr(self._consumer)} "
            f"too, at epoch {current.epoch} step {current.step} while this one is at {mine}. Several trainers on "
            "one buffer each need a consumer name of their own: --consumer NAME (BufferLoader(consumer=NAME))"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise LoaderError(f"the BufferLoader for {self._buffer} is closed; create a new one")

    # -- resume ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where to resume: the (epoch, step) of the next batch, and the job it belongs to."""
        return loader_state(self._manifest, self._epoch, self._step)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict`) and tell the daemon to produce from there.

        Raises StateMismatch when the state belongs to another dataset or job (a
        different seed, batch size, split ... would give different batches) or
        points past the job's end.
        """
        self._check_open()
        epoch, step = resume_position(state, self._manifest, self._buffer)
        self._drain(self._ahead)
        self._drain(self._handed)
        self._epoch, self._step = epoch, step
        self._generation += 1
        self._publish()

    def set_epoch(self, epoch: int) -> None:
        """Go to the first batch of ``epoch``, as ``DistributedSampler.set_epoch`` does for a sampler.

        A script that resumes by epoch (``for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch)``) gets that epoch's batches, bit-identical to an
        uninterrupted run's: progress.json moves there and the daemon regenerates
        from there if it has moved on.  Called at the top of every epoch of an
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
        self.load_state_dict({**self.state_dict(), "epoch": epoch, "step": 0})

    # -- lifecycle ---------------------------------------------------------------

    def close(self) -> None:
        """Mark the batch handed over last as consumed, say in the progress file that this consumer left,
        and end all iterators."""
        if self._closed:
            return
        self._drain(self._ahead)
        self._drain(self._handed)
        if self._published is not None:
            try:
                # It leaves: the daemon stops holding batches for it while another consumer reads, until it
                # writes again, and does not take a trainer that finished for one that went away.
                self._publish(force=True, closed=True)
            except LoaderError as exc:
                logger.warning("closing %s: %s", self._buffer, exc)
        self._closed = True
        self._generation += 1

    def __enter__(self) -> BufferLoader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _wait_for_batch(self, epoch: int, step: int) -> MappedBatch:
        return self._waiter.wait(epoch, step, self._check_progress, self.stop_requested)

    # -- tensors -----------------------------------------------------------------

    def _normalization(
        self, mean: Sequence[float] | None, std: Sequence[float] | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self._normalize:
            return None, None
        channels = self._manifest.channels
        if mean is None or std is None:
            defaults = {3: (IMAGENET_MEAN, IMAGENET_STD), 1: (GRAY_MEAN, GRAY_STD)}
            if channels not in defaults:
                raise ValueError(
                    f"{self._buffer}: images have {channels} channels and normalize=True has defaults only for "
                    "1 or 3; pass mean= and std= (one value per channel) or normalize=False"
                )
            mean = mean if mean is not None else defaults[channels][0]
            std = std if std is not None else defaults[channels][1]
        if len(mean) != channels or len(std) != channels or not all(s > 0 for s in std):
            raise ValueError(
                f"mean={tuple(mean)!r}, std={tuple(std)!r}: need {channels} values each (images in {self._buffer} "
                "have that many channels) and positive std"
            )
        # x * scale - shift == (x / 255 - mean) / std, in two in-place passes.
        std_t = torch.as_tensor(std, dtype=torch.float64).cpu()  # a list, or a tensor already (no copy warning)
        scale = (1.0 / (255.0 * std_t)).to(torch.float32).view(1, channels, 1, 1)
        shift = (torch.as_tensor(mean, dtype=torch.float64).cpu() / std_t).to(torch.float32).view(1, channels, 1, 1)
        return scale.to(self._device), shift.to(self._device)

    def _to_batch(self, mapped: MappedBatch) -> Batch:
        epoch, step = self._epoch, self._step
        self._check(mapped, epoch, step)
        # HWC bytes seen as NCHW: a free permute whose strides are channels_last.
        images = torch.from_numpy(mapped.images).permute(0, 3, 1, 2)
        images = images.to(self._device, non_blocking=self._non_blocking)
        labels = torch.from_numpy(mapped.labels).to(self._device, non_blocking=self._non_blocking)
        if self._scale is not None and self._shift is not None:
            # Convert after the move: uint8 crosses the bus, a quarter of float32's bytes.
            images = images.to(torch.float32).mul_(self._scale).sub_(self._shift)
        return Batch(
            images=images,
            labels=labels,
            indices=torch.from_numpy(mapped.indices),
            epoch=epoch,
            step=step,
            replaced=mapped.meta.replaced,
        )

    def _check(self, mapped: MappedBatch, epoch: int, step: int) -> None:
        """Raise ProtocolError unless ``mapped`` is batch (epoch, step) of this loader's job;
        JobReplaced where the daemon serves another job now (its batches reuse the file names)."""
        problem = self._mismatch(mapped, epoch, step)
        # After the mapping: a batch mapped while the manifest still named our job is ours. And before a
        # mismatch is blamed on the file: a batch of the job that replaced ours differs from the manifest we hold.
        self._job.check()
        if problem is not None:
            raise ProtocolError(problem)

    def _mismatch(self, mapped: MappedBatch, epoch: int, step: int) -> str | None:
        """How ``mapped`` differs from batch (epoch, step) of the manifest this loader holds; None if it does not."""
        meta, m = mapped.meta, self._manifest
        path = mapped.path
        if (meta.epoch, meta.step) != (epoch, step):
            return (f"{path}: holds epoch {meta.epoch} step {meta.step} but its name says epoch {epoch} step {step}; "
                    "delete it (the daemon regenerates missing batches)")
        n, h, w, c = mapped.images.shape
        if (h, w, c) != (m.image_size, m.image_size, m.channels) or not 1 <= n <= m.batch_size or meta.seed != m.seed:
            return (f"{path}: {n} images of {h}x{w}x{c} with seed {meta.seed}, but manifest.json promises up to "
                    f"{m.batch_size} of {m.image_size}x{m.image_size}x{m.channels} with seed {m.seed}: the batch "
                    f"belongs to another job. Stop the daemon, delete the *.batch files in {self._buffer} and "
                    "restart it")
        labels_np = mapped.labels
        if n and (int(labels_np.min()) < 0 or int(labels_np.max()) >= len(m.classes)):
            return (f"{path}: labels range over [{int(labels_np.min())}, {int(labels_np.max())}] but the manifest "
                    f"has {len(m.classes)} classes; delete it (the daemon regenerates missing batches)")
        return None


__all__ = ["Batch", "BufferLoader", "IMAGENET_MEAN", "IMAGENET_STD"]
