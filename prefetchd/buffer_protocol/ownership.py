"""Who owns a buffer: the one daemon that holds ``daemon.lock`` (``DaemonLock``), which live daemon that is
(``daemon_owner``, ``daemon_pid``), and whether a pid named in a document is still the live process that wrote
it (``alive_since``), or, for a consumer's progress, whether its writer is still there (``writer_alive``).

Across pid namespaces (the daemon and a trainer in different containers sharing the tmpfs) a pid names no
process of the reader's, or an unrelated one, so a process of another namespace is judged by a lock it holds
instead, asked for a moment (``_held``): the daemon by ``daemon.lock``, a trainer by its consumer's lock file.
A daemon of the reader's namespace is judged by both its pid and its lock."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from prefetchd.buffer_protocol.errors import ProtocolError
from prefetchd.buffer_protocol.layout import DIR_FLAGS, LOCK_NAME, Dir, at, consumer_lock_name, owning_buffer
from prefetchd.buffer_protocol.json_files import open_regular
from prefetchd.buffer_protocol.progress import Progress, pid_namespace
from prefetchd.buffer_protocol.status import Status, TrainerStatus
from prefetchd.buffer_protocol.status_file import readable_status


# Whether a process of another pid namespace is there is asked of its lock, by taking it for a moment
# (microseconds): the daemon asks a consumer's lock file (``consumer_held``), a reader asks daemon.lock
# (``daemon_owner``).  Whoever takes such a lock and is refused tries again this long
# (``take_lock``) before it takes the holder for another trainer, or another daemon.
LOCK_RETRY_SECONDS = 0.5


class BufferBusy(ProtocolError):
    """Another live daemon owns the buffer."""


class DaemonLock:
    """One daemon per buffer: an flock on ``daemon.lock`` that holds the owner's pid.

    The kernel drops an flock when its holder dies, so a SIGKILLed daemon never
    leaves a stale lock behind.

    The file is ``LOCK_MODE`` (less the umask): readers need its pid (``daemon_owner``), nobody
    but the owner writes it, and nobody runs it.  flock(2) needs only a read-only descriptor, so
    whoever may read the file can also hold the lock and keep a daemon from starting: with
    --group-access that is any member of the buffer's group (systemd/README.md, "who it runs as").
    A reader asks whether the lock is held by taking it shared for a moment (``daemon_owner``), so a
    daemon refused it tries again briefly (``take_lock``).
    """

    LOCK_MODE = 0o644

    def __init__(self, buffer: Dir) -> None:
        self.path = Path(buffer) / LOCK_NAME
        self._fd: int | None = None
        self._directory: tuple[int, int] | None = None  # (st_dev, st_ino) of the buffer when locked
        # The buffer folder the lock file is in, held open: what the daemon writes at its top (status.json) goes
        # there, never into another folder made under the buffer's name once this one was removed or replaced.
        self.dir_fd: int | None = None
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
            taken = take_lock(fd)
        except OSError:
            os.close(fd)
            raise
        if not taken:
            os.close(fd)
            raise BufferBusy(self._held_by(daemon_owner(self.path.parent)))
        try:
            dir_fd: int | None = os.open(self.path.parent, DIR_FLAGS)
        except OSError:
            dir_fd = None
        try:
            ours = dir_fd is not None and self._names(fd, dir_fd)
        except FileNotFoundError:
            ours = False
        if dir_fd is None or not ours:  # its holder removed it after this opened it, or the folder was replaced
            if dir_fd is not None:
                os.close(dir_fd)
            os.close(fd)
            return False
        try:
            _write_pid(fd)
        except OSError:  # no page for it (ENOSPC): the start is refused, leaving no lock file it made
            if created:
                with contextlib.suppress(OSError):
                    if self._names(fd):
                        os.unlink(self.path)
            os.close(fd)
            os.close(dir_fd)
            raise
        self._fd, self.dir_fd = fd, dir_fd
        self._created = created
        directory = os.fstat(dir_fd)
        self._directory = (directory.st_dev, directory.st_ino)
        return True

    def _held_by(self, owner: DaemonOwner | None) -> str:
        buffer = self.path.parent
        if owner is not None:
            return (f"{buffer}: buffer is owned by a running daemon ({owner}); stop it with {owner.how_to_stop(buffer)}, "
                    "or pick another --buffer")
        # No live pid in the file: whoever holds the flock is no prefetchd daemon (a daemon
        # writes its pid right after it takes the lock and blanks it just before it lets go).
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
        except NotADirectoryError:  # the path's buffer is a file now
            what = "the buffer directory was replaced by a file"
        except OSError:
            return None  # cannot tell now (EACCES, ENOMEM): asked again at the next look
        # Only to say what happened: a directory's inode number is not stable on every filesystem (overlayfs).
        try:
            directory = os.stat(buffer)
        except FileNotFoundError:
            return f"{buffer}: the buffer directory was removed"
        except OSError:
            return f"{buffer}: {what}"
        if not stat.S_ISDIR(directory.st_mode):
            return f"{buffer}: the buffer directory was replaced by a file"
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

    def _names(self, fd: int, dir_fd: int | None = None) -> bool:
        """Whether the lock's path (its name in the folder of ``dir_fd`` where given) still names the file open
        as ``fd``; OSError where it cannot be looked at (FileNotFoundError: nothing there)."""
        there = os.stat(at(self.path, dir_fd), dir_fd=dir_fd, follow_symlinks=False)
        mine = os.fstat(fd)
        return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self) -> None:
        """Let go, the pid blanked first (``_blank_pid``): the file names no daemon from then on."""
        if self._fd is not None:
            _blank_pid(self._fd)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        if self.dir_fd is not None:
            os.close(self.dir_fd)
            self.dir_fd = None


def _write_pid(fd: int) -> None:
    """Write this process's pid into the lock file ``fd`` over what it holds (the blanks of a daemon that let go,
    the pid of one that died): at offset 0, then cut to its length.  A file that holds anything has its page, and
    a write into it needs no other: a daemon restarted on a full tmpfs can still say who owns the buffer.  Only an
    empty file (new, or emptied by a daemon of an earlier 0.1 build) needs a page: OSError (ENOSPC) where there is
    none.  A reader between the two steps may find the pid with the end of a longer one after it: no pid, as in
    an empty file, while a daemon that is taking the lock is not one yet."""
    data = f"{os.getpid()}\n".encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def _blank_pid(fd: int) -> None:
    """Overwrite the lock file's pid with spaces, its length kept, so that it names no daemon (SPEC rule 4) and
    keeps its page for the next daemon's pid (``_write_pid``): a daemon stopped and started again while the tmpfs is
    full would otherwise find no page to write its pid in.  Where the write fails, the file is emptied instead,
    which takes no space."""
    try:
        os.pwrite(fd, b" " * os.fstat(fd).st_size, 0)
    except OSError:
        os.ftruncate(fd, 0)


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


def started_after(pid: int | None, namespace: int | None, since: float) -> bool:
    """Whether ``pid`` (of pid namespace ``namespace``, as a progress document names its writer) is a live process
    of this pid namespace started after ``since`` (a time.time()); False where that cannot be told, or within the
    second of slack ``create_time()`` has (``_started_by``)."""
    if pid is None or namespace is None or not same_pid_namespace(namespace):
        return False
    try:
        return bool(psutil.Process(pid).create_time() > since + 1.0)
    except psutil.Error:
        return False


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


def service_unit(pid: int) -> str | None:
    """The systemd service ``pid`` runs in, from /proc/PID/cgroup (a unit's processes are in its cgroup, v1 and v2
    alike): "prefetchd@train.service"; None where it runs in none.  OSError where its cgroups cannot be read (no
    /proc, hidepid, gone): whether it runs in one is not known."""
    with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
        found = re.search(r"/([^/\s]+\.service)$", f.read(), re.MULTILINE)
    return found[1] if found else None


def same_pid_namespace(namespace: int | None) -> bool:
    """Whether a pid a process of ``namespace`` wrote (a ``Progress.pid_namespace``, a ``Status.pid_namespace``)
    names the same process here: ``namespace`` is this process's, or one of the two is unknown (a writer that
    predates the field, no /proc), where a pid is taken as it always was."""
    ours = pid_namespace()
    return namespace is None or ours is None or namespace == ours


def pid_named(pid: int | None, here: bool) -> str:
    """"pid N", as messages name a process, saying so where N is its number in another pid namespace than this
    process's (``here`` false): there it names no process, or an unrelated one.  "pid unknown" for None (a progress
    document of an older writer has none)."""
    if pid is None:
        return "pid unknown"
    return f"pid {pid}" + ("" if here else " of another pid namespace")


def writer_named(writer: Progress | TrainerStatus) -> str:
    """``pid_named`` for the writer of a progress document: ``writer`` is the document, or what the daemon's
    status says of its writer."""
    return pid_named(writer.pid, same_pid_namespace(writer.pid_namespace))


def writer_alive(directory: Dir, consumer: str, progress: Progress, dir_fd: int | None = None) -> bool | None:
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
        return consumer_held(directory, consumer, dir_fd) if progress.locked else None
    if progress.pid is None or progress.time is None:
        return None
    return alive_since(progress.pid, progress.time)


def take_lock(fd: int) -> bool:
    """flock ``fd`` exclusively; False where another holds it, still after trying again for LOCK_RETRY_SECONDS:
    a reader may be asking whether it is held, for a moment (``consumer_held``, ``daemon_owner``).  OSError
    where it cannot be locked at all (a filesystem without flock)."""
    deadline = time.monotonic() + LOCK_RETRY_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
        time.sleep(0.01)


def consumer_held(directory: Dir, consumer: str, dir_fd: int | None = None) -> bool | None:
    """Whether a process holds ``consumer``'s lock file in ``directory`` (SPEC rule 9); None when that cannot
    be told: the file is missing (its holder may lock one unlinked since), not a regular file, not readable
    by this user, or on a filesystem without flock (``_held``)."""
    try:
        fd = open_regular(Path(directory) / consumer_lock_name(consumer), os.O_RDONLY, "a consumer's lock file",
                          dir_fd=dir_fd)
    except (OSError, ProtocolError):
        return None
    try:
        return _held(fd)
    finally:
        os.close(fd)


def _held(fd: int) -> bool | None:
    """Whether another open file holds an flock on ``fd``'s file; None on a filesystem without flock.

    There is no asking the kernel who holds an flock without taking it (/proc/locks hides a holder of
    another pid namespace), so this takes a shared lock and lets go at once.  Whoever locks the file in
    those microseconds is refused and tries again (``take_lock``)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def lock_file_held(path: Path) -> bool:
    """Whether some open file holds the flock on the lock file at ``path`` (False where there is none, or the
    filesystem has no flock).  Another open file of this process counts too: not for the daemon's own lock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return _held(fd) is True
    finally:
        os.close(fd)


def lock_holders(path: Path) -> set[int] | None:
    """Pids of the processes holding an flock on ``path``'s file, as this process's /proc numbers them (the process
    that took each lock); an empty set where ``path`` is gone; None where /proc/locks cannot be read (no /proc).

    For `prefetchd stop`, before it signals the pid daemon.lock names: from a daemon taking the lock until it writes
    its first status.json, which says its pid namespace, a reader of another namespace takes that pid for one of its
    own (``daemon_owner``), and a process with that number here (pid 1 of a container is the host's init) is no
    daemon.  A holder the reading /proc's pid namespace does not see, the kernel leaves out (older kernels show 0).
    A lock's file is matched by its inode number alone: the device /proc/locks prints is the kernel's superblock's,
    which stat(2) reports otherwise on a btrfs subvolume or an overlayfs, where `prefetchd stop` would then always
    refuse.  Another file of the same number on another filesystem, locked by the very pid daemon.lock names, is
    the one confusion left."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return set()
    try:
        # Bytes, parsed as bytes: no codec to look up, which a process that dropped root's euid may not import.
        with open("/proc/locks", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    inode = b":%d" % st.st_ino
    holders = set()
    for line in lines:
        # "1: FLOCK  ADVISORY  WRITE 4957 00:1b:1091607 0 EOF"; a process waiting for it: "1: -> FLOCK ..."
        fields = line.split()
        if (fields[1:2] == [b"FLOCK"] and len(fields) > 5 and fields[5].endswith(inode) and fields[4].isdigit()
                and int(fields[4]) > 0):
            holders.add(int(fields[4]))
    return holders


@dataclass(frozen=True)
class DaemonOwner:
    """The live daemon owning a buffer (``daemon_owner``)."""

    pid: int  # as daemon.lock and status.json name it: the daemon's pid in its own pid namespace
    # The daemon's pid namespace where it is another than this process's (its status.json says so): then ``pid``
    # names no process here, or an unrelated one, never to be looked at or signalled.  None: this process's.
    pid_namespace: int | None = None

    @property
    def here(self) -> bool:
        """Whether ``pid`` names the daemon in this process's pid namespace, to be looked at or signalled."""
        return self.pid_namespace is None

    @property
    def where(self) -> str:
        """What follows a command that looks at or signals this daemon by its pid, for messages: "" for a daemon of
        this pid namespace, where it runs otherwise."""
        if self.here:
            return ""
        return " where it runs (its container, or the host): here its pid names another process, or none"

    def how_to_stop(self, buffer: Dir) -> str:
        """How to stop this daemon, owning ``buffer``, as messages say it: a service's through systemctl, which
        `prefetchd stop` would leave inactive as if it had been stopped that way."""
        command = f"`prefetchd stop --buffer {owning_buffer(Path(buffer))}`"
        if self.here:
            try:
                unit = service_unit(self.pid)
            except OSError:  # not known: the command that signals it
                unit = None
            return f"`systemctl stop {unit}` (its service)" if unit is not None else command
        return f"{command}{self.where} (or stop its service or container there: `systemctl stop`, `docker stop`)"

    def stopped_note(self) -> str | None:
        """What to do about this daemon where it is stopped (SIGSTOP, Ctrl-Z in its terminal, a debugger's stop), for
        messages that would otherwise quote its last status as if it ran: it beats again once continued, so
        restarting it is not the fix.  None where it runs, is of another pid namespace, or cannot be looked at."""
        if not self.here:
            return None
        try:
            stopped = psutil.Process(self.pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
        except psutil.Error:
            return None
        if not stopped:
            return None
        return (f"the daemon ({self}) is stopped (SIGSTOP, Ctrl-Z in its terminal, or a debugger), so it builds "
                f"nothing: `kill -CONT {self.pid}` (or `fg` in its shell) lets it go on where it was")

    def __str__(self) -> str:
        return pid_named(self.pid, self.here)

    def wrote(self, status: Status | None) -> bool:
        """Whether ``status`` is this daemon's own, its heartbeat this daemon's: written by its pid in its pid
        namespace, not by an earlier daemon (two daemons' own pids are compared, whichever namespace they are of)."""
        return (status is not None and status.pid == self.pid
                and _other_namespace(status.pid_namespace) == self.pid_namespace)


def _other_namespace(namespace: int | None) -> int | None:
    """``namespace``, a writer's, where it is known to be another than this process's; None otherwise."""
    return None if same_pid_namespace(namespace) else namespace


def daemon_owner(buffer: Dir, status: Status | None = None) -> DaemonOwner | None:
    """The live daemon owning ``buffer``, or None (SPEC rules 4 and 8).  For a rank's stream directory the owner
    is the parent buffer's daemon.  ``status``: the buffer's status.json where the caller has just read it (it is
    read here otherwise).

    daemon.lock names the owner's pid.  Where status.json, written by that pid, says it is of another pid
    namespace than this process's (a daemon on the host or in another container sharing the tmpfs), the pid
    names no process here, or an unrelated one (pid 1 of a container is the host's init): that daemon runs
    while the lock is held (``_held``; an flock is the kernel's, one for every namespace).  Otherwise it runs
    while the lock is held too, and a process has the pid, started before the lock file's mtime (which rules
    out a pid reused after the owner died) and runs as the file's owner.  The lock alone would let whoever
    can read the file pass for a daemon (``DaemonLock``); the pid alone took the host's init for a daemon of
    another namespace killed before its first status said so, which leaves its own pid 1 in the file.  On a
    filesystem without flock the pid alone decides.
    """
    found = _owner_or_why_not(owning_buffer(buffer), status)
    return found if isinstance(found, DaemonOwner) else None


def why_no_owner(buffer: Dir, status: Status | None = None) -> str | None:
    """Why ``daemon_owner`` finds no daemon owning ``buffer``, in words that follow "no daemon owns it: "; None
    where one owns it now.  A trainer that gives up on a daemon says it: where the status beats on, the reason is
    what to look at (a lock file removed, a pid another process has now)."""
    found = _owner_or_why_not(owning_buffer(buffer), status)
    return None if isinstance(found, DaemonOwner) else found


def _owner_or_why_not(buffer: Path, status: Status | None) -> DaemonOwner | str:
    """``daemon_owner``'s look: the owner, or why there is none."""
    lock = buffer / LOCK_NAME
    try:
        fd = open_regular(lock, os.O_RDONLY, "the daemon's lock file")
    except FileNotFoundError:
        return f"there is no {lock}"
    except (OSError, ProtocolError) as exc:  # not a lock a daemon made: nobody owns the buffer
        return str(exc)
    try:
        text = os.read(fd, 64).decode("ascii", "replace").strip()
        st = os.fstat(fd)
        if not text.isdigit():
            return f"{lock} names no pid (its daemon let go of it)"
        pid = int(text)
        namespace = _namespace_of(buffer, pid, status)
        held = _held(fd)
        if namespace is not None:
            if held:
                return DaemonOwner(pid, namespace)
            return f"nothing holds {lock} (its daemon, {pid_named(pid, False)}, ended)"
    finally:
        os.close(fd)
    if held is False:  # let go: whatever process has that pid here now, no daemon owns the buffer
        try:
            ended = not _started_by(pid, st.st_mtime)
        except psutil.AccessDenied:
            ended = False
        if ended:
            return f"pid {pid}, which {lock} names, has ended"
        return f"nothing holds {lock}, whose pid {pid} let go of it"
    try:
        if not _started_by(pid, st.st_mtime):
            return (f"pid {pid}, which {lock} names, is not running, or is another process started after the file "
                    "was written")
        if not _runs_as(pid, st.st_uid):
            return f"pid {pid}, which {lock} names, runs as another user than the file's owner"
    except psutil.AccessDenied:
        return f"pid {pid}, which {lock} names, cannot be looked at by this user"
    return DaemonOwner(pid)


def _namespace_of(buffer: Path, pid: int, status: Status | None) -> int | None:
    """The pid namespace of daemon ``pid`` of ``buffer`` as its status.json (``status``, or read now) says, where it
    is another than this process's; None where it is this one's or cannot be told (no status of that pid yet, one
    of a daemon that predates the field, one that cannot be read): the pid is then looked up here, as it always
    was."""
    if status is None:
        status = readable_status(buffer)
    return _other_namespace(status.pid_namespace) if status is not None and status.pid == pid else None


def daemon_pid(buffer: Dir) -> int | None:
    """Pid of the live daemon owning ``buffer`` where that pid names it here, to be looked at or signalled; None
    where no daemon owns it, and for one of another pid namespace (``daemon_owner`` tells of that one)."""
    owner = daemon_owner(buffer)
    return owner.pid if owner is not None and owner.here else None


def _runs_as(pid: int, uid: int) -> bool:
    """Whether ``pid`` runs as ``uid``, the owner of the lock file naming it.  A daemon creates its lock as
    itself; one renamed into place by whoever may write the buffer (a group member) is theirs, and could
    name any process, with an mtime to match: `prefetchd stop` run as root would SIGTERM it.  A process
    /proc hides (hidepid) counts: the caller cannot signal it either."""
    try:
        return bool(psutil.Process(pid).uids().effective == uid)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return True
