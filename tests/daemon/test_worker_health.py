"""What a dead worker's whereabouts make of its death (worker_health.WorkerHealth.died): a file is blamed
only where workers died on it running the same task again, never for deaths that fell elsewhere; and what the
controller makes of a Ray slice's stall, of Ray workers that die before their first image, and of slices that do
not begin in --worker-start-timeout."""

from __future__ import annotations

import multiprocessing
import time
from types import SimpleNamespace
from typing import Any

import pytest

from prefetchd.daemon import worker_health
from prefetchd.daemon.builds import Builds
from prefetchd.daemon.errors import DaemonError
from prefetchd.daemon.pool import Worker
from prefetchd.daemon.production_stats import Stats
from prefetchd.daemon.tasks import Task
from prefetchd.daemon.whereabouts import START_HOOK, Whereabouts
from prefetchd.daemon.worker_health import (CRASHES_TO_BLAME, MAX_TASK_HANGS, MAX_WORKER_RESTARTS, SliceStall,
                                            WorkerHealth)

TASKS = {task_id: Task(task_id, "b.tmp", 4096, 3072, 0, ((0, 10 * task_id), (1, 10 * task_id + 1)))
         for task_id in (1, 2)}


def dead(task: int, sample: int, exitcode: int = -11, begun: bool = True) -> Worker:
    """A worker that died holding both tasks, its whereabouts left as a worker writes them."""
    where = Whereabouts(multiprocessing.RawArray("q", Whereabouts.INITIAL))
    if begun:
        where.ready()
        where.begin(task)
        if sample >= 0:
            where.begin(task, sample)
    process: Any = SimpleNamespace(pid=4242, exitcode=exitcode)  # a multiprocessing.Process that has exited
    return Worker(process, None, None, None, where, dict(TASKS))  # type: ignore[arg-type]


def health() -> WorkerHealth:
    pool: Any = SimpleNamespace(job=None)  # read only to word a start's step, which a worker not begun (0) needs not
    return WorkerHealth(pool, Stats(), 600.0, dict.fromkeys(TASKS), str, 1, 600.0)


def test_a_file_is_blamed_once_workers_died_on_it_in_the_same_task() -> None:
    h = health()
    for _ in range(CRASHES_TO_BLAME - 1):
        assert h.died(dead(1, 11)) is None
    assert h.died(dead(1, 11, exitcode=-6)) == (11, f"crashed its worker {CRASHES_TO_BLAME} times "
                                                   "(signal SIGSEGV, then signal SIGABRT)")
    assert h.crashed_items == ((11, h.crashed[11]),)
    assert not h.ends, "the file's deaths leave the restart window: the bad-sample limits judge them"
    # A task queued before that is told of it; one told already is left as it is.
    builds = Builds(2)
    builds.queue.extend(TASKS.values())
    builds.tell_queued(h.crashed_items)
    told = builds.queue[0]
    builds.tell_queued(h.crashed_items)
    assert [t.crashed for t in builds.queue] == [h.crashed_items] * 2 and builds.queue[0] is told
    # A task sent before the file was found out kills one more worker: no new verdict, nor a count.
    assert h.died(dead(2, 11)) is None and not h.ends


def test_deaths_that_fall_on_different_files_or_tasks_or_between_images_blame_none() -> None:
    h = health()
    # Another file of the task, the same file in another task, before the task's first image, before any task.
    deaths = [dead(1, 10), dead(1, 11), dead(2, 11), dead(2, 21), dead(1, -1), dead(2, -1), dead(2, 20, begun=False)]
    assert [h.died(worker) for worker in deaths] == [None] * len(deaths)
    assert not h.crashed and len(h.ends) == len(deaths), "each counts towards the restart limit"


def test_workers_killed_from_outside_on_one_file_blame_it_not(caplog: Any) -> None:
    """Killed by hand at a steady pace, restarted workers reached the same image after the same start: two kills
    on one file replaced a healthy image as undecodable (a review's walk of RELIABILITY.md).  A file can crash its
    worker (a fault signal) or make it exit (a C library's exit(1)); SIGKILL, SIGTERM and the like come from outside,
    and a worker whose server died (exit code 255) did not die of its file."""
    h = health()
    outside = [-9, -15, -2, -1, -3, 255] * CRASHES_TO_BLAME
    assert [h.died(dead(1, 11, exitcode=code)) for code in outside] == [None] * len(outside)
    assert not h.crashed and len(h.ends) == len(outside), "each counts towards the restart limit"
    assert ("died (signal SIGKILL) on task 1, 11 (file 2 of its task's 2); requeuing its 2 tasks and starting "
            "another (not that file's fault)") in caplog.text
    # A file that makes its worker exit is found out as one that crashes it.
    h = health()
    assert h.died(dead(1, 11, exitcode=1)) is None
    assert h.died(dead(1, 11, exitcode=1)) == (11, f"crashed its worker {CRASHES_TO_BLAME} times (exit code 1)")


