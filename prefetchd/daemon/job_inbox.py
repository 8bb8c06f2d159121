"""Jobs submitted through job.json: which settings a job may set, checking a request and answering it
(``JobInbox``), keeping the accepted one for a restart to resume, and waiting for the next job."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefetchd.buffer_protocol import (BadJobRequest, DaemonLock, JobRequest, JobResult, Progress, ProtocolError,
                                       RunningJob, State, Status, readable_status)
from prefetchd.buffer_protocol.errors import shown
from prefetchd.buffer_protocol.job_request import put_back, when_written
from prefetchd.buffer_protocol.layout import ACCEPTED_JOB_NAME, JOB_NAME, at, stream_dirs
from prefetchd.buffer_protocol.ownership import writer_alive
from prefetchd.daemon.config import FIELDS, DaemonConfig
from prefetchd.daemon.consumers import MAX_PROGRESS_READS, progress_stats
from prefetchd.daemon.errors import BufferLost, ConfigError
from prefetchd.access import user_name
from prefetchd.daemon.job_policy import JobPolicy
from prefetchd.daemon.sdnotify import Notifier
from prefetchd.daemon.wakeup import Wakeup
from prefetchd.words import epochs_flag, one_line
from prefetchd.locations import is_url

log = logging.getLogger(__name__)

# Fields that say how this machine produces, not what: a job cannot set them.
MACHINE_FIELDS = frozenset({
    "buffer", "workers", "high_water", "low_water", "min_free_mb", "reset", "group_access", "index_cache",
    "max_buffer_bytes", "consumer_timeout", "task_timeout", "worker_start_timeout",
    "metrics_port", "metrics_address", "metrics_textfile", "readers", "allowed_data", "allowed_transforms",
    "ray", "ray_builds",
})
JOB_FIELDS = frozenset(FIELDS) - MACHINE_FIELDS
ONE_SHOT_FIELDS = frozenset({"refresh_index"})  # for the start that asked, not kept for a restart to resume
TRAINER_ACTIVE_SECONDS = 30.0
# How the answer to a job that was accepted and then failed begins (`prefetchd status` shows it as such).
FAILED_WHILE_PRODUCING = "failed while producing"
FINISHED_PRODUCING = "finished producing"  # an accepted job's answer once its epochs are consumed


def job_verdict(accepted: bool, reason: str) -> str:
    """A job's answer as the log and `prefetchd status` say it: "accepted: ..." or "refused: ...", but for
    an accepted job's answer replaced once it failed or finished, which carries its own verb."""
    if reason.startswith((FAILED_WHILE_PRODUCING, FINISHED_PRODUCING)):
        return reason
    return f"{'accepted' if accepted else 'refused'}: {reason}"


WAIT_STATUS_SECONDS = 1.0


def job_settings(cfg: DaemonConfig) -> dict[str, Any]:
    """What a job asks for, in job.json's terms; ``ranks`` as the ranks it names ("0-1" and "0,1" alike), None where
    it names them all: the running job's "--world-size 1 --ranks 0", which every suggested submit command spells
    out, was another job than the same one started without --ranks (refused while a trainer read, a walk)."""
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(cfg).items() if k in JOB_FIELDS}
    if cfg.ranks is not None:
        ranks = cfg.local_ranks
        settings["ranks"] = None if ranks == tuple(range(cfg.world_size)) else ",".join(map(str, ranks))
    return settings


# The longest answer to a job kept in status.json (which readers take up to MAX_DOCUMENT_LEN) and printed by submit.
MAX_REASON_CHARS = 2000


