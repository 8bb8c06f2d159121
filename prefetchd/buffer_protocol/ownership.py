"""Who owns a buffer: the one daemon that holds ``daemon.lock`` (``DaemonLock``), and whether a pid
named in a document is still the live process that wrote it (``alive_since``, ``daemon_pid``), or, for a
consumer's progress, whether its writer is still there (``writer_alive``), also from another pid namespace."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path

import psutil

from prefetchd.buffer_protocol.errors import ProtocolError
from prefetchd.buffer_protocol.layout import LOCK_NAME, Dir, consumer_lock_name, owning_buffer
from prefetchd.buffer_protocol.documents import Progress, open_regular, pid_namespace


class BufferBusy(ProtocolError):
    """Another live daemon owns the buffer."""


class DaemonLock:
    """One daemon per buffer: an flock on ``daemon.lock`` that holds the owner's pid.

    The kernel drops an flock when its holder dies, so a SIGKILLed daemon never
    leaves a stale lock behind.

    The file is ``LOCK_MODE`` (less the umask): readers need its pid (``daemon_pid``), nobody
    but the owner writes it, and nobody runs it.  flock(2) needs only a read-only descriptor, so
    whoever may read the file can also hold the lock and keep a daemon from starting: with
    --group-access that is any member of the buffer's group (systemd/README.md, "who it runs as").
    """

    LOCK_MODE = 0o644

    def __init__(self, buffer: Dir) -> None:
        self.path = Path(buffer) / LOCK_NAME
        self._fd: int | None = None
        self._directory: tuple[int, int] | None = None  # (st_dev, st_ino) of the buffer when locked
        self._created = False  # acquire() made the file, so nothing else had been there

    def acquire(self) -> None:
        """Take the buffer, or raise BufferBusy.  A lock file removed by the holder that let go (``remove``)
        after this opened it is tried again: a lock on a file no longer at the path keeps nobody out."""
        for _ in range(10):
            if self._take():
                return
        raise ProtocolError(f"{self.path}: replaced again and again while this daemon locked it; find who removes "
                            f"it (`fuser -v {self.path}`), or pick another --buffer")

    def _take(self) -> bool:
        try:  # O_EXCL first, to know whether this daemon made the file (``remove`` deletes only such a one)
            fd = open_regular(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, "the daemon's lock file", self.LOCK_MODE)
            created = True
        except FileNotFoundError:  # the folder itself: made by another daemon whose start was refused, and removed
            raise ProtocolError(f"{self.path.parent}: the buffer folder was removed while this daemon took it "
                                "(by hand, or by another daemon's refused start, which removes a folder it made); "
                                "start again") from None
        except FileExistsError:
            try:
                fd = open_regular(self.path, os.O_RDWR, "the daemon's lock file")
            except FileNotFoundError:  # removed since: made again at the next try
                return False
            created = False
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_nlink != 1:
            os.close(fd)
            # Another user's file (or a hard link to one) would get our pid written into it.
            raise ProtocolError(f"{self.path}: belongs to uid {st.st_uid} or has {st.st_nlink} links, so this "
                                f"daemon (uid {os.geteuid()}) did not create it; remove it, or pick another --buffer")
        if stat.S_IMODE(st.st_mode) & ~self.LOCK_MODE:
            # One made by an older daemon (0777 less the umask: group-writable under UMask=0007).
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & self.LOCK_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise BufferBusy(self._held_by(daemon_pid(self.path.parent))) from None
            raise
        try:
            ours = self._names(fd)
        except FileNotFoundError:
            ours = False
        if not ours:
            os.close(fd)  # its holder removed it after this opened it
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        self._created = created
        directory = os.stat(self.path.parent)
        self._directory = (directory.st_dev, directory.st_ino)
        return True

    def _held_by(self, pid: int | None) -> str:
        buffer = self.path.parent
        if pid is not None:
            return (f"{buffer}: buffer is owned by a running daemon (pid {pid}); stop it with "
                    f"`prefetchd stop --buffer {buffer}` or pick another --buffer")
        # No live pid in the file: whoever holds the flock is no prefetchd daemon (a daemon
        # writes its pid right after it takes the lock and empties the file just before it lets go).
        return (f"{buffer}: {self.path} is locked by a process that is not a running prefetchd daemon (pid "
                "unknown: the file names no live daemon; any user who can read the file can lock it); find it "
                f"with `fuser -v {self.path}` and end it, or pick another --buffer")

    def lost(self) -> str | None:
        """Why this lock no longer keeps the buffer to its holder, or None while it does: ``daemon.lock``
        was removed, or the buffer directory removed or replaced (``rm -rf`` and ``mkdir``, another
        buffer moved there), so the path's lock is another file, which another daemon may take."""
        assert self._fd is not None, "acquire() first"
        buffer = self.path.parent
        try:
            if self._names(self._fd):
                return None  # the file locked, so the directory it is in: nothing else decides
            what = f"{LOCK_NAME} was removed and made again"
        except FileNotFoundError:
            what = f"{LOCK_NAME} was removed"
        except OSError:
            return None  # cannot tell now (EACCES, ENOMEM): asked again at the next look
        # Only to say what happened: a directory's inode number is not stable on every filesystem (overlayfs).
        try:
            directory = os.stat(buffer)
        except FileNotFoundError:
            return f"{buffer}: the buffer directory was removed"
        except OSError:
            return f"{buffer}: {what}"
        replaced = (directory.st_dev, directory.st_ino) != self._directory
        return f"{buffer}: " + ("the buffer directory was replaced by another" if replaced else what)

    def remove(self) -> None:
        """Let go and delete the lock file, if acquire() made it (a refused start leaves the buffer as it
        found it).  Deleted while still locked, and only while the path is still the file locked: a daemon
        that opened it meanwhile finds it gone once it has the lock, and makes a new one."""
        if self._fd is not None and self._created:
            with contextlib.suppress(OSError):
                if self._names(self._fd):
                    os.unlink(self.path)
        self.release()

    def _names(self, fd: int) -> bool:
        """Whether the lock's path still names the file open as ``fd``; OSError where it cannot be looked
        at (FileNotFoundError: nothing there)."""
        there, mine = os.stat(self.path), os.fstat(fd)
        return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def alive_since(pid: int, since: float) -> bool:
    """Whether process ``pid`` exists, is no zombie and was started by ``since`` (a time.time()).

    The start time rules out a pid the kernel reused for another process after the
    one that wrote ``since`` (a lock, a progress file) died.  A process of another
    user counts as alive when it exists, also where /proc hides it (hidepid, systemd's
    ProtectProc=invisible: the service's sandbox), so its start time cannot be read.
    """
    try:
        return _started_by(pid, since)
    except psutil.AccessDenied:
        return True


