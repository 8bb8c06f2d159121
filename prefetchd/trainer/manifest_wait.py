"""Waiting for the manifest of a loader's buffer, which a loader reads when it is created.

:func:`wait_for_manifest` waits up to ``timeout`` seconds for a daemon to write it, and
when none comes says why and what to do: no daemon owns the buffer (start one), the
daemon waits for a job (submit one) or is still indexing, it produces other ranks
than this one, or the buffer holds one stream per rank and a rank's was wanted.  A
daemon that failed is :class:`FailedDaemon`'s to tell, here and in
``ranks.rank_stream``, which waits for a rank's stream the same way.
"""

from __future__ import annotations

import logging
import stat
import time
from pathlib import Path

from prefetchd.access import no_access
from prefetchd.buffer_protocol import (
    Manifest,
    ProtocolError,
    State,
    Status,
    DaemonOwner,
    daemon_owner,
    readable_status,
)
from prefetchd.buffer_protocol.layout import MANIFEST_NAME, STREAM_PREFIX, owning_buffer
from prefetchd.trainer.daemon_status import check_served, owner_status, served_world, status_summary
from prefetchd.trainer.errors import DaemonGone, LoaderError, LoaderTimeout, NoAccess
from prefetchd.trainer.wait_bounds import MORE_TIME

logger = logging.getLogger(__name__)

# What `prefetchd start --data ROOT` takes, as the loaders' "start one" advice names it: not class folders alone.
DATA_FORMS = "dataset: class folders, a file list or shards, local or at a URL"
MANIFEST_FIRST_DELAY = 0.010
MANIFEST_MAX_DELAY = 0.050
STATUS_LOOK_SECONDS = 1.0  # how often a wait for a manifest reads the daemon's status (it beats about that often)


class FailedDaemon:
    """A wait for a manifest and the failure of the buffer's daemon (status.json's ``failed``, no daemon
    owning the buffer since): one that failed while the wait went on ends it at once, with the daemon's
    reason, as a daemon lost mid-run does; one that had failed before the wait began does not, since a
    user or a service manager may be starting another: the wait goes on to its ``timeout``, said at
    once with the reason and what to do, and the timeout's message leads with that failure."""

    def __init__(self, buffer: Path, timeout: float) -> None:
        self.buffer = buffer
        self.timeout = timeout
        self.since = time.time()
        self.earlier = ""  # the reason of a failure from before the wait, once seen

    def check(self, owner: DaemonOwner | None, status: Status | None) -> None:
        """``owner_status`` of the buffer, as just read."""
        if owner is not None or status is None or status.state != State.FAILED:
            return
        reason = " ".join(status.message.split()) or "its status gives no reason"
        shows = f"`prefetchd status --buffer {owning_buffer(self.buffer)}` shows it"
        if status.heartbeat >= self.since:
            raise DaemonGone(f"{self.buffer}: the daemon failed before it wrote a manifest: {reason}. Start it again "
                             f"once that is fixed ({shows})")
        if not self.earlier:
            logger.warning("the daemon last on %s failed before this loader started, and none runs there now: %s. "
                           "Waiting up to %g s in case another starts (its service restarting it, or you); fix that "
                           "first, then start it again (%s)", self.buffer, reason, self.timeout, shows)
        self.earlier = reason

    def timed_out(self, message: str) -> str:
        """The timeout's ``message``, led by the earlier failure where no daemon owns the buffer now (one that
        does was started since, and the message is about it; the failure then follows)."""
        if not self.earlier:
            return message
        if daemon_owner(self.buffer) is not None:
            return f"{message}; the daemon last on it failed: {self.earlier}"
        return (f"{self.buffer}: the daemon last on it failed before this loader started ({self.earlier}), and no "
                f"other started within the {self.timeout:g} s waited: fix that first, then start it again. {message}")


