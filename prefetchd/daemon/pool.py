"""The worker pool: processes forked from a preloaded forkserver, the tasks each
holds, and a replacement for each one that dies or hangs.

The controller owns the queue of tasks and decides what a result means, and
``worker_health`` what a death or a hang does; the pool only moves tasks to
workers and results back, each worker holding at most ``TASKS_PER_WORKER`` so it
never waits for the controller.  It also watches where each worker is
(``whereabouts.Whereabouts``), so that the controller can tell one that has not
moved for long (``stalled``) and kill it.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.heap
import multiprocessing.util
import os
import resource
import selectors
import shutil
import signal
import stat
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import psutil

from prefetchd.daemon import jpeg_crop
from prefetchd.daemon.errors import ConfigError, DaemonError, processes_taken
from prefetchd.daemon.logs import run_logged
from prefetchd.daemon.wakeup import Wakeup
from prefetchd.daemon.tasks import Filled, Task, WorkerJob, WriteFailed
from prefetchd.daemon.whereabouts import Whereabouts
from prefetchd.daemon.workers import forkserver_preload, worker_main
from prefetchd.words import counted

log = logging.getLogger(__name__)

WORKER_STOP_SECONDS = 5.0
TASKS_PER_WORKER = 2  # queued per worker so it never waits for the controller
# Of the time between two looks at the workers (``stalled``), at most this much counts as time a worker made no
# progress: a controller that was itself stopped (SIGSTOP, a debugger, swapped out) for a minute while its workers
# went on must not find them all a minute older and kill them.  Looks come about once a second.
MAX_LOOK_GAP_SECONDS = 5.0
SERVER_END_SECONDS = 0.5  # for a worker server whose workers' reports ended at once to show it ended (gone_server)
SERVER_RESTART_SECONDS = 10.0  # for a dead worker server to be reaped, so that a worker start starts another
KILL_WAIT_SECONDS = 1.0  # for a killed worker to exit (one in a read of a hung NFS mount goes when the read ends)
T = TypeVar("T")
# The controller's open files: its own (the buffer's folder and lock, inotify, epoll, the log, the worker server's
# pipes: 23 in all with one worker, 27 with two and a metrics server) and 3 per worker (its task socket, its exit
# sentinel, the pipe of its start): 116 at 32 workers.  The rest of the first figure is room for a metrics scrape,
# an index file, Ray's bridge.
FILES_BESIDE_WORKERS = 32
FILES_PER_WORKER = 3


@dataclass
class Worker:
    process: Any  # multiprocessing.Process
    conn: Connection
    ps: psutil.Process
    server: psutil.Process | None  # the worker server that forked it (None: gone before it was asked)
    where: Whereabouts
    tasks: dict[int, Task] = field(default_factory=dict)
    seen: int = -2  # its moves at the last look (``stalled``); -2: not looked at yet
    still: float = 0.0  # seconds it has held tasks without a move (or not got ready), as the looks counted them
    noted: bool = False  # the controller said it makes no progress (once per stall)
    # The step of its start (``whereabouts.START_STEPS``) each worker before it in its place was killed on for not
    # getting ready in --worker-start-timeout, those in a row up to it (and it too, once killed so: ``worker_health``).
    start_hangs: tuple[int, ...] = ()


class WorkerPool:
    def __init__(self, job: WorkerJob, size: int) -> None:
        self.job = job
        self.size = size
        self.workers: list[Worker] = []
        self._looked = 0.0  # when ``stalled`` last looked (monotonic); 0: never
        self._ctx = worker_context()
        # Each worker's pipe and exit sentinel, registered once: at 16 workers and 1000 tasks a
        # second, building a fresh selector of 33 descriptors for every wait (what
        # multiprocessing.connection.wait does) was a sizeable share of the controller's CPU.
        self._selector = selectors.DefaultSelector()
        self._wake: Wakeup | None = None  # registered by the first wait and left so (it is the same every time)
        # What the workers learn about the files they decode, shared between them (jpeg_crop.CleanFiles).
        self._clean = jpeg_crop.CleanFiles(len(job.index)) if jpeg_crop.available() and size > 0 else None

    def start(self, heartbeat: Callable[[], None], every: float) -> None:
        """Start the workers while ``heartbeat`` goes on, every ``every`` seconds.

        The first start waits until the fork server has imported torch, which takes
        seconds on a busy machine; a status.json that stood still that long would
        make trainers (and `prefetchd status`) take a starting daemon for a stuck one.
        """
        self.workers.extend(with_heartbeat(lambda: [self._spawn() for _ in range(self.size)], heartbeat, every))

    def _spawn(self, start_hangs: tuple[int, ...] = ()) -> Worker:
        """Start a worker from the worker server.  One that has just died (killed; the OOM killer takes it once no
        worker is left) and is not reaped yet, multiprocessing takes for alive: the start then fails on its
        closed socket (EOFError: an internal error that stopped the job, seen under a full test suite's load).
        Once reaped, a start starts a new server: tried again until then, each time with new pipes (a child the
        dying server may have forked on the old ones sees them closed, and exits)."""
        deadline = time.monotonic() + SERVER_RESTART_SECONDS
        while True:
            try:
                return self._spawn_once(start_hangs)
            except (EOFError, ConnectionError) as exc:
                if time.monotonic() >= deadline:
                    # Most often the fork server's own fork refused (EAGAIN): its traceback is in the log above.
                    raise DaemonError(f"cannot start a worker: the worker server died and did not start again "
                                      f"within {SERVER_RESTART_SECONDS:g} s ({type(exc).__name__}: {exc}); most likely "
                                      f"{processes_taken()}") from exc
                time.sleep(0.05)

    def _spawn_once(self, start_hangs: tuple[int, ...]) -> Worker:
        parent, child = self._ctx.Pipe()
        level = logging.getLogger().getEffectiveLevel()
        where = self._ctx.RawArray("q", Whereabouts.INITIAL)
        proc = self._ctx.Process(target=run_logged, args=(level, worker_main, child, self.job, self._clean, where),
                                 name="prefetchd-worker", daemon=True)
        try:
            proc.start()
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        ps = psutil.Process(proc.pid)
        worker = Worker(proc, parent, ps, _parent(ps), Whereabouts(where), start_hangs=start_hangs)
        self._selector.register(parent, selectors.EVENT_READ, (worker, False))
        self._selector.register(proc.sentinel, selectors.EVENT_READ, (worker, True))
        return worker

    def _forget(self, worker: Worker) -> None:
        self.workers.remove(worker)
        self._selector.unregister(worker.conn)
        self._selector.unregister(worker.process.sentinel)
        worker.conn.close()

    def dispatch(self, todo: deque[Task]) -> None:
        """Hand tasks from the front of ``todo`` to the least busy workers."""
        for worker in sorted(self.workers, key=lambda w: len(w.tasks)):
            while todo and len(worker.tasks) < TASKS_PER_WORKER:
                task = todo.popleft()
                worker.tasks[task.task_id] = task
                try:
                    worker.conn.send(task)
                except OSError:  # died meanwhile; its sentinel requeues the task
                    break

    def wait(self, timeout: float, wake: Wakeup, on_result: Callable[[Task, Filled | WriteFailed], None],
             also: Sequence[Any] = ()) -> list[Worker]:
        """Wait up to ``timeout`` for results (each handed to ``on_result``), a worker's death, ``wake``
        or any of ``also`` (the remote pool's pipe and process, which its owner then reads).

        Returns the workers that died, removed from the pool after the results they
        sent before dying were handed on; their unfinished tasks are in ``tasks``.
        """
        if wake is not self._wake:
            if self._wake is not None:
                self._selector.unregister(self._wake)
            self._selector.register(wake, selectors.EVENT_READ, None)  # the caller reads it; here it ends the wait
            self._wake = wake
        for extra in also:  # the remote pool's: registered for this wait only, since its pipe may be replaced
            self._selector.register(extra, selectors.EVENT_READ, None)
        try:
            ready = [key.data for key, _ in self._selector.select(timeout) if key.data is not None]
        finally:
            for extra in also:
                self._selector.unregister(extra)
        for worker, exited in ready:
            if not exited:
                self._receive_one(worker, on_result)
        dead = []
        for worker, exited in ready:
            if exited and worker in self.workers:
                while worker.conn.poll():  # results it sent before dying still count
                    if not self._receive_one(worker, on_result):
                        break
                self._forget(worker)
                dead.append(worker)
        return dead

    @staticmethod
    def _receive_one(worker: Worker, on_result: Callable[[Task, Filled | WriteFailed], None]) -> bool:
        """One result from ``worker``, whose pipe is readable; False when it died instead.  One per
        wait: the selector reports a pipe with more in it again at once, and no ``poll()`` (a
        selector built, used and closed) is spent on finding that out."""
        try:
            result = worker.conn.recv()
        except (EOFError, OSError):
            return False  # it died; its sentinel handles the rest
        task = worker.tasks.pop(result.task_id, None)
        if task is not None:
            on_result(task, result)
        return True

    def stalled(self) -> list[Worker]:
        """Look where each worker is; return those that hold tasks and have not moved since the last look, and
        those not ready yet (still starting: importing what its job needs), their ``still`` grown by the time
        since then (at most ``MAX_LOOK_GAP_SECONDS``): a start is timed from the first look at the worker.  A
        worker that is idle or moved (became ready: a move) starts again from 0."""
        now = time.monotonic()
        gap = min(now - self._looked, MAX_LOOK_GAP_SECONDS) if self._looked else 0.0
        self._looked = now
        stalled = []
        for worker in self.workers:
            moves = worker.where.moves
            if moves != worker.seen or (moves >= 0 and not worker.tasks):
                worker.seen, worker.still, worker.noted = moves, 0.0, False
            else:
                worker.still += gap
                stalled.append(worker)
        return stalled

    def kill(self, worker: Worker, on_result: Callable[[Task, Filled | WriteFailed], None]) -> None:
        """SIGKILL ``worker`` (one that hangs) and remove it from the pool once the results it sent before
        are handed to ``on_result``; its unfinished tasks are left in ``worker.tasks``."""
        worker.process.kill()
        worker.process.join(KILL_WAIT_SECONDS)
        while worker.conn.poll():  # a task it finished just before still counts
            if not self._receive_one(worker, on_result):
                break
        self._forget(worker)

    def add_worker(self, start_hangs: tuple[int, ...] = ()) -> None:
        """Start one more worker: in place of one that died or was killed (``worker_health``), after
        ``start_hangs`` (``Worker.start_hangs``)."""
        self.workers.append(self._spawn(start_hangs))

    def stop(self) -> None:
        """Ask every worker to finish its tasks and exit; kill those still there after WORKER_STOP_SECONDS."""
        _continue_children()
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
        for worker in list(self.workers):
            self._forget(worker)
        if self._wake is not None:  # the daemon's, which outlives this job's pool
            self._selector.unregister(self._wake)
            self._wake = None
        self._selector.close()  # its epoll descriptor: one more open for every job the daemon served
        if self._clean is not None:
            self._clean.close()
            self._clean = None


def make_room_for_files(workers: int) -> None:
    """Raise this process's soft limit on open files (RLIMIT_NOFILE) to what ``workers`` workers need, as far as
    the hard limit allows; the workers started after this inherit it.  The usual soft limit of 1024 ran out near
    330 workers, which ``--workers`` defaults to on a box of that many CPUs: the start failed with "Too many open
    files", an internal error.  ConfigError when the hard limit is too low as well."""
    need = FILES_BESIDE_WORKERS + FILES_PER_WORKER * workers
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        fit = (hard - FILES_BESIDE_WORKERS) // FILES_PER_WORKER
        raise ConfigError(f"{counted(workers, 'worker')} need{'s' if workers == 1 else ''} about {need} open files in the "
                          f"daemon, but its limit is {hard} "
                          f"(`ulimit -Hn`): raise it (LimitNOFILE={need} in a systemd unit; `ulimit -n {need}` as "
                          "root in a shell)" + (f", or pass --workers {fit} or fewer" if fit > 0 else
                                                f"; fewer workers do not help: one needs {FILES_BESIDE_WORKERS + FILES_PER_WORKER}"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    log.info("raised the open-file limit from %d to %d for %d workers", soft, need, workers)


def with_heartbeat(work: Callable[[], T], heartbeat: Callable[[], None], every: float) -> T:
    """``work()`` on a thread while ``heartbeat()`` runs every ``every`` seconds here; its result, or its
    exception re-raised here.  For what waits on the fork server, which may import torch for seconds."""
    done: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            done.append(work())
        except BaseException as exc:  # re-raised below, in the controller's thread
            failed.append(exc)

    thread = threading.Thread(target=run, name="prefetchd-spawn", daemon=True)
    thread.start()
    while thread.is_alive():
        heartbeat()
        thread.join(every)
    if failed:
        raise failed[0]
    return done[0]


def _parent(ps: psutil.Process) -> psutil.Process | None:
    try:
        return ps.parent()
    except psutil.Error:  # the worker, or its server, gone already
        return None


def gone_server(worker: Worker, wait: float = SERVER_END_SECONDS) -> int | None:
    """The pid of the worker server that forked ``worker`` if that server has ended, else None.  It counts as
    ended once it is a zombie (until the next worker start reaps it) or gone; its workers' reports end as its
    files close, a moment before that, so it is looked at for up to ``wait`` seconds."""
    server = worker.server
    if server is None:
        return None
    deadline = time.monotonic() + wait
    while True:
        try:
            if not server.is_running() or server.status() == psutil.STATUS_ZOMBIE:
                return int(server.pid)
        except psutil.NoSuchProcess:
            return int(server.pid)
        except psutil.Error:  # not ours to look at: it runs, for all we know
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


def worker_context() -> multiprocessing.context.ForkServerContext:
    """A forkserver that has imported the worker code (and torch where jobs need it) once.

    Workers must not inherit the controller's threads or locks, which rules out
    plain fork; spawn re-imports torch in every worker, seconds each on a busy
    machine. A forkserver with the worker module preloaded starts each worker
    (also a replacement for one that died) in milliseconds.
    """
    ctx = multiprocessing.get_context("forkserver")
    assert isinstance(ctx, multiprocessing.context.ForkServerContext)
    _own_temp_folder()
    _shared_arrays_beside_an_unusable_shm()
    ctx.set_forkserver_preload(forkserver_preload())
    return ctx


# The forkserver listens on a Unix socket in multiprocessing's temp folder, which goes in a folder of ours:
# TMPDIR/prefetchd-mp-XXXXXXXX/pymp-XXXXXXXX/listener-XXXXXXXX.  Such a path holds at most 107 bytes: a longer
# TMPDIR (a scheduler's per-job scratch folder) failed the bind with "AF_UNIX path too long" (seen under
# pytest-xdist's deep temp folders).  Then the folders go under /tmp.
SOCKET_FOLDER_LIMIT = 107 - len("/prefetchd-mp-XXXXXXXX/pymp-XXXXXXXX/listener-XXXXXXXX")
TEMP_PREFIX = "prefetchd-mp-"
# A folder of ours unlocked for longer than this is left by a process that is gone; younger, it may be one made a
# moment ago whose process has yet to lock it.
ORPHAN_SECONDS = 60.0


@functools.cache  # once a process: multiprocessing keeps its temp folder, and each job start came here (logged twice)
def _own_temp_folder() -> None:
    """Put multiprocessing's temp folder (the worker server's socket) in a folder this process holds an flock on.

    multiprocessing removes its pymp-* folder at a clean exit only: every daemon killed with SIGKILL (the OOM
    killer's way) left one in TMPDIR for good.  The kernel drops the flock with its holder, in any pid namespace,
    so the next daemon to start removes what such a one left, and never the folder of a daemon that runs."""
    tmpdir = tempfile.gettempdir()
    base = tmpdir if len(os.fsencode(tmpdir)) <= SOCKET_FOLDER_LIMIT else "/tmp"
    _remove_orphaned_temp_folders(base)
    ours = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=base)
    held = os.open(ours, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX)  # kept open for the life of the process
    tempfile.tempdir = ours
    try:
        # Made now and kept for the process, removed at its exit by multiprocessing as before; ours after it.
        folder = multiprocessing.util.get_temp_dir()
    finally:
        tempfile.tempdir = tmpdir
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(ours, True), exitpriority=-101)
    if base != tmpdir:
        log.info("TMPDIR %s is too long for the worker server's socket; its socket is in %s", tmpdir, folder)


def _remove_orphaned_temp_folders(base: str) -> None:
    """Remove the folders ``_own_temp_folder`` made in ``base`` whose process is gone (their flock is free)."""
    try:
        entries = [entry for entry in os.scandir(base) if entry.name.startswith(TEMP_PREFIX)]
    except OSError:
        return  # an unreadable temp folder: nothing of ours to find
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or time.time() - st.st_mtime < ORPHAN_SECONDS:
                continue
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: its daemon runs
        finally:
            os.close(fd)
        shutil.rmtree(entry.path, ignore_errors=True)
        log.info("removed %s, the worker server's socket folder of a daemon that was killed", entry.path)


def _shared_arrays_beside_an_unusable_shm() -> None:
    """Where /dev/shm is missing or read-only (a container's), put multiprocessing's shared arrays (each worker's
    whereabouts, the files known clean) in the temp folder.  Its heap picks /dev/shm whenever that reports room,
    so the first worker's start failed there, on a buffer elsewhere too: "internal error: OSError: Read-only file
    system: '/dev/shm/pym-...'" or FileNotFoundError (a user's walk; `prefetchd demo` in such a container with it).
    The arrays are a few KiB: on disk they cost nothing that matters."""
    if not os.access(SHM, os.W_OK):
        # The candidates multiprocessing.heap.Arena tries before the temp folder (['/dev/shm'] on Linux).
        setattr(multiprocessing.heap.Arena, "_dir_candidates", [])


SHM = "/dev/shm"


def start_worker_server() -> None:
    """Start the forkserver now, so that its imports overlap whatever the daemon does next."""
    worker_context()
    multiprocessing.forkserver.ensure_running()


MAX_CHUNK = 32  # images per task for local workers
MIN_CHUNK = 16  # ... where the cap leaves room for enough batches at once (task_images)
MAX_REMOTE_CHUNK = 64  # ... and when every task goes to a Ray cluster


def batches_to_fill(slots: int, chunk: int, batch_size: int) -> int:
    """Batches to keep being built so that ``slots`` workers (local workers, or a Ray cluster's CPUs) each hold
    ``TASKS_PER_WORKER`` tasks of ``chunk`` images, with one batch more to begin while those complete."""
    return -(-slots * TASKS_PER_WORKER * chunk // batch_size) + 1


def task_images(batch_size: int, workers: int, cap: int) -> int:
    """Images per task for ``workers`` local workers (0: every task goes to a Ray cluster), with
    ``cap`` batches allowed per stream.

    Every worker holds ``TASKS_PER_WORKER`` tasks, so the batches being built must hold
    ``workers * TASKS_PER_WORKER`` tasks between them.  Each task costs the controller about
    0.2 ms of CPU on top of its images (pickling, the pipes, the bookkeeping; measured in
    docs/BENCHMARKS.md, "Tasks per batch"), so tasks take at least ``MIN_CHUNK`` images
    where half the cap holds the batches that takes; below that, one batch spread over every
    worker's slots; never more than ``MAX_CHUNK``.  The batch is then split evenly: 33
    images go 11 + 11 + 11, not 16 + 16 + 1.  A Ray task costs ~3 ms over the worker,
    raylet and bridge (docs/SCALE.md): remote-only tasks take up to ``MAX_REMOTE_CHUNK``.
    """
    if workers == 0:  # each batch in at least two slices, as if for one worker
        largest = max(1, min(MAX_REMOTE_CHUNK, batch_size // TASKS_PER_WORKER))
    else:
        slots = workers * TASKS_PER_WORKER
        spread = batch_size // slots
        roomy = batch_size * max(1, cap // 2) // slots
        largest = max(1, min(MAX_CHUNK, batch_size, max(spread, min(MIN_CHUNK, roomy))))
    tasks = -(-batch_size // largest)
    return -(-batch_size // tasks)


def _continue_children() -> None:
    """SIGCONT this process's children and theirs, as systemd's stop does.  Stopped with the daemon (Ctrl-Z stops a
    terminal's whole process group), the forkserver reaps no worker and reports no exit, so joining one waited for
    good, at the latest in multiprocessing's own join at exit (a walk: a stopped daemon continued by `prefetchd
    stop` never exited)."""
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.send_signal(signal.SIGCONT)
