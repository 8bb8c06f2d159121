"""The loader's bounded waits, and telling a slow daemon from a stuck or a gone one.

A :class:`BufferLoader` waits for two things: the manifest when it is created, and
each batch file.  Every wait is bounded by ``timeout``; while a batch is waited
for, the daemon is looked at every ``liveness_interval`` (a quarter of the
shortest bound, at most 1 s)::

    no daemon owns daemon.lock    for daemon_grace     -> DaemonGone   (restart it)
    the holder's status.json heartbeat older than
                                  stall_timeout        -> DaemonStuck  (py-spy, kill, restart)
    the holder's status.json says it waits for a job while
    the manifest is this loader's job at once              -> JobEnded     (submit it again)
    nothing of the above, the batch still missing after
                                  timeout              -> LoaderTimeout

Only the heartbeat counts, never the batch rate: a daemon that is slow (a huge
batch, a cold network filesystem) but alive rewrites status.json about once a
second and is never called stuck.  Every message carries the daemon's own account
of itself from status.json (:func:`status_summary`).  Whether a daemon owns the
buffer is ``daemon_owner``'s to say, also of one in another pid namespace (another
container sharing the tmpfs), whose heartbeat counts the same.

A daemon whose builds wait for the dataset's storage (status.json's
``storage_wait``: an object store's outage, a dataset's mount gone) will resume by
itself once it is back, so while the owner beats and says so of this loader's rank,
``timeout`` does not run out: it counts from the last look that found it waiting.
A daemon gone or stuck meanwhile still ends the wait as above.  The loader's
messages then say that its builds wait for the storage, and why, before the
``write_failures`` those builds add to (which a full tmpfs adds to as well).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import time
import weakref
from collections.abc import Callable
from pathlib import Path

from prefetchd.buffer_protocol import (
    Manifest,
    MappedBatch,
    ProtocolError,
    State,
    Status,
    batch_name,
    DaemonOwner,
    daemon_owner,
    map_batch,
    read_status,
    readable_status,
)
from prefetchd.buffer_protocol.documents import augmentation_options, exact_number
from prefetchd.buffer_protocol.layout import (DIR_FLAGS, MANIFEST_NAME, PROGRESS_PATTERN, STREAM_PREFIX,
                                             check_stream_folder, owning_buffer)
from prefetchd.launch import option_args
from prefetchd.trainer.errors import (DaemonGone, DaemonStuck, JobEnded, JobReplaced, LoaderError, LoaderTimeout,
                                      StopRequested)
from prefetchd.access import user_name
from prefetchd.words import counted, epochs_flag, moment, rank_ranges

logger = logging.getLogger(__name__)

# How to wait longer, named for both ways in: prefetchd-train's flag and the loader's argument.
MORE_TIME = "pass a larger --timeout (prefetchd-train; timeout= of the loader)"
# What `prefetchd start --data ROOT` takes, as the loaders' "start one" advice names it: not class folders alone.
DATA_FORMS = "dataset: class folders, a file list or shards, local or at a URL"
# The defaults of the waits, for BufferLoader, prefetchd-train's flags and the Lightning module alike.
DEFAULT_TIMEOUT = 120.0  # seconds for the manifest and for each batch, but one waiting on its storage (BatchWaiter)
DEFAULT_STALL_TIMEOUT = 60.0  # seconds without a heartbeat before a live daemon counts as stuck
DAEMON_GRACE = 5.0  # seconds with no daemon holding the lock before it counts as gone (a restart takes less)

# Waiting for a batch starts with 1 ms sleeps (a daemon that keeps up publishes
# within a few ms) and backs off to 20 ms, so a stalled daemon costs ~50 wake-ups
# a second, not a busy core.
FIRST_DELAY = 0.001
MAX_DELAY = 0.020
MANIFEST_FIRST_DELAY = 0.010
MANIFEST_MAX_DELAY = 0.050
SLOW_WAIT_WARNING = 10.0
STORAGE_WAIT_LOG_SECONDS = 60.0  # a wait on the daemon's storage is said at once, then this often at most


STATUS_LOOK_SECONDS = 1.0  # how often a wait for a manifest reads the daemon's status (it beats about that often)


def owner_status(buffer: Path) -> tuple[DaemonOwner | None, Status | None]:
    """The live daemon owning ``buffer`` (a rank's stream: its parent's), and the status last written
    there; None for either that is not there (or, for the status, cannot be read)."""
    status = readable_status(buffer)
    return daemon_owner(buffer, status), status


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
    deadline = time.monotonic() + timeout
    delay = MANIFEST_FIRST_DELAY
    logged = False
    failed = FailedDaemon(buffer, timeout)
    next_look = time.monotonic()
    while True:
        try:
            manifest: Manifest | None = Manifest.read(buffer)
        except FileNotFoundError:
            manifest = None
            wrong = _rank_streams_instead(buffer)  # or no daemon has started on this buffer yet
            if wrong is not None:
                raise wrong from None
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


def check_served(stream: Path, owner: DaemonOwner | None, status: Status | None) -> None:
    """LoaderError where the daemon holding ``stream``'s buffer does not produce it (``unserved_rank``)."""
    unserved = unserved_rank(stream, owner, status)
    if unserved is not None:
        raise LoaderError(f"{unserved}: restart it with --ranks that include this rank")


