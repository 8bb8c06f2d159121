"""The loader's batches on their way to a CUDA device: copies started ahead, and those handed out whose copy may
still be running.

``prefetchd.trainer.gpu`` copies a mapped batch to the device (a pinned staging ring or a page-locked mapping, a
side stream).  This keeps the loader's side of it: the next ``prefetch`` batches whose files are already there
are started while the consumer works on the one handed out (double buffering), and a batch handed out counts as
consumed only once its copy has completed, so progress.json may trail the loader's position by a batch the copy
engine still reads (``consumed_until``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from prefetchd.buffer_protocol import Manifest, MappedBatch, ProtocolError
from prefetchd.trainer.batch import Batch
from prefetchd.trainer.gpu import DeviceFeeder, Transfer

Key = tuple[int, int]  # a batch's (epoch, step)


class DevicePath:
    """The copies of one loader's ``feeder``: at most ``prefetch`` started ahead of the position handed out."""

    def __init__(self, feeder: DeviceFeeder, prefetch: int, manifest: Manifest) -> None:
        self.feeder = feeder
        self.prefetch = prefetch
        self.manifest = manifest
        self.ahead: deque[Transfer] = deque()  # started, not yet handed out: consecutive positions
        self.handed: deque[Transfer] = deque()  # handed out, copy not yet known to be complete

    def next(self, key: Key, wait: Callable[[int, int], MappedBatch], peek: Callable[[int, int], MappedBatch]) -> Batch:
        """Batch ``key`` on the device: its copy started ahead, or the batch ``wait`` returns (checked).  Then the
        copies of the next batches whose files ``peek`` maps (checked; FileNotFoundError where not there yet)."""
        transfer = self._take_ahead(key)
        if transfer is None:
            transfer = self.feeder.start(wait(*key), key)
        images, labels = self.feeder.hand_out(transfer)
        self.handed.append(transfer)
        # Double buffering: the next batch's copy overlaps the consumer's work on this one.
        self._fill_ahead(key, peek)
        return Batch(
            images=images, labels=labels, indices=transfer.indices, epoch=key[0], step=key[1],
            replaced=transfer.replaced,
        )

    def _take_ahead(self, key: Key) -> Transfer | None:
        if self.ahead and self.ahead[0].key == key:
            return self.ahead.popleft()
        self._drain(self.ahead)  # started for positions the consumer no longer asks for
        return None

    def _fill_ahead(self, key: Key, peek: Callable[[int, int], MappedBatch]) -> None:
        """Start the copies of the next ``prefetch`` batches whose files are already there."""
        last = self.ahead[-1].key if self.ahead else key
        while len(self.ahead) < self.prefetch:
            epoch, step = last[0], last[1] + 1
            if step >= self.manifest.steps_per_epoch:
                epoch, step = epoch + 1, 0
            epochs = self.manifest.epochs
            if epochs is not None and epoch >= epochs:
                return
            try:
                mapped = peek(epoch, step)
            except (FileNotFoundError, ProtocolError, ValueError):
                # Not produced yet, or broken: its own turn waits for it or reports it.
                return
            self.ahead.append(self.feeder.start(mapped, (epoch, step)))
            last = (epoch, step)

    def consumed_until(self, position: Key) -> Key:
        """The position progress.json may name, the loader at ``position``: handed-out batches still being copied
        are not consumed."""
        while self.handed and self.feeder.finish(self.handed[0], wait=False):
            self.handed.popleft()
        return min(position, self.handed[0].key) if self.handed else position

    def drain(self) -> None:
        """Wait for every copy started, ahead and handed out: the loader moves elsewhere, or closes."""
        self._drain(self.ahead)
        self._drain(self.handed)

    def _drain(self, transfers: deque[Transfer]) -> None:
        while transfers:
            self.feeder.finish(transfers.popleft(), wait=True)


__all__ = ["DevicePath"]
