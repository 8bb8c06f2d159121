"""How a stream reads its consumers' progress files: where each consumer is, who joins, who is still there.

At each poll the stream reads the progress file of every consumer it took, then takes newcomers while there
is room under its ``max_consumers`` (``_join``), reading at most ``max_reads`` files: a file that gives no
position (a link, one of another job, a member's junk) is refused and takes no consumer's place, and the files
past the cap are left out, each said in a throttled line and in the status's ``progress_file``.
``check_trainer`` says when a consumer's writer goes, goes silent and comes back.

A part of :class:`~prefetchd.daemon.stream.Stream`, which sets what is declared here in its ``__init__``; the
books of one consumer are ``consumers.py``'s.
"""

from __future__ import annotations

import heapq
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from prefetchd.buffer_protocol import DEFAULT_CONSUMER, Manifest, Progress, ProtocolError, progress_name
from prefetchd.buffer_protocol.layout import MAX_EPOCH, consumer_files
from prefetchd.buffer_protocol.ownership import started_after
from prefetchd.daemon.consumers import Consumer, Newcomer, Unreadable, progress_stats, unreadable
from prefetchd.throttle import Throttle
from prefetchd.words import counted

log = logging.getLogger("prefetchd.daemon.stream")  # the stream's messages, as before this module was split off

# The progress files left out for the cap, and those refused before their consumers were taken, are each said
# at most this often per stream.
IGNORED_SAID_SECONDS = 300.0
# A progress file the daemon may not read (an older trainer's, 0600) is read again this often: its owner's chmod, which
# the log advises, gives it no new inode.  Each such look (an open refused, two stats, the owners' names for the
# message) took 0.16 ms (2-core EPYC, tmpfs): 256 such files, the most a poll reads, 40 ms every 10 s.
UNREADABLE_RETRY_SECONDS = 10.0


class OtherJob(str):
    """Why a progress file is refused: it is of another job, the one a --replace (or another job) replaced."""


def _level(problem: str) -> int:
    """Another job's progress file is what every --replace leaves (its trainer writes back before it notices):
    said, not warned about (a soak's 84 warnings were all of it)."""
    return logging.INFO if isinstance(problem, OtherJob) else logging.WARNING