def unserved_rank(stream: Path, owner: DaemonOwner | None, status: Status | None) -> str | None:
    """Why ``stream``, a rank's stream directory, gets no manifest: the daemon holding its buffer
    (``owner_status``: ``owner`` and ``status``) produces other ranks, says its status, and no other daemon
    can produce this one there while it runs.  None when it does produce it, or while that is not known
    (no daemon, no job yet, a flat buffer)."""
    buffer = owning_buffer(stream)
    if (buffer == stream or owner is None or status is None or not owner.wrote(status) or status.production is None
            or not status.production.streams):
        return None  # starting, or serving no job yet
    rank = int(stream.name.removeprefix(STREAM_PREFIX))
    served = [s.rank for s in status.production.streams]
    if rank in served:
        return None
    return (f"the daemon of {buffer} ({owner}) produces ranks {rank_ranges(served)}, not rank {rank}, so {stream} "
            "gets no manifest while it runs: every rank of a box reads the box's one daemon")


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


def served_world(buffer: Path) -> tuple[int, Path] | None:
    """The world size the buffer's daemon produces for, with the manifest that says so; None before any."""
    candidates = [buffer / MANIFEST_NAME]
    try:
        candidates += sorted(d / MANIFEST_NAME for d in buffer.glob(f"{STREAM_PREFIX}*") if d.is_dir())
    except OSError:
        pass
    for path in candidates:
        try:
            return Manifest.read(path.parent).world_size, path
        except (FileNotFoundError, NotADirectoryError):
            continue
    return None


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


