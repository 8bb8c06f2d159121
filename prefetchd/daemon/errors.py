"""Errors the daemon reports to its user, and the exit codes they map to."""

from __future__ import annotations

import errno
import resource

from prefetchd import access

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2  # click's own code for bad flags; we use it for bad configuration too
EXIT_NOT_RUNNING = 3  # `prefetchd status` when no daemon owns the buffer (LSB convention)
EXIT_BAD_DATA = 4  # `prefetchd start`: --strict or the bad-sample budget stopped the job; a restart fails again
EXIT_BUFFER_BUSY = 5  # `prefetchd start`: another live daemon owns the buffer; this one changed nothing
# `prefetchd status`, `show` and `submit`: this user may not read (or write) the buffer; for status LSB's "status
# unknown", and no number they use for anything else (4 is EXIT_BAD_DATA only for `start`); prefetchd-train's too.
EXIT_NO_ACCESS = access.EXIT_NO_ACCESS


class DaemonError(RuntimeError):
    """A problem the user can fix; the message says what and how."""

    exit_code = EXIT_FAILURE


class ConfigError(DaemonError):
    """A configuration value, flag or file is wrong."""

    exit_code = EXIT_USAGE


class DatasetError(DaemonError):
    """The dataset is missing, empty or unreadable."""


class BufferLost(DaemonError):
    """The buffer was removed or replaced under the running daemon: it stops rather than write into a
    directory it no longer owns (another daemon may own it now)."""

    @classmethod
    def because(cls, why: str) -> BufferLost:
        return cls(f"{why}; stopping, since this daemon no longer owns what is there (another one may): start it "
                   "again, which makes the buffer anew")


class BadDataError(DatasetError):
    """Too many samples could not be decoded (or one, with --strict): the data needs fixing."""

    exit_code = EXIT_BAD_DATA


def out_of_processes(exc: BaseException) -> str | None:
    """What to tell the user where ``exc`` is the system refusing a new thread or process (this user's
    ``ulimit -u``, a cgroup's pids.max); None for any other error.  Such a daemon died with a raw traceback
    ("RuntimeError: can't start new thread" while indexing) or an "internal error" (a user's walk)."""
    if not (isinstance(exc, RuntimeError) and "can't start new thread" in str(exc)
            or isinstance(exc, OSError) and exc.errno == errno.EAGAIN):
        return None
    return f"cannot start another thread or process ({exc}): {processes_taken()}"


def processes_taken() -> str:
    """Which limits on processes and threads were reached, ``ulimit -u``'s value where one is set, and what to do:
    said where the system refused one (``out_of_processes``) and where the worker server died of it."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    limit = f"this user's limit of {soft} (ulimit -u), or " if soft != resource.RLIM_INFINITY else ""
    return (f"the processes and threads allowed, {limit}its cgroup's pids.max, are taken; raise the limit "
            "(LimitNPROC= or TasksMax= in a systemd unit, --pids-limit for a container) or lower --workers")
