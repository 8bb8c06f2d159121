"""`prefetchd start`: check the buffer, take it over, index the dataset, run the producer."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import select
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

from prefetchd.buffer_protocol import (
    BadJobRequest,
    DaemonLock,
    JobRequest,
    JobResult,
    Manifest,
    Progress,
    ProtocolError,
    State,
    Status,
    stream_dir,
    write_status,
)
from prefetchd.buffer_protocol.errors import shown
from prefetchd.buffer_protocol.layout import (ACCEPTED_JOB_NAME, JOB_NAME, LOCK_NAME, MANIFEST_NAME, STREAM_PREFIX,
                                             list_consumers, progress_name, stream_dirs)
from prefetchd.daemon.buffer_dir import (NO_ROOM_ERRNOS, adopt_manifest, another_jobs, check_capacity, free_bytes,
                                         holds_a_stream, make_stream_dir, note_buffer_filesystem, prepare_buffer,
                                         remove_stream, sweep_temp_files)
from prefetchd.daemon.config import FIELDS, DaemonConfig, fill_defaults, require_ray
from prefetchd.daemon.dataset import split_folders_as_classes, split_members
from prefetchd.daemon.errors import BufferLost, ConfigError, DaemonError, DatasetError
from prefetchd.daemon.job_policy import JobPolicy, check_files_inside, user_name
from prefetchd.daemon.jpeg_crop import decoder_summary
from prefetchd.daemon.logs import one_line, status_unwritten
from prefetchd.daemon.metrics import Metrics
from prefetchd.daemon.producer import STATUS_SECONDS, Producer, new_producer_id, start_worker_server
from prefetchd.daemon.sampler import samples_per_rank, steps_per_epoch
from prefetchd.daemon.sdnotify import Notifier, status_line
from prefetchd.daemon.sources import open_dataset
from prefetchd.daemon.hook import validate_hook
from prefetchd.daemon.resample import resize_summary
from prefetchd.daemon.wakeup import Wakeup, stop_signals_deferred
from prefetchd.words import binary_size, counted

log = logging.getLogger(__name__)

# Fields that say how this machine produces, not what: a job cannot set them.
MACHINE_FIELDS = frozenset({
    "buffer", "workers", "high_water", "low_water", "min_free_mb", "reset", "group_access", "index_cache",
    "max_buffer_bytes", "consumer_timeout",
    "metrics_port", "metrics_address", "metrics_textfile", "readers", "allowed_data", "allowed_transforms",
    "ray", "ray_builds",
})
JOB_FIELDS = frozenset(FIELDS) - MACHINE_FIELDS
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
    """What a job asks for, in job.json's terms."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(cfg).items() if k in JOB_FIELDS}


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
        self._seen = self._stamp() if ignore_current else None
        self.result: JobResult | None = None
        self.pending_id: str | None = None
        # The roots the pending job's files must be inside (resolved local ones, or URLs; None: not confined).
        self.pending_confinement: tuple[str, ...] | None = None
        self.pending_owner: int | None = None  # the pending job's submitter: its job.json's owner (uid), which the log names
        self.pending_request: JobRequest | None = None  # what ``accepted`` records

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = (self.buffer / JOB_NAME).stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def answer(self, job_id: str | None, accepted: bool, reason: str) -> None:
        # The reason quotes job.json's fields, which any member of the buffer's group wrote: `prefetchd submit`
        # and `prefetchd status` print it to whoever runs them, so its newlines and terminal escapes are
        # written out as the log writes them.
        reason = one_line(reason)
        if len(reason) > MAX_REASON_CHARS:  # a megabyte-long `data` quoted whole would outgrow status.json
            reason = f"{reason[:MAX_REASON_CHARS - 40]}... ({len(reason)} characters in all)"
        (log.info if accepted else log.warning)("job %s %s", job_id or "(unreadable)", job_verdict(accepted, reason))
        self.result = JobResult(job_id=job_id, accepted=accepted, reason=reason, time=time.time())

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
        try:
            job, confinement = self._checked(request)
        except ConfigError as exc:  # the config's allow-lists changed since it was accepted
            log.warning("not resuming job %s, which the earlier daemon was producing: %s", request.job_id, exc)
            self.forget_accepted()
            return None
        self._pend(request, confinement)
        return job

    def _checked(self, request: JobRequest) -> tuple[DaemonConfig, tuple[str, ...] | None]:
        """The job ``request`` asks for, held to what its submitter may ask (``JobPolicy.confine``)."""
        return self.policy.confine(self._validate(request), request.owner)

    def _pend(self, request: JobRequest, confinement: tuple[str, ...] | None) -> None:
        self.pending_id, self.pending_confinement, self.pending_owner = request.job_id, confinement, request.owner
        self.pending_request = request

    def accepted(self) -> None:
        """Keep the pending request, now produced, for a restarted daemon to resume (``JobRequest.record``)."""
        if self.pending_request is None:
            return
        try:
            self.pending_request.record(self.buffer, self.dir_fd)
        except OSError as exc:  # a full tmpfs: a restart then waits for a job, or starts the configured one
            log.warning("cannot keep job %s for a restart to resume (%s): a restart would not resume it",
                        self.pending_request.job_id, exc.strerror)

    def forget_accepted(self) -> None:
        """Drop the record of the accepted job: it ended, or cannot be resumed."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ACCEPTED_JOB_NAME if self.dir_fd is not None else self.buffer / ACCEPTED_JOB_NAME,
                      dir_fd=self.dir_fd)

    def poll(self, running: DaemonConfig | None) -> DaemonConfig | None:
        """A new job to switch to, or None (nothing new, or refused: see ``result``)."""
        stamp = self._stamp()
        if stamp is None or stamp == self._seen:
            return None
        self._seen = stamp
        try:
            request = JobRequest.read(self.buffer)
        except ProtocolError as exc:  # under the document's job_id where it has one, so its submitter sees the answer
            self.answer(exc.job_id if isinstance(exc, BadJobRequest) else None, False, str(exc))
            return None
        if request is None:
            return None
        try:
            job, confinement = self._checked(request)
        except ConfigError as exc:
            self.answer(request.job_id, False, str(exc))
            return None
        except Exception as exc:  # any member of the buffer's group writes job.json: no job stops the daemon
            log.exception("internal error while checking job %s", request.job_id)
            self.answer(request.job_id, False, f"internal error while checking the job ({type(exc).__name__}: "
                        f"{shown(str(exc))}); the daemon goes on; please report it with its log")
            return None
        if running is not None and job_settings(job) == job_settings(running):
            self.answer(request.job_id, True, "already producing this job")
            return None
        idle, writer = freshest_progress(self.buffer)
        if running is not None and idle < TRAINER_ACTIVE_SECONDS and not request.replace:
            self.answer(request.job_id, False,
                        f"a trainer of {user_name(writer)} is consuming the running job on {running.data} (progress "
                        f"written {idle:.0f} s ago); submit with --replace to replace it anyway")
            return None
        self._pend(request, confinement)
        return job

    def _validate(self, request: JobRequest) -> DaemonConfig:
        unknown = set(request.settings) - JOB_FIELDS
        if unknown:
            raise ConfigError(f"unknown job settings {shown(sorted(unknown))}; allowed: {', '.join(sorted(JOB_FIELDS))}")
        values: dict[str, Any] = {
            k: Path(v) if FIELDS[k].metadata["kind"] is Path and isinstance(v, str) else v
            for k, v in request.settings.items()
        }
        job = dataclasses.replace(self.machine, **values)
        if job.data is None:
            raise ConfigError("the job names no dataset: set `data` to a folder of class folders, a file list or a folder of shards")
        return job


def freshest_progress(buffer: Path) -> tuple[float, int | None]:
    """Seconds since any consumer of ``buffer`` (or of its ranks' streams) that has not left last wrote its
    progress file, and that file's owner (the trainer's user; None where there is none)."""
    idle, writer = float("inf"), None
    for directory, consumer in ((d, c) for d in [buffer, *stream_dirs(buffer)] for c in list_consumers(d)):
        path = directory / progress_name(consumer)
        try:
            progress = Progress.read(directory, consumer)
        except ProtocolError:  # damaged: its writer may still be there, so it counts by its time
            progress = None
        if progress is not None and progress.closed:
            continue  # it left (BufferLoader.close): a job that replaces this one takes nothing from it
        with contextlib.suppress(FileNotFoundError):  # gone meanwhile
            st = path.lstat()
            age = time.time() - st.st_mtime
            if age < idle:
                idle, writer = age, st.st_uid
    return idle, writer


def wait_for_job(buffer: Path, inbox: JobInbox, wake: Wakeup, publish: Callable[[Status], None],
                 notifier: Notifier, lock: DaemonLock) -> DaemonConfig | None:
    """Sleep until job.json holds an acceptable job; None when a stop signal came first.  BufferLost
    when the buffer is removed or replaced meanwhile (``DaemonLock.lost``)."""
    message = f"waiting for a job: `prefetchd submit --buffer {buffer} --data ROOT`"
    log.info("%s", message)
    notifier.ready(message)  # the buffer is usable: trainers may submit now
    last_status = 0.0
    while wake.stop_signal is None:
        notifier.watchdog()
        job = inbox.poll(None)
        if job is not None:
            return job
        now = time.monotonic()
        if now - last_status >= WAIT_STATUS_SECONDS:
            lost = lock.lost()
            if lost is not None:
                raise BufferLost.because(lost)
            publish(Status(pid=os.getpid(), state=State.WAITING_FOR_JOB, heartbeat=time.time(), message=message,
                           job_result=inbox.result))
            last_status = now
        select.select([wake], [], [], WAIT_STATUS_SECONDS)
        wake.drain()
    # The last status says it stopped, not that it waits for a submit nobody will read.
    notifier.stopping(wake.stop_reason)
    publish(Status(pid=os.getpid(), state=State.STOPPED, heartbeat=time.time(), message=wake.stop_reason,
                   job_result=inbox.result))
    return None


class StoppedWhileStarting(Exception):
    """A stop signal came while a job started: the start is given up where it was (``StartupBeat``)."""


class StartupBeat:
    """The heartbeat while a job starts: indexing a large dataset takes minutes, and a daemon
    whose status.json does not move in that time would look stuck to trainers (and systemd).
    It is where a stop signal is noticed meanwhile too (``wake``): waited for until the index
    was done, a `systemctl stop` ended in SIGKILL and `prefetchd stop` in its timeout."""

    def __init__(self, buffer: Path, notifier: Notifier, job_result: Callable[[], JobResult | None] = lambda: None,
                 wake: Wakeup | None = None, buffer_fd: int | None = None) -> None:
        self.buffer = buffer
        self.buffer_fd = buffer_fd  # the locked buffer folder's fd (DaemonLock.dir_fd), which status.json goes into
        self.notifier = notifier
        self.job_result = job_result
        self.wake = wake
        self._last: float | None = None

    def __call__(self, message: str) -> None:
        """Write a "starting" status saying ``message``, at most once per STATUS_SECONDS; cheap to call often.
        StoppedWhileStarting once a stop signal came."""
        if self.wake is not None and self.wake.stop_signal is not None:
            raise StoppedWhileStarting(self.wake.stop_reason)
        self.notifier.watchdog()
        now = time.monotonic()
        if self._last is not None and now - self._last < STATUS_SECONDS:
            return
        self._last = now
        try:
            write_status(self.buffer, Status(pid=os.getpid(), state=State.STARTING, heartbeat=time.time(),
                                             message=message, job_result=self.job_result()), self.buffer_fd)
        except OSError as exc:
            status_unwritten(self.buffer, exc)


ROOM_RETRY_SECONDS = 1.0  # a write refused for want of space is tried again this often while a job starts


def write_when_room(write: Callable[[], None], path: Path, beat: StartupBeat) -> None:
    """``write`` (the document at ``path``), waited for while the buffer's filesystem has no room for it, as
    production waits at the --min-free-mb floor: a daemon restarted while the tmpfs is full goes on once space
    is freed there, instead of exiting.  The log says so when the wait begins and when it ends; the status
    too where a page is free for it (a filesystem without one keeps the last status, its mtime the heartbeat:
    SPEC rule 8); a stop signal ends the wait (``beat``)."""
    since: float | None = None
    while True:
        try:
            write()
        except OSError as exc:
            if exc.errno not in NO_ROOM_ERRNOS:
                raise
            why = (f"no room to write {path} ({exc.strerror}; {binary_size(free_bytes(path.parent))} free on its "
                   "filesystem)")
            if since is None:
                since = time.monotonic()
                log.warning("waiting for room: %s; free space there, and the daemon goes on by itself", why)
                beat.notifier.status(f"waiting for room to write {path}")
            beat(f"waiting for room: {why}")
            time.sleep(ROOM_RETRY_SECONDS)
            continue
        if since is not None:
            log.info("wrote %s after waiting %.0f s for room; going on", path, time.monotonic() - since)
        return


def lock_buffer(lock: DaemonLock, buffer: Path) -> None:
    """``lock.acquire()``, a filesystem without room for the pid refused in a line that says what to do.  The lock
    file of a daemon that stopped or died keeps its page (``DaemonLock``); only a new one, or one an earlier 0.1
    build emptied, needs a page, and no status can say that a daemon waits without its pid in the lock: it exits."""
    try:
        lock.acquire()
    except OSError as exc:
        if exc.errno not in NO_ROOM_ERRNOS:
            raise
        raise DaemonError(f"{buffer / LOCK_NAME}: no room to write this daemon's pid in it ({exc.strerror}; "
                          f"{binary_size(free_bytes(buffer))} free on {buffer}'s filesystem); free space there "
                          f"(`df -h {buffer}`) and start the daemon again (a systemd unit restarts it by "
                          "itself)") from None


def start_job(job: DaemonConfig, reset: bool, wake: Wakeup, inbox: JobInbox,
              publish: Callable[[Status], None], notifier: Notifier, lock: DaemonLock) -> Producer:
    """Index the job's dataset, take over the buffer for it and return its producer."""
    beat = StartupBeat(Path(job.buffer), notifier, lambda: inbox.result, wake, lock.dir_fd)
    beat(f"starting the job on {job.data}")
    job, notes = fill_defaults(job)
    for note in notes:
        log.info("default: %s", note)
    short = check_capacity(job)
    if short is not None:
        log.warning("%s", short)
    if job.transform is not None:
        validate_hook(job.transform)  # a typo fails here, not in every worker
    assert job.data is not None
    notifier.status(f"indexing {job.data}")
    index = open_dataset(job.data, tick=lambda: beat(f"indexing {job.data}"),
                         index_cache=job.index_cache, refresh_index=job.refresh_index)
    mistaken = split_folders_as_classes(index.classes, job.data)
    if mistaken is not None:
        log.warning("%s", mistaken)
    if inbox.pending_id is not None and inbox.pending_confinement is not None:
        check_files_inside(index, job.data, inbox.pending_confinement, tick=lambda: beat(f"checking the files of {job.data}"))
    members = split_members(len(index), job.split, job.val_fraction, index.source_index)
    samples = samples_per_rank(len(members), job.world_size)
    if job.drop_last and samples < job.batch_size:
        per_rank = " per rank" if job.world_size > 1 else ""
        raise ConfigError(f"drop_last: the {job.split} split's {samples} samples{per_rank} fill no batch of "
                          f"{job.batch_size}, so every batch would be left out; lower --batch-size or leave out "
                          "--drop-last")
    producer_id = new_producer_id()
    streams = []
    if job.world_size > 1:
        # A flat single-rank job left in the top directory is another job.
        adopt_manifest(job.buffer, None, reset, job.world_size)
    for rank in job.local_ranks:
        directory = stream_dir(job.buffer, rank, job.world_size)
        manifest = Manifest(
            dataset_root=job.data,  # as given (a file list, not its folder), for status and restart hints
            fingerprint=index.fingerprint,
            classes=list(index.classes),
            num_samples=len(index),
            split=job.split,
            seed=job.seed,
            batch_size=job.batch_size,
            image_size=job.image_size,
            samples_per_epoch=samples,
            steps_per_epoch=steps_per_epoch(samples, job.batch_size, job.drop_last),
            epochs=job.epochs,
            producer=producer_id,
            rank=rank,
            world_size=job.world_size,
            val_fraction=job.val_fraction,
            augmentation=job.augmentation,
            drop_last=job.drop_last,
        )
        streams.append((directory, manifest))
    # Streams of ranks this job does not produce that another job wrote (one of a larger world, say): a loader
    # opened there would read that job's batches as if they were served, so they go, but only with --reset (a
    # submitted job is one), as another job's streams of this job's ranks do. Those of this job (a restart with
    # fewer --ranks) are left as they are, as the job's other data is.  (A single-rank job's adopt_manifest
    # looks at them itself.)
    others = [(leftover, differences)
              for leftover in sorted(set(job.buffer.glob(f"{STREAM_PREFIX}*")) - {directory for directory, _ in streams})
              if job.world_size > 1 and holds_a_stream(leftover)
              and (differences := another_jobs(leftover, streams[0][1]))]
    if others and not reset:
        leftover, differences = others[0]
        raise ConfigError(f"buffer {job.buffer} holds batches of a different job in {leftover.name}, a rank this job "
                          f"does not produce ({'; '.join(differences)}); pass --reset (reset = true in a config) to delete them, or use another "
                          "--buffer")
    folders: list[int] = []  # each stream folder's fd, which its Stream keeps (and closes)
    try:
        for directory, manifest in streams:
            folders.append(make_stream_dir(directory, job.group_access))
            adopt_manifest(directory, manifest, reset)
            write_when_room(functools.partial(manifest.write, directory, folders[-1]), directory / MANIFEST_NAME,
                            beat)
        for leftover, _differences in others:
            log.info("removing %s: another job's stream, of a rank this job does not produce", leftover)
            remove_stream(leftover)  # logs what it cannot remove: a file of someone else's, a folder put there
        ranks = f", ranks {job.ranks or f'0-{job.world_size - 1}'} of {job.world_size}" if job.world_size > 1 else ""
        log.info(
            "producing %s split of %s into %s: %s, %s of %d at %dpx per epoch%s, "
            "%s, high/low water %d/%d per rank, epochs %s",
            job.split, job.data, job.buffer, counted(samples, "sample"), counted(streams[0][1].steps_per_epoch, "step"),
            job.batch_size, job.image_size,
            ranks, counted(job.workers or 0, "worker"), job.high_water, job.low_water, job.epochs or "unbounded",
        )
        beat(f"starting the workers for {job.data}")  # the last look for a stop signal before they start
    except BaseException:
        for fd in folders:
            os.close(fd)
        raise
    # Its streams take the fds (and close them, or their finalizers do should the producer not be made).
    return Producer(job, index, members, [(d, m, fd) for (d, m), fd in zip(streams, folders, strict=True)], wake,
                    poll_jobs=inbox.poll, job_result=lambda: inbox.result, on_status=publish, notifier=notifier,
                    lock_lost=lock.lost, buffer_fd=lock.dir_fd)


