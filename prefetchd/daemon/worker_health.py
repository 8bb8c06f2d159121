"""Worker health: what the controller makes of a local worker that dies or hangs.

A worker that dies (its exit seen by ``pool.WorkerPool.wait``) is replaced, and its tasks go to
others; more than ``MAX_WORKER_RESTARTS`` ends within ``RESTART_WINDOW_SECONDS`` stop the job (beside a Ray
cluster, the local workers: the producer's ``_local_workers_end``), and so do more than ``MAX_WORKER_RESTARTS``
deaths in a row before the worker was ready, none ready meanwhile, at any pace (a hook's module that kills the
worker importing it, after seconds of torch's import on a slow machine, never died 11 times within 60 s).  Where
it died is in the ``whereabouts.Whereabouts`` it left: a file that kills whatever decodes it (a decoder's
segfault) kills the worker that retries the task too, on the same
file; at ``CRASHES_TO_BLAME`` such deaths the file is taken for an undecodable one (``crashed``: the
controller counts it as a bad sample, and the workers fail it unread, ``tasks.Task.crashed``), and
those deaths no longer count towards the restart limit, which is for workers that die for their own
reasons: the bad-sample limits (--strict, --max-bad-samples) are the ones for bad files.  A worker the
kernel's OOM killer killed (``_ended``), or that was killed from outside (SIGKILL, SIGTERM: by hand, say), blames
no file, whatever it was on: it counts towards the restart limit only, whose message then says so.  One that
hangs never dies: a worker that holds tasks and has begun no image for ``--task-timeout`` (a
read of a hung mount, a hook that never returns, a SIGSTOP; ``pool.WorkerPool.stalled``, from the
``whereabouts.Whereabouts`` it writes) is killed after a warning that names it, the batch and the file,
and replaced the same way; a task that hangs ``MAX_TASK_HANGS`` times stops the job (those kills are
no ends for the restart limit: a hung mount stalls every worker at once).  So is one that does not
get ready for its first task in ``--worker-start-timeout`` (a hook's module that blocks when imported, torch on
a hung mount: the step of its start is in its whereabouts too, and named); ``MAX_TASK_HANGS`` such workers in a
row in one place stop the job.

The controller (``producer.Producer``) keeps the job's verdict, and its ``builds.Builds`` the task queue::

    for dead in pool.wait(...):             for worker in health.hung(remote.stalled_slice()):
        bad = health.died(dead)                 why = health.kill(worker, on_result)  # or the job stops
        builds.requeue(dead.tasks)              builds.requeue(worker.tasks)
        builds.tell_queued(crashed_items)       why = health.replace(worker)
        count bad as a bad sample
        why = health.replace(dead)

A slice built on a Ray cluster (``--ray``) is judged the same way, from what the bridge hands back
(``Hung``, ``Died``: ``remote.messages``): one that made no progress there for ``--task-timeout`` had its Ray workers
killed (``hung_remotely``: a hang of its task, counted towards ``MAX_TASK_HANGS`` with its local
ones), and one built an item at a time whose Ray worker died says the sample it died on
(``died_remotely``: a death on that file, counted towards ``CRASHES_TO_BLAME`` with local ones).
Ray starts its workers again itself: neither counts towards the restart limit.  A slice at the cluster
that has made no progress for a quarter of --task-timeout (at most 60 s) is said as a local worker's stall
is (``hung``'s ``remote``, from the bridge's report: ``stall_note`` and ``stall``), so that a trainer waits
on until it is handed back.  A Ray worker's start is timed as a local worker's is: a slice that has not begun
--worker-start-timeout after it was submitted (its Ray worker importing a hook's module that blocks there, or
reading --data's probe samples on a hung mount; its wait in Ray's queue counts too) had its Ray worker killed
and was submitted again by the bridge (``ray_start_hung``: a start hang, said, and said as a starting worker's
stall a quarter of the way there); ``MAX_TASK_HANGS`` of one slice in a row, with no slice built on the cluster
in between, end the cluster's part (``_ray_end``).  A Ray worker that dies before its first image (in its
start: a hook's module that kills the process when imported, say) blames no file, and the bridge submits its
slice again; more than ``MAX_WORKER_RESTARTS`` such deaths in a row, with no slice built on the cluster in
between, end it too (``ray_start_died``), as the restart limit ends the local workers'.  In a row, not within
``RESTART_WINDOW_SECONDS`` as for local workers: a Ray worker's start (a container's, importing torch from a
network filesystem) may take longer than the window's share of each death, and such a cluster never reached the
limit: it was warned of forever while it built nothing.  The cluster's part ends so: a job with local workers
goes on with them alone (``RemotePool.give_up``), as it does while a cluster is lost; with --workers 0 the job
stops.

``WorkerHealth`` counts, names and judges; it reads the builds of the tasks not yet answered
(``Builds.by_task``) only to name a task's batch and to tell one still wanted.
"""