class StreamProgress:
    """The consumers of a :class:`~prefetchd.daemon.stream.Stream` and the reading of their progress files."""

    # Set by Stream.__init__.
    dir: Path
    fd: int
    manifest: Manifest
    steps: int
    end: int | None
    started: float
    high: int
    consumer_timeout: float
    consumers: dict[str, Consumer]
    forgotten: Consumer
    max_consumers: int
    max_reads: int
    ignored: int
    _ignored_said: float | None
    newcomers: dict[str, Newcomer]
    _listed: dict[str, int]
    _refusals: int
    _refused_latest: str
    _refused_lines: Throttle
    holders: list[Consumer]

    if TYPE_CHECKING:  # the stream's, and its windows' (stream_windows.py)
        @property
        def rank(self) -> int: ...
        def key(self, g: int) -> tuple[int, int]: ...
        def g(self, key: tuple[int, int]) -> int: ...
        def plan(self) -> None: ...

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
        and silent ones (past the consumer timeout) are not waited for.

        Silence counts from this daemon's start at the earliest: a trainer of a sweep that crashed, and resumes
        after the others finished, finds no daemon, and the one started again for it (README, "Several
        trainers") found its progress older than the timeout and ended at once, with "nothing to produce"."""
        if self.end is None:
            return False
        now = time.time()
        seen = [c for c in self.consumers.values() if c.seen] or [self.consumers[DEFAULT_CONSUMER]]
        expected = [c for c in seen if not c.closed
                    and min(c.silent_for(now), now - self.started) <= self.consumer_timeout]
        return any(c.position >= self.end for c in seen) and all(c.position >= self.end for c in expected)

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
        for name in self.consumers.keys() - present.keys():  # the default one, kept: its file with a problem was
            self.consumers[name].error = ""  # removed, as the problem's message says to; it is no problem now
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
        # Left unread for the cap: not one refused already (for its mode, read again now and then), which the status
        # counts as refused, with why, and the log said so: it was counted twice, in a line that told its owner to
        # remove the files of consumers that will not come back where a chmod was what it needed.
        self._ignore([name for name in unread if name not in read and not book[name].refused] if room <= 0 else [])
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
        self._refused_lines.log(log, _level(problem), "ignoring %s: %s", self.dir / progress_name(name), problem,
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
            writer = "a consumer" if progress.pid is None else f"pid {progress.pid}"
            return OtherJob(f"{writer} wrote it for another job (key {progress.job}, this job's is "
                            f"{self.manifest.job_key}): a trainer of the job this one replaced; this job's trainer "
                            "writes its own over it, or remove it if no trainer of this job reads here")
        if progress.step >= self.steps:
            return f"step {progress.step} is past the {self.steps} steps of an epoch"
        if progress.epoch > MAX_EPOCH:
            return f"epoch {progress.epoch} is past {MAX_EPOCH}, the last a batch's name holds"
        if self.end is not None and self.g((progress.epoch, progress.step)) > self.end:
            # No trainer of this job gets there: taken, it ended the job while its trainer read epoch 0 (a review).
            return (f"epoch {progress.epoch} step {progress.step} is past the end of the job, epoch "
                    f"{self.end // self.steps} step 0 (after {counted(self.end // self.steps, 'epoch')} of "
                    f"{self.steps} steps); its trainer writes its own position over it, or remove it")
        return progress

    def _take(self, consumer: Consumer, progress: Progress) -> bool:
        """Take ``progress``, read for ``consumer``; True when its position moved."""
        g = self.g((progress.epoch, progress.step))
        if self.end is not None:
            g = min(g, self.end)
        before, was_seen, was_closed = consumer.position, consumer.seen, consumer.closed
        fresh = consumer.document is None and started_after(progress.pid, progress.pid_namespace, self.started)
        moved = consumer.take(progress, g, fresh)
        # The default consumer's first write is the trainer starting, no news; a named one joining is.
        if was_closed != consumer.closed or (not was_seen and consumer.name != DEFAULT_CONSUMER):
            if consumer.closed:
                keep = ("every batch consumed" if self.end is not None and g >= self.end else
                        "it holds no batches until it writes again" if self._others_hold(consumer, time.time()) else
                        "its window stays filled for whoever comes next")
                log.info("%s of rank %d left at epoch %d step %d; %s", consumer.label, self.rank, *self.key(g), keep)
            else:
                log.info("%s joined rank %d at epoch %d step %d", consumer.label, self.rank, *self.key(g))
                # Its writer judged afresh (``check_trainer``): the one that left is gone, and "is back" would
                # say this join again.
                consumer.alive = None
        elif moved and g < before:
            log.info("rank %d's %s moved back from %s to %s; regenerating from there",
                     self.rank, consumer.label.removeprefix("the "), self.key(before), self.key(g))
        return moved

    def _others_hold(self, consumer: Consumer, now: float) -> bool:
        """Whether other consumers hold the batches, so that ``consumer`` holds none, as ``StreamWindows.plan``
        decides: for one that left (closed), another that waits; for one gone or silent, another that waits and
        is live."""
        others = [c for c in self.consumers.values() if c is not consumer and c.waits(self.end)]
        return bool(others) if consumer.closed else any(c.live(now, self.consumer_timeout) for c in others)

    def _progress_problem(self, consumer: Consumer, problem: str) -> None:
        if consumer.problem(problem):
            path = str(self.dir / progress_name(consumer.name))
            # A ProtocolError names the file itself: "ignoring P: P: field ..." said it twice (a review).
            log.log(_level(problem), "ignoring %s: %s", path, problem.removeprefix(f"{path}: "))

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
        for c in self.consumers.values():
            if not c.seen:
                continue
            others_hold = self._others_hold(c, now)
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
                    keep = ("it holds no batches while other consumers read" if others_hold else
                            f"the buffer fills from there to the high-water mark ({self.high} batches) for a trainer "
                            "that resumes it")
                    log.info("%s: rank %d's %s (%s) is not running: it wrote its progress (epoch %d step %d) %.0f s "
                             "ago, before this daemon started; %s", self.dir, self.rank, c.label.removeprefix("the "),
                             c.writer, epoch, step, c.silent_for(now), keep)
                elif not alive:
                    keep = ("It stops holding batches while other consumers read" if others_hold else
                            f"Keeping the buffer at the high-water mark ({self.high} batches) for when a trainer comes back")
                    log.warning("%s: rank %d's %s (%s) has gone away; progress last moved %.0f s ago, at epoch %d "
                                "step %d. %s", self.dir, self.rank, c.label.removeprefix("the "), c.writer,
                                c.silent_for(now), epoch, step, keep)
                elif c.alive is False:
                    log.info("rank %d's %s is back (%s) at epoch %d step %d", self.rank,
                             c.label.removeprefix("the "), c.writer, epoch, step)
                c.alive = alive
            silent = c.silent_for(now) > self.consumer_timeout
            if others_hold and silent and not c.silent and c.alive is not False:
                log.warning("rank %d's %s has written no progress for %.0f s (--consumer-timeout %g); it stops "
                            "holding batches until it writes again", self.rank, c.label.removeprefix("the "),
                            c.silent_for(now), self.consumer_timeout)
                c.silent = True
            elif c.silent and not silent:
                log.info("rank %d's %s writes progress again, at epoch %d step %d", self.rank,
                         c.label.removeprefix("the "), epoch, step)
                c.silent = False