def already_consumed(producer: Producer) -> str:
    """Why a submitted job has nothing to produce, and how to have it produced again."""
    epochs = counted(producer.streams[0].manifest.epochs or 0, "epoch")
    return (f"nothing to produce: this job's trainers already consumed all {epochs} (their progress: "
            f"{producer.progress_files}); to produce it again from epoch 0, remove those files and submit it again")


def run_daemon(cfg: DaemonConfig) -> int:
    """Serve the buffer: the job given at start (if any), then jobs submitted through job.json.

    A daemon started with a dataset exits when that job's epochs are consumed; one
    started without waits for jobs and goes back to waiting after each.  The process is
    expected to exit when this returns: stop signals stay ignored from then on.
    """
    # Before anything is set up: a stop signal now (`prefetchd stop` just after the start) ends the first loop.
    with stop_signals_deferred():
        return _serve(cfg)


def run_as_batch() -> None:
    """Put the daemon's threads, and so every thread and process it starts after this (the worker
    server, the workers, the Ray bridge), under SCHED_BATCH, where they run under SCHED_OTHER (the
    default; a policy the user chose, such as `chrt --idle`, is kept).

    The daemon is a CPU-bound background job.  Under SCHED_BATCH its wake-ups do not preempt the
    running task: the trainer's threads keep their core until their slice ends, and so do the
    workers when the controller wakes (a task done, a progress file renamed); the controller runs
    at the next tick instead, some milliseconds later, which its workers' two queued tasks cover.
    Its nice value and its share of the CPU do not change.  Measured on the 2-core EPYC (a 2-worker
    daemon read by a `BufferLoader`, 2 MiB pages, docs/BENCHMARKS.md "The daemon under
    SCHED_BATCH"): the workers were preempted ~300 times a second instead of ~410; `prefetchd bench`
    at 2 workers, alternating with the code before, made 1515, 1515 and 1493 img/s against 1475,
    1480 and 1491."""
    if not hasattr(os, "SCHED_BATCH"):  # not Linux
        return
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]  # a thread started at import too
    except OSError as exc:
        log.debug("cannot run under SCHED_BATCH: %s", exc)
        return
    for tid in threads:
        try:
            if os.sched_getscheduler(tid) == os.SCHED_OTHER:
                os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except OSError as exc:  # a sandbox that forbids it: the default policy then
            log.debug("cannot run under SCHED_BATCH: %s", exc)
            return