def wait_for_manifest(buffer: Path, timeout: float) -> Manifest:
    """``buffer``'s manifest, waiting up to ``timeout`` seconds for a daemon to write it."""
    if buffer.exists() and not buffer.is_dir():  # else the manifest's open says "Not a directory" about permissions
        raise LoaderError(f"{buffer} is not a directory; pass the daemon's --buffer directory")
    mode = buffer.stat().st_mode if buffer.is_dir() else 0
    if mode & stat.S_IWOTH:
        # /dev/shm itself, say: no daemon takes a folder every user may write (SPEC rule 7), so the wait was for
        # nothing, and its timeout advised `prefetchd start --buffer /dev/shm`, which start refuses.
        raise LoaderError(f"{buffer} is writable by every user (mode {stat.S_IMODE(mode):04o}), "
                          f"which no daemon takes as its buffer; pass the daemon's --buffer, a folder of its own "
                          f"such as {buffer / 'bf'}")
    deadline = time.monotonic() + timeout
    delay = MANIFEST_FIRST_DELAY
    logged = False
    failed = FailedDaemon(buffer, timeout)
    next_look = time.monotonic()
    check_readable(buffer)
    while True:
        try:
            manifest: Manifest | None = Manifest.read(buffer)
        except FileNotFoundError:
            manifest = None
            wrong = _rank_streams_instead(buffer)  # or no daemon has started on this buffer yet
            if wrong is not None:
                raise wrong from None
        except ProtocolError:
            check_readable(buffer)  # a buffer made since, of a group this user is not in
            raise
        now = time.monotonic()
        if manifest is not None and owning_buffer(buffer) == buffer:
            return manifest
        if manifest is not None or now >= next_look:
            # Also once a rank's stream has a manifest: an earlier run of the job may have left it (its daemon
            # restarted with fewer --ranks), and its batches would never come.
            next_look = now + STATUS_LOOK_SECONDS
            owner, status = owner_status(buffer)
            check_served(buffer, owner, status)
            if manifest is not None:
                return manifest
            failed.check(owner, status)
        if now >= deadline:
            raise LoaderTimeout(failed.timed_out(_manifest_timeout_message(buffer, timeout)))
        if not logged:
            logger.info("waiting up to %g s for %s", timeout, buffer / "manifest.json")
            logged = True
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 1.5, MANIFEST_MAX_DELAY)


def check_readable(buffer: Path, flag: str = "") -> None:
    """NoAccess, in the words of `prefetchd status`, where this user may not read ``buffer`` (a --group-access
    buffer of a group it is not in): whose it is and how to join its group, not the manifest's "Permission
    denied".  ``flag``: the option that named it ("--buffer"), said before it; a buffer not there yet passes."""
    denied = no_access(buffer)
    if denied is not None:
        raise NoAccess(f"cannot read {flag + ' ' if flag else ''}{buffer}: {denied}")


def _manifest_timeout_message(buffer: Path, timeout: float) -> str:
    waited = f"{timeout:g} s"
    owner = daemon_owner(buffer)
    if owner is not None:
        return (
            f"{buffer}: the daemon ({owner}) owns this buffer but wrote no manifest.json within {waited} "
            f"({status_summary(buffer)}); {why_no_manifest(buffer)}"
        )
    where = "does not exist" if not buffer.exists() else "has no manifest.json"
    return (
        f"{buffer} {where} after waiting {waited} for the daemon's manifest.json, and no prefetchd daemon "
        f"owns it. Start one with `prefetchd start --buffer {buffer} --data ROOT` (ROOT: the {DATA_FORMS}), "
        f"or {MORE_TIME} if one is still starting"
    )


def why_no_manifest(buffer: Path, more_time: str = MORE_TIME) -> str:
    """What to do about a live daemon that has written no manifest for a trainer: give it a job, or
    wait for it (``buffer``: the daemon's, not a rank's stream; ``more_time``: how to wait longer)."""
    status = readable_status(buffer)
    if status is not None and status.state == State.WAITING_FOR_JOB:
        return (f"it is waiting for a job: give it one with `prefetchd submit --buffer {buffer} --data ROOT` "
                "(and this run's batch and image size)")
    return f"it may still be indexing a large dataset. Check `prefetchd status --buffer {buffer}`, or {more_time}"


def _rank_streams_instead(buffer: Path) -> LoaderError | None:
    """The error for a loader pointed at the top of a buffer that holds one stream per rank."""
    streams = sorted(d for d in buffer.glob(f"{STREAM_PREFIX}*") if (d / MANIFEST_NAME).is_file())
    if not streams:
        return None
    try:
        served = served_world(buffer)
    except ProtocolError:
        served = None
    size = f" of world size {served[0]}" if served is not None else ""
    return LoaderError(
        f"{buffer} holds one stream per rank ({', '.join(d.name for d in streams[:3])}"
        f"{', ...' if len(streams) > 3 else ''}{size}), not a single stream: pass a rank's, "
        f"`prefetchd.buffer_protocol.stream_dir({str(buffer)!r}, rank, world_size)`, or "
        f"`prefetchd.trainer.rank_stream({str(buffer)!r})` under torchrun"
    )


__all__ = ["DATA_FORMS", "STATUS_LOOK_SECONDS", "FailedDaemon", "check_readable", "wait_for_manifest", "why_no_manifest"]
