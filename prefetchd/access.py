"""Whether this user may use a buffer directory (or read a dataset), and where not, whose it is and what to do: the
words of `prefetchd status`, `stop`, `submit`, `show`, `config` and `prefetchd-train` alike, in the one place that
both the daemon's commands and the trainer (which never imports the daemon) import."""

from __future__ import annotations

import grp
import os
import pwd
import stat
from pathlib import Path

from prefetchd.buffer_protocol.errors import user_name

# This user may not use a path it named (read, write or enter it): the exit code of every command that refuses one
# for that, prefetchd's (status, show, submit, a path under a folder it may not enter) and prefetchd-train's.
EXIT_NO_ACCESS = 4


def group_name(gid: int) -> str:
    """``prefetchd`` for messages, or ``gid 1001`` when the group has no name."""
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"


def _seen(path: Path) -> bool:
    """Whether ``path`` exists as far as this user can tell: not where a folder above it may not be entered
    (``Path.exists`` raises PermissionError there, which ended `submit` and `config` in a traceback)."""
    try:
        return path.exists()
    except OSError:
        return False


def nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (that this user can see): the filesystem a new directory there
    would be on."""
    path = path.absolute()
    while not _seen(path) and path != path.parent:
        path = path.parent
    return path


def no_access(buffer: Path, write: bool = False) -> str | None:
    """Why this user may not read (``write``: nor write) ``buffer``, a --group-access buffer of a group it is
    not in say, naming its owner, group and mode and what to do; None where it may, or where it is not there
    (the commands say that themselves).  A rank's stream directory is reached through its buffer: one this
    user may not enter is the one named.  With ``write``, a ``buffer`` that is not there is one to create: the
    nearest folder above it that is must let this user write in it.  A filesystem mounted read-only (a
    container's volume with ``:ro``) is said as such, not as a permission its owner could grant."""
    if write and not _seen(buffer):
        above = nearest_existing(buffer)
        if above.is_dir() and not os.access(above, os.W_OK | os.X_OK):
            return f"cannot create it: {_read_only(above) or _denied(above, os.stat(above), os.W_OK | os.X_OK)}"
    for path, need in ((buffer.parent, os.X_OK), (buffer, os.R_OK | os.X_OK | (os.W_OK if write else 0))):
        try:
            st = os.stat(path)
        except OSError:
            return None
        if not os.access(path, need):
            # access(2) refuses a write on a read-only mount (EROFS) to the owner, root too.
            read_only = _read_only(path) if need & os.W_OK and os.access(path, need & ~os.W_OK) else None
            return read_only or _denied(path, st, need)
    return None


def cannot_read(path: Path) -> str | None:
    """Why this user may not read ``path`` (a dataset: a folder to list, or a file), naming the folder on the way
    that it may not enter where that is what stops it, whose it is and what to do; None where it may, or where
    ``path`` is not there (the callers say that themselves)."""
    path = path.absolute()
    for above in (*reversed(path.parents), path):
        try:
            st = os.stat(above)
        except OSError:
            return None
        need = os.X_OK if above != path else os.R_OK | (os.X_OK if stat.S_ISDIR(st.st_mode) else 0)
        if not os.access(above, need):
            return _denied(above, st, need)
    return None


def _read_only(path: Path) -> str | None:
    """Why nobody may write in ``path``, a folder on a filesystem mounted read-only; None where it is not."""
    try:
        if not os.statvfs(path).f_flag & os.ST_RDONLY:
            return None
        mount, device = path.absolute(), os.stat(path).st_dev
        while mount != mount.parent and os.stat(mount.parent).st_dev == device:
            mount = mount.parent
    except OSError:
        return None
    return (f"{path} is on a filesystem mounted read-only (at {mount}), where no user may write; mount it "
            "read-write (in a container: the volume without :ro)")


def _denied(path: Path, st: os.stat_result, need: int) -> str:
    group = group_name(st.st_gid)
    me = os.getuid()
    try:
        account = pwd.getpwuid(me)
    except KeyError:  # no name to add to a group
        account = None
    try:
        members = grp.getgrgid(st.st_gid).gr_mem
    except KeyError:
        members = []
    login = account.pw_name if account is not None else "USER"
    listed = account is not None and (login in members or account.pw_gid == st.st_gid)
    what = (f"{path}: permission denied: it belongs to {user_name(st.st_uid)} and group {group} "
            f"(mode {stat.S_IMODE(st.st_mode):04o})")
    ask = f"ask {user_name(st.st_uid)} for access"
    group_bits = sum(bit for wanted, bit in ((os.R_OK, stat.S_IRGRP), (os.W_OK, stat.S_IWGRP), (os.X_OK, stat.S_IXGRP))
                     if need & wanted)
    if st.st_mode & group_bits != group_bits:
        return f"{what}: its group may not {'write' if need & os.W_OK else 'read'} it either; {ask}"
    named = group.removeprefix("gid ")  # as usermod and newgrp take it
    if listed:  # /etc/group has the user, this session's groups do not: it began before `usermod -aG`
        return f"{what}; {user_name(me)} joined that group after this session began: log in again (or run `newgrp {named}`)"
    return (f"{what}, and {user_name(me)} is not in that group; join it (`sudo usermod -aG {named} {login}`, which takes "
            f"effect at the next login), or {ask}")


__all__ = ["cannot_read", "group_name", "nearest_existing", "no_access", "user_name"]
