"""`prefetchd start`: check the buffer, take it over, index the dataset, run the producer."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from pathlib import Path

from prefetchd.buffer_protocol import DaemonLock, State, Status, write_status
from prefetchd.buffer_protocol.layout import LOCK_NAME
from prefetchd.daemon.buffer_dir import (NO_ROOM_ERRNOS, free_bytes, let_group_read_files, note_buffer_filesystem,
                                        prepare_buffer, sweep_temp_files)
from prefetchd.daemon.config import DaemonConfig, require_ray
from prefetchd.daemon.errors import ConfigError, DaemonError, DatasetError
from prefetchd.daemon.job_inbox import (FAILED_WHILE_PRODUCING, FINISHED_PRODUCING, JobInbox, replacing_answer,
                                        wait_for_job)
from prefetchd.access import user_name
from prefetchd.daemon.job_start import StoppedWhileStarting, already_consumed, start_job
from prefetchd.daemon import jpeg_crop
from prefetchd.daemon.jpeg_crop import decoder_summary
from prefetchd.daemon.logs import status_unwritten
from prefetchd.daemon.metrics import Metrics
from prefetchd.daemon.pool import make_room_for_files
from prefetchd.daemon.producer import start_worker_server
from prefetchd.daemon.resample import resize_summary
from prefetchd.daemon.sdnotify import Notifier, status_line
from prefetchd.daemon.wakeup import Wakeup, stop_signals_deferred
from prefetchd.daemon.workers import oom_order_lost
from prefetchd.words import binary_size, counted, one_line

log = logging.getLogger(__name__)


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


GROUP_READ = 0o040


def let_group_read() -> None:
    """With --group-access, take the group's read bit out of the umask: the buffer's group reads what the daemon
    and its workers create there (batches, manifest.json, status.json, daemon.lock), whatever umask it was started
    under.  A daemon started by hand under umask 077 made them 0600, and a member's trainer failed with
    "manifest.json: cannot open a manifest document (Permission denied)"; the systemd unit's UMask=0007 had hidden
    that.  The umask rather than a mode on each file: no file the daemon creates is left out, and the processes it
    starts inherit it.  Only read: members never write the daemon's files, and what the umask keeps from others
    stays kept."""
    old = os.umask(0o077)  # the only way to read it; strict for the moment it is set
    new = old & ~GROUP_READ
    os.umask(new)
    if new != old:
        log.info("umask %04o -> %04o: --group-access lets the buffer's group read what the daemon writes there",
                 old, new)


def _serve(cfg: DaemonConfig) -> int:
    # First: the environment it reads must not reach the worker fork server.
    notifier = Notifier.from_env()
    run_as_batch()  # before the worker server and any thread, which inherit it
    if cfg.group_access:
        let_group_read()  # before it creates a file, and before the worker server, which inherits it
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
        # It keeps the open-file limit it starts with, and each worker's start hands it a few files: under a
        # soft limit of 16 its first one failed, a traceback in the log and a restart (a user's walk). The job
        # raises the limit for all of its workers (``job_start``), this one for the server first.
        make_room_for_files(cfg.workers or 1)
        start_worker_server()
        if (lost := oom_order_lost()) is not None:
            log.warning("%s", lost)
        # Once: whether the crop-aware decoder is built (how to get it if not), and what resizes.
        # A warning where one is built but not used: what runs is not what the user built.
        log.log(logging.WARNING if jpeg_crop.unusable else logging.INFO, "%s; %s", decoder_summary(), resize_summary())
        swept = sweep_temp_files(buffer)
        if swept:
            log.info("deleted %d half-written files left by an earlier daemon", swept)
        opened = let_group_read_files(buffer) if cfg.group_access else 0
        if opened:
            log.info("gave the buffer's group read access to %s of the daemon's in %s, which an earlier daemon left "
                     "without it (started under umask 077, or without --group-access): the group's trainers read them",
                     counted(opened, "file"), buffer)
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
            inbox.settle()
        elif not serve_jobs and not reset and inbox.left_a_finished_job():
            log.info("the buffer holds the submitted job the earlier daemon here finished (every epoch read): the "
                     "configured job on %s takes its place", cfg.data)
            reset = True
        running_id: str | None = None  # the submitted job being produced

        def refuse_pending(reason: str) -> None:
            """Answer the submitted job that was to start: refused.  It replaces nothing: the job it was to stop
            (if any) starts again, as it was."""
            nonlocal job, reset, replaced, reset_back, resuming
            inbox.answer(inbox.pending_id, False, reason, inbox.pending_owner)
            if resuming:
                inbox.forget_accepted()
            inbox.settle()
            job, reset, replaced, reset_back, resuming = replaced, reset_back, None, False, False

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
                                           message=str(stopped), job_result=inbox.result,
                                           running_job=inbox.running_job()))
                    break
                except (DatasetError, ConfigError) as exc:
                    if submitted:
                        # Its dataset is opened only now, after the running job stopped for it. A refused
                        # job replaces nothing: that one resumes from progress.json, its batches kept.
                        goes_on = f"; still producing {replaced.data}" if replaced is not None else ""
                        refuse_pending(f"{exc}{goes_on}")
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
                                               message=one_line(str(exc)), job_result=inbox.result,
                                               running_job=inbox.running_job()))
                    except OSError:
                        pass
                    raise
                if submitted:
                    producer.take_positions()
                    if producer.finished:
                        # Accepted, it would be "producing" nothing: its trainers' progress says every epoch is read.
                        producer.shutdown()  # its pool's selector and shared file, never started
                        refuse_pending(already_consumed(producer))
                        continue
                    # Who asked for it, and what it stopped: a --replace took the buffer from someone's trainer.
                    replacing = (", resumed after a restart" if resuming else
                                 replacing_answer(replaced, job) if replaced is not None else "")
                    inbox.answer(inbox.pending_id, True,
                                 f"producing {job.data} for {user_name(inbox.pending_owner)}{replacing}",
                                 inbox.pending_owner)
                    inbox.accepted(job)
                    running_id = inbox.pending_id
                    inbox.settle()
                replaced, reset_back, resuming = None, False, False
                served = True
                try:
                    producer.run()
                except (ConfigError, DatasetError) as exc:
                    if not serve_jobs:
                        raise
                    # A submitted job that fails while it runs (its hook, its data): the daemon serves the next
                    # one.  Exiting would only have a supervisor restart it into the same job.json, and fail again.
                    inbox.answer(running_id, False, f"{FAILED_WHILE_PRODUCING} {job.data}: {exc}",
                                 inbox.running_submitter())
                    inbox.forget_accepted()
                    job = None
                    continue
                finally:
                    # A job's end (finished, replaced, failed): the cycles it left (numpy's header parse makes closures
                    # that refer to each other, exceptions hold their frames) are collected now rather than at a rare
                    # full collection, ~9 ms: a daemon serving jobs grew by ~6.5 KiB a job, evenly (tools/soak.py;
                    # docs/RELIABILITY.md, "Long runs").  Not at start, where it would delay the first batch.
                    gc.collect()
                if producer.next_job is not None:
                    replaced, job, reset = job, producer.next_job, True
                elif (serve_jobs or running_id is not None) and producer.finished:
                    # A submitted job's end: the daemon waits for the next, also one started with its own data (a
                    # service's config), which exited here and, exit code 0, was not restarted: its group had no
                    # daemon to submit to.  Its answer said "producing" next to the state waiting-for-job. Only the
                    # running job's answer is replaced, or an accepted one after it, which is about that job too
                    # ("already producing this job": status then said that beside waiting-for-job): one refused
                    # meanwhile stays for its submitter to read.
                    result = inbox.result
                    ended = f"{FINISHED_PRODUCING} {job.data}: every epoch was read"
                    if producer.bad.files:  # else gone with the job's figures once the daemon waits for the next
                        ended += (f"; files that could not be decoded or read: {len(producer.bad.files)}, their "
                                  "samples replaced (the daemon's log names them)")
                    if running_id is not None and result is not None and (result.job_id == running_id or result.accepted):
                        inbox.answer(running_id, True, ended, inbox.running_submitter())
                    elif running_id is not None:  # its end was not logged either (a user's walk)
                        log.info("job %s %s (the status keeps the answer to %s, refused meanwhile)", running_id, ended,
                                 result.job_id if result is not None else "a later request")
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