def test_a_worker_that_died_before_it_was_ready_is_said_with_the_step_it_was_on(caplog: Any) -> None:
    """A hook's module that kills the worker importing it (a segfault in its extension) was said as a death
    between tasks, with nothing of the import: now the step of the start is named."""
    pool: Any = SimpleNamespace(job=SimpleNamespace(augment=SimpleNamespace(transform="users.hooks:aug")))
    h = WorkerHealth(pool, Stats(), 600.0, dict.fromkeys(TASKS), str, 1, 600.0)
    worker = dead(1, -1, begun=False)
    worker.where.starting(START_HOOK)
    with caplog.at_level("ERROR", logger="prefetchd.daemon.worker_health"):
        assert h.died(worker) is None
    assert ("worker pid 4242 died (signal SIGSEGV) before it was ready, importing the --transform hook's module "
            "users.hooks; requeuing its 2 tasks and starting another") in caplog.text, caplog.text


def test_workers_killed_together_for_a_hang_do_not_trip_the_restart_limit() -> None:
    """A hung mount stalls every worker at once: 11 of them killed at --task-timeout stopped the job as "11
    workers died within 60 s (out of memory?)", where each task had hung once of the 3 times that stop it."""
    killed, started = [], []
    pool: Any = SimpleNamespace(job=None, workers=[], kill=lambda worker, on_result: killed.append(worker),
                                add_worker=lambda start_hangs=(): started.append(start_hangs))
    h = WorkerHealth(pool, Stats(), 600.0, dict.fromkeys(TASKS), str, 1, 600.0)
    workers = [dead(1 + i % 2, -1) for i in range(MAX_WORKER_RESTARTS + 2)]  # alive, stuck: only whereabouts read
    for worker in workers:
        assert h.kill(worker, lambda task, result: None) is None
        assert h.replace(worker) is None
    assert len(killed) == len(started) == len(workers) and h.stats.worker_hangs == len(workers)
    # Deaths still count: the limit is for workers that die for their own reasons.
    for worker in workers[:MAX_WORKER_RESTARTS]:
        h.died(worker)
        assert h.replace(worker) is None
    h.died(workers[-1])
    assert f"{MAX_WORKER_RESTARTS + 1} workers died within" in (h.replace(workers[-1]) or "")


