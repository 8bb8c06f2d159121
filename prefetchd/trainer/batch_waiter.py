"""Waiting for a batch file, and telling a slow daemon from a stuck or a gone one.

A :class:`BatchWaiter` maps each batch of a loader's job once the daemon has
written it, looking it up in the stream folder it checked and opened when it was
made (:func:`open_stream_folder`).  Every wait is bounded by ``timeout``
(``wait_bounds``); while a batch is waited for, the daemon is looked at every
``liveness_interval`` (a quarter of the shortest bound, at most 1 s)::

    no daemon owns daemon.lock    for daemon_grace     -> DaemonGone   (restart it)
    the holder's status.json heartbeat older than
                                  stall_timeout        -> DaemonStuck  (py-spy, kill, restart; kill -CONT if stopped)
    the holder's status.json says it waits for a job while
    the manifest is this loader's job at once              -> JobEnded     (submit it again)
    nothing of the above, the batch still missing after
                                  timeout              -> LoaderTimeout

Only the heartbeat counts, never the batch rate: a daemon that is slow (a huge
batch, a cold network filesystem) but alive rewrites status.json about once a
second and is never called stuck.  Every message carries the daemon's own account
of itself from status.json (``daemon_status.status_summary``).

A daemon whose builds wait for the dataset's storage (status.json's
``storage_wait``: an object store's outage, a dataset's mount gone) will resume by
itself once it is back, so while the owner beats and says so of this loader's rank,
``timeout`` does not run out: it counts from the last look that found it waiting.
A daemon gone or stuck meanwhile still ends the wait as above.  The loader's
messages then say that its builds wait for the storage, and why, before the
``write_failures`` those builds add to (which a full tmpfs adds to as well).

So does a daemon whose status says a worker building its batches is stalled
(``worker_stall``: a read of a hung mount, a hook that never returns, a worker
that never gets ready): it kills that worker at its ``--task-timeout`` (600 s by
default, five times the loader's default ``timeout``) and builds its tasks on
another, and a loader that gave up first ended a run the daemon would have
carried on.  That bound is the daemon's, and a task that hangs 3 times stops the
job, which ends the wait as a daemon gone does, with the daemon's reason.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections.abc import Callable
from pathlib import Path

from prefetchd.buffer_protocol import (
    Manifest,
    MappedBatch,
    Production,
    ProtocolError,
    State,
    Status,
    WorkerStall,
    batch_name,
    DaemonOwner,
    daemon_owner,
    map_batch,
    readable_status,
    why_no_owner,
)
from prefetchd.buffer_protocol.layout import (DEFAULT_CONSUMER, DIR_FLAGS, PROGRESS_PATTERN, STREAM_PREFIX,
                                             check_stream_folder, owning_buffer, progress_name)
from prefetchd.oom import oom_kills
from prefetchd.trainer.daemon_status import check_served, short, status_summary
from prefetchd.trainer.errors import DaemonGone, DaemonStuck, JobEnded, LoaderError, LoaderTimeout, StopRequested
from prefetchd.trainer.job_command import job_command
from prefetchd.trainer.wait_bounds import DEFAULT_STALL_TIMEOUT, MORE_TIME
from prefetchd.words import counted

logger = logging.getLogger(__name__)

# Waiting for a batch starts with 1 ms sleeps (a daemon that keeps up publishes
# within a few ms) and backs off to 20 ms, so a stalled daemon costs ~50 wake-ups
# a second, not a busy core.
FIRST_DELAY = 0.001
MAX_DELAY = 0.020
SLOW_WAIT_WARNING = 10.0
STORAGE_WAIT_LOG_SECONDS = 60.0  # a wait on the daemon's storage is said at once, then this often at most
WORKER_STALL_LOG_SECONDS = 60.0  # a wait on a stalled worker of the daemon, likewise
# ... but another stall is said at once: one whose ``since`` is this far from the last one's.  A stall's own moves by
# microseconds from one status to the next (the daemon's wall clock less the seconds it counted), and each status
# was said as a new stall, once a second.
ANOTHER_STALL_SECONDS = 1.0


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

    def __init__(self, buffer: Path, manifest: Manifest, timeout: float, grace: float, stall: float | None,
                 consumer: str = DEFAULT_CONSUMER) -> None:
        self.buffer = buffer
        self.progress = progress_name(consumer)  # where a daemon started again finds this loader's position
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
        # When a stalled worker of the daemon was last logged (monotonic), and that stall; None while none is.
        self._stall_said: float | None = None
        self._stall: WorkerStall | None = None
        self._oom_kills = oom_kills()  # the machine's, now: a daemon that vanished may be one killed since

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
        stalled: WorkerStall | None = None  # the last stalled worker the daemon said it would kill, which moved it too
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
                    stall = self._stalled_worker(owner, status, name, now)
                    if stall is not None:
                        deadline = max(deadline, now + self.timeout)
                        stalled = stall
                elif gone_since is None:
                    gone_since = now
                # Looked at once more, to say why: the last status may still beat (a lock file removed, a clock
                # stepped), which says what to look at.
                if gone_since is not None and now - gone_since >= self.grace and (
                        why := why_no_owner(self.buffer, status)) is not None:
                    raise DaemonGone(
                        f"{self.buffer}: no prefetchd daemon owns this buffer (none seen for {self.grace:g} s: {why}) "
                        f"and batch {name} (epoch {epoch}, step {step}) is not there; last "
                        f"{status_summary(self.buffer, self.manifest.rank)}. {self._restart_hint()}"
                        f"{self._oom_hint()}"
                    )
            if now >= deadline:
                if not looked:  # a timeout shorter than the liveness interval: the message names the owner
                    owner = daemon_owner(self.buffer)
                owned = f"the daemon ({owner}) owns the buffer" if owner is not None else "no daemon owns the buffer"
                held = [*(["it waited for its storage"] if stored else []),
                        *([f"a worker was stalled ({short(stalled.reason)})"] if stalled is not None else [])]
                waited = (f"{now - start:.0f} s, the last {self.timeout:g} s of it since the daemon last said "
                          f"{' and '.join(held)},") if held else f"{self.timeout:g} s"
                status = readable_status(self.buffer)
                # Paused for space, more time only waits longer: the filesystem is what to mend (a walk).
                then = (f"free space on the buffer's filesystem (the daemon is paused for it: {short(status.message)})"
                        if status is not None and status.state == State.PAUSED_LOW_SPACE
                        else f"{MORE_TIME} if the daemon is just slow")
                raise LoaderTimeout(
                    f"{self.buffer}: waited {waited} for batch {name} (epoch {epoch}, step {step}) "
                    f"and it did not appear; {owned}; {status_summary(self.buffer, self.manifest.rank)}. Check "
                    f"`prefetchd status --buffer {self.buffer}`, or {then}"
                )
            if stop_requested is not None and stop_requested():
                raise StopRequested(f"asked to stop while waiting for {path}")
            if not warned and now - start >= SLOW_WAIT_WARNING:
                warned = True
                owner = daemon_owner(self.buffer)
                stopped = owner.stopped_note() if owner is not None else None
                # A stopped daemon's status is as it was when it stopped: said first, with what lets it go on.
                logger.warning("still waiting for %s after %.0f s; %s%s", path, now - start,
                               f"{stopped}; as of its last heartbeat, " if stopped is not None else "",
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
                              "(`prefetchd start --reset`, or a job of another --world-size); start the trainer again, from its last "
                              "checkpoint (prefetchd-train --resume)")
        raise LoaderError(f"{self.buffer}: is not the buffer folder this loader started on (removed and made again "
                          "since, or a link that leads to another now); start the trainer again, from its last checkpoint "
                          "(prefetchd-train --resume)")

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
        answer = f" (its last answer to a job: {short(own.job_result.reason)})" if own.job_result is not None else ""
        progress = owning_buffer(self.buffer) / PROGRESS_PATTERN if not self._rank_stream else \
            owning_buffer(self.buffer) / f"{STREAM_PREFIX}*" / PROGRESS_PATTERN
        raise JobEnded(
            f"{self.buffer}: the daemon ({owner}) is done with this loader's job{answer} and waits for a job, so "
            f"batch {name} (epoch {epoch}, step {step}) will not be built. To have the job produced again, submit it "
            f"(`{job_command(self.manifest, self.buffer, 'submit')}`); where its trainers read all its epochs the "
            f"daemon refuses it (\"nothing to produce\") until their progress files ({progress}) are removed, and "
            "then produces it from epoch 0"
        )

    def _fresh_production(self, owner: DaemonOwner, status: Status | None) -> Production | None:
        """What daemon ``owner`` says of its production now: its status's, where it wrote that status and beat
        within the stall bound (the default one when the check is off).  An older heartbeat is no word of the
        daemon's now: a stopped daemon's last status would hold a wait for ever."""
        if status is None or not owner.wrote(status) or status.production is None:
            return None
        fresh = self.stall if self.stall is not None else DEFAULT_STALL_TIMEOUT
        return status.production if time.time() - status.heartbeat <= fresh else None

    def _waits_on_storage(self, owner: DaemonOwner, status: Status | None, name: str, now: float) -> bool:
        """Whether daemon ``owner``, beating, says this stream's builds wait for the dataset's storage (then
        logged: at once, and once a ``STORAGE_WAIT_LOG_SECONDS`` after).  The stream is named by its manifest's
        rank, as the daemon names it (a flat buffer's is rank 0); a wait on other ranks' batches only is none
        of this loader's: its batch is late for another reason.  Only the daemon's word now counts
        (``_fresh_production``)."""
        production = self._fresh_production(owner, status)
        wait = production.storage_wait if production is not None else None
        since = wait.since_of(self.manifest.rank) if wait is not None else None
        if wait is None or since is None:
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
                whose, short(wait.reason), name, self.timeout, owning_buffer(self.buffer))
        return True

    def _stalled_worker(self, owner: DaemonOwner, status: Status | None, name: str, now: float) -> WorkerStall | None:
        """The stalled worker daemon ``owner``, beating, says it will kill (``worker_stall``), then logged: at once,
        and once a ``WORKER_STALL_LOG_SECONDS`` after; None when it says none.  Any rank's loader waits on: the
        workers serve every rank, and a stalled one holds tasks of any rank's batches (this one's among them, or
        queued behind them).  Only the daemon's word now counts (``_fresh_production``)."""
        production = self._fresh_production(owner, status)
        stall = production.worker_stall if production is not None else None
        if stall is None:
            self._stall_said = None
            return None
        if self._stall_said is None or now - self._stall_said >= WORKER_STALL_LOG_SECONDS or (
                self._stall is not None and abs(self._stall.since - stall.since) >= ANOTHER_STALL_SECONDS):
            self._stall_said = now
            bound = "--worker-start-timeout" if stall.starting else "--task-timeout"
            left = max(0.0, stall.since + stall.timeout - time.time())
            logger.warning(
                "the daemon (%s) of %s says that a worker building its batches is stalled (%s); at its %s of %g s, in "
                "%.0f s, it kills that worker (on a Ray cluster, cancels that slice) and builds its tasks again, so "
                "batch %s may come then: this loader waits on "
                "past its timeout of %g s (a daemon gone, stuck, or that stops the job still ends the wait; "
                "`prefetchd status --buffer %s` shows it)", owner, self.buffer, short(stall.reason), bound, stall.timeout, left,
                name, self.timeout, owning_buffer(self.buffer))
        self._stall = stall
        return stall

    def _oom_hint(self) -> str:
        """For DaemonGone: the kernel's OOM kills since this loader began, where there were any (a daemon killed so
        leaves a status that still says it runs, and no word in its log)."""
        now = oom_kills()
        if now is None or self._oom_kills is None or now <= self._oom_kills:
            return ""
        return (f". The kernel's out-of-memory killer killed {counted(now - self._oom_kills, 'process')} on this "
                "machine since this loader started (`dmesg` names them): if the daemon was one, give it more memory, "
                "or lower its --high-water or --workers")

    def _restart_hint(self) -> str:
        """How to bring the daemon back, for DaemonGone and DaemonStuck alike: the command that resumes the
        job, which names the job only, so the daemon's own flags (--high-water, --workers) are to be added;
        unless it failed, where that command would fail the same way."""
        status = readable_status(self.buffer)
        if status is not None and status.state == State.FAILED:
            return (f"It failed (the message in its status, above): fix that first, then restart it with the "
                    f"flags it had: the job's are `{job_command(self.manifest, self.buffer)}`, to which add the "
                    "daemon's own it was started with (such as --workers, --strict or --max-bad-*); it resumes "
                    f"from {self.progress}")
        return (f"Restart it with `{job_command(self.manifest, self.buffer)}` and the daemon's own flags it was "
                "started with (such as --workers or --high-water), or as it was started (its service): it resumes "
                f"from {self.progress}")

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
        state = short(own.state) if own is not None else "unknown"
        pid = owner.pid
        stopped = owner.stopped_note()
        if stopped is not None:
            raise DaemonStuck(
                f"{self.buffer}: {stopped}; it has written no {what} for {age:.1f} s (stall_timeout {self.stall:g} s; "
                f"last state {state}) and batch {name} (epoch {epoch}, step {step}) has been waited for {waited:.1f} "
                f"s. Continue it and start the trainer again, from its last checkpoint; or stop it with "
                f"{owner.how_to_stop(self.buffer)}, which continues it to take its SIGTERM. {self._restart_hint()}")
        raise DaemonStuck(
            f"{self.buffer}: the daemon ({owner}) owns this buffer but has written no {what} for {age:.1f} s "
            f"(stall_timeout {self.stall:g} s; last state {state}) "
            f"and batch {name} (epoch {epoch}, step {step}) has been waited for {waited:.1f} s: it is stuck, or "
            f"stopped (SIGSTOP, a debugger, swapping). See where with `py-spy dump --pid {pid}`{owner.where}, or "
            f"`kill -USR1 {pid}`, which has it write its threads' stacks into its log; then "
            f"stop it (`kill {pid}`, `kill -9 {pid}` if it does not go). {self._restart_hint()}. If it is only slow, "
            "pass a larger stall_timeout (prefetchd-train --daemon-timeout)"
        )


__all__ = ["BatchWaiter", "open_stream_folder"]