def _started_by(pid: int, since: float) -> bool:
    """``pid`` is a live process (a zombie has released its locks already) started by ``since``;
    psutil.AccessDenied is left to the caller."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        started: float = proc.create_time()
    except psutil.ZombieProcess:
        return False
    except psutil.NoSuchProcess:
        return _hidden(pid)
    # create_time() is derived from boot time and jiffies: a second of slack.
    return started <= since + 1.0


def _hidden(pid: int) -> bool:
    """A pid /proc does not show that the kernel still has: signal 0 checks that it exists, and
    fails with EPERM for another user's process, where ESRCH says it is gone."""
    if pid <= 0:  # kill(0, ...) and kill(-1, ...) address process groups
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True
    except (ProcessLookupError, OverflowError):
        return False
    return True  # ours to signal, yet not in /proc: it appeared as psutil looked (a zombie is ZombieProcess)


def same_pid_namespace(namespace: int | None) -> bool:
    """Whether a pid a process of ``namespace`` wrote (a ``Progress.pid_namespace``) names the same process
    here: ``namespace`` is this process's, or one of the two is unknown (a writer that predates the field, no
    /proc), where a pid is taken as it always was."""
    ours = pid_namespace()
    return namespace is None or ours is None or namespace == ours


def writer_named(progress: Progress) -> str:
    """"pid N" of ``progress``'s writer, as messages name it, saying so where N is of another pid namespace."""
    return f"pid {progress.pid}" + ("" if same_pid_namespace(progress.pid_namespace) else " of another pid namespace")


def writer_alive(directory: Dir, consumer: str, progress: Progress) -> bool | None:
    """Whether the process that wrote ``progress``, ``consumer``'s document in ``directory``, is still there;
    None when it cannot be told (SPEC rule 8).

    A writer of this pid namespace is judged by its ``pid`` and ``time`` (``alive_since``).  The pid of a
    writer in another pid namespace (a trainer in another container sharing the tmpfs) names nobody here,
    or an unrelated process: pid 1 of a container is the host's init.  Such a writer is judged by the
    consumer's lock file instead, when its document says it holds it (``locked``): an flock is one lock
    of the kernel's, seen from every namespace, held while the writer's loader is open and let go by
    the kernel when it dies.  Without the lock, whether it is there is unknown: the consumer timeout
    (its ``time``) alone ends its hold.
    """
    if not same_pid_namespace(progress.pid_namespace):
        return consumer_held(directory, consumer) if progress.locked else None
    if progress.pid is None or progress.time is None:
        return None
    return alive_since(progress.pid, progress.time)


def consumer_held(directory: Dir, consumer: str) -> bool | None:
    """Whether a process holds ``consumer``'s lock file in ``directory`` (SPEC rule 9); None when that cannot
    be told: the file is missing (its holder may lock one unlinked since), not a regular file, not readable
    by this user, or on a filesystem without flock.

    There is no asking the kernel who holds an flock without taking it (/proc/locks hides a holder of
    another pid namespace), so this takes a shared lock and lets go at once.  A trainer locking the file
    in those microseconds is refused and tries again (CONSUMER_LOCK_RETRY_SECONDS)."""
    try:
        fd = open_regular(Path(directory) / consumer_lock_name(consumer), os.O_RDONLY, "a consumer's lock file")
    except (OSError, ProtocolError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def daemon_pid(buffer: Dir) -> int | None:
    """Pid of the live daemon owning ``buffer``, or None.

    Reads the pid the owner wrote and checks that process exists, is older than
    the lock file (which rules out a pid reused after the owner died) and runs as
    the file's owner.
    For a rank's stream directory the owner is the parent buffer's daemon.
    """
    path = owning_buffer(buffer) / LOCK_NAME
    try:
        fd = open_regular(path, os.O_RDONLY, "the daemon's lock file")
    except (OSError, ProtocolError):  # missing, or not a lock a daemon made: nobody owns the buffer
        return None
    try:
        text = os.read(fd, 64).decode("ascii", "replace").strip()
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if not text.isdigit():
        return None
    pid = int(text)
    try:
        return pid if _started_by(pid, st.st_mtime) and _runs_as(pid, st.st_uid) else None
    except psutil.AccessDenied:
        return None


def _runs_as(pid: int, uid: int) -> bool:
    """Whether ``pid`` runs as ``uid``, the owner of the lock file naming it.  A daemon creates its lock as
    itself; one renamed into place by whoever may write the buffer (a group member) is theirs, and could
    name any process, with an mtime to match: `prefetchd stop` run as root would SIGTERM it.  A process
    /proc hides (hidepid) counts: the caller cannot signal it either."""
    try:
        return bool(psutil.Process(pid).uids().effective == uid)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return True