from __future__ import annotations

import logging
import signal
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prefetchd.buffer_protocol import WorkerStall, batch_name
from prefetchd.daemon.cgroup_limits import cgroup_oom_kills, out_of_memory_where
from prefetchd.daemon.errors import DaemonError
from prefetchd.daemon.pool import Worker, WorkerPool, gone_server
from prefetchd.daemon.production_stats import Stats
from prefetchd.daemon.stream import Build
from prefetchd.daemon.tasks import CRASHED_REASON, Filled, Task, WriteFailed
from prefetchd.daemon.whereabouts import START_HOOK, start_step
from prefetchd.oom import oom_kills
from prefetchd.words import counted, ended

log = logging.getLogger(__name__)

MAX_WORKER_RESTARTS = 10  # within RESTART_WINDOW_SECONDS, then the daemon gives up
RESTART_WINDOW_SECONDS = 60.0
# Workers that died on one sample of one task (a worker that dies and the one that runs its task again, from its
# first image), after which that sample's file is taken for one that kills its worker.  A segfault in a decoder is
# deterministic: the second death on it is the proof.  A death that is not the file's (one of another process's
# doing, say) falls on the same image of the same task again only by chance: a task's image takes milliseconds; a
# worker killed from outside is no death of its file at all (``KILLED_FROM_OUTSIDE``).  A third try
# would cost one more worker start per such file, and bring the restart limit closer for nothing.  Not a death by
# the OOM killer: memory that runs short as the buffer fills falls on the same image again, the task writing the
# same pages each time (in a 600 MiB cgroup, 29 healthy files were taken for bad ones within 15 s), and replacing
# a healthy file changes the batches.  Those count towards the restart limit only, which stops the job saying so;
# an image too big for the memory is --max-image-pixels' to refuse.
CRASHES_TO_BLAME = 2
# Signals a worker is killed with from outside, which no file it decodes can raise: a death by one of them counts on
# no file.  Killed by hand at a steady pace, restarted workers reached the same image after the same start: 2 of 6
# kills 2 s apart fell on one file, twice, and healthy files were replaced.  What a file can do to its worker is a
# fault signal (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL) or an exit (a C library's exit(1) on a bad file); the
# OOM killer's SIGKILL is the memory's (``_ended``), a hang's kill the controller's own (``kill``).
KILLED_FROM_OUTSIDE = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
# The exit code of a worker whose worker server died, which ends every worker's report at once: not its file's doing.
SERVER_GONE = 255
# A worker killed (SIGKILL; exit code 255: its worker server was, which ends every worker's report at once) this
# long after the count of OOM kills rose (its memory cgroup's, else the machine's) was killed by the OOM killer.
OOM_WINDOW_SECONDS = 2.0
# A task that hangs this many times (each time on a new worker, killed after --task-timeout) stops the job: what
# hangs again is the file or the hook, not the worker.  As many tries as the Ray bridge gives a slice (MAX_ATTEMPTS).
MAX_TASK_HANGS = 3
# A worker without progress this long (or a quarter of --task-timeout, if less) is said to, in the log and the
# status (its message and worker_stall), before it is killed: a trainer waiting meanwhile (120 s by default, less
# than --task-timeout) waits on until the kill while the status says so, its timeout counted from there after.
STALL_NOTE_SECONDS = 60.0
SHOWN_TASK_FILES = 4  # a task's files named in a hang's warning; the file the worker is on always is
# What a Ray worker does before it begins a slice (``task._here``), where its start may block.
RAY_START = ("importing prefetchd, torch or the --transform hook's module, or reading the job's probe samples of "
             "--data")


def ray_start_checks(hook: str | None, mount: bool = True) -> str:
    """What to look at where Ray workers die as they start, or (``mount``) where their start may not return,
    which a hung mount explains too: the import of ``hook``'s module (the job's --transform, if any) and --data's
    mount on the nodes, and their logs.  The daemon's warnings say it, and the bridge's of a node's probe."""
    checks = [f"whether `python -c 'import {hook.partition(':')[0]}'` returns on the nodes (in the daemon's "
              "environment)"] if hook is not None else []
    if mount:
        checks.append("whether --data's mount on the nodes is readable")
    checks.append("the Ray worker logs on the nodes (`ray logs`, or /tmp/ray/session_latest/logs/worker-*.err "
                  "on each)")
    return ", ".join(checks[:-1]) + (" and " if len(checks) > 1 else "") + checks[-1]


def stall_noted_after(limit: float) -> float:
    """Seconds without progress after which a stall is said (a local worker's, or a Ray slice's, which the
    bridge reports from then on), of one killed at ``limit`` seconds."""
    return min(STALL_NOTE_SECONDS, limit / 4)


