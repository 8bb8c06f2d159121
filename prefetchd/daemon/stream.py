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
"""

from __future__ import annotations

import contextlib
import heapq
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
    Progress,
    ProtocolError,
    list_batches,
    map_batch,
    not_of_stream,
    progress_name,
)
from prefetchd.buffer_protocol.layout import DIR_FLAGS, MAX_EPOCH, consumer_files
from prefetchd.buffer_protocol.status import Position, StreamStatus
from prefetchd.daemon.consumers import (MAX_PROGRESS_READS, Consumer, Newcomer, Unreadable, plan_windows,
                                       progress_stats, unreadable)
from prefetchd.daemon.sampler import EpochOrders
from prefetchd.throttle import Throttle
from prefetchd.words import counted

log = logging.getLogger(__name__)

STARVED_SAID_SECONDS = 60.0  # a consumer is said to wait for room under the cap at most this often

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
# The progress files left out for the cap, and those refused before their consumers were taken, are each said
# at most this often per stream.
IGNORED_SAID_SECONDS = 300.0
# A progress file the daemon may not read (an older trainer's, 0600) is read again this often: its owner's chmod, which
# the log advises, gives it no new inode.  Each such look (an open refused, two stats, the owners' names for the
# message) took 0.16 ms (2-core EPYC, tmpfs): 256 such files, the most a poll reads, 40 ms every 10 s.
UNREADABLE_RETRY_SECONDS = 10.0


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
    hangs: dict[int, list[str]] = field(default_factory=dict)  # by task id: the file of each hang of that task

    @property
    def tmp(self) -> Path:
        return self.pending.tmp

    @property
    def layout(self) -> BatchLayout:
        return self.pending.layout



class Stream:
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

    # -- where the consumers are ------------------------------------------------

    @property
    def lead(self) -> Consumer:
        """The consumer status.json's ``progress`` and ``trainer`` describe: the slowest holding
        one, else the default one (the only one a single trainer has)."""
        return self.holders[0] if self.holders else self.consumers.get(DEFAULT_CONSUMER) or next(iter(self.consumers.values()))

    @property
    def progress(self) -> int:
        return self.lead.position

    @property
    def consumed(self) -> int:
        return sum(c.consumed for c in self._counted())

    @property
    def progress_rewinds(self) -> int:
        return sum(c.rewinds for c in self._counted())

    @property
    def progress_rejected(self) -> int:
        return sum(c.rejected for c in self._counted()) + self._refusals

    def _counted(self) -> list[Consumer]:
        return [*self.consumers.values(), self.forgotten]

    @property
    def progress_error(self) -> str:
        """Why progress files are ignored: the first consumer's problem (status.json carries it, for each rank,
        twice: its size stays bounded however many consumers have one; each is in the log), how many others
        have one, the files refused before a consumer was taken for them, and the files left out for the cap."""
        problems = [c.error for c in self.consumers.values() if c.error]
        said = problems[:1]
        if len(problems) > 1:
            said.append(f"and {counted(len(problems) - 1, 'other consumer')} of rank {self.rank} (see the log)")
        refused = self.refused
        if refused:
            latest = f" (the latest: {self._refused_latest})" if not problems else " (see the log)"
            said.append(f"{counted(refused, 'progress file')} in {self.dir} refused, so no consumer is taken for "
                        f"them{latest}")
        if self.ignored:
            said.append(self._ignored_text())
        return "; ".join(said)

    def _ignored_text(self) -> str:
        return (f"{counted(self.ignored, 'progress file')} in {self.dir} ignored: a stream of this daemon takes "
                f"{counted(self.max_consumers, 'consumer')} at most, the default one included")

    @property
    def refused(self) -> int:
        """Progress files refused before a consumer was taken for them, as the last poll listed them."""
        return sum(n.refused for n in self.newcomers.values())

    @property
    def finished(self) -> bool:
        """Every consumer that may still come is at the end, and one got there: closed ones left,
        and silent ones (past the consumer timeout) are not waited for."""
        if self.end is None:
            return False
        now = time.time()
        seen = [c for c in self.consumers.values() if c.seen] or [self.consumers[DEFAULT_CONSUMER]]
        expected = [c for c in seen if not c.closed and c.silent_for(now) <= self.consumer_timeout]
        return any(c.position >= self.end for c in seen) and all(c.position >= self.end for c in expected)

    @property
    def produced_all(self) -> bool:
        """Every batch up to the end of the last epoch that a window holds is published: the status says
        "done" only then, not while a trainer may still wait for the last one being built."""
        if self.end is None:
            return False
        if any(c.position + c.window < self.end for c in self.holders):
            return False
        return all(g in self.published for g in self.held)

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

    def adopt_published(self) -> None:
        """Keep the finished batches an earlier daemon of the same job left, but those with replaced
        samples: built while a file could not be read, and a file since mended (the fix a log line
        asks for) would make them differ from the batches built now.  Built again, each is what the
        data gives today.  Headers that do not parse go too, and batches that are not this stream's at
        their name's position (``not_of_stream``): a daemon before batches named their stream wrote none
        that are (this daemon's manifest says its batches do, and its trainers refuse one that does not), and
        a member of a --group-access buffer's group may rename another rank's batch, or one kept from an
        earlier job, to a name here while no daemon runs.  Each is read through the folder's fd, as
        everything else in it: a member may put a link to another folder in its place, and that folder's
        files would decide which batches stay."""
        redo = older = 0
        manifest = self.manifest
        for key, path in list_batches(self.dir, self.fd).items():
            try:
                meta = map_batch(path, self.fd).meta
            except (ProtocolError, FileNotFoundError):
                meta = None
            if meta is None or meta.replaced:
                redo += 1
            elif meta.job is None and meta.rank is None:
                older += 1
            elif (meta.epoch, meta.step) != key or not_of_stream(meta, manifest.job_key, manifest.rank, keyed=True):
                log.warning("%s holds epoch %d step %d of %s, where its name says epoch %d step %d of rank %d of job "
                            "%s: someone who may rename the buffer's files (a member of its group?) put it there; "
                            "building it again", path, meta.epoch, meta.step, meta.stream, *key, manifest.rank,
                            manifest.job_key)
            else:
                self.published[self.g(key)] = path
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path.name, dir_fd=self.fd)
        self._adopted = set(self.published)  # said by ``say_adopted`` once the windows decide which stay
        if redo:
            log.info("building %s of rank %d again: %s replaced samples or could not be read",
                     counted(redo, "kept batch"), self.rank, "it had" if redo == 1 else "they had")
        if older:
            log.info("building %s of rank %d again: written by a prefetchd before batches named their job and rank",
                     counted(older, "kept batch"), self.rank)

    def say_adopted(self) -> None:
        """Log how many adopted batches stay, once the controller deleted those no window holds: a
        restart with a lower --high-water than the earlier run's keeps fewer than it found."""
        if not self._adopted:
            return
        kept = len(self._adopted & self.published.keys())
        dropped = [g for g in self._adopted if g not in self.published]
        first = min((c.position for c in self.holders), default=self.limit)
        consumed = sum(g < first for g in dropped)
        why = []
        if len(dropped) > consumed:
            capped = self.cap < self.high * len(self.holders)  # --max-buffer-bytes shrank the windows
            why.append(f"{len(dropped) - consumed} beyond --high-water {self.high}"
                       + (f" and the --max-buffer-bytes cap of {counted(self.cap, 'batch')}" if capped else ""))
        if consumed:
            why.append(f"{consumed} already consumed")
        log.info("kept %s of rank %d from an earlier run of the same job%s", counted(kept, "finished batch"),
                 self.rank, f" (deleted {', '.join(why)})" if why else "")
        self._adopted = set()

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

    def read_progress(self) -> bool:
        """Take every consumer's progress and plan the windows again; True when a position moved.

        The consumers taken are read at each poll, then new ones join while there is room under
        ``max_consumers`` (``_join``); one already taken is never dropped for a newcomer.  A poll reads at
        most ``max_reads`` progress files."""
        moved = False
        present = consumer_files(self.dir, self.fd)
        self._forget(set(self.consumers) - present.keys() - {DEFAULT_CONSUMER})
        taken = [self.consumers[name] for name in present if name in self.consumers]
        for consumer in taken:
            moved |= self._read_consumer(consumer)
        moved |= self._join(present, self.max_reads - len(taken))
        self.check_trainer()
        self.plan()
        return moved

    def _join(self, present: dict[str, int], reads: int) -> bool:
        """Read the progress files of consumers not taken yet (of ``present``, the consumers listed with their
        files' inode numbers), at most ``reads`` of them, and take the consumers of those that give a position,
        in the order of their names, while there is room under ``max_consumers``; when more are to be read
        than ``reads``, those written last.  True when a consumer joined.

        Any member of a --group-access buffer's group may put files there under progress names: one that
        gives no position (no progress document, a link, one of another job) takes no consumer's place,
        or a member's junk put there first shut a trainer out until it was removed.  It is said in a
        throttled line, counted once, and not read again until it is replaced (a new inode number, as a
        writer's rename gives): each poll read every such file otherwise, 1.1 s for 20,000.  When the
        stream is full, the files of the rest are not read (``_ignore``)."""
        book = self.newcomers
        if present != self._listed:  # else each is the file it was: 20,000 planted, a poll took 34 ms, not 45
            book = self.newcomers = {name: book[name].listed(ino) if name in book else Newcomer(ino)
                                     for name, ino in present.items() if name not in self.consumers}
            self._listed = present
        now = time.monotonic()
        unread = [name for name, seen in book.items() if seen.to_read(now)]
        room = self.max_consumers - len(self.consumers)
        order = unread
        if room > 0 and len(unread) > reads:
            # A stat of each, once (a rewrite renames another file in): 20,000 took 95 ms.
            unseen = {name for name in unread if book[name].mtime_ns is None}
            if unseen:
                for name, st in progress_stats(self.dir, self.fd, unseen).items():
                    book[name].mtime_ns = st.st_mtime_ns
            chosen = set(heapq.nlargest(max(0, reads), unread, key=lambda name: book[name].mtime_ns or 0))
            order = [name for name in unread if name in chosen]
        joined, read = False, set()
        for name in order:
            if room <= 0:
                break
            read.add(name)
            got = self._read(name)
            if isinstance(got, Progress):
                del book[name]
                self._listed = {}  # the listing no longer says which are newcomers
                consumer = self.consumers[name] = Consumer(name)
                room -= 1
                joined |= self._take(consumer, got)
            elif got is not None:
                self._refuse(name, book[name], got)
        self._ignore([name for name in unread if name not in read] if room <= 0 else [])
        return joined

    def _refuse(self, name: str, seen: Newcomer, problem: str) -> None:
        """The progress file of ``name``, whose consumer is not taken, was read and refused for ``problem``."""
        seen.refused = True
        seen.retry_at = time.monotonic() + UNREADABLE_RETRY_SECONDS if isinstance(problem, Unreadable) else None
        if seen.problem == hash(problem):
            return  # rewritten with the same problem (a trainer of the job this one replaced, say): said already
        seen.problem = hash(problem)
        self._refusals += 1
        self._refused_latest = problem
        self._refused_lines.log(log, logging.WARNING, "ignoring %s: %s", self.dir / progress_name(name), problem,
                                others="other refused progress file", scope=f" in {self.dir}")

    def _forget(self, names: set[str]) -> None:
        for name in sorted(names):
            # Its file removed (by hand: a sweep member that will not come back): it holds nothing and is no
            # longer listed; it went on holding its window, pinning where newcomers join, and the status grew.
            log.info("%s of rank %d is forgotten: its progress file was removed", self.consumers[name].label, self.rank)
            gone = self.consumers.pop(name)
            self.forgotten.consumed += gone.consumed
            self.forgotten.rewinds += gone.rewinds
            self.forgotten.rejected += gone.rejected

    def _ignore(self, names: list[str]) -> None:
        """Leave out the progress files of ``names``, past the cap: said in one line (at most every
        IGNORED_SAID_SECONDS while there are some) and in the status's progress_file."""
        self.ignored = len(names)
        now = time.monotonic()
        # By time alone: files planted and removed by turns would be said at every poll.
        if not names or self._ignored_said is not None and now - self._ignored_said < IGNORED_SAID_SECONDS:
            return
        self._ignored_said = now
        example = ", ".join(progress_name(name) for name in names[:2]) + (", ..." if len(names) > 2 else "")
        log.warning("ignoring %s in %s (%s): a stream of this daemon takes %s at most, the default one included, "
                    "and no batches are kept for their trainers. Remove the progress files of consumers that will "
                    "not come back (they are forgotten and the next ones join), or give the others a buffer of "
                    "their own", counted(len(names), "progress file"), self.dir, example,
                    counted(self.max_consumers, "consumer"))

    def _read_consumer(self, consumer: Consumer) -> bool:
        got = self._read(consumer.name)
        if isinstance(got, str):
            self._progress_problem(consumer, got)
            return False
        return got is not None and self._take(consumer, got)

    def _read(self, name: str) -> Progress | str | None:
        """The progress document of consumer ``name`` if it gives a position this stream takes, else why not;
        None when there is none."""
        try:
            progress = Progress.read(self.dir, name, self.fd)
        except ProtocolError as exc:  # a file an older trainer left 0600 is said with whose it is and what to do
            return unreadable(self.dir, name, self.fd) or str(exc)
        if progress is None:
            return None
        if progress.job is not None and progress.job != self.manifest.job_key:
            # A trainer of the job this one replaced, writing its position back before it notices.
            return (f"pid {progress.pid} wrote it for another job (key {progress.job}, this job's is "
                    f"{self.manifest.job_key}): a trainer of the job this one replaced; this job's trainer writes "
                    "its own over it, or remove it if no trainer of this job reads here")
        if progress.step >= self.steps:
            return f"step {progress.step} is past the {self.steps} steps of an epoch"
        if progress.epoch > MAX_EPOCH:
            return f"epoch {progress.epoch} is past {MAX_EPOCH}, the last a batch's name holds"
        return progress

    def _take(self, consumer: Consumer, progress: Progress) -> bool:
        """Take ``progress``, read for ``consumer``; True when its position moved."""
        g = self.g((progress.epoch, progress.step))
        if self.end is not None:
            g = min(g, self.end)
        before, was_seen, was_closed = consumer.position, consumer.seen, consumer.closed
        moved = consumer.take(progress, g)
        # The default consumer's first write is the trainer starting, no news; a named one joining is.
        if was_closed != consumer.closed or (not was_seen and consumer.name != DEFAULT_CONSUMER):
            if consumer.closed:
                others = any(c is not consumer and c.seen and not c.closed for c in self.consumers.values())
                log.info("%s of rank %d left at epoch %d step %d; %s", consumer.label, self.rank, *self.key(g),
                         "it holds no batches until it writes again" if others else
                         "its window stays filled for whoever comes next")
            else:
                log.info("%s joined rank %d at epoch %d step %d", consumer.label, self.rank, *self.key(g))
        elif moved and g < before:
            log.info("rank %d's %s moved back from %s to %s; regenerating from there",
                     self.rank, consumer.label.removeprefix("the "), self.key(before), self.key(g))
        return moved

    def _progress_problem(self, consumer: Consumer, problem: str) -> None:
        if consumer.problem(problem):
            log.warning("ignoring %s: %s", self.dir / progress_name(consumer.name), problem)

    def plan(self) -> None:
        """Decide which consumers hold batches and how many each: see ``consumers.plan_windows``.

        Live consumers hold; a gone, silent or closed one does not while another is live.  When
        none is live, all that may come back hold, so a single trainer that went away keeps its
        window (SPEC rule 8); when every one left (closed) before the job's end, they hold, so the
        next trainer finds the buffer filled; before any consumer wrote, the default one holds
        from 0.
        """
        now = time.time()
        known = [c for c in self.consumers.values() if c.seen]
        unfinished = [c for c in known if self.end is None or c.position < self.end]
        waiting = [c for c in unfinished if not c.closed]
        live = [c for c in waiting if c.live(now, self.consumer_timeout)]
        left = [] if len(unfinished) < len(known) else unfinished  # one at the end: the job is done (finished)
        holders = live or waiting or left or ([] if known else [self.consumers[DEFAULT_CONSUMER]])
        holders.sort(key=lambda c: (c.position, c.name))
        widths = plan_windows([c.position for c in holders], self.high, self.cap, self.limit)
        for c in self.consumers.values():
            c.window = 0
        self.held = set()
        for c, w in zip(holders, widths):
            c.window = w
            hi = min(c.position + w, self.limit)
            self.held.update(range(c.position, hi))
        # Only a cap below one batch per consumer leaves one without its next batch (plan_windows).
        # One that left (closed) holds for whoever comes next, and waits for nothing.
        starved = {c.name for c in holders if c.position not in self.held and not c.closed
                   and (self.end is None or c.position < self.end)}
        said_before = time.monotonic() - STARVED_SAID_SECONDS
        for c in holders:
            # Consumers taking turns at a cap of a batch or two starve by turns, at every poll.
            if c.name in starved - self._starved and self._starved_said.get(c.name, said_before) <= said_before:
                self._starved_said[c.name] = time.monotonic()
                log.info("rank %d's %s waits: the other consumers' windows fill the cap of %d batches "
                         "(raise --max-buffer-bytes to let it run)", self.rank, c.label.removeprefix("the "), self.cap)
        self._starved = starved
        self.holders = holders

    def outside_window(self) -> tuple[list[int], list[Build]]:
        """Published positions and live builds no window holds."""
        stale = [g for g in self.published if g not in self.held]
        builds = [b for b in self.building.values() if b.g not in self.held and not b.cancelled]
        return stale, builds

    def next_missing(self) -> int | None:
        """The most urgent position of a window that is neither published nor being built, if the
        hysteresis lets production run; None when there is nothing to build now."""
        kept = len(self.published) + self.active
        if self.filling and (kept >= min(self.cap, self.high * len(self.holders)) or not self._gap()):
            self.filling = False
        if not self.filling and (self._running_low() or self._trainer_blocked() or self._unattended() and self._gap()):
            self.filling = True
        if not self.filling:
            return None
        if len(self.published) + len(self.building) >= self.cap:
            # A rewind's cancelled builds keep their temp files until the tasks at workers end (tens of
            # ms; the cluster answers its slices at once, unbuilt): counted too, or the tmpfs would hold
            # more than --max-buffer-bytes meanwhile.
            return None
        best: tuple[int, int, int] | None = None  # (batches ready in its window, its position, g)
        for c in self.holders:
            ready, first = 0, None
            for g in range(c.position, c.position + c.window):
                if g not in self.held:
                    break  # past the end
                if g in self.published:
                    ready += 1
                elif g not in self.building and first is None:
                    first = g
            if first is not None and (best is None or (ready, c.position) < best[:2]):
                best = (ready, c.position, first)
        return best[2] if best is not None else None

    def _running_low(self) -> bool:
        """A holding consumer's window has fallen to the low-water mark (scaled to its window)."""
        for c in self.holders:
            if c.window == 0:
                continue
            ready = sum(1 for g in range(c.position, c.position + c.window) if g in self.published)
            if ready <= self.low * c.window // self.high:
                return True
        return False

    def _gap(self) -> bool:
        """A held position is neither published nor being built."""
        return any(g not in self.published and g not in self.building for g in self.held)

    def _unattended(self) -> bool:
        """No holding consumer reads (each is gone, silent or closed, or none has written yet).

        Then the windows are topped up to the high-water mark at once rather than from the low-water
        mark: no consumption is left for the hysteresis to batch up, and a trainer that comes back
        finds its window full."""
        now = time.time()
        return not any(c.live(now, self.consumer_timeout) for c in self.holders)

    def _trainer_blocked(self) -> bool:
        """The batch a consumer needs next is held but neither published nor being built: after a
        rewind, or a waiting batch lost, the batches further on do not help it, however many there are."""
        return any(c.position in self.held and c.position not in self.published and c.position not in self.building
                   for c in self.holders)

    def check_trainer(self) -> None:
        """Whether the processes that wrote the progress files are still there; logs when one goes,
        goes silent and comes back.

        A single trainer that is gone leaves the window full: the daemon holds the buffer at
        the high-water mark and sleeps until progress.json moves again.  Of several consumers,
        one that is gone or silent stops holding batches while another is live: from the next
        ``read_progress``, which plans the windows and after which the controller deletes what
        no window holds (planning here would let it build into a window before it deleted).
        """
        now = time.time()
        several = sum(c.seen for c in self.consumers.values()) > 1
        for c in self.consumers.values():
            if not c.seen:
                continue
            alive = c.writer_alive(self.dir, self.fd)
            if c.closed or (self.end is not None and c.position >= self.end):
                # It left, or consumed every epoch: it exits, as it should, which is no news to log; the
                # status and metrics still say whether its process is there.
                c.alive = alive if alive is not None else c.alive
                continue
            epoch, step = self.key(c.position)
            if alive is not None and alive != c.alive:
                if not alive and c.alive is None and c.written is not None and c.written < self.started:
                    # Found so at the first look, its progress older than this daemon: the trainer of a run
                    # killed with its daemon (a job scheduler ends both), whose restart (--spawn-daemon
                    # --resume) started this daemon and writes progress within moments: no news to warn of.
                    # status.json calls it gone until a trainer writes, so one that is not coming back shows.
                    keep = ("it holds no batches while other consumers read" if several else
                            f"the buffer fills from there to the high-water mark ({self.high} batches) for a trainer "
                            "that resumes it")
                    log.info("%s: rank %d's %s (%s) is not running: it wrote its progress (epoch %d step %d) %.0f s "
                             "ago, before this daemon started; %s", self.dir, self.rank, c.label.removeprefix("the "),
                             c.writer, epoch, step, c.silent_for(now), keep)
                elif not alive:
                    keep = ("It stops holding batches while other consumers read" if several else
                            f"Keeping the buffer at the high-water mark ({self.high} batches) for when a trainer comes back")
                    log.warning("%s: rank %d's %s (%s) has gone away; progress last moved %.0f s ago, at epoch %d "
                                "step %d. %s", self.dir, self.rank, c.label.removeprefix("the "), c.writer,
                                c.silent_for(now), epoch, step, keep)
                elif c.alive is False:
                    log.info("rank %d's %s is back (%s) at epoch %d step %d", self.rank,
                             c.label.removeprefix("the "), c.writer, epoch, step)
                c.alive = alive
            silent = c.silent_for(now) > self.consumer_timeout
            if several and silent and not c.silent and c.alive is not False:
                log.warning("rank %d's %s has written no progress for %.0f s (--consumer-timeout %g); it stops "
                            "holding batches until it writes again", self.rank, c.label.removeprefix("the "),
                            c.silent_for(now), self.consumer_timeout)
            elif c.silent and not silent:
                log.info("rank %d's %s writes progress again, at epoch %d step %d", self.rank,
                         c.label.removeprefix("the "), epoch, step)
            c.silent = silent

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
