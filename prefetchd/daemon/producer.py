"""The controller: decides which batches to build, feeds the workers, publishes
finished batches and deletes consumed ones.

Each local rank has a ``Stream`` (``stream.py``): the window of batches kept
ahead of its trainer's progress, and the books of what is published and being
built.  One worker pool serves all streams, always feeding the stream with the
fewest batches waiting first.  A batch is written by the one batch writer
(``prefetchd.buffer_protocol.writer``): the controller begins it, the workers
fill its slots, the controller commits it.  The tasks a batch is cut into, and
its cancellation when the window moves off it (its file aborted once no task of
it is at work), are ``builds.Builds``' books; the controller decides which
batches to build and what each answer means.

A worker that dies is replaced and its tasks go to others.  So is one that
hangs: a worker that has made no progress on one image for ``--task-timeout``
(a read of a hung mount, a hook that never returns) is killed, after a warning
that names it, the batch and the file; so is one that does not get ready in
``--worker-start-timeout`` (a hook's module that never finishes importing).  ``worker_health`` judges both; the
controller has ``Builds`` queue the tasks again, and stops the job when it says so.

The space the batches take, which a pause for a full tmpfs is judged by, is
``buffer_space``'s to count; the status document is ``producer_status``'s to
assemble from these books.

Signal handlers only set a flag and wake the loop through a pipe; the loop
does all the work.
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Callable

import numpy as np

from prefetchd.buffer_protocol import (
    BatchLayout,
    DaemonLock,
    Manifest,
    PendingBatch,
    RoomNotYet,
    SpareFiles,
    batch_name,
    write_status,
)
from prefetchd.buffer_protocol.batch import temp_name
from prefetchd.buffer_protocol.layout import MANIFEST_NAME, PROGRESS_PATTERN
from prefetchd.buffer_protocol.status import JobResult, RunningJob, State, Status
from prefetchd.daemon.bad_samples import BadSamples
from prefetchd.daemon.buffer_space import BufferSpace
from prefetchd.daemon.build_failures import BuildFailures
from prefetchd.daemon.builds import Builds
from prefetchd.daemon.config import DaemonConfig
from prefetchd.daemon.dataset import SampleIndex
from prefetchd.daemon.errors import BadDataError, BufferLost, DaemonError, out_of_processes
from prefetchd.daemon.logs import status_unwritten
from prefetchd.daemon.sampler import EpochOrders, batch_slice
from prefetchd.daemon.pool import Worker, WorkerPool, batches_to_fill, start_worker_server, task_images
from prefetchd.daemon.producer_faults import WorkerFaults
from prefetchd.daemon.producer_status import STATUS_SECONDS, production_status
from prefetchd.daemon.production_stats import Stats
from prefetchd.daemon.remote import RemotePool
from prefetchd.daemon.remote.bridge_nodes import REPROBE_SECONDS
from prefetchd.daemon.sdnotify import Notifier
from prefetchd.daemon.stream import Build, Stream, consumer_cap
from prefetchd.daemon.wakeup import Wakeup
from prefetchd.daemon.worker_health import WorkerHealth
from prefetchd.daemon.fill import none_decoded
from prefetchd.daemon.tasks import Filled, Task, WorkerJob, WriteFailed
from prefetchd.throttle import Throttle
from prefetchd.words import all_epochs, binary_size, counted

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25  # progress is re-read at least this often even without a watch event
RETRY_SECONDS = 1.0  # after a batch could not be written (no space, say)
ROOM_NOT_YET_SECONDS = 0.05  # after a batch waited for the pages of consumed batches a trainer still maps
FAILURE_LOG_SECONDS = 10.0  # one log line per this long of failed builds (the others are counted)


class Producer(WorkerFaults):
    def __init__(
        self, cfg: DaemonConfig, index: SampleIndex, members: np.ndarray, streams: list[tuple[Path, Manifest, int]],
        wake: Wakeup, poll_jobs: Callable[[DaemonConfig], DaemonConfig | None] = lambda _: None,
        job_result: Callable[[], JobResult | None] = lambda: None,
        running_job: Callable[[], RunningJob | None] = lambda: None,
        on_status: Callable[[Status], None] = lambda _: None,
        notifier: Notifier | None = None,
        lock_lost: Callable[[], str | None] = lambda: None,
        buffer_fd: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.lock_lost = lock_lost  # DaemonLock.lost: why the buffer is no longer this daemon's
        self.notifier = notifier or Notifier(None)
        self.buffer = Path(cfg.buffer)
        self.buffer_fd = buffer_fd  # the locked buffer folder (DaemonLock.dir_fd): status.json goes into it, not by path
        self.wake = wake
        self.poll_jobs = poll_jobs
        self.job_result = job_result
        self.running_job = running_job
        self.on_status = on_status
        self.next_job: DaemonConfig | None = None
        self.index = index
        high, low = int(cfg.high_water or 2), int(cfg.low_water or 0)
        # The cap on batches kept per stream, all its consumers together (SPEC rule 9).
        cap = int(cfg.max_buffer_bytes) // max(1, cfg.batch_bytes * len(streams)) if cfg.max_buffer_bytes else high
        if cap < 1:
            log.warning("--max-buffer-bytes %d holds no %d-byte batch per rank; keeping one", cfg.max_buffer_bytes,
                        cfg.batch_bytes)
        # One epoch's global order for all the ranks: each takes its share (sampler.EpochOrders).
        orders = EpochOrders(members, cfg.split == "train")
        self.streams = [Stream(d, m, orders, high, low, max(1, cap), cfg.consumer_timeout, fd,
                               consumer_cap(len(streams))) for d, m, fd in streams]
        self.space = BufferSpace(self.buffer, self.streams, cfg.batch_size, cfg.image_size,
                                 int(cfg.min_free_mb or 0) << 20, cfg.space_unit)
        self.workers_wanted = int(cfg.workers if cfg.workers is not None else 1)  # 0: remote only (--ray)
        chunk = task_images(cfg.batch_size, self.workers_wanted, max(1, cap))
        self.stats = Stats()
        self.retry_at = 0.0
        self.state = State.STARTING
        self.message = ""
        # Why builds fail: the latest failure, until a batch is published (for the storage, until the batches it
        # failed are), and the wait on the dataset's storage.
        self.failures = BuildFailures()
        # An outage fails every build in flight, each once a RETRY_SECONDS: one log line per the time the
        # status shows the last one (and counts the others) is enough.
        self.failure_lines = Throttle(FAILURE_LOG_SECONDS)
        self.fatal: str | None = None
        self._positioned = False  # take_positions() ran
        self.fatal_error: type[DaemonError] = DaemonError
        self._job = WorkerJob.from_config(index, members, cfg)
        self.bad = BadSamples(cfg, index, len(members))
        self.pool = WorkerPool(self._job, self.workers_wanted)
        self.remote = (RemotePool(self._job, cfg.ray, cfg.ray_builds, self.workers_wanted, cfg.task_timeout,
                                  cfg.worker_start_timeout)
                       if cfg.ray else None)
        self.builds = Builds(chunk, self.remote)
        self.health = WorkerHealth(self.pool, self.stats, cfg.task_timeout, self.builds.by_task, self.bad.shown,
                                   len(self.streams), cfg.worker_start_timeout)
        self.spares = SpareFiles()

    @property
    def max_building(self) -> int:
        """Batches built at once: enough to keep the local workers' and the cluster's queues full."""
        chunk, size = self.builds.chunk, self.cfg.batch_size
        local = max(2, batches_to_fill(self.workers_wanted, chunk, size)) if self.workers_wanted else 0
        remote = self.remote.builds_wanted(chunk, size) if self.remote is not None else 0
        return max(1, local + remote)

    @property
    def local_given_up(self) -> str:
        """Why this job's local workers were stopped for good (``_local_workers_end``), or "": kept by the pool
        of the cluster that builds alone since (``RemotePool.locals_given_up``), which words its messages with it."""
        return self.remote.locals_given_up if self.remote is not None else ""

    @property
    def workers(self) -> list[Worker]:
        return self.pool.workers

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.streams)

    # -- lifecycle ------------------------------------------------------------

    @property
    def progress_files(self) -> str:
        """Where the trainers' progress documents are: the buffer's, or each rank stream's."""
        return ", ".join(sorted({str(stream.dir / PROGRESS_PATTERN) for stream in self.streams}))

    def take_positions(self) -> None:
        """Adopt the batches the buffer holds and read where the trainers are: what ``finished``
        is judged on.  Once; ``run`` does it unless its caller did, to answer a job before it runs."""
        if self._positioned:
            return
        for stream in self.streams:
            stream.adopt_published()
        self._read_progress()  # deletes the adopted batches no window holds
        for stream in self.streams:
            stream.say_adopted()
        self._positioned = True

    def free_consumed(self) -> None:
        """Delete the batches the trainers consumed, files and all (no spares kept, whose pages a new file cannot
        use): what a daemon restarted on a full tmpfs does while its manifests wait for room (``start_job``), so
        that a trainer reading the batches an earlier run left makes that room, where the two waited on each
        other.  It is ``run``'s deletion, done before the manifests are written, which changes nothing it goes
        by: the batches there are this job's (``adopt_manifest`` cleared another job's), and the trainers'
        progress says which are consumed, naming the job by its identity (``Manifest.job_key``), the same in
        the manifest there and in this one.  Nothing is built until the manifests are written (``run``)."""
        if self._positioned:
            self._read_progress()
        else:
            self.take_positions()
        self.spares.fit(0)

    def run(self) -> None:
        """Produce until stopped by a signal, finished, replaced by another job, or failed."""
        try:
            self.take_positions()
            if self.finished:
                # Restarted after the trainers consumed the last epoch: nothing to build, so no
                # workers to start and no reason to wait for a progress that will not move.
                # A warning: under --log-level warning (prefetchd-train --spawn-daemon) it is why the daemon exits.
                log.warning("the trainers had consumed %s before this daemon started; nothing to produce "
                            "(to produce them again, from epoch 0, remove %s)",
                            all_epochs(self.streams[0].manifest.epochs or 0), self.progress_files)
            else:
                self.pool.start(heartbeat=self._write_status, every=STATUS_SECONDS)
                if self.remote is not None:  # the bridge connects in the background
                    self.remote.start(heartbeat=self._write_status, every=STATUS_SECONDS)
                self.state = State.FILLING
            self.notifier.ready(f"producing the {self.cfg.split} split of {self.cfg.data} into {self.buffer}")
            last_status = last_poll = 0.0
            while not self.finished and self.wake.stop_signal is None and self.fatal is None and self.next_job is None:
                self.notifier.watchdog()
                self._wait(timeout=self._poll_interval())
                now = time.monotonic()
                if self.wake.drain() or now - last_poll >= POLL_SECONDS:
                    self._read_progress()
                    self.next_job = self.poll_jobs(self.cfg)
                    last_poll = now
                self.spares.fit(self._spare_room())
                self._schedule()
                self._dispatch()
                if now - last_status >= STATUS_SECONDS:
                    self._check_hangs()
                    self._check_buffer()
                    if self.fatal is None:
                        self._write_status()
                    last_status = now
                if self.finished:
                    log.info("the trainers consumed %s", all_epochs(self.streams[0].manifest.epochs or 0))
                    break
        except Exception as exc:  # a bug: leave a status that says so, not a silently stale heartbeat
            lost = self.lock_lost() if isinstance(exc, FileNotFoundError) else None
            limited = out_of_processes(exc)
            if lost is not None:  # the buffer removed under the loop, no bug
                self.fatal, self.fatal_error = str(BufferLost.because(lost)), BufferLost
            elif isinstance(exc, DaemonError) or limited is not None:  # said for the user, no bug either
                self.fatal = limited or str(exc)
                log.error("%s", self.fatal)
            else:
                log.exception("internal error in the controller")
                self.fatal = f"internal error: {type(exc).__name__}: {exc} (see the log; please report it)"
        finally:
            self.state = State.STOPPING
            if self.wake.stop_signal is not None or self.fatal is not None:
                self.notifier.stopping(self.fatal or self.wake.stop_reason)
            self.shutdown()
        if self.fatal:
            self.state, self.message = State.FAILED, self.fatal
            if self.fatal_error is not BufferLost:
                self._write_status()
            else:  # not into a directory that is no longer this daemon's; the metrics say it (a walk: "filling")
                self.on_status(self.status())
            raise self.fatal_error(self.fatal)
        if self.next_job is not None:
            self.state, self.message = State.SWITCHING, "replacing the job with the one in job.json"
        else:
            self.state, self.message = State.STOPPED, self.wake.stop_reason
        self._write_status()

    def _stream_lost(self, stream: Stream) -> bool:
        """Whether ``stream``'s folder was replaced since the daemon made it; then the daemon stops, as for a
        replaced buffer, rather than write batches (or a manifest) into whatever folder is there now."""
        replaced = stream.replaced()
        if replaced is not None:
            # A stream folder inside a replaced buffer (or the buffer itself, serving one rank) is the
            # buffer's loss, and said as the status period's check says it, whichever looks first.
            lost = self.lock_lost() or replaced
            self.fatal, self.fatal_error = str(BufferLost.because(lost)), BufferLost
        return replaced is not None

    def _check_buffer(self) -> None:
        """Once a status period: the buffer is still the one this daemon locked (else it stops), and each
        stream's manifest is still there (deleted, it is written again: trainers starting wait for it)."""
        lost = self.lock_lost()
        if lost is not None:
            self.fatal, self.fatal_error = str(BufferLost.because(lost)), BufferLost
            return
        for stream in self.streams:
            if self._stream_lost(stream):
                return
            if stream.holds(MANIFEST_NAME):
                continue
            log.warning("%s was deleted while the daemon ran; writing it again", stream.dir / MANIFEST_NAME)
            try:
                stream.manifest.write(stream.dir, stream.fd)
            except OSError as exc:
                log.warning("cannot write %s again: %s", stream.dir / MANIFEST_NAME, exc.strerror)

    def _poll_interval(self) -> float:
        """How long the loop may sleep when nothing wakes it.

        While the buffer is full and nothing is being built (a trainer away, or one that
        just has enough), only a new progress.json or job.json can give it work, and the
        watcher wakes it for those at once: it sleeps until the next heartbeat is due.
        Without a working watcher it polls the files every POLL_SECONDS.
        """
        idle = (self.wake.watching and all(not s.filling and not s.building for s in self.streams)
                and not self.builds.queue)
        return STATUS_SECONDS if idle else POLL_SECONDS

    def _wait(self, timeout: float) -> None:
        if self.remote is None:
            for worker in self.pool.wait(timeout, self.wake, self._complete):
                self._replace_worker(worker)
            return
        timeout = self.remote.poll_interval(timeout)
        for worker in self.pool.wait(timeout, self.wake, self._complete, also=self.remote.waitables()):
            self._replace_worker(worker)
        self.remote.handle(self._complete, self.builds.requeue, self._remote_fault, self._ray_start_fault)

    # -- workers --------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the workers and the cluster's builds, drop the builds in progress and the spares; what
        ``run`` ends with, and what a producer never run (a job refused) is given up with."""
        if self.remote is not None:
            self.remote.stop()
        self.pool.stop()
        self.builds.abort_all(self.streams)
        self.spares.fit(0)
        for stream in self.streams:  # after the spares, which are named through their folders' fds
            stream.close()

    # -- progress and deletion -----------------------------------------------

    def _read_progress(self) -> None:
        for stream in self.streams:
            stream.read_progress()
            stale, builds = stream.outside_window()
            for g in stale:
                self.spares.retire(stream.published.pop(g), stream.fd)
            for build in builds:
                self.builds.cancel(build)
            stream.reconcile()
        self.failures.left(self._held())

    def _spare_room(self) -> int:
        """How many spares to keep: as many as the streams' caps leave room for, spares included
        (they hold tmpfs pages as batches do).  No fewer: a spare deleted for want of a place costs
        the pages' freeing, and the batch that would have used it is built in fresh ones."""
        return sum(max(0, s.cap - len(s.published) - len(s.building)) for s in self.streams)

    # -- building -------------------------------------------------------------

    def _schedule(self) -> None:
        if time.monotonic() < self.retry_at:
            return
        while sum(s.active for s in self.streams) < self.max_building:
            # The stream closest to running dry goes first.
            wanted = [(len(s.published) + s.active, i, s, s.next_missing()) for i, s in enumerate(self.streams)]
            candidates = sorted((fill, i, s, g) for fill, i, s, g in wanted if g is not None)
            if not candidates:
                if all(s.produced_all for s in self.streams):
                    self.state = State.DONE
                else:
                    # "full" only once the last batch up to the high-water mark is published.
                    busy = any(s.filling or s.building for s in self.streams)
                    self.state = State.FILLING if busy else State.FULL
                self._resume_if_room(0)  # nothing to build: room above the floor is all a pause waits for
                if self.space.paused and self.state != State.DONE:
                    # Batches built in spares meanwhile filled it: the pause goes on until "resumed" says it ended.
                    self.state = State.PAUSED_LOW_SPACE
                return
            _, _, stream, g = candidates[0]
            layout = self.space.layout(stream, g)
            self._resume_if_room(layout.file_len)
            msg = self.space.shortage(layout.file_len, self.spares.bytes)
            spare_only = msg is not None
            if msg is not None:
                if self.space.pause():
                    log.warning(msg)
                    self.stats.low_space_pauses += 1
                self.state, self.message = State.PAUSED_LOW_SPACE, msg
                # A spare of its size takes no page more than the filesystem holds now, however far below the
                # floor other files took it: built there, a trainer gets a batch for each it reads.  Counted only
                # as room, spares fewer than the shortfall (the cap keeps few) starved the trainer, or fed it one
                # batch per retry (a walk: 1 a second), and the fresh file tried meanwhile deleted every spare for
                # a room that could not come.  In a spare only, then: one still mapped is waited for (RoomNotYet).
                if not self.spares.has(layout.file_len):
                    self.failures.end_wait()  # what holds production now is the tmpfs, not the dataset's storage
                    self.retry_at = time.monotonic() + RETRY_SECONDS
                    return
            if not self._start_build(stream, g, layout, spare_only):
                return
            if not self.space.paused:  # else still paused: that batch went into a consumed one's file (a spare)
                self.state, self.message = State.FILLING, ""

    def _resume_if_room(self, file_len: int) -> None:
        """End a pause for space where there is room again for the batches being built and one more of
        ``file_len`` bytes (``BufferSpace.room_again``)."""
        free = self.space.room_again(file_len)
        if free is None:
            return
        self.message = ""  # the pause's, which a full buffer's state kept meanwhile
        if self.state == State.PAUSED_LOW_SPACE:
            self.state = State.FILLING
        # Said, as the pause was: a log's last word is not "paused".
        log.info("resumed: %s has room again above the floor of %d MiB (%s free)", self.buffer,
                 self.space.min_free >> 20, binary_size(free + file_len))

    def _start_build(self, stream: Stream, g: int, layout: BatchLayout, spare_only: bool = False) -> bool:
        """Create the batch's temp file (in a spare only, where ``spare_only``: PendingBatch.begin) and queue its
        tasks; False (retry later) if it cannot be created."""
        if self._stream_lost(stream):
            return False
        epoch, step = stream.key(g)
        order = stream.order(epoch)
        chosen = order[batch_slice(step, self.cfg.batch_size, len(order))]
        final = stream.dir / batch_name(epoch, step)
        try:
            pending = PendingBatch.begin(final, layout, self.spares, stream.fd,
                                         room_wanted=lambda: self.space.room_wanted(layout.file_len),
                                         spare_only=spare_only)
        except RoomNotYet:  # a trainer lets go of a consumed batch within a step
            self.retry_at = time.monotonic() + ROOM_NOT_YET_SECONDS
            return False
        except OSError as exc:  # e.g. a directory planted under the name, out of inodes
            self.stats.write_failures += 1
            self.failures.failing(f"cannot create {temp_name(final).name}: {exc.strerror}", self._held())
            log.warning("cannot create %s: %s; retrying in %.0f s", temp_name(final), exc.strerror, RETRY_SECONDS)
            self.retry_at = time.monotonic() + RETRY_SECONDS
            return False
        self.builds.start(stream, g, epoch, step, pending, chosen, self.health.crashed_items)
        return True

    def _dispatch(self) -> None:
        self.pool.dispatch(self.builds.queue)
        if self.remote is not None:
            self.remote.dispatch(self.builds.queue)

    def _complete(self, task: Task, result: Filled | WriteFailed) -> None:
        build = self.builds.answered(task)
        if self.fatal is not None:
            # The job stops: results that arrived in the same turn must not replace the verdict that
            # stopped it (a budget of 2 reported as "4 files" where the third was the one).
            return
        if isinstance(result, WriteFailed):
            if result.fatal is not None:
                for sample, reason in result.failures:  # the status counts the files that stopped the job too
                    if self.bad.count(sample, reason):  # and the log names each, as the status says it does (it
                        log.warning("%s", self.bad.failure(sample, reason))  # named the run's last: a walk)
                self.fatal, self.fatal_error = result.reason, result.fatal
                if result.run:  # worded again, naming the files that packed samples were packed from
                    self.fatal = none_decoded(self.index, self.bad.split, result.failures[-result.run:], self.bad.shown)
                return
            if not build.failed:  # a failed build, not a failed task (SPEC's errors.write_failures); also one a
                build.failed = True  # rewind cancelled: the tmpfs is as full, and the status says so
                self.stats.write_failures += 1
                self.failures.failing(f"batch {build.tmp.name}: {result.reason}", self._held(),
                                      (build.stream.rank, build.g) if result.storage else None)
                self.failure_lines.log(log, logging.WARNING, "batch %s: %s; retrying in %.0f s", build.tmp.name,
                                       result.reason, RETRY_SECONDS, others="other failed build")
            self.retry_at = time.monotonic() + RETRY_SECONDS
            self.builds.cancel(build)  # or, cancelled already, dropped if that was its last task
            return
        if build.cancelled:  # a task that was at work when its build was cancelled: its answer is ignored
            self.builds.drop_if_answered(build)
            return
        for sample, reason in result.failures:
            if (verdict := self.bad.replaced(sample, reason)) is not None:
                self.fatal, self.fatal_error = verdict, BadDataError
                return
        requested = dict(task.items)
        for slot, index, label in result.slots:
            build.indices[slot] = index
            build.labels[slot] = label
            build.replaced += index != requested[slot]
        self.stats.add_stage_times(result.timings)
        build.remaining -= len(result.slots)
        if build.remaining == 0:
            self._publish(build)

    def _held(self) -> dict[int, set[int]]:
        """By rank, the positions its stream's windows hold (``BuildFailures``)."""
        return {stream.rank: stream.held for stream in self.streams}

    def _publish(self, build: Build) -> None:
        stream = build.stream
        self.builds.finished(build)
        if self._stream_lost(stream):
            return
        try:
            final = build.pending.commit(
                build.labels, build.indices, epoch=build.epoch, step=build.step, seed=self.cfg.seed,
                producer=stream.manifest.producer, replaced=build.replaced, job=stream.manifest.job_key,
                rank=stream.manifest.rank,
            )
        except OSError as exc:  # commit has removed the temp file
            final = build.pending.final
            self.stats.write_failures += 1
            why = f"could not publish {final.name}: {exc.strerror}"
            if final.is_dir() and not final.is_symlink():  # made by hand: nothing else makes one there
                why += f" ({final} is a directory: remove it)"
            # In the status too, as for a failed build: once a second, a count alone said nothing of why.
            self.failures.failing(why, self._held())
            self.failure_lines.log(log, logging.WARNING, "%s; retrying in %.0f s", why, RETRY_SECONDS,
                                   others="other failed build")
            self.retry_at = time.monotonic() + RETRY_SECONDS
            return
        stream.published[build.g] = final
        waited = self.failures.wait
        self.failures.published((stream.rank, build.g), self._held())
        if waited is not None and self.failures.wait is None:  # its start was said, at WARNING: so is its end
            log.info("the dataset's storage answers again: batch %s built after %.0f s of failed reads; production "
                     "goes on", final.name, time.time() - waited.since)
        self.stats.batches += 1
        self.stats.samples += len(build.indices)
        self.stats.replaced += build.replaced

    # -- status ---------------------------------------------------------------

    def status(self) -> Status:
        """The daemon's state (``producer_status``)."""
        return production_status(self)

    def status_message(self) -> str:
        """The status's message: the state's own, else why builds fail (a store that is down reads as such, not as
        a count alone; until a batch is published again, or for the storage until the batches it failed are,
        since one try of a hung store's reads takes minutes), else why nothing is built."""
        if self.message:
            return self.message
        if self.failures.last is not None:
            return f"retrying: {self.failures.last}"
        if self.health.stall_note is not None:
            return self.health.stall_note
        if self.remote is None:
            return ""
        alone = (f"the local workers are given up for this job ({self.local_given_up})" if self.local_given_up
                 else "remote only (--workers 0)")
        if not self.workers_wanted and self.remote.message:
            if not self.remote.connected:
                return f"{alone} and the Ray cluster is {self.remote.message}"
            # Connected, every node with CPUs unfit: a trainer's wait quotes the start of this, so the first node's
            # reason (what to mend) comes first.
            unfit = self.remote.unfit
            more = f" (and {counted(len(unfit) - 1, 'other node')})" if len(unfit) > 1 else ""
            return (f"{alone} and no node of the Ray cluster gets slices: node {unfit[0]}{more}; "
                    "production waits for the cluster (unfit nodes are probed again every "
                    f"{REPROBE_SECONDS:.0f} s)")
        if self.local_given_up:
            return f"{alone}: the Ray cluster builds alone"
        return ""

    def _write_status(self) -> None:
        status = self.status()
        self.on_status(status)
        try:
            write_status(self.buffer, status, self.buffer_fd)
        except OSError as exc:
            status_unwritten(self.buffer, exc)


def new_producer_id() -> str:
    return uuid.uuid4().hex[:12]


__all__ = ["DaemonLock", "Producer", "new_producer_id", "start_worker_server"]