class JobWatch:
    """Tells a loader when the daemon has replaced its job (``prefetchd submit --replace``).

    The manifest is rewritten by rename when a job starts, so a change of its inode or mtime
    is what is looked for: one ``stat`` per batch.  A daemon restarted on the same job writes
    a manifest of the same identity, which passes.  The look comes after a batch is mapped: the
    daemon writes the new job's manifest before any of its batches, so a batch mapped before a
    look that finds the old job is the old job's."""

    def __init__(self, buffer: Path, manifest: Manifest) -> None:
        self.buffer = buffer
        self.manifest = manifest
        self._seen: tuple[int, int] | None = None  # the first look reads the file: it may have changed since

    def check(self) -> None:
        path = self.buffer / MANIFEST_NAME
        try:
            st = os.stat(path)
        except OSError:  # being replaced (the daemon clears before it writes), or gone with the daemon
            self._check_world()
            return
        if (st.st_ino, st.st_mtime_ns) == self._seen:
            return
        try:
            current = Manifest.read(self.buffer)
        except (ProtocolError, OSError):
            return  # half-replaced or damaged: the next look decides
        diff = current.identity_diff(self.manifest)
        # An end before this loader's: it would read on past it and wait out its timeout for a batch the daemon,
        # done, never writes.  A later one costs this loader nothing: it ends where its trainer counted on.
        earlier = current.epochs is not None and (self.manifest.epochs is None or current.epochs < self.manifest.epochs)
        again = job_command(self.manifest, self.buffer, "submit") if diff or earlier else ""
        who = submitted_by(self.buffer) if diff or earlier else None
        if diff:
            ends = ([f"epochs: {self.manifest.epochs!r} -> {current.epochs!r}"]
                    if current.epochs != self.manifest.epochs else [])
            replaced = (f"{who[0]} replaced this loader's job ({who[1]})" if who is not None else
                        "someone replaced this loader's job (`prefetchd submit --replace`, or a daemon started with "
                        "--reset)")
            raise JobReplaced(
                f"{self.buffer}: the daemon now serves another job ({'; '.join(diff + ends)}): {replaced}, so the "
                f"batches there are not its own. Start the trainer again for the new job, or submit this one again "
                f"(`{again} --replace`)"
            )
        if earlier:
            # Not the job's identity: its batches stay, and the daemon goes on from this loader's position, to the
            # new end, which comes before this loader's.
            again_by = (f"{who[0]} submitted it again ({who[1]})" if who is not None else
                        "someone submitted it again (`prefetchd submit --replace`) or restarted its daemon so")
            raise JobReplaced(
                f"{self.buffer}: the daemon now serves this loader's job with {epochs_flag(current.epochs)} (this "
                f"loader's had {epochs_flag(self.manifest.epochs)}): {again_by}. Its batches are this job's, kept, "
                "but the daemon ends before this loader does, which would wait for batches never built. To stop at "
                "the new end, start the trainer again from its checkpoint with the new --epochs (the daemon goes on "
                "from its position); "
                f"to keep the old end, submit the job again (`{again} --replace`)"
            )
        self._seen = (st.st_ino, st.st_mtime_ns)

    def _check_world(self) -> None:
        """A stream without a manifest: a job of another world size took the buffer (its daemon removed
        this rank's stream, or the single-rank job's manifest for the new job's per-rank streams), or
        the stream is being set up again.  Only the first is an error."""
        buffer = owning_buffer(self.buffer)
        try:
            served = served_world(buffer)
        except ProtocolError:
            return  # damaged: the next look decides
        if served is not None and served[0] != self.manifest.world_size:
            removed = ("removed this rank's stream" if buffer != self.buffer else
                       f"keeps one stream per rank in {STREAM_PREFIX}NNNNN directories there")
            who = submitted_by(buffer)
            by = f", which {who[0]} submitted ({who[1]})" if who is not None else ""
            raise JobReplaced(
                f"{self.buffer}: the daemon now serves another job, for --world-size {served[0]} (this loader's "
                f"was {self.manifest.world_size}){by}, and {removed}. Start the trainer again "
                f"for the new job, or submit this one again (`{job_command(self.manifest, self.buffer, 'submit')} "
                "--replace`)"
            )


def submitted_by(buffer: Path) -> tuple[str, str] | None:
    """Who submitted the job the daemon of ``buffer`` (or of its rank's stream) runs now, as its status.json says
    (``running_job``), and which: ("alice (uid 1001)", "job 0123456789ab, submitted 2025-03-01 14:02:07").  None
    where it does not say: the job it was started with, a daemon of an earlier build, a status that cannot be
    read.  The daemon writes it before the manifests of a job that starts, so a loader those stop reads it."""
    status = readable_status(buffer)
    job = status.running_job if status is not None else None
    if job is None or job.submitter is None:
        return None
    return user_name(job.submitter), f"job {job.job_id}, submitted {moment(job.submitted)}"


