"""One rank's stream of batches: the windows the daemon keeps and the batches being built.

Batches are numbered by a global position ``g = epoch * steps_per_epoch + step``.
The trainer's progress ``p`` (the next batch it needs) is the truth: the daemon
keeps exactly the window ``[p, p + high_water)`` — everything before it is
consumed and deleted, everything after it (left by a trainer that rewound) is
deleted too, and missing batches inside it are built in order.  Flow control
has hysteresis: production stops when the window is full and resumes only when
the waiting batches fall to the low-water mark, so the workers run in bursts
rather than one batch at a time.

Several consumers (trainers, each with its own progress file: ``consumers.py``)
may read one stream.  Then the stream keeps the union of the holding consumers'
windows, each planned by ``plan_windows`` within the cap, and a batch is deleted
only when no window holds it.  With one consumer that union is its window.

With several ranks the daemon keeps one ``Stream`` per local rank, each in its
own directory with its own progress and window.  This module only keeps the
books; the controller (``producer.py``) creates, deletes and publishes files.

A ``Stream`` is its folder, its position arithmetic and its builds here, and three
parts, each a module: the reading of its consumers' progress files, newcomers
joining under the cap (``stream_progress.py``); the windows and the hysteresis
that fills them (``stream_windows.py``); the batches an earlier daemon of the
same job left (``stream_adoption.py``).
"""

from __future__ import annotations

import logging
import os
import stat
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prefetchd.buffer_protocol import (
    DEFAULT_CONSUMER,
    BatchLayout,
    Manifest,
    PendingBatch,
    list_batches,
)
from prefetchd.buffer_protocol.layout import DIR_FLAGS, MAX_EPOCH
from prefetchd.buffer_protocol.status import Position, StreamStatus
from prefetchd.daemon.consumers import MAX_PROGRESS_READS, Consumer, Newcomer
from prefetchd.daemon.sampler import EpochOrders
from prefetchd.daemon.stream_adoption import StreamAdoption
from prefetchd.daemon.stream_progress import IGNORED_SAID_SECONDS, StreamProgress
from prefetchd.daemon.stream_windows import StreamWindows
from prefetchd.throttle import Throttle

log = logging.getLogger(__name__)

# Consumers a stream takes, the default one included (a sweep on one box is a few to tens of trainers), and over
# all the streams of a daemon.  Any member of a --group-access buffer's group may write progress files, and a
# stream took every one: 20,000 planted progress.NAME.json made each poll take seconds, logged 20,000 warnings
# and made status.json megabytes, past the MAX_DOCUMENT_LEN (1 MiB) its readers take, so every trainer read the
# daemon as gone.  A consumer is a status.json row of ~350 bytes at most (32-character name, every number at its
# widest), 1024 of them ~365 KiB; the status of 256 ranks (MAX_LOCAL_RANKS) with 4 such consumers each, every
# one's document refused as well (progress_file), measured 614 KiB: within the 1 MiB, with room for a longer
# buffer path.  So 64 per stream for up to 16 ranks, 4 per stream at 256.
MAX_CONSUMERS = 64
MAX_DAEMON_CONSUMERS = 1024


