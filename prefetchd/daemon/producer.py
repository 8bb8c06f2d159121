"""The controller: decides which batches to build, feeds the workers, publishes
finished batches and deletes consumed ones.

Batches are numbered by a global position ``g = epoch * steps_per_epoch + step``.
The trainer's progress ``p`` (the next batch it needs) is the truth: the daemon
keeps exactly the window ``[p, p + high_water)`` — everything before it is
consumed and deleted, everything after it (left by a trainer that rewound) is
deleted too, and missing batches inside it are built in order.  Flow control
has hysteresis: production stops when the window is full and resumes only when
the waiting batches fall to the low-water mark, so the workers run in bursts
rather than one batch at a time.

With several ranks the daemon produces one such stream per local rank
(``Stream``), each in its own directory with its own progress and window; one
worker pool serves them all, always feeding the stream with the fewest batches
waiting first.

Signal handlers only set a flag and wake the loop through a pipe; the loop
does all the work.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable

import numpy as np
import psutil

from prefetchd.buffer_protocol import (
    BatchLayout,
    DaemonLock,
    Manifest,
    Progress,
    ProtocolError,
    alive_since,
    batch_name,
    list_batches,
    list_temp_files,
    write_status,
)
from prefetchd.buffer_protocol.batch import temp_name
from prefetchd.buffer_protocol.layout import STREAM_PREFIX
from prefetchd.daemon.config import DaemonConfig
from prefetchd.daemon.dataset import SampleIndex
from prefetchd.daemon.errors import BadDataError, DaemonError
from prefetchd.daemon.sampler import batch_len, batch_slice, epoch_order
from prefetchd.daemon.sdnotify import Notifier
from prefetchd.daemon.wakeup import Wakeup
from prefetchd.daemon.workers import FORKSERVER_PRELOAD, Filled, Task, WorkerJob, WriteFailed, worker_main

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25  # progress is re-read at least this often even without a watch event
STATUS_SECONDS = 1.0
RETRY_SECONDS = 1.0  # after a batch could not be written (no space, say)
WORKER_STOP_SECONDS = 5.0
MAX_WORKER_RESTARTS = 10  # within RESTART_WINDOW_SECONDS, then the daemon gives up
RESTART_WINDOW_SECONDS = 60.0
TASKS_PER_WORKER = 2  # queued per worker so it never waits for the controller
STAGES = ("read", "decode", "augment", "write")  # the order of ``Filled.timings``
STAGE_WINDOW = 4096  # samples the stage quantiles are taken over
MAX_LISTED_BAD_FILES = 100  # undecodable files named in status.json; all are counted, and logged once


@dataclass(eq=False)
class Build:
    """A batch under construction in its temp file."""

    stream: Stream
    g: int
    epoch: int
    step: int
    tmp: Path
    layout: BatchLayout
    labels: np.ndarray
    indices: np.ndarray
    remaining: int
    outstanding: set[int] = field(default_factory=set)  # task ids sent or queued
    replaced: int = 0
    cancelled: bool = False


@dataclass
class Worker:
    process: Any  # multiprocessing.Process
    conn: Connection
    ps: psutil.Process
    tasks: dict[int, Task] = field(default_factory=dict)


@dataclass
class Stats:
    started: float = field(default_factory=time.time)
    batches: int = 0
    samples: int = 0
    replaced: int = 0
    consumed: int = 0
    worker_restarts: int = 0
    write_failures: int = 0
    low_space_pauses: int = 0
    recent: deque[tuple[float, int, int]] = field(default_factory=lambda: deque(maxlen=64))  # (t, samples, consumed)
    # Per-sample (read, decode, augment, write) seconds of the most recent samples.
    stage_times: deque[tuple[float, float, float, float]] = field(default_factory=lambda: deque(maxlen=STAGE_WINDOW))

    def rates(self) -> tuple[float, float]:
        """Samples produced and batches consumed per second over the last ~10 s."""
        now = time.monotonic()
        self.recent.append((now, self.samples, self.consumed))
        old = next((r for r in self.recent if now - r[0] <= 10.0), self.recent[0])
        dt = now - old[0]
        if dt <= 0:
            return 0.0, 0.0
        return (self.samples - old[1]) / dt, (self.consumed - old[2]) / dt

    def stage_quantiles(self) -> dict[str, dict[str, float]]:
        """p50/p90/p99 seconds per stage over the last ``STAGE_WINDOW`` samples; empty before the first."""
        if not self.stage_times:
            return {}
        times = np.asarray(self.stage_times)
        q = np.quantile(times, [0.5, 0.9, 0.99], axis=0)
        return {stage: {"p50": float(q[0, i]), "p90": float(q[1, i]), "p99": float(q[2, i])}
                for i, stage in enumerate(STAGES)}


class Stream:
    """One rank's stream: its directory, the trainer's progress and the window of batches kept."""

    def __init__(self, directory: Path, manifest: Manifest, members: np.ndarray, shuffle: bool, high: int, low: int) -> None:
        self.dir = directory
        self.manifest = manifest
        self.members = members
        self.shuffle = shuffle
        self.high, self.low = high, low
        self.steps = manifest.steps_per_epoch
        self.end = manifest.epochs * self.steps if manifest.epochs is not None else None
        self.published: dict[int, Path] = {}
        self.building: dict[int, Build] = {}
        self.progress = 0
        self.filling = True
        self.consumed = 0
        self.progress_error = ""
        # Counted for status.json, so that tools and tests see what the log says without parsing it.
        self.vanished_batches = 0  # published batches whose files someone else removed
        self.progress_rejected = 0  # distinct problems with progress.json, each ignored
        self.progress_rewinds = 0  # times the trainer's position moved back
        self.trainer_wait_share: float | None = None
        # Who wrote progress.json last and when (None: nobody yet, or a writer without pid/time).
        self.trainer_pid: int | None = None
        self.progress_time: float | None = None
        self.trainer_alive: bool | None = None
        self._orders: dict[int, np.ndarray] = {}

    @property
    def rank(self) -> int:
        return self.manifest.rank

    def key(self, g: int) -> tuple[int, int]:
        return divmod(g, self.steps)

    def g(self, key: tuple[int, int]) -> int:
        return key[0] * self.steps + key[1]

    @property
    def finished(self) -> bool:
        return self.end is not None and self.progress >= self.end

    @property
    def produced_all(self) -> bool:
        """Every batch of the last epoch is published or being built."""
        if self.end is None or self.end - self.progress > self.high:
            return False
        return all(g in self.published or g in self.building for g in range(self.progress, self.end))

    @property
    def active(self) -> int:
        return sum(not b.cancelled for b in self.building.values())

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) > 4:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = epoch_order(
                self.members, self.manifest.seed, epoch, shuffle=self.shuffle,
                rank=self.manifest.rank, world_size=self.manifest.world_size,
            )
        return self._orders[epoch]

    def adopt_published(self) -> None:
        self.published = {self.g(k): p for k, p in list_batches(self.dir).items()}
        if self.published:
            log.info("kept %d finished batches of rank %d from an earlier run of the same job", len(self.published), self.rank)

    def reconcile(self) -> list[int]:
        """Forget published batches whose files are gone, so that they are built again.

        Only this daemon deletes batches, but a person, a cleanup job or a trainer that found a
        batch damaged (the ProtocolError says to delete it) may too; without a look at the
        directory the daemon would count the batch as waiting for ever and the trainer would
        wait for it until its timeout.  One scandir of at most ``high`` files per poll.
        """
        if not self.published:
            return []
        present = list_batches(self.dir)
        lost = [g for g in self.published if self.key(g) not in present]
        for g in lost:
            path = self.published.pop(g)
            log.warning("batch %s of rank %d vanished from %s; building it again", path.name, self.rank, self.dir)
        self.vanished_batches += len(lost)
        return lost

    def read_progress(self) -> bool:
        """Take the trainer's progress; True when it moved."""
        try:
            progress = Progress.read(self.dir)
        except ProtocolError as exc:
            self._progress_problem(str(exc))
            return False
        if progress is None:
            return False
        if progress.step >= self.steps:
            self._progress_problem(f"step {progress.step} is past the {self.steps} steps of an epoch")
            return False
        self.progress_error = ""
        self.trainer_wait_share = progress.wait_share
        self.trainer_pid, self.progress_time = progress.pid, progress.time
        g = self.g((progress.epoch, progress.step))
        if self.end is not None:
            g = min(g, self.end)
        if g == self.progress:
            return False
        if g < self.progress:
            self.progress_rewinds += 1
            log.info("rank %d's trainer moved back from %s to %s; regenerating from there",
                     self.rank, self.key(self.progress), self.key(g))
        else:
            self.consumed += g - self.progress
        self.progress = g
        return True

    def _progress_problem(self, problem: str) -> None:
        if problem != self.progress_error:
            log.warning("ignoring %s: %s", self.dir / "progress.json", problem)
            self.progress_error = problem
            self.progress_rejected += 1

    def outside_window(self) -> tuple[list[int], list[Build]]:
        """Published positions and live builds outside [progress, progress + high)."""
        lo, hi = self.progress, self.progress + self.high
        stale = [g for g in self.published if not lo <= g < hi]
        builds = [b for b in self.building.values() if not lo <= b.g < hi and not b.cancelled]
        return stale, builds

    def next_missing(self) -> int | None:
        """The first position of the window that is neither published nor being built, if the
        hysteresis lets production run; None when there is nothing to build now."""
        if self.filling and len(self.published) + self.active >= self.high:
            self.filling = False
        if not self.filling and (len(self.published) <= self.low or self._trainer_blocked()):
            self.filling = True
        if not self.filling:
            return None
        hi = self.progress + self.high
        if self.end is not None:
            hi = min(hi, self.end)
        g = self.progress
        while g < hi and (g in self.published or g in self.building):
            g += 1
        return g if g < hi else None

    def _trainer_blocked(self) -> bool:
        """The batch the trainer needs next is neither published nor being built: after a rewind,
        or a waiting batch lost, the batches further on do not help it, however many there are."""
        g = self.progress
        return (self.end is None or g < self.end) and g not in self.published and g not in self.building

    def check_trainer(self) -> None:
        """Whether the process that wrote progress.json is still there; logs when it goes and comes back.

        A trainer that is gone leaves the window full: the daemon holds the buffer at
        the high-water mark and sleeps until progress.json moves again.
        """
        pid, since = self.trainer_pid, self.progress_time
        alive = alive_since(pid, since) if pid is not None and since is not None else None
        if alive is None or alive == self.trainer_alive:
            return
        epoch, step = self.key(self.progress)
        if not alive:
            log.warning(
                "rank %d's trainer (pid %d) has gone away; progress last moved %.0f s ago, at epoch %d step %d. "
                "Keeping the buffer at the high-water mark (%d batches) for when a trainer comes back",
                self.rank, pid, time.time() - (since or 0.0), epoch, step, self.high,
            )
        elif self.trainer_alive is False:
            log.info("rank %d's trainer is back (pid %d) at epoch %d step %d", self.rank, pid, epoch, step)
        self.trainer_alive = alive

    def trainer_status(self) -> dict[str, Any]:
        since = self.progress_time
        return {
            "pid": self.trainer_pid,
            "alive": self.trainer_alive,
            "progress_age_s": round(max(0.0, time.time() - since), 1) if since is not None else None,
        }

    def status(self) -> dict[str, Any]:
        epoch, step = self.key(self.progress)
        return {
            "rank": self.rank,
            "trainer": self.trainer_status(),
            "progress": {"epoch": epoch, "step": step, "trainer_wait_share": self.trainer_wait_share},
            "waiting": len(self.published),
            "building": self.active,
            "progress_file": self.progress_error,
            "vanished_batches": self.vanished_batches,
            "progress_rejected": self.progress_rejected,
            "progress_rewinds": self.progress_rewinds,
        }


