"""The buffer directory: made for this user (or its group) and checked before use, its rank
streams made alike, another job's batches cleared, and whether its filesystem holds the job."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Container, Iterator
from pathlib import Path

from prefetchd.buffer_protocol import BatchLayout, Manifest, ProtocolError, daemon_owner, list_batches
from prefetchd.buffer_protocol.layout import (ACCEPTED_JOB_NAME, DIR_FLAGS, JOB_NAME, MANIFEST_NAME, STREAM_PREFIX,
                                             LOCK_NAME, STATUS_NAME, STREAM_RE, consumer_of, is_consumer_lock, is_temp_name,
                                             parse_batch_name)
from prefetchd.access import group_name, nearest_existing, user_name
from prefetchd.daemon.cgroup_limits import memory_limit
from prefetchd.daemon.config import DaemonConfig, held_bytes
from prefetchd.daemon.errors import ConfigError, DaemonError
from prefetchd.daemon.logs import log_once
from prefetchd.daemon.mounts import RAM_FILESYSTEMS, filesystem_of, huge_pages, huge_pages_hint
from prefetchd.words import binary_size

log = logging.getLogger(__name__)

BUFFER_MODE = 0o700  # batches are the user's data; the trainer runs as the same user
GROUP_BUFFER_MODE = 0o2770  # --group-access: setgid, so files trainers create there get the buffer's group


def prepare_buffer(buffer: Path, group_access: bool = False) -> bool:
    """Create the buffer directory for this user alone (or its group, when asked), or check
    that an existing one is safe to use; refuse it otherwise, saying how to fix it.  True when
    this created it."""
    mode = GROUP_BUFFER_MODE if group_access else BUFFER_MODE
    created = False
    try:
        buffer.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(buffer, mode)
        created = True
        chmod_dir(buffer, mode)  # mkdir's mode goes through the umask and drops setgid
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot create buffer directory {buffer}: {exc.strerror}; pick a writable path such as /dev/shm/bf") from None
    if os.statvfs(buffer).f_flag & os.ST_RDONLY:
        # Before the mode's checks: a chmod, or "fix its permissions", cannot mend a read-only mount (a walk).
        raise ConfigError(f"buffer directory {buffer} is on a read-only filesystem; remount it read-write "
                          f"(`mount -o remount,rw {filesystem_of(buffer).point}`) or pick another --buffer")
    check_not_shared(buffer)
    check_private_dir(buffer, group_access)
    if not os.access(buffer, os.W_OK | os.X_OK):
        raise ConfigError(f"buffer directory {buffer} is not writable by this user; fix its permissions or pick another --buffer")
    return created


def note_buffer_filesystem(buffer: Path) -> None:
    """Say once where the buffer's pages live: a disk (every batch goes through it), or a tmpfs
    that could use huge pages.  After the lock: a second daemon on the buffer only says it is taken."""
    mount = filesystem_of(buffer)
    if mount.fstype not in RAM_FILESYSTEMS:
        log.warning(
            "buffer %s is on %s (mounted at %s), not a RAM disk: every batch goes through that disk; "
            "use a directory under /dev/shm or another tmpfs", buffer, mount.fstype, mount.point,
        )
    elif huge_pages(mount) is False:
        log.info("%s", huge_pages_hint(buffer, mount))


def make_stream_dir(directory: Path, group_access: bool) -> int:
    """A rank's stream directory, with the buffer's mode and the same checks: its fd (``DIR_FLAGS``), which
    the caller closes.  Work in it goes through the fd (``Stream``): a group member may rename entries of
    a --group-access buffer, and the path may lead elsewhere the next time it is looked up."""
    mode = GROUP_BUFFER_MODE if group_access else BUFFER_MODE
    try:
        os.mkdir(directory, mode)
    except FileExistsError:
        pass
    else:
        with contextlib.suppress(OSError):  # replaced meanwhile (a link: ELOOP): check_private_dir says by what
            chmod_dir(directory, mode)
    check_private_dir(directory, group_access)
    try:
        fd = os.open(directory, DIR_FLAGS)
    except OSError as exc:
        why = (": it was replaced while the daemon made it; a member of the buffer's group renames its entries?"
               if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT) else "")
        raise ConfigError(f"cannot open stream folder {directory} ({exc.strerror}){why}") from None
    if os.fstat(fd).st_uid != os.geteuid():
        os.close(fd)
        raise ConfigError(f"stream folder {directory} was replaced by someone else's while the daemon made it; a "
                          "member of the buffer's group renames its entries?")
    return fd


def chmod_dir(path: Path, mode: int) -> None:
    """chmod the directory at ``path``, never through a link: a stream directory is made inside a buffer its
    group may write, where a member could swap in a link between the mkdir and the chmod (chmod follows
    links), and the daemon would open another of its user's folders to the group.  OSError (ELOOP) then."""
    fd = os.open(path, DIR_FLAGS)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def check_not_shared(buffer: Path) -> None:
    """Refuse a folder every user shares (sticky and world-writable: /dev/shm, /tmp) as the buffer itself.

    ``--buffer /dev/shm`` was refused as any world-writable buffer is, with "`chmod 700 /dev/shm`, or remove
    it" (or, for a user who is not root, "remove it (or chown it)"): advice that breaks every other program's
    shared memory.  The buffer is a folder of the daemon's own inside such a one."""
    try:
        st = os.lstat(buffer)
    except OSError:
        return  # not there (yet): nothing shared; check_private_dir says what else is wrong
    if stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX and st.st_mode & stat.S_IWOTH:
        raise ConfigError(f"buffer {buffer} is a folder every user shares (mode {stat.S_IMODE(st.st_mode):04o}, as "
                          "/dev/shm and /tmp are), not one the daemon can keep to itself: give it a folder of its own "
                          f"there, such as --buffer {buffer / 'bf'}")


