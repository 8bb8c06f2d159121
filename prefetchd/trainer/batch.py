"""What the trainer gets: a ``Batch`` (images, labels, and where they came from), and the
``WaitMeter`` behind the data-wait share a loader reports in its progress file."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False, repr=False)
class Batch:
    """One batch; unpacks as ``images, labels = batch`` like a DataLoader item."""

    images: torch.Tensor
    labels: torch.Tensor
    indices: torch.Tensor
    epoch: int
    step: int
    replaced: int = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield self.images
        yield self.labels

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> torch.Tensor:
        return (self.images, self.labels)[index]

    def __repr__(self) -> str:
        im = self.images
        return (
            f"Batch(epoch={self.epoch}, step={self.step}, images={list(im.shape)} {im.dtype} {im.device}, "
            f"labels={list(self.labels.shape)}, replaced={self.replaced})"
        )



class WaitMeter:
    """Share of the last ``window`` seconds the consumer spent inside ``next()``.

    The spans' total is kept as they come and go, so ``share()`` (called at every progress
    write, so once a batch) costs the few spans at the window's edge, not a pass over every
    span in it: thousands at 100 batches a second.

    A wait still going on (``begin`` without its ``add`` yet) counts up to now: the loader
    rewrites its progress file while it waits, and a trainer stuck on a batch through a
    storage outage must read as waiting (near 100 % and rising), not as fed until the batch
    comes.  ``add`` ends it, and from then on it is one of the spans, counted once."""

    def __init__(self, window: float = 30.0) -> None:
        self.window = window
        self._spans: deque[tuple[float, float]] = deque()
        self._total = 0.0  # seconds in self._spans
        self._waiting_since: float | None = None  # the wait going on, not yet a span

    def begin(self, start: float) -> None:
        """A wait began at ``start``: ``share()`` counts it as it goes, until ``add`` ends it."""
        self._waiting_since = start

    def add(self, start: float, end: float) -> None:
        self._waiting_since = None
        self._spans.append((start, end))
        self._total += end - start
        while self._spans and self._spans[0][1] < end - self.window:
            old_start, old_end = self._spans.popleft()
            self._total -= old_end - old_start

    def share(self) -> float | None:
        """None until two waits have begun (one tells nothing about the trainer's pace)."""
        current = self._waiting_since
        if len(self._spans) + (current is not None) < 2:
            return None
        now = time.monotonic()
        lo = max(self._spans[0][0], now - self.window)  # two waits: at least one has ended
        waited = self._total
        for start, end in self._spans:  # in time order: only the first few begin before lo
            if start >= lo:
                break
            waited -= min(end, lo) - start
        if current is not None:
            waited += now - max(current, lo)
        return min(1.0, max(0.0, waited) / max(now - lo, 1e-9))


__all__ = ["Batch", "WaitMeter"]