def test_workers_that_die_before_they_are_ready_stop_at_the_limit_however_slowly_they_die(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Local workers that died at their start, each after seconds of imports (torch, then a hook's module that
    kills the process), died fewer than 11 times within 60 s on a slow machine: restarted forever, they never
    tripped the restart limit (the CI's Ray fault test, stop 71).  Now 11 in a row, none ready meanwhile, end them
    at any pace; a worker that is ready ends the row."""
    clock = [1000.0]
    monkeypatch.setattr(worker_health, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    ready: list[Worker] = []
    pool: Any = SimpleNamespace(job=SimpleNamespace(augment=SimpleNamespace(transform="users.hooks:aug")),
                                workers=ready, add_worker=lambda start_hangs=(): None)
    h = WorkerHealth(pool, Stats(), 600.0, dict.fromkeys(TASKS), str, 1, 600.0)

    def die_starting() -> str | None:
        clock[0] += 30.0  # two deaths a minute: never 11 within 60 s
        worker = dead(1, -1, exitcode=-9, begun=False)
        worker.where.starting(START_HOOK)
        assert h.died(worker) is None
        return h.replace(worker)

    assert [die_starting() for _ in range(MAX_WORKER_RESTARTS)] == [None] * MAX_WORKER_RESTARTS
    ready.append(dead(2, -1))  # one got ready: the row starts again
    assert [die_starting() for _ in range(MAX_WORKER_RESTARTS)] == [None] * MAX_WORKER_RESTARTS
    ready.clear()
    assert h.died(dead(2, -1)) is None and h.replace(dead(2, -1)) is None  # a ready worker's death ends it too
    assert [die_starting() for _ in range(MAX_WORKER_RESTARTS)] == [None] * MAX_WORKER_RESTARTS
    assert die_starting() == (f"{MAX_WORKER_RESTARTS + 1} workers in a row died before they were ready, none ready "
                              "meanwhile (the last: signal SIGKILL, importing the --transform hook's module "
                              "users.hooks); check the log for what they died of")


def test_a_worker_server_that_does_not_start_again_stops_the_local_workers_saying_why() -> None:
    """``WorkerPool.add_worker`` gave up on a dead worker server: the reason the local workers end (the job
    stops, or a Ray cluster builds alone), not an internal error."""
    def add_worker(start_hangs: tuple[int, ...] = ()) -> None:
        raise DaemonError("cannot start a worker: the worker server died and did not start again within 10 s")

    pool: Any = SimpleNamespace(job=None, workers=[], add_worker=add_worker)
    h = WorkerHealth(pool, Stats(), 600.0, dict.fromkeys(TASKS), str, 1, 600.0)
    worker = dead(1, -1, exitcode=255)
    h.died(worker)
    assert h.replace(worker) == "cannot start a worker: the worker server died and did not start again within 10 s"


def test_a_ray_slice_without_progress_is_said_as_a_local_workers_stall(caplog: Any) -> None:
    """The bridge knew how long a slice had gone without progress, but the status said nothing of it until the
    slice was handed back at --task-timeout, and a trainer with a shorter timeout gave up first."""
    pool: Any = SimpleNamespace(job=None, stalled=lambda: [])
    h = WorkerHealth(pool, Stats(), 600.0, dict.fromkeys(TASKS), str, 1, 600.0)
    h.hung(SliceStall(TASKS[1], None, time.monotonic() - 59))  # under a quarter of 600 s, at most 60 s
    assert h.stall_note is None and h.stall is None
    stalled = SliceStall(TASKS[1], 11, time.monotonic() - 200)
    with caplog.at_level("WARNING", logger="prefetchd.daemon.worker_health"):
        for _look in range(2):
            assert h.hung(stalled) == []  # the bridge hands it back itself
    assert h.stall is not None and h.stall.reason == h.stall_note and h.stall.timeout == 600 and not h.stall.starting
    assert abs(h.stall.since - (time.time() - 200)) < 5, h.stall
    assert h.stall_note.startswith("a slice on the Ray cluster has made no progress for 200 s on task 1, 11 (file 2 of "
                                   "its task's 2); at 600 s (--task-timeout) it is cancelled"), h.stall_note
    assert caplog.text.count("a slice on the Ray cluster has made no progress") == 1, "said once in the log"
    h.hung(None)  # handed back: the bridge reports it no more
    assert h.stall_note is None and h.stall is None


def test_ray_workers_that_die_before_their_first_image_stop_the_job_unless_the_cluster_builds_meanwhile() -> None:
    """Such a death blames no file, and the bridge submits the slice again: where every Ray worker dies so (a
    hook's module that kills the process importing it), the slice went round for good."""
    pool: Any = SimpleNamespace(job=SimpleNamespace(augment=SimpleNamespace(transform="users.hooks:aug")), size=0)
    h = WorkerHealth(pool, Stats(), 600.0, dict.fromkeys(TASKS), str, 1, 600.0)
    for death in range(MAX_WORKER_RESTARTS):
        task = TASKS[1] if death % 2 else None  # a slice's, or a probe's
        assert h.ray_start_died(task, "cpu-2/77ab01c3", "WorkerCrashedError", "...", 0) is None
    # A slice the cluster built: its workers do start, and the count begins again (a big cluster's own churn).
    for _death in range(MAX_WORKER_RESTARTS):
        assert h.ray_start_died(TASKS[2], "", "WorkerCrashedError", "...", 1) is None
    why = h.ray_start_died(TASKS[2], "", "OutOfMemoryError", "...", 1)
    assert why is not None and why.startswith(f"the Ray cluster's workers die before their first image: "
                                              f"{MAX_WORKER_RESTARTS + 1} in a row"), why
    assert "(the last: Ray: OutOfMemoryError, before the first image of its slice of task 2)" in why, why
    assert "Ray worker logs" in why and "`python -c 'import users.hooks'`" in why, why


def test_ray_workers_that_die_slowly_before_their_first_image_still_stop_the_job(monkeypatch: Any) -> None:
    """The deaths were counted within 60 s, as local workers' are: where each Ray worker's start took 10 s or more
    (importing torch on busy nodes, a container's start), the count never passed 10 and the daemon warned of
    every death for good while the cluster built nothing.  Now they are counted in a row, since the last slice
    built."""
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    pool: Any = SimpleNamespace(job=SimpleNamespace(augment=SimpleNamespace(transform=None)), size=1)
    h = WorkerHealth(pool, Stats(), 600.0, dict.fromkeys(TASKS), str, 1, 600.0)
    for _death in range(MAX_WORKER_RESTARTS):
        clock[0] += 20.0
        assert h.ray_start_died(None, "cpu-2/77ab01c3", "WorkerCrashedError", "...", 0) is None
    clock[0] += 20.0
    why = h.ray_start_died(None, "cpu-2/77ab01c3", "WorkerCrashedError", "...", 0)
    assert why is not None and f"{MAX_WORKER_RESTARTS + 1} in a row, and the cluster built no slice in between" in why


def test_a_ray_slice_not_begun_is_said_as_a_starting_workers_stall_bounded_by_the_worker_start_timeout() -> None:
    """A slice at the cluster that has not begun (its Ray worker's start blocks) is said as a local worker that has
    not got ready is (``starting``, --worker-start-timeout), so that a trainer waits on until the bridge submits it
    again, rather than as one that made no progress for a quarter of --task-timeout."""
    pool: Any = SimpleNamespace(job=None, stalled=lambda: [])
    h = WorkerHealth(pool, Stats(), 4.0, dict.fromkeys(TASKS), str, 1, 600.0)
    h.hung(SliceStall(TASKS[1], None, time.monotonic() - 59, starting=True))  # under a quarter of 600 s
    assert h.stall is None, "not said at a quarter of --task-timeout (1 s here): a start takes longer"
    h.hung(SliceStall(TASKS[1], None, time.monotonic() - 61, starting=True))
    assert h.stall is not None and h.stall.starting and h.stall.timeout == 600 and h.stall.reason == h.stall_note
    assert h.stall_note.startswith("a slice on the Ray cluster has not begun in 61 s since it was submitted (slice "
                                   "1): it waits in Ray's queue, or its Ray worker is starting (importing prefetchd, "
                                   "torch or the --transform hook's module"), h.stall_note
    assert h.stall_note.endswith("at 600 s (--worker-start-timeout) it is cancelled, its Ray worker killed, and it is "
                                 "submitted again"), h.stall_note


def test_a_ray_slice_that_never_begins_stops_the_job_unless_the_cluster_builds_meanwhile() -> None:
    """A row per slice, as a local worker's start hangs are per place: one round of every slice cut at once (a
    cluster whose workers' start blocks, the slices queued behind them too) is no verdict; a slice built ends
    every row."""
    pool: Any = SimpleNamespace(job=SimpleNamespace(augment=SimpleNamespace(transform=None)), size=0)
    builds = {task_id: SimpleNamespace(cancelled=False, epoch=0, step=task_id, stream=SimpleNamespace(rank=0))
              for task_id in TASKS}
    h = WorkerHealth(pool, Stats(), 600.0, builds, str, 1, 600.0)
    for _round in range(MAX_TASK_HANGS - 1):
        assert h.ray_start_hung(TASKS[1], 600.0, 0) is None and h.ray_start_hung(TASKS[2], 600.0, 0) is None
    assert h.ray_start_hung(TASKS[2], 600.0, 1) is None, "the cluster built a slice: a new row"
    assert h.ray_start_hung(TASKS[1], 600.0, 1) is None
    builds[1].cancelled = True  # a rewind dropped its batch: its slice never stops the job
    for _round in range(MAX_TASK_HANGS):
        assert h.ray_start_hung(TASKS[1], 600.0, 1) is None
    for _round in range(MAX_TASK_HANGS - 2):  # the row of slice 2 begun at the built slice
        assert h.ray_start_hung(TASKS[2], 600.0, 1) is None
    why = h.ray_start_hung(TASKS[2], 600.0, 1)
    assert why is not None and why.startswith("batch e000000-s00000002.batch (epoch 0, step 2) cannot be built on the "
                                              f"Ray cluster: its slice 2 did not begin {MAX_TASK_HANGS} times in a "
                                              "row"), why
    hangs = 2 * (MAX_TASK_HANGS - 1) + 2 + MAX_TASK_HANGS + MAX_TASK_HANGS - 1
    assert h.stats.worker_hangs == hangs, "each a hang, as a local worker killed for its start is"
    assert "whether --data's mount on the nodes is readable and the Ray worker logs on the nodes" in why, why
    assert "python -c" not in why, "no hook to import"