def check_private_dir(path: Path, group_access: bool) -> None:
    """Refuse a directory others could plant files in: the trainer maps what it finds there.

    It must be a real directory (not a symlink) owned by this user, writable by nobody
    else, except its group with ``group_access``.
    """
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise ConfigError(f"cannot use buffer directory {path}: {exc.strerror}") from None
    problem = private_dir_problem(path, st, group_access)
    if problem is not None:
        raise ConfigError(problem)
    perms = stat.S_IMODE(st.st_mode)
    if group_access and perms & 0o770 != 0o770:
        chmod_dir(path, GROUP_BUFFER_MODE)  # ours, and the user asked for the group
        log.info("buffer directory %s: mode %04o -> %04o for --group-access", path, perms, GROUP_BUFFER_MODE)
    elif not group_access and perms & 0o077:
        # Once: a one-rank job's stream folder is the buffer, checked again when the job starts (said twice).
        log_once(log, logging.WARNING, "buffer directory %s has mode %04o: other users can list or read its batches; "
                 "`chmod 700 %s` (a new buffer is created 0700)", path, perms, path)


def private_dir_problem(path: Path, st: os.stat_result, group_access: bool) -> str | None:
    """Why ``check_private_dir`` refuses ``path`` (its ``os.lstat``) for a daemon run by this user, and what to do;
    None where it takes it.  ``prefetchd config`` says the same without acting on the buffer."""
    if stat.S_ISLNK(st.st_mode):
        return (f"buffer {path} is a symbolic link (to {os.readlink(path)}); the daemon does not follow links to its "
                "buffer: pass the real directory as --buffer")
    if not stat.S_ISDIR(st.st_mode):
        return f"buffer {path} exists and is not a directory; pick a directory such as /dev/shm/bf"
    me = os.geteuid()
    if st.st_uid != me:
        return (f"buffer directory {path} belongs to {user_name(st.st_uid)}, not to {user_name(me)} who runs the "
                f"daemon; another user could change what the trainer reads: {_reclaim(path, st.st_uid)} or pick "
                "another --buffer")
    perms = stat.S_IMODE(st.st_mode)
    hint = f"chmod {GROUP_BUFFER_MODE:o} {path}" if group_access else f"chmod 700 {path}"
    if perms & stat.S_IWOTH:
        return (f"buffer directory {path} is writable by every user (mode {perms:04o}), who could plant files the "
                f"trainer reads; `{hint}`, or remove it")
    if perms & stat.S_IWGRP and not group_access:
        # Most often one a --group-access daemon made (2770), a service's: chmod-ing it would lock out the
        # trainers it is for, which the plain "or `chmod 700`" did not say (a walk as a non-root user).
        return (f"buffer directory {path} is writable by its group {group_name(st.st_gid)} (mode {perms:04o}): pass "
                f"--group-access if that group's trainers should use it (a --group-access daemon makes its buffer "
                f"so), or `{hint}` if not, which locks them out")
    return None


