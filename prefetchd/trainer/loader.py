"""Where a batch is read: batch files in the buffer -> tensors on the trainer's device.

A :class:`BufferLoader` hands out the batches of the daemon's job, position after position, each a
:class:`Batch` (images, labels, indices).  It is made, looked at and closed here, and is three parts besides,
each a module: its epochs, each batch waited for, checked and handed out (``loader_iteration.py``); its
progress file, the trainer's side of flow control (``loader_progress.py``); the state it resumes from, and
its moves to a position (``loader_resume.py``).

On a CUDA device the batch goes through ``prefetchd.trainer.gpu`` (``pin``):
a pinned staging ring or a page-locked mapping, copied on a side stream and
converted on the device, with the next ``prefetch`` batches already on their way
while the consumer works on this one.

Several trainers may read one buffer (a sweep, an ensemble): each passes its own
``consumer`` name and writes ``progress.NAME.json`` instead; the daemon keeps every
batch until no consumer's window holds it.  A named consumer starts, unless told
where, at the oldest batch still in the buffer (none there: where the slowest live
consumer is), and ``close()`` marks the file closed
so that it holds nothing.
A loader still open when the interpreter exits closes then, and one collected unclosed (made in a
function that returned) says in its progress file that it left (``prefetchd.trainer.leaving``).

Waiting for the manifest is ``prefetchd.trainer.manifest_wait``; for each batch, and
telling a slow daemon from a stuck or a gone one, ``prefetchd.trainer.batch_waiter``; a
job replaced under the loader, ``prefetchd.trainer.job_watch``; the copies to the device in
flight, ``prefetchd.trainer.device_path``; what a loader says as it leaves,
``prefetchd.trainer.leaving``; checking a mapped batch
and normalising it, ``prefetchd.trainer.tensors``; the checkpoint state,
``prefetchd.trainer.resume``.

The loader is not thread-safe; use one per consumer thread and buffer.  Two threads iterating one at once
(or one calling ``iter()`` while another fetches) are refused (``LoaderError``): they handed one batch out
twice, skipped another and then waited out the timeout.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

import torch

from prefetchd.buffer_protocol import DEFAULT_CONSUMER, Manifest, check_consumer, list_batches
from prefetchd.trainer.batch import Batch, WaitMeter
from prefetchd.trainer.batch_waiter import BatchWaiter
from prefetchd.trainer.errors import LoaderError
from prefetchd.trainer.device_path import DevicePath
from prefetchd.trainer.gpu import PIN_MODES, Backend, CudaBackend, DeviceFeeder, PinMode
from prefetchd.trainer.job_watch import JobWatch
from prefetchd.trainer.leaving import Where, close_at_exit, say_left
from prefetchd.trainer.loader_iteration import LoaderIteration
from prefetchd.trainer.loader_progress import LoaderProgress
from prefetchd.trainer.loader_resume import LoaderResume
from prefetchd.trainer.manifest_wait import wait_for_manifest
from prefetchd.trainer.progress_file import ProgressFile, live_positions
from prefetchd.trainer.resume import as_count, loader_state, resume_position
from prefetchd.trainer.tensors import IMAGENET_MEAN, IMAGENET_STD, check_statistics, normalization
from prefetchd.trainer.wait_bounds import (DAEMON_GRACE, DEFAULT_STALL_TIMEOUT, DEFAULT_TIMEOUT, buffer_path,
                                           check_timeout, seconds)

logger = logging.getLogger(__name__)

DeviceLike = str | torch.device


class BufferLoader(LoaderIteration, LoaderProgress, LoaderResume):
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
            (1-32 of ``A-Za-z0-9_-``); it writes ``progress.NAME.json``.  None (or "", the protocol's name
            for it, as a script passing an empty argument gives): the default consumer, ``progress.json``, as a
            single trainer does.
        start: (epoch, step) to begin at; ``load_state_dict`` moves it later.  Default:
            (0, 0) for the default consumer, the oldest batch still in the buffer for
            a named one (it joins where the others are; where none waits, at the next batch
            the slowest live consumer of the job needs, else (0, 0)).

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
        self._timeout = check_timeout(timeout)
        if not seconds(daemon_grace) or not daemon_grace >= 0:
            raise ValueError(f"daemon_grace={daemon_grace!r}: pass a non-negative number of seconds")
        if stall_timeout is not None and (not seconds(stall_timeout) or not stall_timeout > 0):
            raise ValueError(f"stall_timeout={stall_timeout!r}: pass a positive number of seconds, or None to disable")
        if not isinstance(normalize, bool):  # "false" from a config file is true, and gave normalised floats
            raise ValueError(f"normalize={normalize!r}: pass True (float32, normalised) or False (raw uint8)")
        check_statistics(normalize, mean, std)
        start = _start_pair(start)
        self._consumer = check_consumer(consumer if consumer is not None else DEFAULT_CONSUMER)
        self._buffer = buffer_path(buffer)
        if isinstance(device, int) and not isinstance(device, bool) and not torch.cuda.is_available():
            # BufferLoader(buffer, 64): DataLoader's second argument is the batch size, ours the device.
            raise ValueError(f"device={device!r}: the second argument is the device (a CUDA index here), and CUDA is "
                             "not available; the batch size is the daemon's (`prefetchd start --batch-size`)")
        self._device = _device(device)
        if self._device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} but CUDA is not available here; pass device='cpu'")
        self._manifest = wait_for_manifest(self._buffer, self._timeout)
        self._job = JobWatch(self._buffer, self._manifest)
        self._normalized = (normalization(mean, std, self._manifest.channels, self._buffer, self._device)
                            if normalize else None)
        if self._device.type != "cuda" and pin not in ("auto", "none"):  # before the consumer is taken
            raise ValueError(
                f"pin={pin!r} needs a CUDA device, but device={str(device)!r}; pass pin='auto' or leave it out"
            )
        self._waiter = BatchWaiter(self._buffer, self._manifest, self._timeout, float(daemon_grace),
                                   float(stall_timeout) if stall_timeout is not None else None, self._consumer)
        try:
            self._at = Where(*self._start_position(start))
            self._progress = ProgressFile(self._buffer, self._consumer, self._manifest.job_key)
            if start is None and self._consumer == DEFAULT_CONSUMER:  # where it starts the job over, unasked
                self._left_at = self._mid_job_left_at()
        except BaseException:  # a loader that was never made holds no folder open (a mount it was refused on can go)
            self._waiter.close()
            raise
        self._waits = WaitMeter()
        self._generation = 0
        self._closed = False
        self._busy = threading.Lock()  # held while a batch is fetched: a second thread at it is refused
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
        # Resumed at the job's end: as load_state_dict; not mid-job, where the first batch read publishes.
        if start is not None and self._resumed_at_end():
            self._publish()
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
            return resume_position(loader_state(self._manifest, *start), self._manifest, self._buffer,
                                   f"start={start}")
        if self._consumer == DEFAULT_CONSUMER:
            return (0, 0)
        # Join where the others are: the oldest batch the daemon still holds, else (they read each batch as soon as
        # it is built) the next one the slowest of them needs.  Not (0, 0), which had the daemon build the job again
        # from its start for the newcomer (a walk: 9 of 37 joins beside a fast reader).
        waiting = list_batches(self._buffer, self._waiter.fd)
        if waiting:
            return min(waiting)
        return min(live_positions(self._buffer, self._manifest.job_key, self._waiter.fd, self._consumer),
                   default=(0, 0))

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

    @property
    def dataset(self) -> NoReturn:
        """None here: the daemon reads the dataset.  An AttributeError as before (``hasattr`` stays False), with a
        message for the code that asked: Accelerate's ``skip_first_batches``, kept from a DataLoader script, failed
        with "'BufferLoader' object has no attribute 'dataset'" from inside accelerate (a user's walk)."""
        raise AttributeError(
            f"a BufferLoader has no dataset: the daemon of {self._buffer} reads {self._manifest.dataset_root}. "
            "Code that asks for one expects a DataLoader: drop accelerator.skip_first_batches (load_state with "
            "register_for_checkpointing puts the loader at the checkpoint's batch), and a resume's skipping of "
            "batches (load_state_dict does it; docs/DROP_IN.md)")

    def __len__(self) -> int:
        return self._manifest.steps_per_epoch

    def __repr__(self) -> str:
        return (
            f"BufferLoader({str(self._buffer)!r}, device={str(self._device)!r}, normalize={self._normalized is not None}, "
            f"pin={self._pin!r}, position={self.position}, steps_per_epoch={len(self)}"
            + (", closed)" if self._closed else ")")
        )

    # -- lifecycle ---------------------------------------------------------------

    def __reduce__(self) -> Any:
        # A copy would hold the number of a folder descriptor and a lock of this process: in another one it
        # failed at its first batch with "cannot open batch file (Bad file descriptor); check the buffer's
        # permissions" (a walk of the API: pickle, copy.deepcopy, multiprocessing's spawn).
        raise TypeError(f"a BufferLoader cannot be pickled or copied (it holds {self._buffer} open and its "
                        "consumer's lock): make one in the process that reads, from the buffer's path")

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
        self._check_open()  # a second `with` of a closed loader entered, and failed at its first batch
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _device(device: DeviceLike) -> torch.device:
    """``device`` as torch names it; ValueError naming ``device=`` for what torch refuses in its own words ('gpu',
    None) and for a device no batch goes to ('meta' failed at the first batch)."""
    try:
        named = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is no device torch knows; pass 'cpu', 'cuda' or 'cuda:N'") from None
    if named.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: batches go to the CPU or a CUDA device; pass 'cpu', 'cuda' or 'cuda:N'")
    return named


def _start_pair(start: object) -> tuple[int, int] | None:
    """``start=`` as (epoch, step), numpy integers too; ValueError for anything else (an IndexError for (1,),
    and "loader state has epoch='0', step=','" for "0,0", before)."""
    if start is None:
        return None
    pair = tuple(start) if isinstance(start, (tuple, list)) else ()
    counts = [as_count(n) for n in pair]
    if len(counts) != 2 or None in counts:
        raise ValueError(f"start={start!r}: pass (epoch, step), two non-negative integers, such as "
                         "(loader.state_dict()['epoch'], loader.state_dict()['step'])")
    return counts[0], counts[1]  # type: ignore[return-value]


__all__ = ["Batch", "BufferLoader", "IMAGENET_MEAN", "IMAGENET_STD"]
