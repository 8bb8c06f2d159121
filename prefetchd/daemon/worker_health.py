"""Worker health: what the controller makes of a local worker that dies or hangs.

A worker that dies (its exit seen by ``pool.WorkerPool.wait``) is replaced, and its tasks go to
others; more than ``MAX_WORKER_RESTARTS`` ends within ``RESTART_WINDOW_SECONDS`` stop the job.  One
that hangs never dies: a worker that holds tasks and has begun no image for ``--task-timeout`` (a
read of a hung mount, a hook that never returns, a SIGSTOP; ``pool.WorkerPool.stalled``, from the
``workers.Whereabouts`` it writes) is killed after a warning that names it, the batch and the file,
and replaced the same way; a task that hangs ``MAX_TASK_HANGS`` times stops the job.

The controller (``producer.Producer``) keeps the task queue and the job's verdict::

    for dead in pool.wait(...):             for worker in health.hung():
        health.died(dead)                       why = health.kill(worker, on_result)  # or the job stops
        requeue(dead.tasks)                     requeue(worker.tasks)
        why = health.replace(dead)              why = health.replace(worker)

``WorkerHealth`` counts, names and judges; it reads the builds the controller keeps, by task id,
only to name a task's batch and to tell one still wanted.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping

from prefetchd.buffer_protocol import batch_name
from prefetchd.daemon.pool import Worker, WorkerPool
from prefetchd.daemon.production_stats import Stats
from prefetchd.daemon.stream import Build
from prefetchd.daemon.workers import Filled, Task, WriteFailed
from prefetchd.words import counted

log = logging.getLogger(__name__)

MAX_WORKER_RESTARTS = 10  # within RESTART_WINDOW_SECONDS, then the daemon gives up
RESTART_WINDOW_SECONDS = 60.0
# A task that hangs this many times (each time on a new worker, killed after --task-timeout) stops the job: what
# hangs again is the file or the hook, not the worker.  As many tries as the Ray bridge gives a slice (MAX_ATTEMPTS).
MAX_TASK_HANGS = 3
# A worker without progress this long (or a quarter of --task-timeout, if less) is said to, in the log and the
# status's message, before it is killed: a trainer's LoaderTimeout (120 s by default) quotes that message, so
# it names the worker and the file even where --task-timeout is longer than the trainer waits.
STALL_NOTE_SECONDS = 60.0
SHOWN_TASK_FILES = 4  # a task's files named in a hang's warning; the file the worker is on always is


class WorkerHealth:
    """The deaths and hangs of ``pool``'s workers, counted in ``stats``.

    ``task_timeout``: seconds a worker may go without beginning an image (--task-timeout);
    ``builds``: the controller's build of each task it has queued or sent, by task id (the tasks of a
    dropped build are not there); ``shown``: a sample as the log shows it (``BadSamples.shown``);
    ``ranks``: the streams the controller serves (with more than one, a batch is named with its rank).
    """

    def __init__(self, pool: WorkerPool, stats: Stats, task_timeout: float, builds: Mapping[int, Build],
                 shown: Callable[[int], str], ranks: int) -> None:
        self.pool = pool
        self.stats = stats
        self.task_timeout = task_timeout
        self.builds = builds
        self.shown = shown
        self.ranks = ranks
        self.ends: deque[float] = deque()  # when workers died or were killed, within RESTART_WINDOW_SECONDS
        self.hangs: dict[int, list[str]] = {}  # by task id, of tasks still wanted: the file of each hang
        self.stall_note: str | None = None  # a worker that makes no progress, said before it is killed

    # -- deaths ---------------------------------------------------------------

    def died(self, worker: Worker) -> None:
        """Say that ``worker`` died (one killed for a hang was said when it was)."""
        log.error("worker pid %s died (exit code %s); requeuing its %d tasks and starting another",
                  worker.process.pid, worker.process.exitcode, len(worker.tasks))

    def replace(self, worker: Worker) -> str | None:
        """Start a worker in place of ``worker``, which died or was killed; or, when too many ended lately,
        why the job must stop.  Its tasks are the controller's to queue again."""
        self.stats.worker_restarts += 1
        now = time.monotonic()
        self.ends.append(now)
        while self.ends and now - self.ends[0] > RESTART_WINDOW_SECONDS:
            self.ends.popleft()
        if len(self.ends) > MAX_WORKER_RESTARTS:
            return (f"{len(self.ends)} workers died within {RESTART_WINDOW_SECONDS:.0f} s "
                    f"(last exit code {worker.process.exitcode}); check the log and `dmesg` for the cause (out of memory?)")
        self.pool.add_worker()
        return None

    # -- hangs ----------------------------------------------------------------

    def hung(self) -> list[Worker]:
        """The workers that have made no progress (begun no image, finished no task) for --task-timeout,
        to be killed (``kill``).  One that has made none for a while, not that long yet, is said to, once
        in the log and in ``stall_note`` while it lasts."""
        limit = self.task_timeout
        notes = []
        hung = []
        for worker in self.pool.stalled():
            if worker.still < min(STALL_NOTE_SECONDS, limit / 4):
                continue
            if worker.still >= limit:
                hung.append(worker)
                continue
            task, sample = self._stuck_on(worker)
            notes.append(f"worker pid {worker.process.pid} has made no progress for {worker.still:.0f} s on "
                         f"{self._place(task, sample)}; at {limit:g} s (--task-timeout) it is killed and its task "
                         "retried")
            if not worker.noted:
                worker.noted = True
                log.warning("%s", notes[-1])
        self.stall_note = notes[0] if notes else None
        return hung

    def kill(self, worker: Worker, on_result: Callable[[Task, Filled | WriteFailed], None]) -> str | None:
        """Kill ``worker``, one of ``hung``'s, handing what it sent before to ``on_result``, and say so;
        why the job must stop when the task it was on hung ``MAX_TASK_HANGS`` times, else None: then its
        tasks (``worker.tasks``) are the controller's to queue again, and ``replace(worker)``."""
        task, sample = self._stuck_on(worker)
        place = self._place(task, sample)
        self.stats.worker_hangs += 1
        build = self.builds.get(task.task_id)
        hangs: list[str] = []
        if build is not None:  # a task still wanted: its hangs are kept until it is done or dropped
            self.hangs = {task_id: files for task_id, files in self.hangs.items() if task_id in self.builds}
            hangs = self.hangs.setdefault(task.task_id, [])
        hangs.append(self.shown(sample) if sample is not None else "before its first file")
        self.pool.kill(worker, on_result)
        # Held still after the kill (not finished as it came) and of a build still wanted: hung for good?
        final = (len(hangs) >= MAX_TASK_HANGS and task.task_id in worker.tasks and build is not None
                 and not build.cancelled)
        then = (f"that task hung {counted(len(hangs), 'time')}: the job stops" if final else
                f"its {'task goes' if len(worker.tasks) == 1 else f'{len(worker.tasks)} tasks go'} to a new worker "
                f"(hang {len(hangs)} of {MAX_TASK_HANGS} for that task)")
        log.warning("worker pid %d made no progress for %.0f s (--task-timeout %g) on %s: killed it; %s",
                    worker.process.pid, worker.still, self.task_timeout, place, then)
        return self._hung_for_good(task, hangs) if final else None

    # -- naming ---------------------------------------------------------------

    @staticmethod
    def _stuck_on(worker: Worker) -> tuple[Task, int | None]:
        """The task ``worker`` makes no progress on, and the sample (None: before its first)."""
        where = worker.where
        task = worker.tasks.get(where.task)
        if task is None:  # it did not begin the next one it holds
            return next(iter(worker.tasks.values())), None
        return task, where.sample if where.sample >= 0 else None

    def _batch_of(self, task: Task) -> str:
        build = self.builds.get(task.task_id)
        if build is None:
            return f"task {task.task_id}"
        rank = f", rank {build.stream.rank}" if self.ranks > 1 else ""
        return f"batch {batch_name(build.epoch, build.step)} (epoch {build.epoch}, step {build.step}{rank})"

    def _place(self, task: Task, sample: int | None) -> str:
        """Where a worker makes no progress, for the log and the status: the batch, the file, the task's files."""
        files = [self.shown(index) for _slot, index in task.items]
        shown = ", ".join(files[:SHOWN_TASK_FILES]) + (f" and {len(files) - SHOWN_TASK_FILES} more"
                                                        if len(files) > SHOWN_TASK_FILES else "")
        samples = [index for _slot, index in task.items]
        if sample is None:
            on = f"before the first of its task's {counted(len(files), 'file')}"
        elif sample in samples:
            on = f"{self.shown(sample)} (file {samples.index(sample) + 1} of its task's {len(files)})"
        else:  # a replacement for a file of the task that could not be decoded
            on = f"{self.shown(sample)} (a replacement for a file of its task that could not be decoded)"
        return f"{self._batch_of(task)}, {on}; the task's files: {shown}"

    def _hung_for_good(self, task: Task, hangs: list[str]) -> str:
        """Why the job stops: ``task`` hung MAX_TASK_HANGS times, on ``hangs``."""
        where = (f"each time on {hangs[0]}" if len(set(hangs)) == 1 else f"on {', then '.join(hangs)}")
        return (f"{self._batch_of(task)} cannot be built: its task hung {counted(len(hangs), 'time')}, each worker "
                f"killed after {self.task_timeout:g} s without progress (--task-timeout), {where}. "
                "Something never returns there: a read of a hung mount or storage (is it readable, "
                "`cat` it?), or the --transform hook; fix that and start the daemon again (it resumes), or raise "
                "--task-timeout if an image can take that long")


__all__ = ["MAX_TASK_HANGS", "MAX_WORKER_RESTARTS", "RESTART_WINDOW_SECONDS", "WorkerHealth"]