def open_stream_folder(folder: Path, rank_stream: bool) -> int:
    """An fd of the folder a loader reads its batches from, which the caller closes.  A rank's stream folder
    (``rank_stream``) is checked first (``check_stream_folder``: the buffer owner's, no link) and opened without
    following a link; the fd is taken only where it is the very folder checked, which a member of a --group-access
    buffer's group may have swapped for one of theirs in between.  A buffer that is its own stream is opened as its
    path leads, as it was read before: a link to it is its user's to make."""
    checked = check_stream_folder(folder) if rank_stream else None
    try:
        fd = os.open(folder, DIR_FLAGS if rank_stream else DIR_FLAGS & ~os.O_NOFOLLOW)
    except OSError as exc:
        if checked is not None:
            _say_what(folder)
        raise LoaderError(f"{folder}: cannot open the folder to read its batches ({exc.strerror}); check that it is "
                          "the daemon's --buffer (or a rank's stream in it) and that this user may read it") from None
    opened = os.fstat(fd)
    if checked is None or (opened.st_dev, opened.st_ino) == (checked.st_dev, checked.st_ino):
        return fd
    os.close(fd)
    _say_what(folder)
    raise LoaderError(f"{folder}: was replaced while the loader opened it (by the daemon making it again, or a member "
                      "of the buffer's group renaming its entries); start the trainer again")


def _say_what(folder: Path) -> None:
    """ProtocolError where stream folder ``folder`` is someone else's, or a link (``check_stream_folder``)."""
    with contextlib.suppress(FileNotFoundError):  # gone: the caller says it changed
        check_stream_folder(folder)


