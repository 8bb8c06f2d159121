"""A consumer's progress file in the buffer: the trainer's side of flow control.

The daemon reads ``progress.json`` (``progress.NAME.json`` for a named consumer)
and deletes every batch before the position it names.  A :class:`ProgressFile`
writes it for one loader:

- the same position is not written twice in a row (``publish``), except while the
  loader waits for a batch, when ``stale`` asks for it to be written again every
  ``PROGRESS_REFRESH_SECONDS`` (SPEC rule 9) or when someone else rewrote it;
- a folder this user may not write in (another user's buffer it may only read, a
  --group-access buffer whose group lost its write bit, a read-only mount) is refused
  when the loader is made (:class:`NoAccess`, the words of ``prefetchd.access``): its
  trainer would read the batches that are there while the daemon, never told, deletes
  none and builds no more;
- a write that fails later (a full tmpfs, a permission taken away) is retried at the next
  publish, and is an error only once it has kept failing for ``PROGRESS_WRITE_GRACE``
  seconds: for a permission :class:`AccessLost`, a ``NoAccess`` as at the start.  The
  log says so when the trouble starts, with what to do, again every
  ``PROGRESS_WRITE_WARN_SECONDS`` while it lasts, and when a write goes through
  again: not at every try (a waiting loader tries about once a second).  The last
  write, as the loader closes, has no next try: its failing is said at once
  (``LoaderError``, which ``close`` logs), as is a loader that closes while its
  writes fail: the daemon was not told where it stopped;
- another trainer reading as the same consumer is an error (each needs a consumer
  name of its own): the first holds ``flock`` on the consumer's lock file
  (``progress.json.lock``) while its loader is open, and a second one's loader
  refuses to start; the kernel lets go of a trainer that dies.  The file says it
  holds the lock (``locked``), which is how a daemon in another pid namespace, to
  which its pid means nothing, tells it is still there.  A trainer that
  ignores the lock (an older prefetchd) is caught by its writes, looked for at
  most every ``ALONE_CHECK_SECONDS`` while publishing and at every look while
  waiting.  A second open loader of this process on the same consumer shares the
  first one's lock, and is warned about: the two take turns at one file.

Which position may be written (a batch still being copied to the GPU is not
consumed) is the loader's to say.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import os
import stat
import threading
import time
import weakref
from pathlib import Path

from prefetchd.access import no_access, user_name
from prefetchd.buffer_protocol import (DEFAULT_CONSUMER, Progress, ProtocolError, alive_since, consumer_lock_name,
                                      progress_name, same_pid_namespace, take_lock, writer_alive, writer_named)
from prefetchd.buffer_protocol.layout import TRAINER_FILE_MODE, consumer_files
from prefetchd.buffer_protocol.progress import PROGRESS_REFRESH_SECONDS
from prefetchd.trainer.errors import AccessLost, LoaderError, NoAccess
from prefetchd.throttle import Throttle
from prefetchd.words import counted

logger = logging.getLogger(__name__)

# progress.json may fail to be written for a while (a full tmpfs): the loader keeps delivering
# the batches that are there and retries; only a failure that lasts this long is an error.
PROGRESS_WRITE_GRACE = 30.0
PROGRESS_WRITE_WARN_SECONDS = 10.0  # while the writes keep failing, said again this often at most
ALONE_CHECK_SECONDS = 1.0  # how often a publish reads the progress file first, for another trainer's writes
DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)  # a write refused for a permission, or a read-only mount


class ConsumerHeld(Exception):
    """Another process holds a consumer's lock file."""


