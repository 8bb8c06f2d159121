"""One rank's stream of batches: the window the daemon keeps and the batches being built.

Batches are numbered by a global position ``g = epoch * steps_per_epoch + step``.
The trainer's progress ``p`` (the next batch it needs) is the truth: the daemon
keeps exactly the window ``[p, p + high_water)`` — everything before it is
consumed and deleted, everything after it (left by a trainer that rewound) is
deleted too, and missing batches inside it are built in order.  Flow control
has hysteresis: production stops when the window is full and resumes only when
the waiting batches fall to the low-water mark, so the workers run in bursts
rather than one batch at a time.

With several ranks the daemon keeps one ``Stream`` per local rank, each in its
own directory with its own progress and window.  This module only keeps the
books; the controller (``producer.py``) creates, deletes and publishes files.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from prefetchd.buffer_protocol import (
    BatchLayout,
    Manifest,
    PendingBatch,
    Progress,
    ProtocolError,
    alive_since,
    list_batches,
)
from prefetchd.buffer_protocol.status import Position, StreamStatus, TrainerStatus
from prefetchd.daemon.sampler import epoch_order

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Build:
    """A batch under construction in its temp file."""

    stream: Stream
    g: int
    epoch: int
    step: int
    pending: PendingBatch
    labels: np.ndarray
    indices: np.ndarray
    remaining: int
    outstanding: set[int] = field(default_factory=set)  # task ids sent or queued
    replaced: int = 0
    cancelled: bool = False

    @property
    def tmp(self) -> Path:
        return self.pending.tmp

    @property
    def layout(self) -> BatchLayout:
        return self.pending.layout



class Stream:
    """One rank's stream: its directory, the trainer's progress and the window of batches kept."""

    def __init__(self, directory: Path, manifest: Manifest, members: np.ndarray, shuffle: bool, high: int, low: int) -> None:
        self.dir = directory
        self.manifest = manifest
        self.members = members
        self.shuffle = shuffle
        self.high, self.low = high, low
        self.steps = manifest.steps_per_epoch
        self.end = manifest.epochs * self.steps if manifest.epochs is not None else None
        self.published: dict[int, Path] = {}
        self.building: dict[int, Build] = {}
        self.progress = 0
        self.filling = True
        self.consumed = 0
        self.progress_error = ""
        # Counted for status.json, so that tools and tests see what the log says without parsing it.
        self.vanished_batches = 0  # published batches whose files someone else removed
        self.progress_rejected = 0  # distinct problems with progress.json, each ignored
        self.progress_rewinds = 0  # times the trainer's position moved back
        self.trainer_wait_share: float | None = None
        # Who wrote progress.json last and when (None: nobody yet, or a writer without pid/time).
        self.trainer_pid: int | None = None
        self.progress_time: float | None = None
        self.trainer_alive: bool | None = None
        self._orders: dict[int, np.ndarray] = {}

    @property
    def rank(self) -> int:
        return self.manifest.rank

    def key(self, g: int) -> tuple[int, int]:
        return divmod(g, self.steps)

    def g(self, key: tuple[int, int]) -> int:
        return key[0] * self.steps + key[1]

    @property
    def finished(self) -> bool:
        return self.end is not None and self.progress >= self.end

    @property
    def produced_all(self) -> bool:
        """Every batch of the last epoch is published or being built."""
        if self.end is None or self.end - self.progress > self.high:
            return False
        return all(g in self.published or g in self.building for g in range(self.progress, self.end))

    @property
    def active(self) -> int:
        return sum(not b.cancelled for b in self.building.values())

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) > 4:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = epoch_order(
                self.members, self.manifest.seed, epoch, shuffle=self.shuffle,
                rank=self.manifest.rank, world_size=self.manifest.world_size,
            )
        return self._orders[epoch]

    def adopt_published(self) -> None:
        self.published = {self.g(k): p for k, p in list_batches(self.dir).items()}
        if self.published:
            log.info("kept %d finished batches of rank %d from an earlier run of the same job", len(self.published), self.rank)

    def reconcile(self) -> list[int]:
        """Forget published batches whose files are gone, so that they are built again.

        Only this daemon deletes batches, but a person, a cleanup job or a trainer that found a
        batch damaged (the ProtocolError says to delete it) may too; without a look at the
        directory the daemon would count the batch as waiting for ever and the trainer would
        wait for it until its timeout.  One scandir of at most ``high`` files per poll.
        """
        if not self.published:
            return []
        present = list_batches(self.dir)
        lost = [g for g in self.published if self.key(g) not in present]
        for g in lost:
            path = self.published.pop(g)
            log.warning("batch %s of rank %d vanished from %s; building it again", path.name, self.rank, self.dir)
        self.vanished_batches += len(lost)
        return lost

    def read_progress(self) -> bool:
        """Take the trainer's progress; True when it moved."""
        try:
            progress = Progress.read(self.dir)
        except ProtocolError as exc:
            self._progress_problem(str(exc))
            return False
        if progress is None:
            return False
        if progress.step >= self.steps:
            self._progress_problem(f"step {progress.step} is past the {self.steps} steps of an epoch")
            return False
        self.progress_error = ""
        self.trainer_wait_share = progress.wait_share
        self.trainer_pid, self.progress_time = progress.pid, progress.time
        g = self.g((progress.epoch, progress.step))
        if self.end is not None:
            g = min(g, self.end)
        if g == self.progress:
            return False
        if g < self.progress:
            self.progress_rewinds += 1
            log.info("rank %d's trainer moved back from %s to %s; regenerating from there",
                     self.rank, self.key(self.progress), self.key(g))
        else:
            self.consumed += g - self.progress
        self.progress = g
        return True

    def _progress_problem(self, problem: str) -> None:
        if problem != self.progress_error:
            log.warning("ignoring %s: %s", self.dir / "progress.json", problem)
            self.progress_error = problem
            self.progress_rejected += 1

    def outside_window(self) -> tuple[list[int], list[Build]]:
        """Published positions and live builds outside [progress, progress + high)."""
        lo, hi = self.progress, self.progress + self.high
        stale = [g for g in self.published if not lo <= g < hi]
        builds = [b for b in self.building.values() if not lo <= b.g < hi and not b.cancelled]
        return stale, builds

    def next_missing(self) -> int | None:
        """The first position of the window that is neither published nor being built, if the
        hysteresis lets production run; None when there is nothing to build now."""
        if self.filling and len(self.published) + self.active >= self.high:
            self.filling = False
        if not self.filling and (len(self.published) <= self.low or self._trainer_blocked()):
            self.filling = True
        if not self.filling:
            return None
        hi = self.progress + self.high
        if self.end is not None:
            hi = min(hi, self.end)
        g = self.progress
        while g < hi and (g in self.published or g in self.building):
            g += 1
        return g if g < hi else None

    def _trainer_blocked(self) -> bool:
        """The batch the trainer needs next is neither published nor being built: after a rewind,
        or a waiting batch lost, the batches further on do not help it, however many there are."""
        g = self.progress
        return (self.end is None or g < self.end) and g not in self.published and g not in self.building

    def check_trainer(self) -> None:
        """Whether the process that wrote progress.json is still there; logs when it goes and comes back.

        A trainer that is gone leaves the window full: the daemon holds the buffer at
        the high-water mark and sleeps until progress.json moves again.
        """
        if self.finished:
            return  # a trainer that consumed every epoch is done, not gone: it exits, as it should
        pid, since = self.trainer_pid, self.progress_time
        alive = alive_since(pid, since) if pid is not None and since is not None else None
        if alive is None or alive == self.trainer_alive:
            return
        epoch, step = self.key(self.progress)
        if not alive:
            log.warning(
                "rank %d's trainer (pid %d) has gone away; progress last moved %.0f s ago, at epoch %d step %d. "
                "Keeping the buffer at the high-water mark (%d batches) for when a trainer comes back",
                self.rank, pid, time.time() - (since or 0.0), epoch, step, self.high,
            )
        elif self.trainer_alive is False:
            log.info("rank %d's trainer is back (pid %d) at epoch %d step %d", self.rank, pid, epoch, step)
        self.trainer_alive = alive

    def trainer_status(self) -> TrainerStatus:
        since = self.progress_time
        age = round(max(0.0, time.time() - since), 1) if since is not None else None
        return TrainerStatus(pid=self.trainer_pid, alive=self.trainer_alive, progress_age_s=age)

    def status(self) -> StreamStatus:
        epoch, step = self.key(self.progress)
        return StreamStatus(
            rank=self.rank,
            trainer=self.trainer_status(),
            progress=Position(epoch, step, self.trainer_wait_share),
            waiting=len(self.published),
            building=self.active,
            progress_file=self.progress_error,
            vanished_batches=self.vanished_batches,
            progress_rejected=self.progress_rejected,
            progress_rewinds=self.progress_rewinds,
        )