class BatchWaiter:
    """Waits for the batch files of one buffer's job, watching the daemon that owns it; looks them up in the
    folder it opened when it was made, which it holds open until :meth:`close`.

    Args:
        buffer, manifest: the stream directory and its job (named in restart commands).
        timeout: seconds any one batch is waited for.
        grace: seconds without an owner of the buffer before :class:`DaemonGone`.
        stall: seconds without the owner's heartbeat before :class:`DaemonStuck`; None: never.
    """

    def __init__(self, buffer: Path, manifest: Manifest, timeout: float, grace: float, stall: float | None) -> None:
        self.buffer = buffer
        self._rank_stream = owning_buffer(buffer) != buffer
        # The folder the loader reads its batches from, open for its life (``close``, or a finalizer for a waiter
        # dropped unclosed): a batch is looked up in it (``map_batch``'s dir_fd), never by a path that a member of
        # a --group-access buffer's group could lead, between the open and a check, to a folder of theirs.
        self.fd = open_stream_folder(buffer, self._rank_stream)
        self._closer = weakref.finalize(self, os.close, self.fd)
        self.manifest = manifest
        self.timeout = timeout
        self.grace = grace
        self.stall = stall
        # Often enough that the grace period and the stall bound are honoured to ~25 %.
        self.liveness_interval = min(1.0, max(0.01, grace / 4), max(0.01, (stall or 4.0) / 4))
        # (owner, wall time) of the first look at a daemon that had written no heartbeat of its own yet.
        self._beatless: tuple[DaemonOwner, float] | None = None
        # When the daemon is next looked at, kept from one wait to the next: a trainer that waits a
        # little for most batches would otherwise look at it (the lock's process, status.json,
        # progress.json: ~0.5 ms) at every batch instead of every liveness_interval.
        self._next_look = 0.0
        # When the daemon's storage wait was last logged (monotonic); None while it is not waiting.
        self._storage_said: float | None = None

    def wait(self, epoch: int, step: int, check_progress: Callable[[], None],
             stop_requested: Callable[[], bool] | None = None) -> MappedBatch:
        """Map batch (epoch, step) once it is there; ``check_progress`` runs at each look at the daemon
        (the loader makes sure progress.json still names what it waits for).  ``stop_requested`` is
        asked between tries: True raises :class:`StopRequested` (a stalled daemon would otherwise hold
        a stop until the stall bound)."""
        name = batch_name(epoch, step)
        path = os.path.join(self.buffer, name)  # a str: a poll that finds nothing builds no Path
        start = time.monotonic()
        deadline = start + self.timeout
        delay = FIRST_DELAY
        gone_since: float | None = None
        owner: DaemonOwner | None = None
        looked = False  # at the daemon, in this wait (the last look may belong to the wait before)
        warned = False
        stored = False  # the daemon said it waited for its storage, which moved the deadline
        while True:
            try:
                return self._map(path)
            except FileNotFoundError:
                pass  # not produced yet, or deleted to be regenerated after a rewind
            now = time.monotonic()
            if now >= self._next_look:
                self._next_look = now + self.liveness_interval
                looked = True
                check_progress()
                # A folder the daemon made again gets the batches, never the one open here: said now, not at the
                # timeout.
                self.check_folder()
                status = readable_status(self.buffer)
                owner = daemon_owner(self.buffer, status)
                if owner is not None:
                    gone_since = None
                    if self._rank_stream:
                        check_served(self.buffer, owner, status)  # its daemon restarted with fewer --ranks?
                    self._check_heartbeat(owner, status, name, epoch, step, now - start)
                    self._check_job_ended(owner, status, name, epoch, step)
                    if self._waits_on_storage(owner, status, name, now):
                        deadline = max(deadline, now + self.timeout)
                        stored = True
                elif gone_since is None:
                    gone_since = now
                if gone_since is not None and now - gone_since >= self.grace:
                    raise DaemonGone(
                        f"{self.buffer}: no prefetchd daemon owns this buffer (none seen for {self.grace:g} s) "
                        f"and batch {name} (epoch {epoch}, step {step}) is not there; last "
                        f"{status_summary(self.buffer, self.manifest.rank)}. {self._restart_hint()}"
                    )
            if now >= deadline:
                if not looked:  # a timeout shorter than the liveness interval: the message names the owner
                    owner = daemon_owner(self.buffer)
                owned = f"the daemon ({owner}) owns the buffer" if owner is not None else "no daemon owns the buffer"
                waited = (f"{now - start:.0f} s, the last {self.timeout:g} s of it since the daemon last said it "
                          "waited for its storage,") if stored else f"{self.timeout:g} s"
                raise LoaderTimeout(
                    f"{self.buffer}: waited {waited} for batch {name} (epoch {epoch}, step {step}) "
                    f"and it did not appear; {owned}; {status_summary(self.buffer, self.manifest.rank)}. Check "
                    f"`prefetchd status --buffer {self.buffer}`, or {MORE_TIME} if the daemon is just slow"
                )
            if stop_requested is not None and stop_requested():
                raise StopRequested(f"asked to stop while waiting for {path}")
            if not warned and now - start >= SLOW_WAIT_WARNING:
                warned = True
                logger.warning("still waiting for %s after %.0f s; %s", path, now - start,
                               status_summary(self.buffer, self.manifest.rank))
            time.sleep(min(delay, max(0.0, deadline - now)))
            delay = min(delay * 2, MAX_DELAY)

    def map_if_there(self, epoch: int, step: int) -> MappedBatch:
        """Batch (epoch, step) where its file is there (FileNotFoundError where not), without waiting."""
        return self._map(os.path.join(self.buffer, batch_name(epoch, step)))

    def _map(self, path: str) -> MappedBatch:
        """The batch file at ``path``, looked up in the folder open here; then the folder at the path is checked."""
        if self.fd < 0:
            raise LoaderError(f"the BufferLoader for {self.buffer} is closed; create a new one")
        mapped = map_batch(path, dir_fd=self.fd)
        # The manifest and the progress file are still read and written by path, where a member may have renamed a
        # folder of theirs in.  A buffer that is its own stream only its user (or its parent's owner) can replace.
        if self._rank_stream:
            self.check_folder()
        return mapped

    def check_folder(self) -> None:
        """LoaderError where the folder at the loader's path is not the one it reads its batches from: one the daemon
        made again since (--reset, a job of another world size), whose batches never come in the folder open here, or
        a buffer removed and made again; a rank's stream folder of someone else, or a link, is a ProtocolError
        (``check_stream_folder``).  An lstat and an fstat, a few us.  A folder gone is let be: JobWatch tells a job of
        another world size, and a folder being made again is found at a later look."""
        try:
            now = os.lstat(self.buffer) if self._rank_stream else os.stat(self.buffer)
        except FileNotFoundError:
            return
        held = os.fstat(self.fd)
        # A folder removed has no links left: a new one of the same inode number (ext4 reuses them) is not it.
        if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino) and held.st_nlink:
            return
        if self._rank_stream:
            if not os.path.lexists(self.buffer):
                return
            _say_what(self.buffer)
            raise LoaderError(f"{self.buffer}: the daemon made this stream folder again since this loader started "
                              "(`prefetchd start --reset`, or a job of another --world-size); start the trainer again")
        raise LoaderError(f"{self.buffer}: is not the buffer folder this loader started on (removed and made again "
                          "since, or a link that leads to another now); start the trainer again")

    def close(self) -> None:
        """Close the folder's fd; a later map raises LoaderError."""
        self._closer()
        self.fd = -1

    def _check_job_ended(self, owner: DaemonOwner, status: Status | None, name: str, epoch: int, step: int) -> None:
        """Raise JobEnded when daemon ``owner`` says it waits for a job while the buffer's manifest is still this
        loader's job: it finished it (or stopped producing it), and builds none of its batches until the job is
        submitted again.  A manifest of another job, or none, is JobWatch's to tell."""
        own = status if owner.wrote(status) else None
        if own is None or own.state != State.WAITING_FOR_JOB:
            return
        try:
            current = Manifest.read(self.buffer)
        except (ProtocolError, OSError):
            return
        if current.identity_diff(self.manifest) or current.epochs != self.manifest.epochs:
            return
        answer = f" (its last answer to a job: {_short(own.job_result.reason)})" if own.job_result is not None else ""
        progress = owning_buffer(self.buffer) / PROGRESS_PATTERN if not self._rank_stream else \
            owning_buffer(self.buffer) / f"{STREAM_PREFIX}*" / PROGRESS_PATTERN
        raise JobEnded(
            f"{self.buffer}: the daemon ({owner}) is done with this loader's job{answer} and waits for a job, so "
            f"batch {name} (epoch {epoch}, step {step}) will not be built. To have the job produced again, submit it "
            f"(`{job_command(self.manifest, self.buffer, 'submit')}`); where its trainers read all its epochs the "
            f"daemon refuses it (\"nothing to produce\") until their progress files ({progress}) are removed, and "
            "then produces it from epoch 0"
        )

    def _waits_on_storage(self, owner: DaemonOwner, status: Status | None, name: str, now: float) -> bool:
        """Whether daemon ``owner``, beating, says this stream's builds wait for the dataset's storage (then
        logged: at once, and once a ``STORAGE_WAIT_LOG_SECONDS`` after).  The stream is named by its manifest's
        rank, as the daemon names it (a flat buffer's is rank 0); a wait on other ranks' batches only is none
        of this loader's: its batch is late for another reason.  A heartbeat older than the stall bound (the
        default one when the check is off) is no word of the daemon's now: a stopped daemon's last status
        would hold the wait for ever."""
        own = status if owner.wrote(status) else None
        wait = own.production.storage_wait if own is not None and own.production is not None else None
        since = wait.since_of(self.manifest.rank) if wait is not None else None
        fresh = self.stall if self.stall is not None else DEFAULT_STALL_TIMEOUT
        if own is None or wait is None or since is None or time.time() - own.heartbeat > fresh:
            self._storage_said = None
            return False
        if self._storage_said is None or now - self._storage_said >= STORAGE_WAIT_LOG_SECONDS:
            self._storage_said = now
            # Since this rank's batches began to fail: another rank's may have failed long before.
            whose = f" to build rank {self.manifest.rank}'s batches" if self.manifest.world_size > 1 else ""
            logger.warning(
                "the daemon (%s) of %s has waited %.0f s for its dataset's storage%s (%s); batch %s comes once that "
                "is back, so this loader waits on past its timeout of %g s (a daemon gone or stuck still ends the "
                "wait; `prefetchd status --buffer %s` shows it)", owner, self.buffer, max(0.0, time.time() - since),
                whose, _short(wait.reason), name, self.timeout, owning_buffer(self.buffer))
        return True

    def _restart_hint(self) -> str:
        """How to bring the daemon back, for DaemonGone and DaemonStuck alike: the command that resumes the
        job, which names the job only, so the daemon's own flags (--high-water, --workers) are to be added;
        unless it failed, where that command would fail the same way."""
        status = readable_status(self.buffer)
        if status is not None and status.state == State.FAILED:
            return (f"It failed (the message in its status, above): fix that first, then restart it with the "
                    f"flags it had: the job's are `{job_command(self.manifest, self.buffer)}`, to which add the "
                    "daemon's own it was started with (such as --workers, --strict or --max-bad-*); it resumes "
                    "from progress.json")
        return (f"Restart it with `{job_command(self.manifest, self.buffer)}` and the daemon's own flags it was "
                "started with (such as --workers or --high-water), or as it was started (its service): it resumes "
                "from progress.json")

    def _check_heartbeat(self, owner: DaemonOwner, status: Status | None, name: str, epoch: int, step: int,
                         waited: float) -> None:
        """Raise DaemonStuck when daemon ``owner`` owns the buffer but has not beaten for ``stall`` (``status``:
        the buffer's, as just read).

        A status written by another process (the previous daemon) is not this one's
        heartbeat (``DaemonOwner.wrote``); a daemon without one yet is timed from the loader's first look.
        """
        if self.stall is None:
            return
        wall = time.time()
        own = status if owner.wrote(status) else None
        if own is not None:
            last, what = own.heartbeat, "heartbeat"
            self._beatless = None
        else:
            if self._beatless is None or self._beatless[0] != owner:
                self._beatless = (owner, wall)
            last, what = self._beatless[1], "heartbeat at all since the loader first saw it"
        age = wall - last
        if age <= self.stall:
            return
        state = _short(own.state) if own is not None else "unknown"
        pid = owner.pid
        raise DaemonStuck(
            f"{self.buffer}: the daemon ({owner}) owns this buffer but has written no {what} for {age:.1f} s "
            f"(stall_timeout {self.stall:g} s; last state {state}) "
            f"and batch {name} (epoch {epoch}, step {step}) has been waited for {waited:.1f} s: it is stuck, or "
            f"stopped (SIGSTOP, a debugger, swapping). See where with `py-spy dump --pid {pid}`{owner.where}; then "
            f"stop it (`kill {pid}`, `kill -9 {pid}` if it does not go). {self._restart_hint()}. If it is only slow, "
            "pass a larger stall_timeout (prefetchd-train --daemon-timeout)"
        )