class _ConsumerLocks:
    """The consumer lock files this process holds, by file identity (st_dev, st_ino), whatever the path's
    spelling: this process's loaders of one consumer share one lock (a notebook cell run twice: warned
    about), and it is let go when the last of them closes.

    ``flock`` belongs to the open file, which a forked child shares: the child forgets the locks
    (``os.register_at_fork``) and closes its copies, and the owner unlocks before it closes, so a
    child that outlives a closed loader (a DataLoader worker) keeps nothing locked."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, int], list[int]] = {}  # identity -> [descriptor, loaders]
        self._mutex = threading.Lock()
        # Releases not done yet (``release``): a loader's finalizer may run inside ``take`` on the thread that
        # holds the mutex (the garbage collector runs at any allocation), and must not wait for it.
        self._pending: collections.deque[tuple[int, int]] = collections.deque()

    def take(self, path: Path) -> tuple[tuple[int, int], bool]:
        """Lock ``path`` (made if missing; never through a link): (its identity, whether another loader of
        this process holds it already).  ConsumerHeld where another process does; OSError where it cannot
        be locked at all (not a regular file, no lock support)."""
        try:
            with self._mutex:
                self._release_now()  # a loader of this file collected since is not counted as holding it
                return self._take(path)
        finally:
            self._release_pending()

    def _take(self, path: Path) -> tuple[tuple[int, int], bool]:
        # Read-only: flock takes such a descriptor, and a lock file a group member's trainer made is one to read.
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, TRAINER_FILE_MODE)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file: remove it")
            if st.st_uid == os.geteuid() and st.st_nlink == 1 and stat.S_IMODE(st.st_mode) != TRAINER_FILE_MODE:
                # O_CREAT's mode is less the umask: the daemon and the next member's trainer must read it (one
                # this user's older trainer left 0600 is opened up too).  One link: not another file of this
                # user's that a member hard-linked under the lock's name.
                os.fchmod(fd, TRAINER_FILE_MODE)
            key = (st.st_dev, st.st_ino)
            if key in self._held:
                self._held[key][1] += 1
                os.close(fd)
                return key, True
            if not take_lock(fd):  # tried again for a moment: a daemon may be asking whether it is held
                raise ConsumerHeld(str(path))
        except BaseException:
            os.close(fd)
            raise
        self._held[key] = [fd, 1]
        return key, False

    def release(self, key: tuple[int, int]) -> None:
        """One loader of ``key`` lets go; the last unlocks it.  From a finalizer run while this thread holds the
        mutex (in ``take``), once ``take`` lets go of it: waiting for it there would wait for ever."""
        self._pending.append(key)
        self._release_pending()

    def _release_pending(self) -> None:
        # Whoever holds the mutex looks again once it lets go (``take``'s finally, this loop): a release that
        # found it taken, by this thread or another, is not left behind.
        while self._pending and self._mutex.acquire(blocking=False):
            try:
                self._release_now()
            finally:
                self._mutex.release()

    def _release_now(self) -> None:
        """The pending releases, the mutex held."""
        while self._pending:
            key = self._pending.popleft()
            held = self._held.get(key)
            if held is None:
                continue  # a forked child's copy, forgotten at the fork
            held[1] -= 1
            if held[1] == 0:
                del self._held[key]
                fcntl.flock(held[0], fcntl.LOCK_UN)
                os.close(held[0])

    def forget_in_child(self) -> None:
        for fd, _loaders in self._held.values():
            os.close(fd)  # the parent's lock stays: it holds the open file too
        self._held.clear()
        self._pending.clear()
        self._mutex = threading.Lock()  # one held by another thread at the fork would never be let go


def _another_trainer(progress: Progress) -> bool:
    """Whether ``progress`` was written by a live trainer of another process that has not left.

    A pid of another pid namespace names nothing here (or an unrelated process, even this one): such a
    document is another process's, and is taken for a live trainer's.  The callers ask about a document
    that was written after this loader's first write, or while another process holds the consumer's lock."""
    if progress.closed or progress.pid is None or progress.time is None:
        return False
    if not same_pid_namespace(progress.pid_namespace):
        return True
    return progress.pid != os.getpid() and alive_since(progress.pid, progress.time)


_LOCKS = _ConsumerLocks()
os.register_at_fork(after_in_child=_LOCKS.forget_in_child)


class ProgressFile:
    """Where one loader tells the daemon which batch it needs next (see the module docstring)."""

    def __init__(self, buffer: Path, consumer: str, job_key: str) -> None:
        self.buffer = buffer
        self.consumer = consumer
        self.path = buffer / progress_name(consumer)
        self.published: tuple[int, int] | None = None  # the position last written
        self._written: Progress | None = None  # the document last written (its writer's pid and time filled in)
        self.closed = False
        self._job_key = job_key
        self._published_at = 0.0  # time.monotonic() of the last write
        self._next_alone_check = 0.0  # when publish next reads the file for another trainer's writes
        self._failing_since: float | None = None  # monotonic time of the first of the writes failing now
        self._failures = 0  # writes failed since then
        self._failure_said: tuple[float, str] | None = None  # when the failure was last logged, and its error
        # ``stale``'s line that the file is not ours: where the writes fail too (the buffer's tmpfs unmounted under
        # it), it was said at every look, once a second (a walk).
        self._stale_said = Throttle(PROGRESS_WRITE_WARN_SECONDS)
        self._failure: OSError | None = None  # the error of the last write that failed
        denied = no_access(buffer, write=True)
        if denied is not None:  # before the lock, which it would fail to make and warn of in other words
            raise NoAccess(
                f"cannot write {self.path.name} in {buffer}: a trainer reading it tells the daemon there which "
                "batches it has consumed, without which the daemon deletes none and builds no further than its "
                f"high-water mark: {denied}")
        lock = self._take_lock()
        # The lock is let go at release(), or when a loader never closed is collected.
        self._unlock = weakref.finalize(self, _LOCKS.release, lock) if lock is not None else None

    def _take_lock(self) -> tuple[int, int] | None:
        """Hold the consumer's lock file (``_LOCKS``): its identity, or None where it cannot be locked (a
        warning: then only the writes tell another trainer); LoaderError where another trainer holds it."""
        path = self.buffer / consumer_lock_name(self.consumer)
        try:
            key, shared = _LOCKS.take(path)
        except ConsumerHeld:
            raise LoaderError(
                f"{self.buffer}: another trainer{self._holder()} reads it as {self.who} (it holds {path}). Several "
                "trainers on one buffer each need a consumer name of their own: --consumer NAME "
                "(BufferLoader(consumer=NAME))") from None
        except OSError as exc:
            logger.warning("%s: cannot lock it (%s)%s; another trainer reading %s as %s is noticed only by its writes",
                           path, exc.strerror or exc, self._lock_denied(path, exc), self.buffer, self.who)
            return None
        if shared:
            logger.warning(
                "%s: another BufferLoader of this process reads it as %s and is still open. Two loaders take "
                "turns at one progress file, and the daemon builds again the batches each moves back to; close "
                "the other first (loader.close(), or a with block), or give each a consumer= of its own",
                self.buffer, self.who)
        return key

    def _lock_denied(self, path: Path, exc: OSError) -> str:
        """Whose the lock file this user may not open is, and what to do, for the warning; "" for another error.
        The folder is writable (checked first): another user's trainer made the file, an older one that left
        its mode to the umask (``TRAINER_FILE_MODE``)."""
        if not isinstance(exc, PermissionError):
            return ""
        try:
            st = os.stat(path)
        except OSError:
            return ""
        return (f": it belongs to {user_name(st.st_uid)} and has mode {stat.S_IMODE(st.st_mode):04o} (a trainer of "
                f"an older prefetchd, under a umask that takes the group's bits, makes it so). Remove it while no "
                f"trainer reads as {self.who} (`rm {path}`), and update that user's prefetchd")

    def _holder(self) -> str:
        """" (pid N)" for the live writer of this consumer's progress, the likely holder of its lock, or ""."""
        try:
            current = Progress.read(self.buffer, self.consumer)
        except (ProtocolError, OSError):
            return ""
        return f" ({writer_named(current)})" if current is not None and _another_trainer(current) else ""

    def release(self) -> None:
        """The loader closed: another trainer may read as this consumer now."""
        self.closed = True
        if self._unlock is not None:
            self._unlock()  # once: a finalizer runs at most once

    @property
    def who(self) -> str:
        """This consumer, as messages name it."""
        return "the default consumer" if self.consumer == DEFAULT_CONSUMER else f"consumer {self.consumer!r}"

    def publish(self, position: tuple[int, int], wait_share: float | None, force: bool = False,
                closed: bool = False, read_batches: int | None = None) -> None:
        """Write ``position`` unless it is the one written last (``force``: all the same); ``closed``: the
        loader leaves, and the file says so; ``read_batches``: the batches the loader consumed by reading them."""
        if position == self.published and not force:
            return
        now = time.monotonic()
        if self.published is not None and now >= self._next_alone_check:
            # A trainer that never waits never reaches stale(): look here too, once a second at most.
            self._next_alone_check = now + ALONE_CHECK_SECONDS
            try:
                self._check_alone(Progress.read(self.buffer, self.consumer))
            except (ProtocolError, OSError):
                pass  # unreadable: overwritten below, and a wait looks again
        try:
            written = Progress(*position, wait_share=wait_share, closed=closed, job=self._job_key,
                               read_batches=read_batches, locked=self._unlock is not None and self._unlock.alive,
                               ).write(self.buffer, self.consumer)
        except OSError as exc:
            if closed:  # the loader leaves: no next publish will try again
                self._failing_since = self._failing_since if self._failing_since is not None else now
                self._failure = exc
                raise LoaderError(self.untold()) from exc
            if self._keep_trying(exc):
                return  # left unpublished, so the next call tries again
            raise self._gave_up(exc) from exc
        if self._failing_since is not None:
            logger.warning("wrote %s again after %.0f s (%s failed)", self.path,
                           time.monotonic() - self._failing_since, counted(self._failures, "write"))
            self._failing_since, self._failures, self._failure_said, self._failure = None, 0, None, None
        self.published = position
        self._written = written
        self._published_at = time.monotonic()

    def written_since(self) -> bool:
        """Whether the progress file is no longer the document this loader wrote last: another writer of this
        consumer wrote it since (a second loader of this process, or a trainer of another that ignores the lock),
        removed it or left it unreadable; also True before this loader wrote.  By the writer's pid and time, not
        by the position, which the other writer may have written too."""
        readable, current = self._read_back()
        return not readable or current is None or not self._mine(current)

    def another_wrote(self) -> bool:
        """Whether the progress file holds a document another writer of this consumer wrote since this loader
        last did (a second loader of this process that replaced it); not where it is gone or unreadable, which
        this loader's next write replaces, or says it cannot."""
        readable, current = self._read_back()
        return readable and current is not None and self._written is not None and not self._mine(current)

    def _read_back(self) -> tuple[bool, Progress | None]:
        """(whether the progress file could be read, the document there: None where there is none)."""
        try:
            return True, Progress.read(self.buffer, self.consumer)
        except (ProtocolError, OSError):
            return False, None

    def _mine(self, current: Progress) -> bool:
        """Whether ``current`` is the document this loader wrote last: by the writer's pid and time, not by the
        position, which another writer may have written too."""
        mine = self._written
        return mine is not None and ((current.epoch, current.step, current.pid, current.time, current.pid_namespace)
                                     == (mine.epoch, mine.step, mine.pid, mine.time, mine.pid_namespace))

    def failing(self) -> str | None:
        """Since when, and why, this loader cannot write its progress file; None while it can."""
        if self._failing_since is None:
            return None
        why = f" ({self._failure_said[1]})" if self._failure_said is not None else ""
        return f"it has not written {self.path} for {time.monotonic() - self._failing_since:.0f} s{why}"

    def _gave_up(self, exc: OSError) -> LoaderError:
        """The error of writes that kept failing with ``exc`` for the grace: for a permission (the buffer's group lost
        its write bit, a folder made read-only), ``AccessLost``, a ``NoAccess`` as at the start, which names what
        the daemon still goes by (the file keeps the last position written) and whose the folder is."""
        failed = f"{self.path}: cannot write it ({exc.strerror or exc}) for {PROGRESS_WRITE_GRACE:g} s"
        if exc.errno in DENIED:
            return AccessLost(
                f"{failed}, so the daemon still goes by {self._told()} (it deletes no batch from there on and builds "
                f"no further than its high-water mark): {self._fix(exc)}; then resume from the last checkpoint")
        return LoaderError(f"{failed}; the daemon needs it to know what to produce and delete: {self._fix(exc)}")

    def _told(self) -> str:
        """What the progress file tells the daemon while this loader's writes fail."""
        return (f"epoch {self.published[0]} step {self.published[1]}, the last position this loader wrote"
                if self.published is not None else "no position of this loader's, which never wrote it")

    def untold(self) -> str | None:
        """What a loader that leaves while its writes fail did not tell the daemon, and what to do; None where
        its last write went through (or it never tried one)."""
        if self._failing_since is None or self._failure is None:
            return None
        return (f"{self.path}: cannot write it ({self._failure.strerror or self._failure}, for "
                f"{time.monotonic() - self._failing_since:.0f} s) as the loader closes, so the daemon was not told "
                f"where this trainer stopped nor that it left: it goes by {self._told()}; {self._fix(self._failure)}")

    def _fix(self, exc: OSError) -> str:
        """What to do about writes failing with ``exc``; for a permission, whose the folder is (``no_access``)."""
        if exc.errno in DENIED:
            denied = no_access(self.buffer, write=True)
            if denied is not None:
                return denied
        return {errno.EISDIR: "remove the directory that took its name",
                errno.ENOSPC: "free space on the buffer's filesystem (what else fills it?)",
                errno.EACCES: "give this user write access to the buffer (its group, with --group-access)"}.get(
            exc.errno or 0, "check that the buffer directory exists, is writable and has free space")

    def _keep_trying(self, exc: OSError) -> bool:
        """A write failed with ``exc``: whether to try again at the next publish (within the grace), said when
        the failing starts, when its error changes and every ``PROGRESS_WRITE_WARN_SECONDS`` while it lasts."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        self._failures += 1
        self._failure = exc
        failing = now - self._failing_since
        if failing >= PROGRESS_WRITE_GRACE:
            return False
        error = exc.strerror or str(exc)
        if self._failure_said is None or self._failure_said[1] != error:
            until = time.strftime("%H:%M:%S", time.localtime(time.time() + PROGRESS_WRITE_GRACE - failing))
            logger.warning(
                "cannot write %s (%s); the loader goes on with the batches that are there and tries again at "
                "each batch and while it waits; still failing at %s (%.0f s from now), it stops with an error; %s",
                self.path, error, until, PROGRESS_WRITE_GRACE - failing, self._fix(exc))
        elif now - self._failure_said[0] >= PROGRESS_WRITE_WARN_SECONDS:
            logger.warning("still cannot write %s (%s) after %.0f s (%s failed); an error in %.0f s unless a "
                           "write goes through", self.path, error, failing, counted(self._failures, "write"),
                           PROGRESS_WRITE_GRACE - failing)
        else:
            return True
        self._failure_said = (now, error)
        return True

    def stale(self) -> bool:
        """While the loader waits: whether the file must be written again, because it does not name the
        position written last or because PROGRESS_REFRESH_SECONDS have passed since.

        Someone else rewound or damaged it (or the last write failed), and the daemon now builds
        other batches than the one the loader waits for; it would wait until its timeout. The
        refresh tells a daemon serving several consumers that this one waits rather than went
        silent (a silent consumer stops holding batches after --consumer-timeout).
        """
        try:
            current = Progress.read(self.buffer, self.consumer)
        except (ProtocolError, OSError):
            current = None
        if current is not None and (current.epoch, current.step) == self.published:
            return time.monotonic() - self._published_at >= PROGRESS_REFRESH_SECONDS
        if self.published is not None:
            self._check_alone(current)
            if self._stale_said.let_through() is not None:
                mine = f"this loader's position, epoch {self.published[0]} step {self.published[1]}"
                logger.warning("%s %s", self.path,
                               f"names epoch {current.epoch} step {current.step}, not {mine}; writing it again"
                               if current is not None else f"is not there, or cannot be read: writing {mine} again")
        return True

    def _check_alone(self, current: Progress | None) -> None:
        """Raise when ``current``, this consumer's progress as read, was written by another trainer that is
        still there and has not left.  Two trainers taking turns at one consumer's progress each make the
        daemon build the other's batches, and the first to finish ends the daemon's job under the other."""
        if current is None or not _another_trainer(current):
            return
        mine = f"epoch {self.published[0]} step {self.published[1]}" if self.published else "its start"
        raise LoaderError(
            f"{self.path}: another trainer ({writer_named(current)}) reads {self.buffer} as {self.who} too, at epoch {current.epoch} step {current.step} while this one is at {mine}. Several trainers on "
            "one buffer each need a consumer name of their own: --consumer NAME (BufferLoader(consumer=NAME))"
        )


def live_positions(directory: Path, job: str, dir_fd: int, but: str) -> list[tuple[int, int]]:
    """The positions the consumers of ``directory`` (listed through its fd ``dir_fd``) other than ``but`` need next,
    in job ``job``, of those whose writer is known to be there and has not left: where a newcomer joins the others
    when no batch waits.  An unreadable file, or one of another job, is no one's to follow."""
    positions = []
    for consumer in consumer_files(directory, dir_fd):
        if consumer == but:
            continue
        try:
            progress = Progress.read(directory, consumer, dir_fd)
        except (ProtocolError, OSError):
            continue
        if (progress is not None and progress.job == job and not progress.closed
                and writer_alive(directory, consumer, progress, dir_fd)):
            positions.append((progress.epoch, progress.step))
    return positions


__all__ = ["ALONE_CHECK_SECONDS", "PROGRESS_WRITE_GRACE", "PROGRESS_WRITE_WARN_SECONDS", "ProgressFile", "live_positions"]
