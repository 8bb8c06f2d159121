"""The consumers of one stream: who reads it, where each one is, and which batches their windows hold.

Several trainers may read one stream (a sweep, an ensemble: SPEC rule 9), each
writing its own progress file.  A :class:`Consumer` keeps the books of one of them:
its position, whether its writer is still there and whether it went silent.
:func:`plan_windows` decides how many batches from each holding consumer's
position the stream keeps: up to ``high`` each, all of them together within
``cap``; when they do not fit the slowest consumer's window shrinks first.

This module reads progress files and logs; the stream (``stream.py``, its windows
``stream_windows.py``) turns the plan into batches to build and delete.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Container, Sequence
from dataclasses import dataclass
from pathlib import Path

from prefetchd.access import user_name
from prefetchd.buffer_protocol import (DEFAULT_CONSUMER, Progress, consumer_lock_name, progress_name, writer_alive,
                                      writer_named)
from prefetchd.buffer_protocol.layout import at, consumer_entries
from prefetchd.buffer_protocol.status import ConsumerStatus, Position, TrainerStatus

log = logging.getLogger(__name__)

# Progress files the daemon reads at most in one look: a poll of a stream taking MAX_CONSUMERS (64) consumers,
# fewer in proportion for one taking fewer (``Stream``), and the look at a buffer's trainers that a new job.json
# takes (``job_inbox.freshest_progress``).  Any member of a --group-access buffer's group may put files there
# under progress names, and one that is no progress document takes no consumer's place, so the reads and not the
# consumers have to bound a look: a refused file took 54 us to open, read and parse (2-core EPYC, tmpfs), 20,000
# of them 1.1 s, 256 of them 14 ms; one of MAX_PROGRESS_LEN (4 KiB) of numbers, the most a reader takes, 0.21 ms,
# 256 of them 54 ms.  Listing 20,000 took 20 ms, with an lstat of each (``progress_stats``) 95 ms.
MAX_PROGRESS_READS = 256


def progress_stats(directory: Path, dir_fd: int | None = None, only: Container[str] | None = None,
                   ) -> dict[str, os.stat_result]:
    """The lstat of each consumer's progress file in ``directory`` (listed through its fd ``dir_fd`` where given),
    of those in ``only`` where given.  What picks the files to read when there are more than MAX_PROGRESS_READS:
    those written last, as a trainer rewrites its own every PROGRESS_REFRESH_SECONDS while it waits, and at each
    batch it reads, where files planted and left there grow old."""
    found: dict[str, os.stat_result] = {}
    # From the listing: a path made for each file, then a stat by it, took three times as long.
    for consumer, entry in consumer_entries(directory, dir_fd):
        if only is not None and consumer not in only:
            continue
        with contextlib.suppress(FileNotFoundError):  # gone meanwhile
            found[consumer] = entry.stat(follow_symlinks=False)
    return found


class Unreadable(str):
    """What ``unreadable`` says: a problem of the file's mode, which its owner's chmod mends without a rewrite, so a
    stream reads such a file again now and then (``Stream._join``), where another refused file is read again only
    once replaced."""


def unreadable(directory: Path, consumer: str, dir_fd: int | None = None) -> Unreadable | None:
    """Why the daemon may not read ``consumer``'s progress file in ``directory`` (through its fd ``dir_fd`` where
    given), nor perhaps its lock: whose they are, their mode and what to do; None where its mode lets the daemon
    read it (another problem, then).  A trainer of an older prefetchd under umask 077 left them 0600, which the
    daemon, another user, may not read (``TRAINER_FILE_MODE``): it said "cannot open a progress document
    (Permission denied)", and nobody knew whose the file was, nor that an update would do."""
    found: list[tuple[Path, os.stat_result]] = []
    for name in (progress_name(consumer), consumer_lock_name(consumer)):
        path = directory / name
        try:
            st = os.stat(at(path, dir_fd), dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        # The kernel's own check (faccessat), as the open that failed made it: groups, ACLs, root.
        if stat.S_ISREG(st.st_mode) and not os.access(at(path, dir_fd), os.R_OK, dir_fd=dir_fd, effective_ids=True):
            found.append((path, st))
    if not found or found[0][0].name != progress_name(consumer):
        return None  # the lock alone is read only for a trainer of another pid namespace, whose progress says so

    def whose(st: os.stat_result) -> str:
        return f"belongs to {user_name(st.st_uid)} and has mode {stat.S_IMODE(st.st_mode):04o}"

    files = " ".join(str(path) for path, _st in found)
    them = "them" if len(found) > 1 else "it"
    lock = f"; nor its lock {found[1][0].name}, which {whose(found[1][1])}" if len(found) > 1 else ""
    who = "the default consumer" if consumer == DEFAULT_CONSUMER else f"consumer {consumer!r}"
    return Unreadable(
        f"the daemon's user, {user_name(os.geteuid())}, may not read it: it {whose(found[0][1])}{lock}. A trainer of "
        f"an older prefetchd leaves {them} so under a umask such as 077 (trainers of this version write {them} 0644 "
        f"whatever the umask); meanwhile the daemon cannot tell where that trainer is, and keeps no batches for it. "
        f"Their owner can make {them} readable (`chmod 644 {files}`) or remove {them} while no trainer reads as {who} "
        f"(`rm {files}`), and should update their prefetchd")


@dataclass(slots=True)
class Newcomer:
    """What a stream knows of the progress file of a consumer it has not taken: a poll reads only those not refused
    (``Stream._join``), and when there are more of those than it reads, the ones written last."""

    inode: int  # the file's, as the stream folder's listing gave it at the last poll
    mtime_ns: int | None = None  # that file's, once looked at (a stat)
    refused: bool = False  # that file was read, and gave no position the stream takes
    problem: int = 0  # the hash of the last problem said of its files: a rewrite with the same one is not said again
    retry_at: float | None = None  # time.monotonic() when a file refused as ``Unreadable`` is to be read again

    def listed(self, inode: int) -> Newcomer:
        """This consumer's, its file listed now with ``inode``: another file (renamed over it) is to be read again."""
        if inode != self.inode:
            self.inode, self.mtime_ns, self.refused, self.retry_at = inode, None, False, None
        return self

    def to_read(self, now: float) -> bool:
        """Whether a poll at ``now`` is to read its file: one not refused yet, or refused for its mode a while ago."""
        return not self.refused or self.retry_at is not None and self.retry_at <= now


@dataclass(eq=False)
class Consumer:
    """One consumer's position (a global batch number) and what is known of its writer."""

    name: str
    position: int = 0
    # The progress document taken last; None before any (the default consumer exists before that).
    document: Progress | None = None
    alive: bool | None = None  # None: unknown (no pid, or not looked at yet)
    silent: bool = False  # said to have gone silent (no progress for longer than the consumer timeout), not since back
    window: int = 0  # batches the plan holds for it from its position
    consumed: int = 0
    rewinds: int = 0
    rejected: int = 0
    error: str = ""

    @property
    def seen(self) -> bool:
        """A progress document of it has been read."""
        return self.document is not None

    @property
    def closed(self) -> bool:
        return self.document is not None and self.document.closed

    @property
    def wait_share(self) -> float | None:
        """Its writer's, while that process is there: a gone or departed one's last share is no trainer's now
        (a dashboard showed a crashed trainer starving at 80 % for as long as the daemon ran)."""
        if self.document is None or self.closed or self.alive is False:
            return None
        return self.document.wait_share

    @property
    def pid(self) -> int | None:
        return self.document.pid if self.document is not None else None

    @property
    def written(self) -> float | None:
        """The document's ``time``: when its writer last wrote it."""
        return self.document.time if self.document is not None else None

    @property
    def label(self) -> str:
        return "the trainer" if self.name == DEFAULT_CONSUMER else f"consumer {self.name!r}"

    def silent_for(self, now: float) -> float:
        """Seconds since its writer last wrote its progress file; 0 when unknown."""
        return max(0.0, now - self.written) if self.written is not None else 0.0

    def waits(self, end: int | None) -> bool:
        """May still read batches: it wrote, has not left (closed), and is short of ``end`` (the job's last
        position; None: unbounded).  Those hold batches, the live ones first (``StreamWindows.plan``)."""
        return self.seen and not self.closed and (end is None or self.position < end)

    def live(self, now: float, timeout: float) -> bool:
        """Holds batches even when others are live: not closed, not gone, not silent too long."""
        return self.seen and not self.closed and self.alive is not False and self.silent_for(now) <= timeout

    def take(self, progress: Progress, g: int, fresh: bool = False) -> bool:
        """Take a document read for this consumer, ``g`` being its global position; True when it moved.  ``fresh``:
        its writer started after this job's stream did, so each batch it read was this stream's."""
        writer = self.document  # None: the first of its documents this daemon reads, read before it
        self.document, self.error = progress, ""
        read = progress.read_batches
        if writer is None and fresh and read:
            # A loader that read before the first of its documents was seen: a poll after its first reads (a
            # loader started as the job did). Its reads are counted; a loader older than the stream may have
            # read another daemon's batches (a resumed run), which are not.
            self.consumed += read
        elif writer is not None and read is not None:
            # What its loader read: a jump forward (a later checkpoint loaded) consumed nothing. A count that went
            # down, or another pid (or pid namespace), is a new loader's, all of it read since.
            same = (progress.pid, progress.pid_namespace) == (writer.pid, writer.pid_namespace)
            before = writer.read_batches or 0
            self.consumed += read - before if same and read >= before else read
        elif writer is not None and g > self.position:
            self.consumed += g - self.position  # a writer that predates ``read_batches``: each move forward, jumps too
        if g == self.position:
            return False
        if writer is not None and g < self.position:
            self.rewinds += 1
        # The first position: where it starts (a consumer joining, a trainer resuming under this daemon).
        self.position = g
        return True

    def problem(self, problem: str) -> bool:
        """Note a problem with its progress file; True when it is a new one (to log and count)."""
        if problem == self.error:
            return False
        self.error = problem
        self.rejected += 1
        return True

    def writer_alive(self, directory: Path, dir_fd: int | None = None) -> bool | None:
        """Whether the process that wrote its progress file in ``directory`` (whose fd is ``dir_fd``) is still
        there, by its pid or, from another pid namespace, by its lock file (``buffer_protocol.writer_alive``);
        None when unknown."""
        return writer_alive(directory, self.name, self.document, dir_fd) if self.document is not None else None

    @property
    def writer(self) -> str:
        """Its writer, as the log names it (``buffer_protocol.writer_named``)."""
        return writer_named(self.document) if self.document is not None else "no writer yet"

    def trainer_status(self, now: float) -> TrainerStatus:
        age = round(self.silent_for(now), 1) if self.written is not None else None
        namespace = self.document.pid_namespace if self.document is not None else None
        return TrainerStatus(pid=self.pid, alive=self.alive, progress_age_s=age, pid_namespace=namespace)

    def status(self, epoch: int, step: int, now: float, holding: bool) -> ConsumerStatus:
        return ConsumerStatus(
            name=self.name, progress=Position(epoch, step, self.wait_share), trainer=self.trainer_status(now),
            holding=holding, window=self.window if holding else 0, closed=self.closed,
        )


def union_size(windows: Sequence[tuple[int, int]]) -> int:
    """Positions covered by the half-open intervals ``windows``."""
    total, reach = 0, None
    for lo, hi in sorted(w for w in windows if w[1] > w[0]):
        if reach is None or lo >= reach:
            total += hi - lo
            reach = hi
        elif hi > reach:
            total += hi - reach
            reach = hi
    return total


def plan_windows(positions: Sequence[int], high: int, cap: int, end: int | None) -> list[int]:
    """How many batches to hold from each position (given slowest first): ``high`` each, unless
    the union of the windows would exceed ``cap`` batches.  Then the slowest consumer's window
    shrinks first, down to one batch (it waits for each batch as it is built, but it moves), then
    the next slowest one's.  Only a cap smaller than the number of consumers takes windows down to
    nothing, the fastest consumer's first: it waits until a slower one catches up with it, so
    every consumer still gets its batches (the slowest never starves behind the others).

    Windows stop at ``end`` (the last batch of the job) and overlap where consumers are close,
    so consumers in lockstep share every batch and the cap binds only when they drift apart.
    """
    def span(p: int, w: int) -> tuple[int, int]:
        return (p, min(p + w, end) if end is not None else p + w)

    widths = [high] * len(positions)

    def size() -> int:
        return union_size([span(p, w) for p, w in zip(positions, widths)])

    def shrink(i: int, floor: int) -> None:
        """Narrow window i to the widest (at least ``floor``) with which the union fits the cap."""
        lo, hi = floor, widths[i]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            widths[i] = mid
            if size() <= cap:
                lo = mid
            else:
                hi = mid - 1
        widths[i] = lo

    for floor, order in ((min(1, high), range(len(positions))), (0, reversed(range(len(positions))))):
        for i in order:
            if size() <= cap:
                return widths
            shrink(i, floor)
    return widths


__all__ = ["MAX_PROGRESS_READS", "Consumer", "Newcomer", "plan_windows", "progress_stats", "union_size",
           "Unreadable", "unreadable"]