def status_summary(buffer: Path, rank: int | None = None) -> str:
    """The daemon's own account of itself from status.json, for wait messages; ``rank``: the waiting loader's,
    whose batches' builds the daemon may say wait for the dataset's storage (None: any rank's)."""
    try:
        status = read_status(buffer)
    except (ProtocolError, OSError) as exc:
        return f"its status.json is unreadable ({exc})"
    if status is None:
        return "the daemon has written no status.json"
    return "daemon status: " + ", ".join(_summary_parts(status, rank))


def _summary_parts(status: Status, rank: int | None = None) -> list[str]:
    parts = [f"state={_short(status.state)}"]
    p = status.production
    wait = p.storage_wait if p is not None else None
    since = (wait.since if rank is None else wait.since_of(rank)) if wait is not None else None
    said = None  # the storage's failure, where said
    if wait is not None and since is not None:
        # Said before the errors: the failed builds it counts are then the storage's, not a full tmpfs.
        whose = f" of rank {rank}'s batches" if rank is not None and p is not None and len(p.streams) > 1 else ""
        said = wait.reason
        parts.append(f"its builds{whose} have waited {max(0.0, time.time() - since):.0f} s for the dataset's "
                     f"storage and resume once it is back ({_short(said)})")
    if status.message and status.message != said:
        parts.append(f"message={_short(status.message)}")
    if p is not None:
        parts.append(f"it sees progress epoch {p.progress.epoch} step {p.progress.step}")
        ranks = f" for its {len(p.streams)} ranks together" if len(p.streams) > 1 else ""
        parts.append(f"{counted(p.waiting, 'batch')} waiting (high water {p.high_water}{ranks})")
        e = p.errors
        # Only what went wrong: zero counters and empty fields are noise in an error message.
        bad = {
            "replaced_samples": e.replaced_samples, "undecodable_files": e.undecodable_files,
            "undecodable": [f"{b.path}: {b.reason}" for b in e.undecodable], "worker_restarts": e.worker_restarts,
            "write_failures": e.write_failures, "progress_file": e.progress_file,
        }
        shown = {k: v for k, v in bad.items() if v}
        if shown:
            parts.append("errors: " + ", ".join(f"{k}={_short(v)}{_MEANING.get(k, '')}" for k, v in shown.items()))
    parts.append(f"last heartbeat {max(0.0, time.time() - status.heartbeat):.1f} s ago")
    return parts