def consumer_cap(streams: int) -> int:
    """Consumers each of a daemon's ``streams`` takes."""
    return max(1, min(MAX_CONSUMERS, MAX_DAEMON_CONSUMERS // max(1, streams)))


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
    failed: bool = False  # a task of it could not write (counted once: errors.write_failures)

    @property
    def tmp(self) -> Path:
        return self.pending.tmp

    @property
    def layout(self) -> BatchLayout:
        return self.pending.layout



class Stream(StreamProgress, StreamWindows, StreamAdoption):
    """One rank's stream: its directory, its consumers' progress and the windows of batches kept.

    ``orders``: the global epoch orders of the job's members and whether they are shuffled, shared by the streams
    of one daemon;
    ``high``: batches kept ahead of each consumer; ``low``: the hysteresis' low-water mark;
    ``cap``: batches waiting and being built (cancelled builds too, until their files go), all
    consumers together (default ``high``);
    ``consumer_timeout``: seconds without a progress write after which a consumer is silent;
    ``max_consumers``: consumers it takes, the default one included (``consumer_cap``); the progress files of
    any more are left alone.  A poll reads at most MAX_PROGRESS_READS progress files at that cap, fewer in
    proportion below it (``read_progress``).
    """

    def __init__(self, directory: Path, manifest: Manifest, orders: EpochOrders, high: int, low: int,
                 cap: int | None = None, consumer_timeout: float = 300.0, dir_fd: int | None = None,
                 max_consumers: int = MAX_CONSUMERS) -> None:
        self.dir = directory  # what messages show; files are created, renamed and deleted through ``fd``
        # The folder the daemon made (or checked), held open: a group member can rename entries of a --group-access
        # buffer and put a link to another folder of the daemon's user under this name, and a path looked up again
        # would lead there.  ``replaced`` tells when the name no longer leads to it (the daemon then stops).
        # ``dir_fd``: the folder's fd, opened by whoever made it (now the stream's to close); else it is opened here.
        self.fd = dir_fd if dir_fd is not None else os.open(directory, DIR_FLAGS)
        self._closer = weakref.finalize(self, os.close, self.fd)  # a Stream dropped unclosed (a test's) leaks no fd
        st = os.fstat(self.fd)
        self.identity = (st.st_dev, st.st_ino)
        self.manifest = manifest
        self.orders = orders
        self.high, self.low = high, low
        self.cap = max(1, cap if cap is not None else high)
        self.consumer_timeout = consumer_timeout
        self.started = time.time()  # progress written before it was for an earlier daemon (check_trainer)
        self.steps = manifest.steps_per_epoch
        self.end = manifest.epochs * self.steps if manifest.epochs is not None else None
        # Where windows stop: the job's end, or for a job without one the first position a batch name cannot hold.
        self.limit = self.end if self.end is not None else (MAX_EPOCH + 1) * self.steps
        self.published: dict[int, Path] = {}
        self.building: dict[int, Build] = {}
        # The default consumer is there from the start, at 0, as the single trainer always was:
        # its window is what a daemon builds before any trainer has written progress.
        self.consumers: dict[str, Consumer] = {DEFAULT_CONSUMER: Consumer(DEFAULT_CONSUMER)}
        self.forgotten = Consumer("")  # the counts of consumers forgotten: the totals must not go back
        self.max_consumers = max(1, max_consumers)
        self.max_reads = max(self.max_consumers, MAX_PROGRESS_READS * self.max_consumers // MAX_CONSUMERS)
        self.ignored = 0  # progress files of consumers past the cap, at the last read
        self._ignored_said: float | None = None  # time.monotonic() they were last said
        self.newcomers: dict[str, Newcomer] = {}  # the progress files of consumers not taken (``_join``)
        self._listed: dict[str, int] = {}  # the listing they are of
        self._refusals = 0  # counted in progress_rejected
        self._refused_latest = ""  # the problem of the latest one
        self._refused_lines = Throttle(IGNORED_SAID_SECONDS)
        self.holders: list[Consumer] = []  # slowest first
        self.held: set[int] = set()
        self._starved: set[str] = set()  # holding consumers whose window the cap shrank to nothing
        self._starved_said: dict[str, float] = {}  # time.monotonic() each was last said to wait
        self.filling = True
        # Counted for status.json, so that tools and tests see what the log says without parsing it.
        self.vanished_batches = 0  # published batches whose files someone else removed
        self._adopted: set[int] = set()  # the positions of the batches an earlier run left, until said
        self._orders: dict[int, np.ndarray] = {}  # this rank's share of recent epochs: 1/world_size of each
        self.plan()

    @property
    def rank(self) -> int:
        return self.manifest.rank

    def holds(self, name: str) -> bool:
        """Whether the stream's folder has an entry ``name`` (looked up through its fd)."""
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def close(self) -> None:
        """Close the folder's fd (once its builds and spares are gone: they are named through it)."""
        self._closer()
        self.fd = -1

    def key(self, g: int) -> tuple[int, int]:
        return divmod(g, self.steps)

    def g(self, key: tuple[int, int]) -> int:
        return key[0] * self.steps + key[1]

    @property
    def active(self) -> int:
        return sum(not b.cancelled for b in self.building.values())

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) > 4:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = self.orders.rank_order(self.manifest.seed, epoch, self.manifest.rank,
                                                         self.manifest.world_size)
        return self._orders[epoch]

    def replaced(self) -> str | None:
        """Why the stream's folder is no longer the one the daemon made (gone, a link, another folder), or None."""
        try:
            st = os.lstat(self.dir)
        except OSError as exc:
            return f"stream folder {self.dir} of rank {self.rank} is gone ({exc.strerror})"
        if (st.st_dev, st.st_ino) == self.identity and not stat.S_ISLNK(st.st_mode) and st.st_uid == os.geteuid():
            return None
        what = f"a link to {os.readlink(self.dir)}" if stat.S_ISLNK(st.st_mode) else "another folder"
        return (f"stream folder {self.dir} of rank {self.rank} was replaced by {what}: a member of the buffer's group "
                "(who may rename its entries) moved it away")

    def reconcile(self) -> list[int]:
        """Forget published batches whose files are gone, so that they are built again.

        Only this daemon deletes batches, but a person, a cleanup job or a trainer that found a
        batch damaged (the ProtocolError says to delete it) may too; without a look at the
        directory the daemon would count the batch as waiting for ever and the trainer would
        wait for it until its timeout.  One scandir of at most ``cap`` files per poll.
        """
        if not self.published:
            return []
        present = list_batches(self.dir, self.fd)
        lost = [g for g in self.published if self.key(g) not in present]
        for g in lost:
            path = self.published.pop(g)
            log.warning("batch %s of rank %d vanished from %s; building it again", path.name, self.rank, self.dir)
        self.vanished_batches += len(lost)
        return lost

    def outside_window(self) -> tuple[list[int], list[Build]]:
        """Published positions and live builds no window holds."""
        stale = [g for g in self.published if g not in self.held]
        builds = [b for b in self.building.values() if b.g not in self.held and not b.cancelled]
        return stale, builds

    def status(self) -> StreamStatus:
        now = time.time()
        lead = self.lead
        epoch, step = self.key(lead.position)
        holding = set(map(id, self.holders))
        consumers = tuple(c.status(*self.key(c.position), now, id(c) in holding)
                          for c in sorted(self.consumers.values(), key=lambda c: c.name) if c.seen)
        return StreamStatus(
            rank=self.rank,
            trainer=lead.trainer_status(now),
            progress=Position(epoch, step, lead.wait_share),
            waiting=len(self.published),
            building=self.active,
            progress_file=self.progress_error,
            vanished_batches=self.vanished_batches,
            progress_rejected=self.progress_rejected,
            progress_rewinds=self.progress_rewinds,
            consumers=consumers,
        )