def _reclaim(path: Path, owner: int) -> str:
    """How this user gets rid of ``path``, a folder of ``owner``'s: in a sticky folder it may not write
    (/dev/shm, /tmp) only its owner or root can remove it, and only root can chown it."""
    me = os.geteuid()
    try:
        above = os.stat(path.parent)
    except OSError:
        above = None
    if me == 0 or (above is not None and above.st_uid == me):
        return f"remove it (or chown it to {user_name(me)})"
    if above is not None and above.st_mode & stat.S_ISVTX or not os.access(path.parent, os.W_OK | os.X_OK):
        return f"ask {user_name(owner)}{' or root' if owner != 0 else ''} to remove it"
    return f"remove it, or ask root to chown it to {user_name(me)}"


def open_own_dir(path: str | os.PathLike[str], dir_fd: int | None = None, shown: str | None = None) -> int | None:
    """An fd of the directory at ``path`` (relative to ``dir_fd``), opened without following a link; None
    (said in one log line) when it is a link, gone, or not the daemon's user's: a group member may make
    ``rank-*`` folders in a --group-access buffer and swap them for links, and what is theirs is theirs
    to clean.  Work below it goes through the fd, never the path again."""
    shown = shown or os.fspath(path)
    try:
        fd = os.open(path, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            log.warning("leaving %s alone: it is not a directory (a link a group member put there?)", shown)
        elif exc.errno != errno.ENOENT:
            log.warning("leaving %s alone: cannot open it (%s)", shown, exc.strerror)
        return None
    owner = os.fstat(fd).st_uid
    if owner != os.geteuid():
        os.close(fd)
        log.warning("leaving %s alone: it belongs to %s, not to %s who runs the daemon; its owner may remove it",
                    shown, user_name(owner), user_name(os.geteuid()))
        return None
    return fd


@contextlib.contextmanager
def _own_dir(path: str | os.PathLike[str], dir_fd: int | None = None, shown: str | None = None) -> Iterator[int | None]:
    """``open_own_dir``'s fd (None where it is not the daemon's), closed at the block's end."""
    fd = open_own_dir(path, dir_fd, shown)
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def clear_buffer(buffer: Path) -> None:
    """Remove another job's batches, manifests and progress, including per-rank stream directories.

    Every deletion is relative to a directory fd opened without following links and checked to be the
    daemon's user's (``open_own_dir``): a group member who swaps a folder for a link to another of that
    user's folders meanwhile has nothing deleted there.  What cannot be deleted (a folder someone put
    files in) is logged and left, never raised: a refused clear must not stop the daemon."""
    with _own_dir(buffer) as fd:
        if fd is not None:
            _clear(fd, str(buffer))


def remove_stream(stream: Path) -> None:
    """Delete a per-rank stream directory with what its job left in it (see ``clear_buffer``)."""
    with _own_dir(stream.parent) as fd:
        if fd is not None:
            _remove_stream(fd, stream.name, str(stream))


def sweep_temp_files(buffer: Path) -> int:
    """Delete what a killed daemon left half-written in ``buffer`` and its ranks' stream directories (through
    fds, as ``clear_buffer``); how many went.  Only the lock holder may call this."""
    with _own_dir(buffer) as fd:
        if fd is None:
            return 0
        entries = _entries(fd)
        count = _unlink(fd, _temp_files(entries), str(buffer))
        for name in _stream_folders(entries):
            shown = f"{buffer}/{name}"
            with _own_dir(name, fd, shown) as stream_fd:
                if stream_fd is not None:
                    count += _unlink(stream_fd, _temp_files(_entries(stream_fd)), shown)
        return count


def let_group_read_files(buffer: Path) -> int:
    """With --group-access, at start: give the buffer's group read on the daemon's own files in ``buffer`` and its
    ranks' stream folders that lack it; how many.  An earlier daemon started under umask 077 without
    --group-access (or by a prefetchd that did not take the group's bit out of its umask: ``main.let_group_read``)
    left them 0600, and a job resumed here keeps its batches, manifest and daemon.lock: the group's trainers could
    read none of them.  Read only, as the umask gives: the group never writes the daemon's files.

    Cheap: one listing of each folder and an lstat per entry; only a file whose mode lacks the bit is opened (10,000
    batches took 72 ms where they had it, 158 ms where none had; 2-core EPYC, tmpfs).
    Through fds, as ``clear_buffer``: never through a link (the listing's lstat, then O_NOFOLLOW, then the fstat of
    what was opened), never another user's file (a member's progress file is its owner's to chmod), nor a file
    with another name elsewhere (a hard link a member made to a file of the daemon's user: its mode is not the
    buffer's to set).  Nor job.json and job.accepted.json, which only the daemon reads: a chmod sets a file's ctime,
    by which the daemon tells a request or a record renamed back (``JobRequest.read``, ``JobRequest.recorded``): the
    request an older submit left 0600 was refused as an old one put back, and the job a record names not resumed.
    A file whose mode cannot be changed (immutable) is warned of and left, but status.json or a manifest
    (``REWRITTEN_AT_START``): DaemonError, naming it."""
    with _own_dir(buffer) as fd:
        if fd is None:
            return 0
        entries = _entries(fd)
        count = _let_group_read(fd, str(buffer), leave={JOB_NAME, ACCEPTED_JOB_NAME})
        for name in _stream_folders(entries):
            shown = f"{buffer}/{name}"
            with _own_dir(name, fd, shown) as stream_fd:
                if stream_fd is not None:
                    count += _let_group_read(stream_fd, shown)
        return count


def _let_group_read(fd: int, shown: str, leave: Container[str] = ()) -> int:
    """``let_group_read_files`` in the folder ``fd`` (``shown``, for the log), but for the files named in ``leave``;
    how many files it opened up."""
    me, count = os.geteuid(), 0
    with os.scandir(fd) as scan:
        closed = [e.name for e in scan
                  if e.name not in leave and e.is_file(follow_symlinks=False) and _lacks_group_read(e, me)]
    for name in closed:
        try:
            file_fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        except OSError as exc:  # gone meanwhile, replaced by a link (ELOOP), unreadable to its owner (mode 0200)
            if exc.errno != errno.ENOENT:
                log.warning("cannot give the group read access to %s/%s: %s", shown, name, exc.strerror)
            continue
        try:
            st = os.fstat(file_fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != me or st.st_mode & stat.S_IRGRP:
                continue  # replaced since the listing
            if st.st_nlink != 1:
                log.warning("leaving %s/%s as it is (mode %04o): it has %d names, so it is also a file elsewhere, "
                            "whose mode is not the buffer's to set; remove it if it is none of the daemon's", shown,
                            name, stat.S_IMODE(st.st_mode), st.st_nlink)
                continue
            try:
                os.fchmod(file_fd, stat.S_IMODE(st.st_mode) | stat.S_IRGRP)
            except OSError as exc:  # an immutable file (chattr +i: EPERM), a filesystem that keeps its own modes
                refused = (f"cannot give the group read access to {shown}/{name} (mode {stat.S_IMODE(st.st_mode):04o}):"
                           f" {exc.strerror}")
                if name in REWRITTEN_AT_START:
                    raise DaemonError(
                        f"{refused}. The daemon replaces that file as it runs, which what refuses the chmod refuses "
                        "too (an immutable or append-only flag, which `lsattr` shows and `chattr -i -a` as root "
                        "clears; a read-only filesystem): clear that, and start again") from None
                log.warning("%s; the group's trainers cannot read it, so it is left as it is. Make it readable "
                            "(`chmod g+r`, once what refuses it is cleared: `lsattr` shows an immutable flag) or remove "
                            "it: a batch removed is built again", refused)
                continue
            count += 1
        finally:
            os.close(file_fd)
    return count


# The daemon's documents that it replaces while it runs (status.json every second, a stream's manifest at each job
# start): one whose mode cannot be changed at start (an immutable file: chattr +i refuses fchmod and rename over it
# alike) stops the start, naming it, where the daemon went on to fail the job with a traceback (the manifest) or to
# beat where nobody sees it (status.json).  daemon.lock never gets here: the lock opens it read-write first, which
# such a file refuses with its own message.  Any other file refused is warned of and left: a batch the group cannot
# read fails only the group's trainer that reads it, and is built again once removed.
REWRITTEN_AT_START = frozenset({STATUS_NAME, MANIFEST_NAME})


def _lacks_group_read(entry: os.DirEntry[str], me: int) -> bool:
    try:
        st = entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return False
    return st.st_uid == me and not st.st_mode & stat.S_IRGRP


def _entries(fd: int) -> list[tuple[str, bool]]:
    """(name, whether a directory, links not followed) of each entry of the directory ``fd``."""
    with os.scandir(fd) as scan:
        return [(e.name, e.is_dir(follow_symlinks=False)) for e in scan]


def _stream_folders(entries: list[tuple[str, bool]]) -> list[str]:
    return [name for name, is_dir in entries if is_dir and STREAM_RE.fullmatch(name)]


def _temp_files(entries: list[tuple[str, bool]]) -> list[str]:
    return [name for name, is_dir in entries if not is_dir and is_temp_name(name)]


def _unlink(fd: int, names: list[str], shown: str) -> int:
    """Delete ``names`` from the directory ``fd`` (``shown``, for the log); how many went.  One that cannot
    be deleted is logged, not raised."""
    count = 0
    for name in names:
        try:
            os.unlink(name, dir_fd=fd)
            count += 1
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not delete %s/%s: %s", shown, name, exc.strerror)
    return count


def _clear(fd: int, shown: str) -> None:
    entries = _entries(fd)
    _unlink(fd, [name for name, is_dir in entries if not is_dir and (
        parse_batch_name(name) is not None or consumer_of(name) is not None or name == MANIFEST_NAME
        or is_consumer_lock(name) or is_temp_name(name))], shown)
    for name in _stream_folders(entries):
        _remove_stream(fd, name, f"{shown}/{name}")


def _remove_stream(parent_fd: int, name: str, shown: str) -> None:
    with _own_dir(name, parent_fd, shown) as fd:
        if fd is None:
            return
        try:
            opened = os.fstat(fd)
            _clear(fd, shown)
            now = os.lstat(name, dir_fd=parent_fd)
            if (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino):
                log.warning("leaving %s: it was replaced while being cleared (by a group member?)", shown)
                return
            os.rmdir(name, dir_fd=parent_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:  # something else in it (a folder a member made), or replaced meanwhile
            log.warning("could not remove %s: %s; remove it by hand when no job uses it", shown, exc.strerror)


def adopt_manifest(buffer: Path, manifest: Manifest | None, reset: bool, world_size: int = 1) -> None:
    """Keep the batches of an earlier run of the same job; refuse (or with ``reset``, clear) others.

    ``manifest`` None: the directory should hold no job at all, being the top of a job of
    ``world_size`` ranks, which keep their streams below it.
    """
    try:
        old: Manifest | None = Manifest.read(buffer)
    except FileNotFoundError:
        old = None
    except ProtocolError as exc:
        if not reset:
            raise ConfigError(f"{exc}. Pass --reset (reset = true in a config) to clear the buffer, or use another --buffer") from None
        old = None
    diff: list[str] = []
    if old is not None:
        diff = (manifest.identity_diff(old) if manifest is not None else
                [f"world_size: {old.world_size} -> {world_size} (a single-rank job is stored there)"])
    # Another job's per-rank streams: directories of this user with something in them. An empty one, a link
    # or another user's is no job's stream (a group member can make any of them in a --group-access buffer)
    # and must not stop the job.
    streams = sorted(d for d in buffer.glob(f"{STREAM_PREFIX}*") if holds_a_stream(d))
    if manifest is not None and manifest.world_size == 1 and streams:
        try:
            theirs = f"world_size: {Manifest.read(streams[0]).world_size} -> 1 "
        except (OSError, ProtocolError):
            theirs = ""
        diff.append(f"{theirs}(per-rank streams of another job are stored there)")
    if diff and not reset:
        raise ConfigError(
            f"buffer {buffer} holds batches of a different job ({'; '.join(diff)}); pass --reset (reset = true in a config) to "
            f"delete them, or use another --buffer"
        )
    if diff or (old is None and list_batches(buffer)):
        log.info("clearing %s: it held batches of another job", buffer)
        clear_buffer(buffer)


def another_jobs(stream: Path, ours: Manifest) -> list[str]:
    """How the job whose batches the stream directory holds differs from ``ours`` (any rank of it); [] for the
    same job.  An unreadable manifest is no job's that can be told to be ours."""
    try:
        theirs = Manifest.read(stream)
    except (OSError, ProtocolError) as exc:
        return [f"its manifest cannot be read: {exc}"]
    return [difference for difference in ours.identity_diff(theirs) if not difference.startswith("rank:")]


def holds_a_stream(path: Path) -> bool:
    try:
        st = os.lstat(path)
        return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and any(path.iterdir())
    except OSError:
        return False


def free_bytes(path: Path | int) -> int:
    """Free bytes of ``path``'s filesystem (or an open descriptor's), as an unprivileged writer may use them."""
    fs = os.statvfs(path)
    return fs.f_bavail * fs.f_frsize


def pause_message(buffer: Path, free: int, held: int, next_len: int, floor: int) -> str:
    """Why production pauses with ``free`` bytes left on ``buffer``'s filesystem once the next batch, of
    ``next_len`` bytes, is built, below the ``floor`` (--min-free-mb, in bytes), and what makes room: "lower
    --high-water" only where the daemon's batches (``held`` bytes waiting and being built, and the next one) would
    hold most of what the filesystem holds then.  Said also where another process's file filled the tmpfs beside a
    few batches, it sent the user to lower a mark that was not what took the space.  ``free`` counts the spares as
    room, and the rest of the filesystem is the other files'; it is below 0 where less than a batch is free, which
    clamped there gave the other files less than they held."""
    fs = os.statvfs(buffer)
    size = fs.f_blocks * fs.f_frsize
    own = held + next_len
    others = max(0, size - free - own)
    head = f"paused: {buffer} would fall to {binary_size(max(free, 0))} free, below the floor of {floor >> 20} MiB"
    if own >= others:
        return (f"{head}; this daemon's batches would hold {binary_size(own)} of the filesystem's "
                f"{binary_size(size)}, other files {binary_size(others)}: free space there or lower --high-water")
    mine = f"only {binary_size(held)}" if held else "none yet"
    daemons = other_buffers(buffer)
    # "free those files" sent users to delete batches of the other daemons sharing the tmpfs (a walk).
    theirs = (f" (among them the buffers of other prefetchd daemons: {', '.join(map(str, daemons[:3]))}"
              f"{' ...' if len(daemons) > 3 else ''}: lower their --high-water or --max-buffer-bytes)" if daemons else "")
    return (f"{head}; other files hold {binary_size(others)} of the filesystem's {binary_size(size)}, this "
            f"daemon's batches {mine}: free those files{theirs} (`df -h {buffer}` names the filesystem), and "
            "production resumes by itself")


def other_buffers(buffer: Path) -> list[Path]:
    """The other buffers of running daemons at the top of ``buffer``'s filesystem or one folder down (/dev/shm/bf,
    /dev/shm/team/bf), sorted: where other files took the space, most likely theirs.  Not the whole filesystem,
    which may hold many files (a pause looks once a second)."""
    point = Path(filesystem_of(buffer).point)
    own = buffer.resolve()
    found: list[Path] = []
    for depth in (1, 2):
        for lock in point.glob("/".join(["*"] * depth + [LOCK_NAME])):
            with contextlib.suppress(OSError, ProtocolError):
                if lock.parent.resolve() != own and daemon_owner(lock.parent) is not None:
                    found.append(lock.parent)
    return sorted(found)


NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # a write refused for want of space (a tmpfs full, a quota reached)


def check_capacity(cfg: DaemonConfig, held: int | None = None) -> str | None:
    """Refuse a high-water mark the filesystem can never hold; return a warning for one it cannot hold now.

    Only the filesystem's size refuses: space other files hold now (another job's buffer, a file
    copied there) may be freed, and production pauses meanwhile (``--min-free-mb``).  A refusal is
    final (exit 2, which the systemd unit does not restart), so a daemon restarted while the tmpfs
    was briefly full would have stayed down.  ``held``: ``held_bytes(cfg)`` where the caller has it (it passed
    the same to ``fill_defaults``), else listed here."""
    assert cfg.high_water is not None and cfg.min_free_mb is not None
    fs = os.statvfs(nearest_existing(Path(cfg.buffer)))  # `prefetchd config` checks a buffer not made yet
    ranks, floor = len(cfg.local_ranks), cfg.min_free_mb << 20
    batches = ranks * cfg.high_water * cfg.batch_bytes
    capped = (cfg.max_buffer_bytes or 0) > batches  # the cap, not the mark, is what needs the room
    need = max(batches, cfg.max_buffer_bytes or 0) + floor
    size, available = fs.f_blocks * fs.f_frsize, fs.f_bavail * fs.f_frsize + (held_bytes(cfg) if held is None else held)
    _check_memory_limit(cfg, ranks, batches)
    if need <= available:
        return None
    shown = size if need > size else available
    needed, has = binary_size(need), binary_size(shown)
    if needed == has:  # "need 1.0 MiB but has 1.0 MiB" says nothing
        needed, has = f"{need} bytes", f"{shown} bytes"
    floor_text = f"plus the {cfg.min_free_mb} MiB floor (--min-free-mb) need {needed}"
    why = ""
    if capped:
        what = f"--max-buffer-bytes {cfg.max_buffer_bytes} {floor_text}"
        lower = "lower --max-buffer-bytes or --min-free-mb"
    else:
        per = f"{ranks} ranks x " if ranks > 1 else ""
        what = f"{per}high_water {cfg.high_water} x {binary_size(cfg.batch_bytes)} batches {floor_text}"
        why, lower = _what_fits(cfg, ranks, shown - floor)
    fix = f"{lower}, or enlarge the tmpfs ({enlarge(filesystem_of(Path(cfg.buffer)).point)})"
    if need > size:
        raise ConfigError(f"{what} but {cfg.buffer} has {has}; {why + ': ' if why else ''}{fix}")
    return (f"{what} but {cfg.buffer} has {has} free now: other files hold the rest. Production pauses whenever it "
            f"would fall below the floor, until they go; free that space, or {fix}")


def _check_memory_limit(cfg: DaemonConfig, ranks: int, batches: int) -> None:
    """Refuse a high-water mark whose batches alone exceed the memory limit of the daemon's cgroup: their tmpfs
    pages count against it, so the kernel's OOM killer would kill the daemon or its workers once the buffer
    filled (a mark of 64 batches of 9.2 MiB in a 512 MiB container did, at its first batches)."""
    limit = memory_limit()
    if limit is None or batches <= limit:
        return
    per = f"{ranks} ranks x " if ranks > 1 else ""
    fits = limit // 2 // (ranks * cfg.batch_bytes)
    lower = (f"lower --high-water ({fits} leaves half of it to the daemon's processes)" if fits >= 1 else
             "lower --batch-size or --image-size")
    raise ConfigError(f"{per}high_water {cfg.high_water} x {binary_size(cfg.batch_bytes)} batches need "
                      f"{binary_size(batches)} of tmpfs pages, which count against the daemon's memory cgroup, but "
                      f"its limit is {binary_size(limit)} (docker run --memory, a Kubernetes memory limit, "
                      f"MemoryMax=): the kernel would kill it as the buffer fills; {lower}, or raise the limit")


def _what_fits(cfg: DaemonConfig, ranks: int, room: int) -> tuple[str, str]:
    """Why no mark fits in ``room`` bytes ("" where one does), and which flags to lower, with the value that fits:
    "lower --high-water" alone misled where not one batch fits (--batch-size 512 at 224 px, 73.5 MiB, on
    Docker's 64 MiB /dev/shm), and the mark was the default, which the user had not set."""
    assert cfg.high_water is not None
    high = room // (ranks * cfg.batch_bytes)
    if high >= 1:
        return "", f"lower --high-water (at most {high} fits), --batch-size or --min-free-mb"
    lo = largest_batch_size(cfg.image_size, room // (ranks * cfg.high_water), below=cfg.batch_size)
    if lo == 0:
        return "the floor leaves no room for a batch", "lower --min-free-mb, --batch-size or --image-size"
    return (f"not one batch of {binary_size(cfg.batch_bytes)} fits",
            f"lower --batch-size (at most {lo} fits high_water {cfg.high_water} at {cfg.image_size} px), --image-size "
            "or --min-free-mb")


def largest_batch_size(image_size: int, file_len: int, *, below: int) -> int:
    """The largest batch size under ``below`` whose batch file at ``image_size`` px is at most ``file_len`` bytes;
    0 where not even one image's is."""
    lo, hi = 0, below - 1
    while lo < hi:  # file_len grows with the batch size
        mid = (lo + hi + 1) // 2
        if BatchLayout.plan(mid, image_size, image_size).file_len <= file_len:
            lo = mid
        else:
            hi = mid - 1
    return lo


def enlarge(point: str) -> str:
    """How to make the tmpfs at ``point`` larger; /dev/shm is small where a container runtime made it (64 MiB)."""
    how = f"mount -o remount,size=... {point}"
    return f"{how}; in a container, docker run --shm-size=..." if point == "/dev/shm" else how