# What a counter's name does not say: write_failures counts failed reads of the dataset too.
_MEANING = {"write_failures": " (builds retried: a failed write of the batch, or a failed read of the dataset)"}


def job_command(m: Manifest, stream: Path, verb: str = "start") -> str:
    """The ``prefetchd start`` (or ``submit``) that serves ``m``'s job on the buffer of ``stream``
    again: every flag of the job's identity (a daemon started with others would refuse the buffer
    as another job's) and its epochs, so that the daemon resumes from progress.json."""
    buffer = owning_buffer(stream)
    options: dict[str, object] = {
        "data": m.dataset_root,
        "split": m.split if m.split != "train" else None,
        "val_fraction": exact_number(m.val_fraction) if m.val_fraction is not None else None,
        "batch_size": m.batch_size,
        "image_size": m.image_size,
        "seed": m.seed or None,
        "world_size": m.world_size if m.world_size > 1 else None,
        "ranks": _served_ranks(m, buffer) if m.world_size > 1 else None,
        **augmentation_options(m.augmentation),
        "drop_last": m.drop_last or None,
        "epochs": m.epochs,
    }
    return shlex.join(["prefetchd", verb, "--buffer", str(buffer), *option_args(options)])


def _served_ranks(m: Manifest, buffer: Path) -> str:
    """The ranks whose streams the daemon that wrote ``m`` produced, as ``--ranks`` takes them (``0-3,6``):
    those whose manifest names the same producer."""
    ranks = [m.rank]
    for directory in sorted(buffer.glob(f"{STREAM_PREFIX}*")):
        try:
            other = Manifest.read(directory)
        except (ProtocolError, OSError):
            continue
        if other.producer == m.producer and other.rank != m.rank:
            ranks.append(other.rank)
    return rank_ranges(ranks)


def _short(value: object, limit: int = 300) -> str:
    """``value`` as text, cut at a word before ``limit`` characters (status.json is written by others)."""
    text = str(value)
    return text if len(text) <= limit else text[: limit - 4].rsplit(" ", 1)[0] + " ..."


__all__ = ["BatchWaiter", "JobWatch", "job_command", "served_world", "status_summary", "wait_for_manifest",
           "MORE_TIME", "why_no_manifest"]