def _killed_from_outside(exitcode: int | None) -> bool:
    """Whether a worker that ended with ``exitcode`` was killed by something other than the file it was on:
    a signal of ``KILLED_FROM_OUTSIDE``, or its worker server's death."""
    return exitcode == SERVER_GONE or (exitcode is not None and exitcode < 0 and -exitcode in KILLED_FROM_OUTSIDE)


@dataclass(frozen=True)
class SliceStall:
    """A slice at the Ray cluster that has made no progress for a while (``remote.messages.Stalled``): its task,
    the sample it is on where the bridge knows it, and when it last moved on (``time.monotonic()``); ``starting``:
    it has not begun yet, ``moved`` being when it was submitted (bounded by --worker-start-timeout)."""

    task: Task
    sample: int | None
    moved: float
    starting: bool = False


class WorkerHealth:
    """The deaths and hangs of ``pool``'s workers, counted in ``stats``.

    ``task_timeout``: seconds a worker may go without beginning an image (--task-timeout);
    ``builds``: the build of each task queued or at work, by task id (``Builds.by_task``; the tasks of a
    dropped build are not there); ``shown``: a sample as the log shows it (``BadSamples.shown``);
    ``ranks``: the streams the controller serves (with more than one, a batch is named with its rank).
    """

    def __init__(self, pool: WorkerPool, stats: Stats, task_timeout: float, builds: Mapping[int, Build],
                 shown: Callable[[int], str], ranks: int, start_timeout: float) -> None:
        self.pool = pool
        self.stats = stats
        self.task_timeout = task_timeout
        self.start_timeout = start_timeout
        self.builds = builds
        self.shown = shown
        self.ranks = ranks
        self.ends: deque[float] = deque()  # when workers died or were killed, within RESTART_WINDOW_SECONDS
        # Local workers that died before they were ready, in a row: none ready meanwhile (``replace``).
        self.start_deaths = 0
        self.oom_ends: deque[float] = deque()  # those of them the kernel's out-of-memory killer killed
        self.oom_files: set[str] = set()  # the files those workers were on (a file shown as ``_place`` shows it)
        # The count of OOM kills looked at: its memory cgroup's, which other cgroups' kills leave alone, else the
        # machine's; and what it was at the last look (``hung``, ``died``).
        self.oom_count = cgroup_oom_kills if cgroup_oom_kills() is not None else oom_kills
        self.oom_seen = self.oom_count()
        self.oom_at: float | None = None  # when a look last found it risen
        self.last_end = ""  # how the last worker that died ended (``ended``, and whose kill)
        # By (task id, sample), of tasks still wanted: when each worker died on that sample, and how it ended.
        self.deaths: dict[tuple[int, int], list[tuple[float, str]]] = {}
        self.crashed: dict[int, str] = {}  # the samples taken for ones that kill their worker, and why
        self.crashed_items: tuple[tuple[int, str], ...] = ()  # the same, for tasks (``Task.crashed``)
        self.hangs: dict[int, list[str]] = {}  # by task id, of tasks still wanted: the file of each hang
        self.stall_note: str | None = None  # a worker that makes no progress, said before it is killed
        self.stall: WorkerStall | None = None  # the same, for the status's worker_stall: the longest such stall
        self.slice_noted: tuple[int, float] | None = None  # (task id, moved) of the Ray slice's stall said last
        # How many Ray workers died before their first image since the cluster last built a slice; and how many
        # it had built then (``ray_start_died``).
        self.ray_start_deaths = 0
        self.ray_built = 0
        # By task id, of tasks still wanted: how many times in a row its slice did not begin on the cluster in
        # --worker-start-timeout since the cluster last built a slice (``ray_start_hung``).
        self.ray_start_hangs: dict[int, int] = {}

    # -- deaths ---------------------------------------------------------------

    def died(self, worker: Worker) -> tuple[int, str] | None:
        """Say that ``worker`` died (one killed for a hang was said when it was), and where; the sample it
        died on and why that sample's file is bad, when that file has now killed ``CRASHES_TO_BLAME``
        workers running the same task (it is in ``crashed`` from now on), else None."""
        now = time.monotonic()
        how, by_oom_killer = self._ended(worker, now)
        self.last_end = how
        task, sample = self._died_on(worker)
        then = f"requeuing its {counted(len(worker.tasks), 'task')} and starting another"
        who = f"worker pid {worker.process.pid}"
        on_a_file = task is not None and sample is not None
        if by_oom_killer or on_a_file and _killed_from_outside(worker.process.exitcode):  # CRASHES_TO_BLAME
            where = "" if task is None or sample is None else f" on {self._place(task, sample, with_files=False)}"
            if by_oom_killer and task is not None and sample is not None:
                self.oom_files.add(self.shown(sample))
            log.error("%s died (%s)%s; %s (not that file's fault)", who, how, where, then)
            self.ends.append(now)
            return None
        self.start_deaths = 0 if worker.where.ready_yet else self.start_deaths + 1
        if task is None or sample is None:  # between tasks or images: none is to blame
            before = "" if worker.where.ready_yet else f" before it was ready, {self._start_step(worker)}"
            log.error("%s died (%s)%s; %s", who, how, before, then)
            self.ends.append(now)
            return None
        return self._death(task, sample, who, how, then, now, restarts=True)

    def died_remotely(self, task: Task, sample: int, how: str) -> tuple[int, str] | None:
        """Say that a Ray worker died building ``task``'s item of ``sample`` (``how``: the Ray error's name),
        and judge that file as ``died`` does; Ray starts another worker itself."""
        return self._death(task, sample, "a Ray worker", f"Ray: {how}", "its task is queued again", time.monotonic(),
                           restarts=False)

    def _death(self, task: Task, sample: int, who: str, how: str, then: str, now: float,
               restarts: bool) -> tuple[int, str] | None:
        """A death of ``who`` on ``sample`` of ``task``: said, and counted on that file (``restarts``: towards
        the restart limit too, until the file is to blame); the file's verdict when it is."""
        place = self._place(task, sample, with_files=False)
        if sample in self.crashed:  # sent before the file was found out: its death is the file's too
            log.error("%s died (%s) on %s, a file that crashed workers before; %s", who, how, place, then)
            return None
        self.deaths = {key: ends for key, ends in self.deaths.items() if key[0] in self.builds}
        deaths = self.deaths.setdefault((task.task_id, sample), []) if task.task_id in self.builds else []
        deaths.append((now, how))
        if restarts:
            self.ends.append(now)
        if len(deaths) < CRASHES_TO_BLAME:
            log.error("%s died (%s) on %s; %s (death %d on that file: at %d it is replaced as undecodable)",
                      who, how, place, then, len(deaths), CRASHES_TO_BLAME)
            return None
        hows = list(dict.fromkeys(how for _, how in deaths))
        reason = f"{CRASHED_REASON} {counted(len(deaths), 'time')} ({', then '.join(hows)})"
        self.crashed[sample] = reason
        self.crashed_items = tuple(sorted(self.crashed.items()))
        for at, _ in deaths:  # the file's deaths, not the workers' own: the bad-sample limits judge them now
            if at in self.ends:
                self.ends.remove(at)
        log.error("%s died (%s) on %s, death %d on that file: it is replaced as undecodable; %s",
                  who, how, place, len(deaths), then)
        return sample, reason

    def _ended(self, worker: Worker, now: float) -> tuple[str, bool]:
        """How ``worker`` ended (``ended``), and whether the kernel's out-of-memory killer ended it: it was killed
        and the count of OOM kills (its memory cgroup's, else the machine's) rose within ``OOM_WINDOW_SECONDS``
        (as the looks found it: each second, ``hung``, and now).  The first such death is said as a warning with
        where memory ran short."""
        self._look_for_oom_kills(now)
        code = worker.process.exitcode
        how = ended(code)
        if code == SERVER_GONE and (server := gone_server(worker)) is not None:
            how = f"its worker server, pid {server}, ended"
        if code not in (-signal.SIGKILL, SERVER_GONE) or self.oom_at is None or now - self.oom_at > OOM_WINDOW_SECONDS:
            return how, False
        if not self.oom_ends:
            log.warning("the kernel's out-of-memory killer killed worker pid %d (%s): lower --workers or "
                        "--high-water, or give the daemon more memory; its task is built again, and more than "
                        "%d such deaths within %.0f s stop the job", worker.process.pid, out_of_memory_where(),
                        MAX_WORKER_RESTARTS, RESTART_WINDOW_SECONDS)
        self.oom_ends.append(now)
        return f"{how}, from the kernel's out-of-memory killer", True

    def _look_for_oom_kills(self, now: float) -> None:
        count = self.oom_count()
        if count is not None and self.oom_seen is not None and count > self.oom_seen:
            self.oom_at = now
        self.oom_seen = count

    @staticmethod
    def _died_on(worker: Worker) -> tuple[Task | None, int | None]:
        """The task ``worker`` died on, of those it held unfinished, and the sample (None: before its first);
        (None, None) where it died holding none it had begun."""
        where = worker.where
        task = worker.tasks.get(where.task) if where.moves >= 0 else None
        if task is None:
            return None, None
        return task, where.sample if where.sample >= 0 else None

    def replace(self, worker: Worker) -> str | None:
        """Start a worker in place of ``worker``, which died or was killed; or, when too many ended lately,
        why the job must stop.  Its tasks are the controller's to queue again."""
        self.stats.worker_restarts += 1
        now = time.monotonic()
        _forget_before(self.ends, now)
        _forget_before(self.oom_ends, now)
        if not self.oom_ends:
            self.oom_files.clear()
        last = self.last_end or ended(worker.process.exitcode)
        if any(w.where.ready_yet for w in self.pool.workers):
            self.start_deaths = 0  # one got ready: the others' starts fail for reasons of their own
        if self.start_deaths > MAX_WORKER_RESTARTS:
            return (f"{self.start_deaths} workers in a row died before they were ready, none ready meanwhile (the "
                    f"last: {last}, {self._start_step(worker)}); check the log for what they died of")
        if len(self.ends) > MAX_WORKER_RESTARTS:
            if self.oom_ends:
                one = (f"; every one of them died on {next(iter(self.oom_files))}: an image too big for this memory? "
                       "--max-image-pixels refuses such images" if len(self.oom_files) == 1 else "")
                return (f"{len(self.ends)} workers died within {RESTART_WINDOW_SECONDS:.0f} s, "
                        f"{len(self.oom_ends)} of them killed by the kernel's out-of-memory killer "
                        f"({out_of_memory_where()}): lower --workers or --high-water, or give the daemon more "
                        f"memory{one}")
            return (f"{len(self.ends)} workers died within {RESTART_WINDOW_SECONDS:.0f} s (the last: {last}); check "
                    "the log and `dmesg` for the cause (out of memory?)")
        # One that never got ready hands its place's row of hung starts on (``kill``; a death keeps the row as it
        # was, a ready worker ends it).
        try:
            self.pool.add_worker(worker.start_hangs if not worker.where.ready_yet else ())
        except DaemonError as exc:  # the worker server does not start again: no local worker can
            return str(exc)
        return None

    # -- hangs ----------------------------------------------------------------

    def hung(self, remote: SliceStall | None = None) -> list[Worker]:
        """The workers that have made no progress (begun no image, finished no task) for --task-timeout, or not
        got ready in --worker-start-timeout since they started, to be killed (``kill``).  One that has made none
        for a while, not that long yet, is said to, once in the log and in ``stall_note`` while it lasts; so is
        ``remote``, the slice at the Ray cluster that has made none the longest (the bridge hands it back at
        --task-timeout: ``hung_remotely``; one not begun it submits again at --worker-start-timeout:
        ``ray_start_hung``).  ``stall_note`` and ``stall`` say the longest of them."""
        self._look_for_oom_kills(time.monotonic())  # so that a rise is one of the last second when a worker dies
        notes = []
        stalls: list[tuple[float, float, bool, int]] = []  # (still, limit, starting, note) of those said
        hung = []
        if remote is not None:
            still = time.monotonic() - remote.moved
            bound = self.start_timeout if remote.starting else self.task_timeout
            if still >= stall_noted_after(bound):  # said until the bridge hands it back, or submits it again
                notes.append(self._slice_note(remote, still))
                stalls.append((still, bound, remote.starting, 0))
                if self.slice_noted != (remote.task.task_id, remote.moved):
                    self.slice_noted = (remote.task.task_id, remote.moved)
                    log.warning("%s", notes[-1])
        for worker in self.pool.stalled():
            ready = worker.where.ready_yet
            limit = self.task_timeout if ready else self.start_timeout
            if worker.still < stall_noted_after(limit):
                continue
            if worker.still >= limit:
                hung.append(worker)
                continue
            if not ready:
                notes.append(f"worker pid {worker.process.pid} has not got ready in {worker.still:.0f} s since it "
                             f"started: it is {self._start_step(worker)}; at {limit:g} s (--worker-start-timeout) it "
                             "is killed and another started")
            else:
                task, sample = self._stuck_on(worker)
                # The bound before the task's files: a trainer's message quotes the start of it.
                notes.append(f"worker pid {worker.process.pid} has made no progress for {worker.still:.0f} s on "
                             f"{self._place(task, sample, with_files=False)}; at {limit:g} s (--task-timeout) it is "
                             f"killed and its task retried; the task's files: {self._files(task)}")
            stalls.append((worker.still, limit, not ready, len(notes) - 1))
            if not worker.noted:
                worker.noted = True
                log.warning("%s", notes[-1])
        longest = max(stalls, default=None)
        self.stall_note = notes[longest[3]] if longest is not None else None
        self.stall = (WorkerStall(since=time.time() - longest[0], timeout=longest[1], starting=longest[2],
                                  reason=notes[longest[3]]) if longest is not None else None)
        return hung

    def _slice_note(self, remote: SliceStall, still: float) -> str:
        """A Ray slice's stall, said as a local worker's is (the bound before the task's files)."""
        task, sample = remote.task, remote.sample
        if remote.starting:
            return (f"a slice on the Ray cluster has not begun in {still:.0f} s since it was submitted "
                    f"({self._slice_of(task)}): it waits in Ray's queue, or its Ray worker is starting ({RAY_START}); "
                    f"at {self.start_timeout:g} s (--worker-start-timeout) it is cancelled, its Ray worker killed, "
                    "and it is submitted again")
        place = self._place(task, sample, with_files=False) if sample is not None else self._somewhere_in(task)
        return (f"a slice on the Ray cluster has made no progress for {still:.0f} s on {place}; at "
                f"{self.task_timeout:g} s (--task-timeout) it is cancelled, its Ray worker killed, and its task "
                f"retried; the task's files: {self._files(task)}")

    def kill(self, worker: Worker, on_result: Callable[[Task, Filled | WriteFailed], None]) -> str | None:
        """Kill ``worker``, one of ``hung``'s, handing what it sent before to ``on_result``, and say so;
        why the job must stop when the task it was on hung ``MAX_TASK_HANGS`` times, else None: then its
        tasks (``worker.tasks``) are the controller's to queue again, and ``replace(worker)``.  One that never got
        ready: ``MAX_TASK_HANGS`` in a row in its place stop the job (``_kill_unready``)."""
        if not worker.where.ready_yet:
            return self._kill_unready(worker, on_result)
        task, sample = self._stuck_on(worker)
        hangs = self._hang(task, self.shown(sample) if sample is not None else "before its first file")
        self.pool.kill(worker, on_result)
        # Not one of the restart limit's ends: a hung mount stalls every worker at once, and 11 killed together
        # stopped the job as "11 workers died within 60 s (out of memory?)"; the hangs' own bound is per task.
        # Held still after the kill (not finished as it came) and of a build still wanted: hung for good?
        final = self._final(task, len(hangs)) and task.task_id in worker.tasks
        then = (f"that task hung {counted(len(hangs), 'time')}: the job stops" if final else
                f"its {'task goes' if len(worker.tasks) == 1 else f'{len(worker.tasks)} tasks go'} to a new worker "
                f"(hang {len(hangs)} of {MAX_TASK_HANGS} for that task)")
        log.warning("worker pid %d made no progress for %.0f s (--task-timeout %g) on %s: killed it; %s",
                    worker.process.pid, worker.still, self.task_timeout, self._place(task, sample), then)
        return self._hung_for_good(task, hangs) if final else None

    def hung_remotely(self, task: Task, sample: int | None, seconds: float) -> str | None:
        """Say that ``task`` made no progress on the Ray cluster for ``seconds`` (--task-timeout), its Ray
        workers killed; ``sample``: the one it was on, where the bridge knows (it built the task an item at
        a time).  Why the job must stop when that task hung ``MAX_TASK_HANGS`` times (here and on local
        workers), else None: then it is the controller's to queue again."""
        files = len(task.items)
        hangs = self._hang(task, self.shown(sample) if sample is not None else f"one of its task's {files} files")
        final = self._final(task, len(hangs))
        then = (f"that task hung {counted(len(hangs), 'time')}: the job stops" if final else
                f"its task is queued again (hang {len(hangs)} of {MAX_TASK_HANGS} for that task)")
        place = self._place(task, sample) if sample is not None else f"{self._somewhere_in(task)}: {self._files(task)}"
        log.warning("a Ray worker made no progress for %.0f s (--task-timeout %g) on %s: cancelled its slice, killing "
                    "the worker; %s", seconds, self.task_timeout, place, then)
        return self._hung_for_good(task, hangs) if final else None

    def ray_start_died(self, task: Task | None, node: str, how: str, text: str, built: int) -> str | None:
        """Say that a Ray worker died before its first image (``remote.messages.StartDied``): before ``task``'s
        slice began (or its first sample), or running the probe of ``node`` (``task`` None); ``how``: the Ray
        error's name, ``text`` its message; ``built``: the slices the cluster has built so far.  Why the cluster
        cannot build (``_ray_end``) when more than ``MAX_WORKER_RESTARTS`` died so in a row, the cluster building
        no slice in between, else None: the bridge submits
        the slice again (a probe runs again), as ever.  A slice built shows that its workers do start: the count
        begins again from there, so a large cluster's own churn (OOM kills, a node's workers lost) never adds up to
        a stop."""
        self._ray_built(built)
        self.ray_start_deaths += 1
        deaths = self.ray_start_deaths
        where = (f"running the probe of node {node}" if task is None else
                 f"before the first image of its slice of {self._batch_of(task)}")
        if deaths <= MAX_WORKER_RESTARTS:
            log.warning("a Ray worker died (Ray: %s: %s) %s; Ray starts another and the %s again (Ray workers dead "
                        "before their first image: %d in a row, no slice built on the cluster in between; more than %d: "
                        "%s)", how, text, where, "node is probed" if task is None else "slice is submitted",
                        deaths, MAX_WORKER_RESTARTS, self._ray_end())
            return None
        return (f"the Ray cluster's workers die before their first image: {deaths} in a row, and the cluster "
                f"built no slice in between (the last: Ray: {how}, {where}). "
                "Such a worker dies as it starts: importing prefetchd, torch or the --transform hook's module, or "
                f"loading the job (out of memory?), before any file is read. Look at {self._ray_checks(mount=False)}; "
                "fix that and start the daemon again (it resumes)")

    def ray_start_hung(self, task: Task, seconds: float, built: int) -> str | None:
        """Say that ``task``'s slice did not begin on the Ray cluster in ``seconds`` since it was submitted
        (--worker-start-timeout; ``remote.messages.StartHung``): the bridge cancelled it, killing its Ray worker,
        and submitted it again.  ``built``: the slices the cluster has built so far.  Why the cluster cannot build
        (``_ray_end``) when that slice did not begin ``MAX_TASK_HANGS`` times in a row, with no slice built on the
        cluster in between, else None.  A hang, as a local worker killed for its start is (``_kill_unready``), and no
        restart: Ray starts another worker itself.  Counted per slice, as a local worker's start hangs are per
        place: every slice of a cluster whose workers' start blocks goes at once (those queued behind them
        too), and one round of them is no more a verdict than one round of local workers is.  A slice built
        shows that the cluster's workers do start: the rows begin again from there, as ``ray_start_died``'s
        count does."""
        self._ray_built(built)
        self.stats.worker_hangs += 1
        self.ray_start_hangs = {t: n for t, n in self.ray_start_hangs.items() if t in self.builds}
        hangs = self.ray_start_hangs.get(task.task_id, 0) + 1
        if task.task_id in self.builds:  # a task still wanted: its row is kept until it is done or dropped
            self.ray_start_hangs[task.task_id] = hangs
        final = self._final(task, hangs)
        then = (f"it did not begin {counted(hangs, 'time')} in a row, with no slice built on the cluster since: "
                f"{self._ray_end()}" if final else
                f"submitted it again (start hang {hangs} of {MAX_TASK_HANGS} in a row for that slice, with no slice "
                "built on the cluster in between)")
        log.warning("a slice on the Ray cluster (%s) did not begin in %.0f s (--worker-start-timeout %g): cancelled "
                    "it, killing its Ray worker; %s. It waited in Ray's queue, or its Ray worker's start did not "
                    "return (%s): look at %s", self._slice_of(task), seconds, self.start_timeout, then, RAY_START,
                    self._ray_checks())
        if not final:
            return None
        return (f"{self._batch_of(task)} cannot be built on the Ray cluster: its slice {task.task_id} did not begin "
                f"{counted(hangs, 'time')} in a row, each cancelled (its Ray worker killed) {self.start_timeout:g} s "
                "after it was submitted (--worker-start-timeout), and the cluster built no slice since. A Ray worker "
                f"begins a slice once it has started ({RAY_START}); something there never returns. Look at "
                f"{self._ray_checks()}; fix that and start the daemon again (it resumes), or raise "
                "--worker-start-timeout if a Ray worker's start, with its wait in Ray's queue, can take that long")

    def _ray_checks(self, mount: bool = True) -> str:
        """``ray_start_checks`` for this job's --transform hook."""
        return ray_start_checks(self.pool.job.augment.transform, mount)

    def _ray_end(self) -> str:
        """What Ray workers that cannot start end in (``ray_start_died``, ``ray_start_hung``): the job stops where
        nothing else builds (--workers 0), else the local workers build alone (``RemotePool.give_up``)."""
        return "the cluster is given up for this job" if self.pool.size else "the job stops"

    def _ray_built(self, built: int) -> None:
        """The cluster has built ``built`` slices so far: where that is more than before, its workers do start,
        and the counts of Ray workers that did not (``ray_start_died``, ``ray_start_hung``) begin again."""
        if built != self.ray_built:
            self.ray_built = built
            self.ray_start_deaths = 0
            self.ray_start_hangs.clear()

    def _hang(self, task: Task, where: str) -> list[str]:
        """Count a hang of ``task`` on ``where`` (a file as the log shows it); the task's hangs so far."""
        self.stats.worker_hangs += 1
        hangs: list[str] = []
        if task.task_id in self.builds:  # a task still wanted: its hangs are kept until it is done or dropped
            self.hangs = {task_id: files for task_id, files in self.hangs.items() if task_id in self.builds}
            hangs = self.hangs.setdefault(task.task_id, [])
        hangs.append(where)
        return hangs

    def _final(self, task: Task, hangs: int) -> bool:
        """Whether ``task``, of a build still wanted, has hung for good, having hung ``hangs`` times."""
        build = self.builds.get(task.task_id)
        return hangs >= MAX_TASK_HANGS and build is not None and not build.cancelled

    def _kill_unready(self, worker: Worker, on_result: Callable[[Task, Filled | WriteFailed], None]) -> str | None:
        """``kill`` of a worker that did not get ready in --worker-start-timeout: its tasks were never begun, so no task
        hangs; its place's row of such starts (``Worker.start_hangs``) grows, and at ``MAX_TASK_HANGS`` the job
        stops.  Not a death for the restart limit either: every worker of a job whose hook never imports is
        killed at once, and "N workers died within 60 s (out of memory?)" would say nothing of why."""
        step = worker.where.step
        self.stats.worker_hangs += 1
        self.pool.kill(worker, on_result)
        worker.start_hangs += (step,)
        final = len(worker.start_hangs) >= MAX_TASK_HANGS
        held = (f"; its {counted(len(worker.tasks), 'task')} go{'es' if len(worker.tasks) == 1 else ''} to others"
                if worker.tasks else "")
        then = (f"{len(worker.start_hangs)} workers in a row in its place did not get ready: the job stops" if final
                else f"another starts in its place (hang {len(worker.start_hangs)} of {MAX_TASK_HANGS} in a row "
                     f"there){held}")
        log.warning("worker pid %d did not get ready in %.0f s (--worker-start-timeout %g): it was %s; killed it; %s",
                    worker.process.pid, worker.still, self.start_timeout, start_step(self.pool.job, step), then)
        return self._start_hung_for_good(worker.start_hangs) if final else None

    def _start_hung_for_good(self, steps: tuple[int, ...]) -> str:
        """Why the job stops: ``MAX_TASK_HANGS`` workers in a row in one place did not get ready, on ``steps``."""
        said = [start_step(self.pool.job, step) for step in steps]
        where = (f"each {said[0]}" if len(set(said)) == 1 else f"{', then '.join(said)}")
        hook = self.pool.job.augment.transform
        what = (f"the --transform hook's module when it is imported (does `python -c 'import "
                f"{hook.partition(':')[0]}'` return?)" if hook is not None and START_HOOK in steps else
                "a read of a hung mount or storage (of the dataset, or of the Python packages imported)")
        return (f"no worker gets ready: {counted(len(steps), 'worker')} in a row, each killed after "
                f"{self.start_timeout:g} s without getting ready (--worker-start-timeout), were {where}. Something "
                f"never returns there: {what}; fix that and start the daemon again (it resumes), or raise "
                "--worker-start-timeout if a worker's start can take that long")

    def _start_step(self, worker: Worker) -> str:
        return start_step(self.pool.job, worker.where.step)

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

    def _slice_of(self, task: Task) -> str:
        """A slice at the Ray cluster, for the log and the status: its task id (the bridge's notes name it so) and
        its batch."""
        known = self.builds.get(task.task_id) is not None
        return f"slice {task.task_id} of {self._batch_of(task)}" if known else f"slice {task.task_id}"

    def _files(self, task: Task) -> str:
        """``task``'s files, the first ``SHOWN_TASK_FILES`` named."""
        files = [self.shown(index) for _slot, index in task.items]
        return ", ".join(files[:SHOWN_TASK_FILES]) + (f" and {len(files) - SHOWN_TASK_FILES} more"
                                                       if len(files) > SHOWN_TASK_FILES else "")

    def _somewhere_in(self, task: Task) -> str:
        """Where a Ray slice built whole makes no progress: on one of its task's files, the bridge knows not which."""
        return f"{self._batch_of(task)}, one of its task's {counted(len(task.items), 'file')}"

    def _place(self, task: Task, sample: int | None, with_files: bool = True) -> str:
        """Where a worker makes no progress (or died), for the log and the status: the batch, the file, and
        ``with_files`` the task's files."""
        samples = [index for _slot, index in task.items]
        if sample is None:
            on = f"before the first of its task's {counted(len(samples), 'file')}"
        elif sample in samples:
            on = f"{self.shown(sample)} (file {samples.index(sample) + 1} of its task's {len(samples)})"
        else:  # a replacement for a file of the task that could not be decoded
            on = f"{self.shown(sample)} (a replacement for a file of its task that could not be decoded)"
        return f"{self._batch_of(task)}, {on}" + (f"; the task's files: {self._files(task)}" if with_files else "")

    def _hung_for_good(self, task: Task, hangs: list[str]) -> str:
        """Why the job stops: ``task`` hung MAX_TASK_HANGS times, on ``hangs``."""
        where = (f"each time on {hangs[0]}" if len(set(hangs)) == 1 else f"on {', then '.join(hangs)}")
        return (f"{self._batch_of(task)} cannot be built: its task hung {counted(len(hangs), 'time')}, each worker "
                f"killed after {self.task_timeout:g} s without progress (--task-timeout), {where}. "
                "Something never returns there: a read of a hung mount or storage (is it readable, "
                "`cat` it?), or the --transform hook; fix that and start the daemon again (it resumes), or raise "
                "--task-timeout if an image can take that long")


def _forget_before(window: deque[float], now: float) -> None:
    """Drop the times of ``window`` (oldest first) older than ``RESTART_WINDOW_SECONDS`` before ``now``."""
    while window and now - window[0] > RESTART_WINDOW_SECONDS:
        window.popleft()


__all__ = ["CRASHES_TO_BLAME", "MAX_TASK_HANGS", "MAX_WORKER_RESTARTS", "RESTART_WINDOW_SECONDS", "SliceStall",
           "WorkerHealth", "stall_noted_after"]