class JobInbox:
    """Turns a changed job.json into a validated config, or a refusal the submitter can read.

    The answer for the last request is published in status.json as ``job_result``.
    A job from another user than the daemon's is held to ``JobPolicy``.
    """

    def __init__(self, buffer: Path, machine: DaemonConfig, ignore_current: bool, dir_fd: int | None = None) -> None:
        self.buffer = buffer
        self.dir_fd = dir_fd  # the locked buffer folder's (DaemonLock.dir_fd), which the accepted job's record goes into
        self.machine = machine  # the user's machine settings, defaults not yet filled
        self.policy = JobPolicy.of(machine)
        # The request of the newest job.json answered (by its mtime): one renamed back into place soon enough for
        # JobRequest.read to let it through is still older than that, where a new one is not.
        self._newest: JobRequest | None = None
        self.result: JobResult | None = None
        # The status the daemon before left (none written by this one yet), which both what it finished and what it
        # ran are judged by; None where there is none or it cannot be read.
        self._left = readable_status(buffer)
        self._seen = self._stamp() if ignore_current or self._finished_before() else None
        # The request taken from job.json (or resumed), from its check until the daemon has answered it (``settle``):
        # what ``accepted`` records.
        self.pending_request: JobRequest | None = None
        # The roots the pending job's files must be inside (resolved local ones, or URLs; None: not confined).
        self.pending_confinement: tuple[str, ...] | None = None
        self.running: RunningJob | None = None  # the submitted job accepted and produced, until it ends
        # An fd of the record of the running job that this daemon wrote (``JobRequest.record``), open for writing: it
        # is emptied through it once it records no running job, wherever a member of the group has renamed it.
        self._record_fd: int | None = None

    def _finished_before(self) -> bool:
        """Whether job.json asks for the job the daemon before finished (its answer "finished producing" in the
        status it left); then that answer stands.  Taken again after a restart, the job was refused ("nothing to
        produce") and the status said it refused, a job that had run to its end (a user's walk)."""
        try:
            request = JobRequest.read(self.buffer)
        except (OSError, ProtocolError):
            return False
        result = self._left_finished()
        if request is None or result is None or result.job_id != request.job_id:
            return False
        self.result = result
        return True

    def _left_finished(self) -> JobResult | None:
        """The answer "finished producing" in the status the daemon before left, where that was its last answer."""
        result = self._left.job_result if self._left is not None else None
        finished = result is not None and result.accepted and result.reason.startswith(FINISHED_PRODUCING)
        return result if finished else None

    def left_a_finished_job(self) -> bool:
        """Whether the daemon before ended waiting after a submitted job it ran to its end (its answer "finished
        producing", no job running): the buffer's manifest is that job's, every epoch read, so a daemon with a job of
        its own takes the buffer.  It refused it as another job's batches (exit 2, which the unit does not restart:
        the service stayed down after any restart, a walk of the service)."""
        return self._left is not None and self._left.running_job is None and self._left_finished() is not None

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            # Not through a link: any member of a --group-access buffer's group may make job.json one, to a path that
            # hangs a stat (an unanswering network mount) or to nothing, and one to nothing was no request at all,
            # never answered.  A link is stamped as itself, and its read refused (O_NOFOLLOW: "a symbolic link").
            st = (self.buffer / JOB_NAME).lstat()
        except (FileNotFoundError, NotADirectoryError):  # no request; a buffer made a file is the lock's to say
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def answer(self, job_id: str | None, accepted: bool, reason: str, submitter: int | None) -> None:
        """Publish the answer to request ``job_id`` (as ``result``), and log it.  ``submitter``: the owner of the
        job.json answered (None: not known), never looked up by ``job_id``, which whoever writes job.json
        chooses: a malformed one under the running job's id was said to be that job's submitter's."""
        # The reason quotes job.json's fields, which any member of the buffer's group wrote: `prefetchd submit`
        # and `prefetchd status` print it to whoever runs them, so its newlines and terminal escapes are
        # written out as the log writes them.
        reason = one_line(reason)
        if len(reason) > MAX_REASON_CHARS:  # a megabyte-long `data` quoted whole would outgrow status.json
            reason = f"{reason[:MAX_REASON_CHARS - 40]}... ({len(reason)} characters in all)"
        (log.info if accepted else log.warning)("job %s %s", job_id or "(unreadable)", job_verdict(accepted, reason))
        self.result = JobResult(job_id=job_id, accepted=accepted, reason=reason, time=time.time(), submitter=submitter)

    def resumable(self) -> DaemonConfig | None:
        """The submitted job an earlier daemon here accepted and had not finished (``accepted``'s record), to start
        with after a restart; None where there is none.  Not job.json: the next request, refused or not, replaces
        that file, and a restart then ran a refused job over the one its trainers read (without --replace); and a
        daemon with its own ``data`` started the configured job, refused the submitted one's batches as another
        job's and exited 2, which the unit does not restart."""
        try:
            request = JobRequest.recorded(self.buffer)
        except ProtocolError as exc:
            log.warning("not resuming the job an earlier daemon accepted: %s", exc)
            return None
        if request is None:
            return None
        if not self._last_status_runs(request):
            self.forget_accepted()
            return None
        try:
            job, confinement = self._checked(request)
        except ConfigError as exc:  # the config's allow-lists changed since it was accepted
            log.warning("not resuming job %s, which the earlier daemon was producing: %s", request.job_id, exc)
            self.forget_accepted()
            return None
        self._pend(request, confinement)
        return job

    def _last_status_runs(self, request: JobRequest) -> bool:
        """Whether the status the earlier daemon left names ``request`` as the job it ran (or no status says).
        A daemon of a prefetchd before job.accepted.json, or one producing its own --data, may have run the buffer
        since (a downgrade and upgrade back): the record then names a job long replaced, and resuming it cleared
        the batches and progress of the one produced since, and told its trainers that job was replaced."""
        status = self._left
        if status is None:
            return True  # nothing to tell by: the record stands
        ran = status.running_job.job_id if status.running_job is not None else None
        if ran == request.job_id:
            return True
        since = f"job {ran}" if ran is not None else "a job not submitted, or by a prefetchd that keeps no record"
        log.warning("not resuming job %s on %s, which %s names as accepted: the last daemon here produced %s after "
                    "it", request.job_id, request.settings.get("data"), ACCEPTED_JOB_NAME, since)
        return False

    def _checked(self, request: JobRequest) -> tuple[DaemonConfig, tuple[str, ...] | None]:
        """The job ``request`` asks for, held to what its submitter may ask (``JobPolicy.confine``)."""
        return self.policy.confine(self._validate(request), request.owner)

    def _pend(self, request: JobRequest, confinement: tuple[str, ...] | None) -> None:
        self.pending_request, self.pending_confinement = request, confinement

    def settle(self) -> None:
        """The pending request is answered (accepted and started, or refused): none is pending."""
        self.pending_request = self.pending_confinement = None

    @property
    def pending_id(self) -> str | None:
        return self.pending_request.job_id if self.pending_request is not None else None

    @property
    def pending_owner(self) -> int | None:
        """The pending job's submitter: its job.json's owner (uid), which the log names."""
        return self.pending_request.owner if self.pending_request is not None else None

    def running_job(self) -> RunningJob | None:
        """The submitted job status.json names as the one that runs: the pending one from its start (before its
        manifests replace the running job's, so that a trainer stopped by them reads who submitted it), else
        the one accepted and produced."""
        request = self.pending_request
        if request is not None:
            return RunningJob(request.job_id, request.owner, request.submitted, "")
        return self.running

    def accepted(self, job: DaemonConfig) -> None:
        """Keep the pending request, now produced and answered as ``job``, as the running job, and for a restarted
        daemon to resume (``JobRequest.record``): with ``job``'s values of the settings the request left to the
        daemon.  A daemon restarted with other flags resumed the request under them, another job (an
        --image-size of 64 became 224), and cleared the batches its trainers read as another job's (a walk)."""
        if self.pending_request is None:
            return
        request, result = self.pending_request, self.result
        answer = result.reason if result is not None and result.job_id == request.job_id else ""
        self.running = RunningJob(request.job_id, request.owner, request.submitted, answer)
        voided = self._void_record()
        left = JOB_FIELDS - request.settings.keys() - ONE_SHOT_FIELDS
        pinned = {**request.settings, **{name: value for name in left if (value := getattr(job, name)) is not None}}
        try:
            self._record_fd = dataclasses.replace(request, settings=pinned).record(self.buffer, self.dir_fd)
        except OSError as exc:  # a full tmpfs: a restart then waits for a job, or starts the configured one
            log.warning("cannot keep job %s for a restart to resume (%s): a restart would not resume it",
                        self.pending_request.job_id, exc.strerror)
            if voided:  # the job before's record, emptied: left there, a restart said a member had renamed it back
                self._remove_record()

    def running_submitter(self) -> int | None:
        """Who submitted the running job (``running``), for the daemon's answers about it."""
        return self.running.submitter if self.running is not None else None

    def forget_accepted(self) -> None:
        """Drop the record of the accepted job: it ended, or cannot be resumed."""
        self.running = None
        self._void_record()
        self._remove_record()

    def _remove_record(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(at(self.buffer / ACCEPTED_JOB_NAME, self.dir_fd), dir_fd=self.dir_fd)

    def _void_record(self) -> bool:
        """Empty the record this daemon wrote last, through its fd: it records no running job any more (replaced by
        another, ended, failed).  Any member of the buffer's group may rename it aside, and renamed back over the
        next one, a restart resumed a job that was over; empty, it is refused as no record, as is one the daemon did
        not write.  Whether there was one (a record a restart resumed, this daemon did not write: none)."""
        fd, self._record_fd = self._record_fd, None
        if fd is None:
            return False
        try:
            os.ftruncate(fd, 0)
        except OSError as exc:  # a file of its own, open for writing: not expected, but then said
            log.warning("cannot empty %s, the record of the job accepted before (%s): a member of the buffer's group "
                        "who kept it aside could have a restarted daemon resume that job",
                        self.buffer / ACCEPTED_JOB_NAME, exc.strerror)
        finally:
            os.close(fd)
        return True

    def poll(self, running: DaemonConfig | None) -> DaemonConfig | None:
        """A new job to switch to, or None (nothing new, or refused: see ``result``)."""
        stamp = self._stamp()
        if stamp is None or stamp == self._seen:
            return None
        self._seen = stamp
        try:
            request = JobRequest.read(self.buffer)
        except ProtocolError as exc:  # under the document's job_id where it has one, so its submitter sees the answer
            bad = exc if isinstance(exc, BadJobRequest) else BadJobRequest(str(exc), None)
            self.answer(bad.job_id, False, str(exc), bad.owner)
            return None
        if request is None:
            return None
        old = self._put_back(request)
        if old is not None:
            self.answer(request.job_id, False, old, request.owner)
            return None
        try:
            job, confinement = self._checked(request)
        except ConfigError as exc:
            self.answer(request.job_id, False, str(exc), request.owner)
            return None
        except Exception as exc:  # any member of the buffer's group writes job.json: no job stops the daemon
            log.exception("internal error while checking job %s", request.job_id)
            self.answer(request.job_id, False, f"internal error while checking the job ({type(exc).__name__}: "
                        f"{shown(str(exc))}); the daemon goes on; please report it with its log", request.owner)
            return None
        if running is not None and job_settings(job) == job_settings(running):
            self.answer(request.job_id, True, "already producing this job", request.owner)
            return None
        idle, writer, gone = freshest_progress(self.buffer)
        if running is not None and idle < TRAINER_ACTIVE_SECONDS and not request.replace:
            # One killed moments ago counts too, for its restart resumes the job; said so, not "is consuming".
            consuming = (f"a trainer of {user_name(writer)} " + (
                f"that wrote its progress {idle:.0f} s ago is gone, and a restart of it within "
                f"{TRAINER_ACTIVE_SECONDS - idle:.0f} s would resume the running job on {running.data}" if gone else
                f"is consuming the running job on {running.data} (progress written {idle:.0f} s ago)"))
            end = new_end(running, job)
            if end is None:
                self.answer(request.job_id, False, f"{consuming}; submit with --replace to replace it anyway",
                            request.owner)
                return None
            if not end.later:
                self.answer(request.job_id, False,
                            f"{consuming}, and this job is that one with an earlier end ({end}): its trainers would "
                            "stop at their next batch (JobReplaced), short of the end they count on; submit with "
                            "--replace to end it there anyway", request.owner)
                return None
            # The same job to a later end takes nothing from its trainers: they read on to their own end, and
            # the daemon keeps the job's batches and goes on from their positions.
        self._pend(request, confinement)
        return job

    def _put_back(self, request: JobRequest) -> str | None:
        """Why ``request`` is an old one renamed back into place, not run (its job.json's mtime is older than that
        of a request answered already, or it is that request); None for a new one, which becomes the newest answered.
        An equal mtime is a new one (two writes in one tick of the filesystem's clock) but for the same job_id."""
        mtime, now = request.written_ns, time.time_ns()
        if mtime is None:
            return None
        newest = self._newest
        bar = newest.written_ns if newest is not None else None
        if newest is not None and bar is not None and mtime < bar <= now:  # past now: the clock was set back since
            return put_back(self.buffer / JOB_NAME, request.owner, mtime,
                            f"is older than job {newest.job_id} of {user_name(newest.owner)}, written {when_written(bar)}, "
                            "which this daemon answered already")
        if newest is not None and (mtime, request.job_id, request.owner) == (bar, newest.job_id, newest.owner):
            # The newest answered itself, renamed back after a request that raised no bar (refused as unreadable,
            # or with an mtime its owner set back): written in one tick with another, it would have another job_id.
            return put_back(self.buffer / JOB_NAME, request.owner, mtime,
                            f"is job {newest.job_id}, which this daemon answered already")
        if mtime <= now:  # one written in the future (its owner set that mtime) raises no bar for anyone else's
            self._newest = request
        return None

    def _validate(self, request: JobRequest) -> DaemonConfig:
        unknown = set(request.settings) - JOB_FIELDS
        if unknown:
            raise ConfigError(f"unknown job settings {shown(sorted(unknown))}; allowed: {', '.join(sorted(JOB_FIELDS))}")
        data = request.settings.get("data")
        if isinstance(data, str) and data and not is_url(data) and not os.path.isabs(data):
            # Made absolute with the daemon's working directory (/ under systemd), it named another folder than the
            # submitter's, and the refusal said only that that one does not exist (a review).
            raise ConfigError(f"data {shown(data)} is a relative path, which the daemon would take from its own "
                              f"working directory ({os.getcwd()}), not the submitter's: name the dataset by its absolute "
                              "path (`prefetchd submit` makes --data absolute itself)")
        values: dict[str, Any] = {
            k: Path(v) if FIELDS[k].metadata["kind"] is Path and isinstance(v, str) else v
            for k, v in request.settings.items()
        }
        job = dataclasses.replace(self.machine, **values)
        if job.data is None:
            raise ConfigError("the job names no dataset: set `data` to a folder of class folders, a file list or a folder of shards")
        return job


@dataclasses.dataclass(frozen=True)
class EpochsChange:
    """A job that is the running one but for ``epochs`` (None: no end): the same batches, another end."""

    old: int | None
    new: int | None

    @property
    def later(self) -> bool:
        """Whether the new end comes after the old: a loader of the running job then reads on to its own end
        (the trainer's ``JobWatch`` stops only one whose end the new one comes before)."""
        return self.new is None or (self.old is not None and self.new > self.old)

    def __str__(self) -> str:
        return f"{epochs_flag(self.new)} instead of {epochs_flag(self.old)}"


def new_end(running: DaemonConfig, job: DaemonConfig) -> EpochsChange | None:
    """How ``job`` changes the end of ``running``, where it differs from it in ``epochs`` alone; else None."""
    old, new = job_settings(running), job_settings(job)
    if old["epochs"] == new["epochs"] or {**old, "epochs": None} != {**new, "epochs": None}:
        return None
    return EpochsChange(running.epochs, job.epochs)


def settings_changed(old: DaemonConfig, new: DaemonConfig) -> str:
    """What a job changes of the one it replaces, for its answer: "batch_size: 8 -> 4; epochs: 3 -> 1"."""
    before, after = job_settings(old), job_settings(new)
    return "; ".join(f"{key}: {before[key]!r} -> {after[key]!r}" for key in sorted(before) if before[key] != after[key])


def replacing_answer(replaced: DaemonConfig, job: DaemonConfig) -> str:
    """What a submitted job did to the one it stopped, as its answer goes on after "producing ROOT for USER"."""
    end = new_end(replaced, job)
    if end is None:
        changed = settings_changed(replaced, job)
        return f", replacing the running job on {replaced.data}" + (f" ({changed})" if changed else "")
    readers = ("its trainers read on to their own end" if end.later else
               "a trainer reading to the old end stops at its next batch (JobReplaced)")
    return f", the running job with {end}: its batches kept, {readers}"


def freshest_progress(buffer: Path) -> tuple[float, int | None, bool]:
    """Seconds since any consumer of ``buffer`` (or of its ranks' streams) that has not left last wrote its
    progress file, that file's owner (the trainer's user; None where there is none), and whether its writer is
    known to be gone (killed: a restart of it may yet resume the job).

    The files are looked at the freshest first, and at most MAX_PROGRESS_READS are read to see whether their
    consumers left: any member of the buffer's group may put files there, and reading every one made each
    job.json wait 1.1 s on 20,000 of them.  Past those reads, the next freshest counts whether or not its
    consumer left: a submission that could replace a trainer's job is refused rather than let through."""
    files = [(st.st_mtime, st.st_uid, directory, consumer) for directory in [buffer, *stream_dirs(buffer)]
             for consumer, st in progress_stats(directory).items()]
    files.sort(key=lambda file: file[0], reverse=True)
    freshest_gone: tuple[float, int | None, bool] | None = None
    for read, (written, owner, directory, consumer) in enumerate(files):
        progress = None
        if read < MAX_PROGRESS_READS:
            try:
                progress = Progress.read(directory, consumer)
            except ProtocolError:  # damaged: its writer may still be there, so it counts by its time
                progress = None
            if progress is not None and progress.closed:
                continue  # it left (BufferLoader.close): a job that replaces this one takes nothing from it
        idle = time.time() - written
        if progress is None or writer_alive(directory, consumer, progress) is not False:
            # A live writer (or one that cannot be told) is the one to name: of two consumers, the freshest killed
            # was said "gone" while the other read on (a walk), and its user sent to --replace.
            return (idle, owner, False) if freshest_gone is None or idle < TRAINER_ACTIVE_SECONDS else freshest_gone
        if freshest_gone is None:
            freshest_gone = (idle, owner, True)
        if idle >= TRAINER_ACTIVE_SECONDS:
            break  # older ones keep no job
    return freshest_gone or (float("inf"), None, False)


def wait_for_job(buffer: Path, inbox: JobInbox, wake: Wakeup, publish: Callable[[Status], None],
                 notifier: Notifier, lock: DaemonLock) -> DaemonConfig | None:
    """Sleep until job.json holds an acceptable job; None when a stop signal came first.  BufferLost
    when the buffer is removed or replaced meanwhile (``DaemonLock.lost``)."""
    message = f"waiting for a job: `prefetchd submit --buffer {buffer} --data ROOT`"
    notifier.ready(message)  # the buffer is usable: trainers may submit now
    last_status = 0.0
    said = False
    while wake.stop_signal is None:
        notifier.watchdog()
        job = inbox.poll(None)
        if job is not None:
            return job
        if not said:  # not where a job.json waits already: it was logged 27 ms before "job ... accepted" (a walk)
            log.info("%s", message)
            said = True
        now = time.monotonic()
        if now - last_status >= WAIT_STATUS_SECONDS:
            lost = lock.lost()
            if lost is not None:
                raise BufferLost.because(lost)
            publish(Status(pid=os.getpid(), state=State.WAITING_FOR_JOB, heartbeat=time.time(), message=message,
                           job_result=inbox.result, running_job=inbox.running_job()))
            last_status = now
        select.select([wake], [], [], WAIT_STATUS_SECONDS)
        wake.drain()
    # The last status says it stopped, not that it waits for a submit nobody will read.
    notifier.stopping(wake.stop_reason)
    publish(Status(pid=os.getpid(), state=State.STOPPED, heartbeat=time.time(), message=wake.stop_reason,
                   job_result=inbox.result, running_job=inbox.running_job()))
    return None