class Producer:
    def __init__(
        self, cfg: DaemonConfig, index: SampleIndex, members: np.ndarray, streams: list[tuple[Path, Manifest]],
        wake: Wakeup, poll_jobs: Callable[[DaemonConfig], DaemonConfig | None] = lambda _: None,
        extra_status: Callable[[], dict[str, Any]] = dict,
        on_status: Callable[[dict[str, Any]], None] = lambda _: None,
        notifier: Notifier | None = None,
    ) -> None:
        self.cfg = cfg
        self.notifier = notifier or Notifier(None)
        self.buffer = Path(cfg.buffer)
        self.wake = wake
        self.poll_jobs = poll_jobs
        self.extra_status = extra_status
        self.on_status = on_status
        self.next_job: DaemonConfig | None = None
        self.index = index
        high, low = int(cfg.high_water or 2), int(cfg.low_water or 0)
        self.streams = [Stream(d, m, members, cfg.split == "train", high, low) for d, m in streams]
        self.min_free = int(cfg.min_free_mb or 0) << 20
        self.workers_wanted = int(cfg.workers or 1)
        self.chunk = max(1, min(16, cfg.batch_size // (2 * self.workers_wanted)))
        self.max_building = max(2, -(-self.workers_wanted * TASKS_PER_WORKER * self.chunk // cfg.batch_size) + 1)
        self.stats = Stats()
        self.todo: deque[Task] = deque()
        self.task_build: dict[int, Build] = {}
        self.next_task_id = 0
        self.retry_at = 0.0
        self.state = "starting"
        self.message = ""
        self.logged_failures: set[str] = set()
        self.bad_files: list[dict[str, str]] = []  # the first MAX_LISTED_BAD_FILES, for the status
        self.restart_times: deque[float] = deque()
        self.fatal: str | None = None
        self.fatal_error: type[DaemonError] = DaemonError
        self.workers: list[Worker] = []
        self._ctx = worker_context()
        self._job = WorkerJob.from_config(index, members, cfg)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.streams)

    # -- lifecycle ------------------------------------------------------------

    def run(self) -> None:
        """Produce until stopped by a signal, finished, replaced by another job, or failed."""
        try:
            for stream in self.streams:
                stream.adopt_published()
            self._read_progress()
            self._start_workers()
            self.state = "filling"
            self.notifier.ready(f"producing the {self.cfg.split} split of {self.cfg.data} into {self.buffer}")
            last_status = last_poll = 0.0
            while self.wake.stop_signal is None and self.fatal is None and self.next_job is None:
                self.notifier.watchdog()
                self._wait(timeout=self._poll_interval())
                now = time.monotonic()
                if self.wake.drain() or now - last_poll >= POLL_SECONDS:
                    self._read_progress()
                    self.next_job = self.poll_jobs(self.cfg)
                    last_poll = now
                self._schedule()
                self._dispatch()
                if now - last_status >= STATUS_SECONDS:
                    self._write_status()
                    last_status = now
                if self.finished:
                    log.info("the trainers consumed all %d epochs", self.streams[0].manifest.epochs)
                    break
        except Exception as exc:  # a bug: leave a status that says so, not a silently stale heartbeat
            log.exception("internal error in the controller")
            self.fatal = f"internal error: {type(exc).__name__}: {exc} (see the log; please report it)"
        finally:
            self.state = "stopping"
            if self.wake.stop_signal is not None or self.fatal is not None:
                self.notifier.stopping(self.fatal or self.wake.stop_reason)
            self._shutdown()
        if self.fatal:
            self.state, self.message = "failed", self.fatal
            self._write_status()
            raise self.fatal_error(self.fatal)
        if self.next_job is not None:
            self.state, self.message = "switching", "replacing the job with the one in job.json"
        else:
            self.state, self.message = "stopped", self.wake.stop_reason
        self._write_status()

    def _poll_interval(self) -> float:
        """How long the loop may sleep when nothing wakes it.

        While the buffer is full and nothing is being built (a trainer away, or one that
        just has enough), only a new progress.json or job.json can give it work, and the
        watcher wakes it for those at once: it sleeps until the next heartbeat is due.
        Without a working watcher it polls the files every POLL_SECONDS.
        """
        idle = self.wake.watching and all(not s.filling and not s.building for s in self.streams) and not self.todo
        return STATUS_SECONDS if idle else POLL_SECONDS

    def _start_workers(self) -> None:
        """Start the workers while the heartbeat goes on.

        The first start waits until the fork server has imported torch, which takes
        seconds on a busy machine; a status.json that stood still that long would
        make trainers (and `prefetchd status`) take a starting daemon for a stuck one.
        """
        started: list[Worker] = []
        failed: list[BaseException] = []

        def spawn_all() -> None:
            try:
                for _ in range(self.workers_wanted):
                    started.append(self._spawn())
            except BaseException as exc:  # re-raised below, in the controller's thread
                failed.append(exc)

        spawner = threading.Thread(target=spawn_all, name="prefetchd-spawn-workers", daemon=True)
        spawner.start()
        while spawner.is_alive():
            self._write_status()
            spawner.join(STATUS_SECONDS)
        self.workers.extend(started)
        if failed:
            raise failed[0]

    def _wait(self, timeout: float) -> None:
        ready = wait([w.conn for w in self.workers] + [w.process.sentinel for w in self.workers] + [self.wake], timeout)
        for worker in list(self.workers):
            if worker.conn in ready:
                self._receive(worker)
        for worker in list(self.workers):
            if worker.process.sentinel in ready or not worker.process.is_alive():
                self._replace_worker(worker)

    # -- workers --------------------------------------------------------------

    def _spawn(self) -> Worker:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=worker_main, args=(child, self._job), name="prefetchd-worker", daemon=True)
        proc.start()
        child.close()
        return Worker(proc, parent, psutil.Process(proc.pid))

    def _receive(self, worker: Worker) -> None:
        while worker.conn.poll():
            try:
                result = worker.conn.recv()
            except (EOFError, OSError):
                return  # it died; its sentinel handles the rest
            task = worker.tasks.pop(result.task_id, None)
            if task is not None:
                self._complete(task, result)

    def _replace_worker(self, worker: Worker) -> None:
        self._receive(worker)  # results it sent before dying still count
        code = worker.process.exitcode
        self.workers.remove(worker)
        worker.conn.close()
        if self.wake.stop_signal is not None:
            return
        now = time.monotonic()
        self.restart_times.append(now)
        while self.restart_times and now - self.restart_times[0] > RESTART_WINDOW_SECONDS:
            self.restart_times.popleft()
        self.stats.worker_restarts += 1
        log.error("worker pid %s died (exit code %s); requeuing its %d tasks and starting another",
                  worker.process.pid, code, len(worker.tasks))
        self.todo.extendleft(reversed(list(worker.tasks.values())))
        if len(self.restart_times) > MAX_WORKER_RESTARTS:
            self.fatal = (f"{len(self.restart_times)} workers died within {RESTART_WINDOW_SECONDS:.0f} s "
                          f"(last exit code {code}); check the log and `dmesg` for the cause (out of memory?)")
            return
        self.workers.append(self._spawn())

    def _shutdown(self) -> None:
        for worker in self.workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + WORKER_STOP_SECONDS
        for worker in self.workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(1.0)
            worker.conn.close()
        self.workers.clear()
        for stream in self.streams:
            for build in stream.building.values():
                build.tmp.unlink(missing_ok=True)
            stream.building.clear()

    # -- progress and deletion -----------------------------------------------

    def _read_progress(self) -> None:
        for stream in self.streams:
            stream.read_progress()
            stale, builds = stream.outside_window()
            for g in stale:
                stream.published.pop(g).unlink(missing_ok=True)
            for build in builds:
                self._cancel(build)
            stream.reconcile()

    def _cancel(self, build: Build) -> None:
        """Stop building ``build``; tasks already at a worker finish and are ignored."""
        build.cancelled = True
        queued = {t.task_id for t in self.todo if t.task_id in build.outstanding}
        self.todo = deque(t for t in self.todo if t.task_id not in queued)
        for task_id in queued:
            del self.task_build[task_id]
        build.outstanding -= queued
        self._maybe_drop(build)

    def _maybe_drop(self, build: Build) -> None:
        if build.cancelled and not build.outstanding:
            build.tmp.unlink(missing_ok=True)
            del build.stream.building[build.g]

    # -- building -------------------------------------------------------------

    def _free_bytes(self) -> int:
        fs = os.statvfs(self.buffer)
        return fs.f_bavail * fs.f_frsize

    def _schedule(self) -> None:
        if time.monotonic() < self.retry_at:
            return
        while sum(s.active for s in self.streams) < self.max_building:
            # The stream closest to running dry goes first.
            wanted = [(len(s.published) + s.active, i, s, s.next_missing()) for i, s in enumerate(self.streams)]
            candidates = sorted((fill, i, s, g) for fill, i, s, g in wanted if g is not None)
            if not candidates:
                if all(s.produced_all for s in self.streams):
                    self.state = "done"
                else:
                    # "full" only once the last batch up to the high-water mark is published.
                    busy = any(s.filling or s.building for s in self.streams)
                    self.state = "filling" if busy else "full"
                return
            _, _, stream, g = candidates[0]
            size = batch_len(stream.key(g)[1], self.cfg.batch_size, stream.manifest.samples_per_epoch)
            layout = BatchLayout.plan(size, self.cfg.image_size, self.cfg.image_size)
            pending = sum(b.layout.file_len for s in self.streams for b in s.building.values())
            free = self._free_bytes() - pending - layout.file_len
            if free < self.min_free:
                msg = (f"paused: {self.buffer} would fall to {max(free, 0) >> 20} MiB free, below the floor of "
                       f"{self.min_free >> 20} MiB; free space there or lower --high-water")
                if self.state != "paused-low-space":
                    log.warning(msg)
                    self.stats.low_space_pauses += 1
                self.state, self.message = "paused-low-space", msg
                self.retry_at = time.monotonic() + RETRY_SECONDS
                return
            if not self._start_build(stream, g, layout):
                return
            self.state, self.message = "filling", ""

    def _start_build(self, stream: Stream, g: int, layout: BatchLayout) -> bool:
        """Create the batch's temp file and queue its tasks; False (retry later) if it cannot be created."""
        epoch, step = stream.key(g)
        order = stream.order(epoch)
        chosen = order[batch_slice(step, self.cfg.batch_size, len(order))]
        tmp = temp_name(stream.dir / batch_name(epoch, step))
        try:
            fd = create_exclusive(tmp)
        except OSError as exc:  # e.g. a directory planted under the name, out of inodes
            self.stats.write_failures += 1
            log.warning("cannot create %s: %s; retrying in %.0f s", tmp, exc.strerror, RETRY_SECONDS)
            self.retry_at = time.monotonic() + RETRY_SECONDS
            return False
        try:
            os.ftruncate(fd, layout.file_len)
        finally:
            os.close(fd)
        n = len(chosen)
        build = Build(stream, g, epoch, step, tmp, layout, np.empty(n, np.int64), np.empty(n, np.int64), remaining=n)
        stream.building[g] = build
        for start in range(0, n, self.chunk):
            items = tuple((slot, int(chosen[slot])) for slot in range(start, min(n, start + self.chunk)))
            task = Task(self.next_task_id, str(tmp), layout.tensors["images"].offset, layout.slot_bytes, epoch, items)
            self.next_task_id += 1
            self.task_build[task.task_id] = build
            build.outstanding.add(task.task_id)
            self.todo.append(task)
        return True

    def _dispatch(self) -> None:
        for worker in sorted(self.workers, key=lambda w: len(w.tasks)):
            while self.todo and len(worker.tasks) < TASKS_PER_WORKER:
                task = self.todo.popleft()
                worker.tasks[task.task_id] = task
                try:
                    worker.conn.send(task)
                except OSError:  # died meanwhile; its sentinel requeues the task
                    break

    def _complete(self, task: Task, result: Filled | WriteFailed) -> None:
        build = self.task_build.pop(task.task_id)
        build.outstanding.discard(task.task_id)
        if isinstance(result, WriteFailed):
            if result.fatal:
                self.fatal = result.reason
                return
            self.stats.write_failures += 1
            log.warning("batch %s: %s; retrying in %.0f s", build.tmp.name, result.reason, RETRY_SECONDS)
            self.retry_at = time.monotonic() + RETRY_SECONDS
            if not build.cancelled:
                self._cancel(build)
            else:
                self._maybe_drop(build)
            return
        if build.cancelled:
            self._maybe_drop(build)
            return
        for path, reason in result.failures:
            if path not in self.logged_failures:
                self.logged_failures.add(path)
                if len(self.bad_files) < MAX_LISTED_BAD_FILES:
                    self.bad_files.append({"path": path, "reason": reason})
                log.warning("cannot decode %s (%s); replacing it with the next sample of the split", path, reason)
        if result.failures and self._over_budget(*result.failures[-1]):
            return
        requested = dict(task.items)
        for slot, index, label in result.slots:
            build.indices[slot] = index
            build.labels[slot] = label
            build.replaced += index != requested[slot]
        self.stats.stage_times.extend(result.timings)
        build.remaining -= len(result.slots)
        if build.remaining == 0:
            self._publish(build)

    def _over_budget(self, path: str, reason: str) -> bool:
        """Fail the job when --strict is on or the undecodable files exceed the budget."""
        verdict = bad_data_verdict(self.cfg, len(self.logged_failures), len(self._job.members), path, reason)
        if verdict is None:
            return False
        self.fatal, self.fatal_error = verdict, BadDataError
        return True

    def _publish(self, build: Build) -> None:
        stream = build.stream
        del stream.building[build.g]
        final = stream.dir / batch_name(build.epoch, build.step)
        layout = build.layout
        try:
            fd = os.open(build.tmp, os.O_WRONLY | os.O_NOFOLLOW)
            try:
                os.pwrite(fd, build.labels.astype("<i8").tobytes(), layout.tensors["labels"].offset)
                os.pwrite(fd, build.indices.astype("<i8").tobytes(), layout.tensors["indices"].offset)
                header = layout.encode_header(
                    epoch=build.epoch, step=build.step, seed=self.cfg.seed,
                    producer=stream.manifest.producer, replaced=build.replaced,
                )
                # The header goes last: a file without its magic is never mistaken for a batch.
                os.pwrite(fd, header, 0)
            finally:
                os.close(fd)
            os.rename(build.tmp, final)
        except OSError as exc:
            build.tmp.unlink(missing_ok=True)
            self.stats.write_failures += 1
            log.warning("could not publish %s: %s; retrying in %.0f s", final.name, exc.strerror, RETRY_SECONDS)
            self.retry_at = time.monotonic() + RETRY_SECONDS
            return
        stream.published[build.g] = final
        self.stats.batches += 1
        self.stats.samples += len(build.indices)
        self.stats.replaced += build.replaced

    # -- status ---------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The daemon's state; for one rank its stream's fields are also at the top level."""
        self.stats.consumed = sum(s.consumed for s in self.streams)
        for stream in self.streams:
            stream.check_trainer()
        produce_rate, consume_rate = self.stats.rates()
        streams = [s.status() for s in self.streams]
        first = streams[0]
        waiting = sum(s["waiting"] for s in streams)
        building = sum(s["building"] for s in streams)
        return {
            "pid": os.getpid(),
            "producer": self.streams[0].manifest.producer,
            "state": self.state,
            "message": self.message,
            "heartbeat": time.time(),
            "started": self.stats.started,
            "progress": first["progress"],
            "trainer": first["trainer"],
            "streams": streams,
            "waiting": waiting,
            "building": building,
            "high_water": self.streams[0].high * len(self.streams),
            "low_water": self.streams[0].low * len(self.streams),
            "batch_bytes": self.cfg.batch_bytes,
            "buffer_bytes": sum(b.layout.file_len for s in self.streams for b in s.building.values())
            + waiting * self.cfg.batch_bytes,
            "free_bytes": self._free_bytes(),
            "workers": len(self.workers),
            "workers_cpu_percent": round(sum(self._cpu_percent(w) for w in self.workers), 1),
            "rates": {"samples_per_s": round(produce_rate, 1), "consumed_batches_per_s": round(consume_rate, 2)},
            "stages": self.stats.stage_quantiles(),
            "totals": {"batches": self.stats.batches, "samples": self.stats.samples, "consumed_batches": self.stats.consumed},
            "errors": {
                "replaced_samples": self.stats.replaced,
                "undecodable_files": len(self.logged_failures),
                "undecodable": self.bad_files,
                "worker_restarts": self.stats.worker_restarts,
                "write_failures": self.stats.write_failures,
                "low_space_pauses": self.stats.low_space_pauses,
                "vanished_batches": sum(s["vanished_batches"] for s in streams),
                "progress_rejected": sum(s["progress_rejected"] for s in streams),
                "progress_rewinds": sum(s["progress_rewinds"] for s in streams),
                "progress_file": "; ".join(s["progress_file"] for s in streams if s["progress_file"]),
            },
            **self.extra_status(),
        }

    @staticmethod
    def _cpu_percent(worker: Worker) -> float:
        try:
            return float(worker.ps.cpu_percent(None))  # since the previous call: one status period
        except psutil.Error:
            return 0.0

    def _write_status(self) -> None:
        status = self.status()
        self.on_status(status)
        try:
            write_status(self.buffer, status)
        except OSError as exc:
            log.warning("cannot write status to %s: %s", self.buffer, exc.strerror)


def create_exclusive(path: Path) -> int:
    """Create ``path`` for writing, never opening what is already there.

    Nothing should be: the sweep at start and every cancelled build delete their
    temp files.  A name that exists anyway was put there by someone else (with
    --group-access, a member of the group): a link planted there would make
    O_TRUNC cut, and the workers write into, a file the daemon never created.
    Unlinking removes only the name in our directory, not what it points to.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o644)
    except FileExistsError:
        log.warning("%s exists though this daemon did not create it; removing the name and creating its own", path)
        path.unlink()
        return os.open(path, flags, 0o644)


def bad_data_verdict(cfg: DaemonConfig, bad: int, split: int, path: str, reason: str) -> str | None:
    """Why the job must stop now that ``bad`` distinct files of a ``split``-sample split could not be
    decoded, the last being ``path`` (for ``reason``); None while the policy lets it replace them."""
    if cfg.strict:
        return (f"--strict: cannot decode {path} ({reason}); fix or remove the file, or start without "
                "--strict to replace undecodable images with the next sample of the split")
    exceeded = []
    if cfg.max_bad_samples is not None and bad > cfg.max_bad_samples:
        exceeded.append(f"--max-bad-samples {cfg.max_bad_samples}")
    if cfg.max_bad_fraction is not None and bad > cfg.max_bad_fraction * split:
        exceeded.append(f"--max-bad-fraction {cfg.max_bad_fraction:g} of {split} samples")
    if not exceeded:
        return None
    return (f"{bad} files could not be decoded, more than {' and '.join(exceeded)} allows (the last: {path}: "
            f"{reason}); the log names every one and `prefetchd status --json` the first {MAX_LISTED_BAD_FILES}; "
            "repair or remove them, or raise the limit")


def worker_context() -> multiprocessing.context.ForkServerContext:
    """A forkserver that has imported the worker code (torch included) once.

    Workers must not inherit the controller's threads or locks, which rules out
    plain fork; spawn re-imports torch in every worker, seconds each on a busy
    machine. A forkserver with the worker module preloaded starts each worker
    (also a replacement for one that died) in milliseconds.
    """
    ctx = multiprocessing.get_context("forkserver")
    assert isinstance(ctx, multiprocessing.context.ForkServerContext)
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


def start_worker_server() -> None:
    """Start the forkserver now, so that its imports overlap whatever the daemon does next."""
    worker_context()
    multiprocessing.forkserver.ensure_running()


def sweep_leftovers(buffer: Path) -> int:
    """Delete what a killed daemon left half-written; only the lock holder may call this."""
    count = 0
    for directory in [buffer, *(d for d in buffer.glob(f"{STREAM_PREFIX}*") if d.is_dir() and not d.is_symlink())]:
        for path in list_temp_files(directory):
            path.unlink(missing_ok=True)
            count += 1
    return count


def new_producer_id() -> str:
    return uuid.uuid4().hex[:12]


__all__ = ["DaemonLock", "Producer", "new_producer_id", "start_worker_server", "sweep_leftovers"]