def _serve(cfg: DaemonConfig) -> int:
    # First: the environment it reads must not reach the worker fork server.
    notifier = Notifier.from_env()
    run_as_batch()  # before the worker server and any thread, which inherit it
    if cfg.ray is not None:
        require_ray()  # now, not after indexing the dataset
    buffer = Path(cfg.buffer)
    created = prepare_buffer(buffer, cfg.group_access)
    lock = DaemonLock(buffer)
    try:
        lock_buffer(lock, buffer)
    except DaemonError:
        if created:  # a refused start leaves the buffer as it found it
            with contextlib.suppress(OSError):
                buffer.rmdir()
        raise
    served = False  # until it waits for a job or produces one, a failure is a refused start
    try:
        note_buffer_filesystem(buffer)
        # The worker server imports what workers need (seconds where that is torch); it runs while we index.
        start_worker_server()
        # Once: whether the crop-aware decoder is built (how to get it if not), and what resizes.
        log.info("%s; %s", decoder_summary(), resize_summary())
        swept = sweep_temp_files(buffer)
        if swept:
            log.info("deleted %d half-written files left by an earlier daemon", swept)
        metrics = Metrics(buffer, cfg.metrics_port, cfg.metrics_address, cfg.metrics_textfile)

        def publish(status: Status) -> None:
            """Every status goes to the metrics and systemd; the producer writes status.json itself."""
            metrics.update(status)
            notifier.status(status_line(status))

        def publish_waiting(status: Status) -> None:
            publish(status)
            try:
                write_status(buffer, status, lock.dir_fd)
            except OSError as exc:  # a full tmpfs: the one there beats on (SPEC rule 8), the log says why
                status_unwritten(buffer, exc)
        serve_jobs = cfg.data is None
        inbox = JobInbox(buffer, cfg, ignore_current=not serve_jobs, dir_fd=lock.dir_fd)
        job: DaemonConfig | None = cfg if not serve_jobs else None
        reset = cfg.reset
        replaced: DaemonConfig | None = None  # the job a submitted one stopped, until that one has started
        # With the configured job coming back after a resumed one is refused: its batches are not the buffer's.
        reset_back = False
        resuming = False  # the job starting is the submitted one an earlier daemon here was producing
        resumed = inbox.resumable()
        if resumed is not None and (serve_jobs or not cfg.reset):
            instead = f", in place of the configured job on {cfg.data}" if not serve_jobs else ""
            log.info("resuming job %s on %s, which the earlier daemon here was producing%s (its trainers read on)%s",
                     inbox.pending_id, resumed.data, instead,
                     "; submit the configured job to produce that one again" if not serve_jobs else "")
            job, reset, resuming = resumed, True, True
            if not serve_jobs:
                replaced, reset_back = cfg, True
        elif resumed is not None:
            log.info("not resuming job %s, which the earlier daemon here was producing: reset = true clears the "
                     "buffer for the configured job on %s", inbox.pending_id, cfg.data)
            inbox.forget_accepted()
            inbox.pending_id = inbox.pending_confinement = inbox.pending_request = None
        running_id: str | None = None  # the submitted job being produced
        with Wakeup(buffer, last=True) as wake:
            while wake.stop_signal is None:
                submitted = job is None or inbox.pending_id is not None
                if job is None:
                    served = True
                    job = wait_for_job(buffer, inbox, wake, publish_waiting, notifier, lock)
                    if job is None:
                        break
                    reset = True  # a submitted job is the instruction to replace what the buffer holds
                try:
                    producer = start_job(job, reset, wake, inbox, publish, notifier, lock)
                except StoppedWhileStarting as stopped:
                    notifier.stopping(str(stopped))
                    publish_waiting(Status(pid=os.getpid(), state=State.STOPPED, heartbeat=time.time(),
                                           message=str(stopped), job_result=inbox.result))
                    break
                except (DatasetError, ConfigError) as exc:
                    if submitted:
                        # Its dataset is opened only now, after the running job stopped for it. A refused
                        # job replaces nothing: that one resumes from progress.json, its batches kept.
                        goes_on = f"; still producing {replaced.data}" if replaced is not None else ""
                        inbox.answer(inbox.pending_id, False, f"{exc}{goes_on}")
                        if resuming:
                            inbox.forget_accepted()
                        inbox.pending_id, job, reset, replaced, reset_back = None, replaced, reset_back, None, False
                        resuming = False
                        continue
                    if serve_jobs:
                        # The job a refused one was to replace does not start again (its data went away meanwhile):
                        # a daemon that serves jobs waits for the next one, rather than exit and leave the buffer's
                        # group without a daemon until someone restarts it.
                        log.error("cannot resume the job on %s after the refused one: %s; waiting for the next job",
                                  job.data, exc)
                        job = None
                        continue
                    # The job given at start, or the one resumed: as when its dataset goes away mid-run. The
                    # last status says why, not "starting" (status and trainers read it after the exit).
                    try:
                        publish_waiting(Status(pid=os.getpid(), state=State.FAILED, heartbeat=time.time(),
                                               message=one_line(str(exc)), job_result=inbox.result))
                    except OSError:
                        pass
                    raise
                if submitted:
                    producer.take_positions()
                    if producer.finished:
                        # Accepted, it would be "producing" nothing: its trainers' progress says every epoch is read.
                        producer.shutdown()  # its pool's selector and shared file, never started
                        inbox.answer(inbox.pending_id, False, already_consumed(producer))
                        if resuming:
                            inbox.forget_accepted()
                        inbox.pending_id, job, reset, replaced, reset_back = None, replaced, reset_back, None, False
                        resuming = False
                        continue
                    # Who asked for it, and what it stopped: a --replace took the buffer from someone's trainer.
                    replacing = (", resumed after a restart" if resuming else
                                 f", replacing the running job on {replaced.data}" if replaced is not None else "")
                    inbox.answer(inbox.pending_id, True,
                                 f"producing {job.data} for {user_name(inbox.pending_owner)}{replacing}")
                    inbox.accepted()
                    running_id, inbox.pending_id = inbox.pending_id, None
                replaced, reset_back, resuming = None, False, False
                served = True
                try:
                    producer.run()
                except (ConfigError, DatasetError) as exc:
                    if not serve_jobs:
                        raise
                    # A submitted job that fails while it runs (its hook, its data): the daemon serves the next
                    # one.  Exiting would only have a supervisor restart it into the same job.json, and fail again.
                    inbox.answer(running_id, False, f"{FAILED_WHILE_PRODUCING} {job.data}: {exc}")
                    inbox.forget_accepted()
                    job = None
                    continue
                if producer.next_job is not None:
                    replaced, job, reset = job, producer.next_job, True
                elif (serve_jobs or running_id is not None) and producer.finished:
                    # A submitted job's end: the daemon waits for the next, also one started with its own data (a
                    # service's config), which exited here and, exit code 0, was not restarted: its group had no
                    # daemon to submit to.  Its answer said "producing" next to the state waiting-for-job. Only the
                    # running job's answer is replaced: one refused meanwhile stays for its submitter to read.
                    if running_id is not None and inbox.result is not None and inbox.result.job_id == running_id:
                        inbox.answer(running_id, True, f"{FINISHED_PRODUCING} {job.data}: every epoch was read")
                    inbox.forget_accepted()
                    job = None
                else:
                    break
            if wake.stop_signal is not None:
                log.info("%s", wake.stop_reason)
        metrics.close()
        return 0
    except Exception:
        if not served:  # a refused start leaves the buffer as it found it, but for the status saying why
            lock.remove()
            if created:
                with contextlib.suppress(OSError):  # not empty: that status, or what someone put there meanwhile
                    buffer.rmdir()
        raise
    finally:
        notifier.stopping()
        lock.release()
