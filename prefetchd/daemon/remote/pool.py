"""The Ray cluster as the controller sees it: ``RemotePool``, beside ``prefetchd.daemon.pool``'s
WorkerPool, feeding a bridge process from the controller's queue (see ``prefetchd.daemon.remote``)."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from prefetchd.buffer_protocol import RemoteNode, RemoteStatus
from prefetchd.daemon.config import require_ray
from prefetchd.daemon.pool import TASKS_PER_WORKER, batches_to_fill, with_heartbeat, worker_context
from prefetchd.daemon.remote.bridge import bridge_main
from prefetchd.daemon.remote.bridge_nodes import REPROBE_SECONDS
from prefetchd.daemon.remote.messages import (REPORT_SECONDS, Cancel, Cancelled, Died, Done, Hung, Note, Report, Returned,
                                              Stalled, StartDied, StartHung)
from prefetchd.daemon.worker_health import SliceStall
from prefetchd.daemon.tasks import Filled, Task, WorkerJob, WriteFailed
from prefetchd.words import counted

log = logging.getLogger(__name__)

SILENT_SECONDS = 15.0  # no report for this long while connected: the cluster is gone
CONNECT_SECONDS = 120.0  # ray.init; a private local cluster starts in ~10 s on a busy 2-core box
# ray.init after a failed one: a head that accepts connections (the bridge checks) and answers takes seconds, and a
# head that never answers must not hold each attempt for minutes.
RETRY_CONNECT_SECONDS = 30.0
# A head that accepts connections but not yet ray.init (Ray gives up on one that refuses its token after 20 s) is
# warned about after this long, once: the user hears within seconds that local workers build alone meanwhile.
NO_ANSWER_SECONDS = 15.0
RECONNECT_SECONDS = 10.0
BRIDGE_STOP_SECONDS = 15.0  # ray.shutdown of a private cluster takes seconds
RATE_WINDOW_SECONDS = 10.0
# Slices handed back by the cluster and queued again that are logged as warnings; the rest at debug level, as is
# a cancelled batch's slice handed back (dropped: nothing is lost to the job).
LOGGED_RETURNS = 10

# ``Builds.requeue`` (the controller's): queues lost tasks again, first, and returns those it queued; it drops a
# cancelled build's (only the controller's builds know which are cancelled).
Requeue = Callable[[list[Task]], list[Task]]
# The producer's ``_remote_fault``: a slice that hung at the cluster, or killed the Ray worker building it, judged as
# a local worker's hang or death is (``worker_health``); it queues the slice again unless the job stops.
OnFault = Callable[[Task, "Hung | Died"], None]
# The producer's ``_ray_start_fault``: a Ray worker died before its first image (``StartDied``), with the task of
# the slice it ran (None: a probe), counted towards the bound that stops a job whose Ray workers all die so; or a
# slice did not begin in --worker-start-timeout (``StartHung``), counted towards the one for starts that hang.
OnStartFault = Callable[["StartDied | StartHung", "Task | None"], None]


@dataclass
class _NodeBooks:
    images: int = 0
    slices: int = 0
    recent: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=256))  # (time, images)
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=256))

    def status(self, node: str, now: float) -> RemoteNode:
        recent = [(t, n) for t, n in self.recent if now - t <= RATE_WINDOW_SECONDS]
        rate = sum(n for _, n in recent) / RATE_WINDOW_SECONDS
        p50 = float(np.median(self.latencies)) if self.latencies else 0.0
        return RemoteNode(node, self.images, self.slices, round(rate, 1), round(p50, 4))


class RemotePool:
    """The Ray cluster as the controller sees it: a pool beside ``WorkerPool`` that takes tasks
    from the same queue while it is connected, and hands back the ones it loses."""

    def __init__(self, job: WorkerJob, address: str, builds: int | None, local_workers: int,
                 task_timeout: float, start_timeout: float) -> None:
        require_ray()
        self.job = job
        self.task_timeout = task_timeout
        self.start_timeout = start_timeout  # --worker-start-timeout: the bridge's bound on a slice that has not begun
        self.address = address
        self.builds = builds
        self.local_workers = local_workers
        self.locals_given_up = ""  # why the job's local workers were stopped for good (``local_workers_given_up``)
        self._ctx = worker_context()
        self.process: Any = None
        self.conn: Connection | None = None
        self.started = 0.0
        self.last_report = 0.0
        self.cpus_seen = 0.0  # when the cluster last had a CPU
        self.retry_at = 0.0
        self.connected = False
        self.failed_attempts = 0
        self.told_no_answer = False  # the warning that the cluster does not answer yet, once until it does
        self.refusal: str | None = None  # why the bridge could not connect, as it said before exiting
        self.nodes = 0
        self.cpus = 0  # of the nodes that get slices: all but the unfit ones
        self.unfit: tuple[str, ...] = ()
        # The warnings the bridges sent: each new bridge (after a reconnection) probes the nodes again, and
        # "node X cannot read --data" found again is no news.
        self.warned: set[str] = set()
        self.message = "connecting"
        self.stalled: Stalled | None = None  # the bridge's slice longest without progress, as it last reported
        self.lost = ""  # why the cluster was lost, kept in the status beside each failed reconnection until it is back
        self.given_up = ""  # why this job builds no more on the cluster (``give_up``): no reconnection then
        self.in_flight: dict[int, Task] = {}
        self.paths: Counter[str] = Counter()  # batches (their temp files) with slices at the cluster
        self.images = self.slices = self.retries = self.stragglers = self.disconnects = self.returned = 0
        self.node_books: dict[str, _NodeBooks] = {}
        self.copied_bytes = 0
        self.copy_seconds = 0.0

    # -- lifecycle

    def start(self, heartbeat: Callable[[], None] = lambda: None, every: float = REPORT_SECONDS) -> None:
        """Start a bridge; it connects in the background and reports when it is ready.  The first start
        may wait seconds for the fork server (``heartbeat`` runs meanwhile), later ones do not."""
        parent, child = self._ctx.Pipe()
        args = (child, self.job, self.address, self.task_timeout, self.start_timeout)
        self.process = self._ctx.Process(target=bridge_main, args=args, name="prefetchd-ray-bridge", daemon=True)
        with_heartbeat(self.process.start, heartbeat, every)
        child.close()
        self.conn = parent
        self.started = time.monotonic()
        self.refusal = None
        # Said once, and again after a loss: not at every reconnection attempt while there is no cluster.
        (log.info if self.failed_attempts == 0 else log.debug)("connecting to the Ray cluster at %s", self.address)

    def stop(self) -> None:
        """Let the bridge cancel its slices and disconnect; kill it if it hangs (a vanished cluster)."""
        if self.process is None or self.conn is None:
            return
        try:
            self.conn.send(None)
        except OSError:
            pass
        # A bridge that is not connected may be stuck in ray.init on a vanished cluster: nothing to wait for.
        self.process.join(BRIDGE_STOP_SECONDS if self.connected else 1.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(1.0)
        self.conn.close()
        self.process = self.conn = None
        self.connected = False

    # -- the controller's loop

    def waitables(self) -> list[Any]:
        return [self.conn, self.process.sentinel] if self.conn is not None else []

    def poll_interval(self, timeout: float) -> float:
        """How long the controller may sleep: not past a reconnection or a silence check."""
        if self.process is None:
            return timeout if self.given_up else max(0.0, min(timeout, self.retry_at - time.monotonic()))
        return min(timeout, REPORT_SECONDS)

    def handle(self, on_result: Callable[[Task, Filled | WriteFailed], None], requeue: Requeue,
               on_fault: OnFault, on_start_fault: OnStartFault) -> None:
        """Hand on what the bridge sent; notice a dead or silent one; reconnect when it is time."""
        now = time.monotonic()
        if self.process is None:
            if now >= self.retry_at and not self.given_up:
                self.start()
            return
        self._receive(on_result, requeue, on_fault, on_start_fault)
        if self.process is None:  # given up on what it sent
            return
        if not self.process.is_alive():
            self._receive(on_result, requeue, on_fault, on_start_fault)  # what it sent before it exited still counts
            if self.process is not None:  # (not given up on that)
                self._lose(self.refusal or f"the bridge process exited (code {self.process.exitcode})", requeue)
        elif self.connected and now - self.last_report > SILENT_SECONDS:
            self._lose(f"no answer from the cluster for {SILENT_SECONDS:.0f} s", requeue)
        elif self.connected and self.in_flight and self.cpus == 0 and now - self.cpus_seen > SILENT_SECONDS:
            # Its slices wait at Ray for a node with a CPU; the local workers can build them meanwhile.
            self._lose(f"no node with a CPU that reads --data for {SILENT_SECONDS:.0f} s", requeue)
        elif not self.connected and now - self.started > self._connect_seconds():
            self._lose(f"could not connect within {self._connect_seconds():.0f} s", requeue)
        elif (not self.connected and not self.told_no_answer and self.address != "local"
              and now - self.started > NO_ANSWER_SECONDS):
            # (A private cluster, --ray local, starts rather than answers; its ray.init fails, or ends, by itself.)
            self.told_no_answer = True
            self.message = self._not_connected(f"no answer after {NO_ANSWER_SECONDS:.0f} s yet")
            log.warning("the Ray cluster at %s does not answer yet (%.0f s); %s meanwhile; prefetchd waits up to "
                        "%.0f s for it (Ray gives up sooner on some heads: one that refuses this daemon's token, "
                        "after 20 s), then tries again every %.0f s", self.address, NO_ANSWER_SECONDS,
                        self._fallback(), self._connect_seconds(), RECONNECT_SECONDS)

    def _connect_seconds(self) -> float:
        return CONNECT_SECONDS if self.failed_attempts == 0 else RETRY_CONNECT_SECONDS

    def _not_connected(self, why: str) -> str:
        """The status' message while an attempt to connect failed or waits: after a loss, the loss first."""
        if self.lost:
            return f"lost: {self.lost}; reconnecting: {why}; {self._fallback()}"
        return f"not connected: {why}; {self._fallback()}"

    def _fallback(self) -> str:
        """Who builds while the cluster does not."""
        if not self.local_workers:
            why = "given up for this job" if self.locals_given_up else "--workers 0"
            return f"no local workers ({why}): production waits for the cluster"
        return f"{counted(self.local_workers, 'local worker')} build{'s' if self.local_workers == 1 else ''} alone"

    def _receive(self, on_result: Callable[[Task, Filled | WriteFailed], None], requeue: Requeue,
                 on_fault: OnFault, on_start_fault: OnStartFault) -> None:
        while self.conn is not None:  # None once a message gave the cluster up (``give_up``)
            try:
                if not self.conn.poll():
                    return
                msg = self.conn.recv()
            except (EOFError, OSError):
                return
            if isinstance(msg, Report):
                self._on_report(msg)
            elif isinstance(msg, Note):
                again = msg.level >= logging.WARNING and msg.text in self.warned
                if msg.level >= logging.WARNING:
                    self.warned.add(msg.text)
                log.log(logging.DEBUG if again else msg.level, "ray: %s", msg.text)
            elif isinstance(msg, Done):
                task = self._take(msg.result.task_id)
                if task is None:
                    continue
                self.retries += msg.retries
                self.stragglers += msg.straggler
                self.copied_bytes += msg.copied[0]
                self.copy_seconds += msg.copied[1]
                if isinstance(msg.result, Filled):
                    n = len(msg.result.slots)
                    self.images += n
                    self.slices += 1
                    books = self.node_books.setdefault(msg.node, _NodeBooks())
                    books.images += n
                    books.slices += 1
                    books.recent.append((time.monotonic(), n))
                    books.latencies.append(msg.latency)
                on_result(task, msg.result)
            elif isinstance(msg, Cancelled):  # no news: the slices of a build the controller cancelled
                requeue([t for t in map(self._take, msg.task_ids) if t is not None])  # which it drops
            elif isinstance(msg, Returned):
                task = self._take(msg.task_id)
                if task is not None:  # a stale one's are no retries of this job's slices
                    self._on_returned(task, msg, requeue)
            elif isinstance(msg, (Hung, Died)):
                task = self._take(msg.task_id)
                if task is not None:
                    self.retries += msg.retries
                    on_fault(task, msg)
            elif isinstance(msg, (StartDied, StartHung)):  # the bridge submits that slice again: still in flight
                if isinstance(msg, StartHung) and self.stalled is not None and self.stalled.task_id == msg.task_id:
                    self.stalled = None  # its stall ended with the cancelled copy; the next report says any new one
                task = self.in_flight.get(msg.task_id) if msg.task_id is not None else None
                if msg.task_id is None or task is not None:  # a stale one's is no fault of this job's slices
                    on_start_fault(msg, task)

    def _on_returned(self, task: Task, msg: Returned, requeue: Requeue) -> None:
        """A slice the cluster gave up on: queued again, unless its build was cancelled (a rewind, a failed
        write) before the controller read this, which only the controller knows: ``requeue`` then drops it."""
        self.retries += msg.retries  # as a Done's are, its batch cancelled or not: the cluster did submit it again
        said = (msg.task_id, os.path.basename(task.path), counted(msg.retries + 1, "attempt"),
                msg.reason.splitlines()[0][:300])
        if not requeue([task]):  # no slice lost to the job: its batch is thrown away
            log.debug("slice %d of %s came back from the cluster after %s (%s); dropped: its batch was cancelled",
                      *said)
            return
        self.returned += 1
        (log.warning if self.returned <= LOGGED_RETURNS else log.debug)(
            "slice %d of %s came back from the cluster after %s (%s); queuing it again%s", *said,
            "; further ones are logged at debug level" if self.returned == LOGGED_RETURNS else "")

    def _on_report(self, report: Report) -> None:
        if not report.connected:
            self.refusal = report.message
            return
        if not self.connected:
            beside = f"beside {counted(self.local_workers, 'local worker')}" if self.local_workers else "alone (--workers 0)"
            log.info("connected to the Ray cluster at %s: %s; each node with CPUs builds batches %s once it has "
                     "read samples of --data", self.address, counted(report.nodes, "node"), beside)
            self.cpus_seen = time.monotonic()
        self.connected = True
        self.failed_attempts = 0
        self.told_no_answer = False
        self.lost = ""
        idle = self._all_unfit(report)
        if idle and idle != self.message:
            log.warning("no node of the Ray cluster at %s gets slices: %s", self.address, idle)
        self.message = idle
        self.nodes, self.cpus, self.unfit = report.nodes, report.cpus, report.unfit
        stalled = report.stalled
        self.stalled = stalled if stalled is not None and stalled.task_id in self.in_flight else None
        self.last_report = time.monotonic()
        if self.cpus:
            self.cpus_seen = self.last_report

    def _all_unfit(self, report: Report) -> str:
        """The status' message while connected: why no node gets slices (each one with CPUs is unfit), or ""."""
        if report.cpus or not report.unfit:
            return ""
        return (f"{counted(len(report.unfit), 'node')} with CPUs, each unfit (one that cannot read --data is "
                f"probed again every {REPROBE_SECONDS:.0f} s); {self._fallback()}")

    def stalled_slice(self) -> SliceStall | None:
        """The slice at the cluster that has made no progress the longest, once that is long enough to be said
        (the bridge's ``Stalled``), until the bridge answers for it (hands it back as hung, say)."""
        if self.stalled is None or self.stalled.task_id not in self.in_flight:
            return None
        return SliceStall(self.in_flight[self.stalled.task_id], self.stalled.sample, self.stalled.moved,
                          self.stalled.starting)

    def _take(self, task_id: int) -> Task | None:
        task = self.in_flight.pop(task_id, None)
        if task is not None:
            self.paths[task.path] -= 1
            if self.paths[task.path] <= 0:
                del self.paths[task.path]
        return task

    def _lose(self, reason: str, requeue: Requeue) -> None:
        """Give up on this bridge: its slices go back to the queue (a cancelled batch's are dropped), and a
        new one connects later."""
        fallback = self._fallback()
        again = f"trying again every {RECONNECT_SECONDS:.0f} s"
        was_connected = self.connected
        self.connected = False
        if self.process is not None:
            if self.process.is_alive():
                self.process.kill()
            self.process.join(1.0)
        if self.conn is not None:
            self.conn.close()
        self.process = self.conn = None
        self.retry_at = time.monotonic() + RECONNECT_SECONDS
        lost, queued = self._hand_back(requeue)
        if was_connected:
            self.disconnects += 1
            self.lost = reason
            self.message = f"lost: {reason}; {fallback}"
            dropped = len(lost) - len(queued)
            dropped_said = f", {counted(dropped, 'slice')} of cancelled batches dropped" if dropped else ""
            log.warning("Ray cluster at %s lost: %s; %s (%s queued again%s); %s", self.address, reason,
                        fallback, counted(len(queued), "slice"), dropped_said, again)
        else:
            self.message = self._not_connected(reason)
            (log.warning if self.failed_attempts == 0 else log.debug)(
                "cannot use the Ray cluster at %s: %s; %s; %s", self.address, reason, fallback, again)
            self.failed_attempts += 1

    def _hand_back(self, requeue: Requeue) -> tuple[list[Task], list[Task]]:
        """Forget what a bridge that is gone held (its slices, its unfit nodes, its stall) and queue its slices
        again (a cancelled batch's are dropped): those it held, and those queued."""
        lost = list(self.in_flight.values())
        self.unfit = ()
        self.stalled = None
        self.in_flight.clear()
        self.paths.clear()
        return lost, requeue(lost) if lost else []

    def local_workers_given_up(self, why: str) -> None:
        """The job's local workers are stopped for good (too many died, ``why``: the producer's
        ``_local_workers_end``): the cluster builds alone, and while it does not, nothing does (its next message
        says so)."""
        self.local_workers = 0
        self.locals_given_up = why

    def give_up(self, reason: str, requeue: Requeue) -> None:
        """Build no more on the cluster for this job, whose local workers build alone from now on: its Ray
        workers cannot start (``WorkerHealth.ray_start_died``, ``.ray_start_hung``: ``reason``), which a
        reconnection would not mend.  The bridge cancels its slices and disconnects first (``stop``), so that
        none of them writes into a batch any more; then they go back to the queue (a cancelled batch's are
        dropped).  The status keeps saying why until the job ends; the daemon's next start tries the cluster
        again."""
        self.stop()
        self.given_up = reason
        _lost, queued = self._hand_back(requeue)
        # ``reason`` ends with what to mend, and that the daemon's next start (it resumes) uses the cluster again.
        self.message = f"{RemoteStatus.GIVEN_UP}, {self._fallback()}: {reason}"
        log.warning("the Ray cluster at %s is given up for this job, %s (%s it held queued again): %s", self.address,
                    self._fallback(), counted(len(queued), "slice"), reason)

    def cancel(self, task_ids: Iterable[int]) -> None:
        """A build was cancelled: tell the bridge of its slices that it holds, so that it frees their nodes and
        answers each at once (``Cancel``).  They stay in flight until answered: the build's temp file goes
        only then, and no late copy of a slice can reach the file of a later build of the same batch."""
        held = tuple(sorted(task_id for task_id in task_ids if task_id in self.in_flight))
        if not held or self.conn is None:
            return
        try:
            self.conn.send(Cancel(held))
        except OSError:  # the bridge died: handle() notices, and hands back what it held
            pass

    def dispatch(self, todo: deque[Task]) -> None:
        """Send tasks from the front of ``todo`` while the cluster has room: ``TASKS_PER_WORKER`` per
        cluster CPU, and slices of at most ``builds`` batches (--ray-builds)."""
        if not self.connected or self.conn is None or self.cpus == 0:
            return
        room = TASKS_PER_WORKER * self.cpus - len(self.in_flight)
        skipped: list[Task] = []
        while todo and room > 0:
            task = todo.popleft()
            if self.builds is not None and task.path not in self.paths and len(self.paths) >= self.builds:
                skipped.append(task)  # left to the local workers
                continue
            try:
                self.conn.send(task)
            except OSError:  # the bridge died; handle() notices and requeues what it held
                todo.appendleft(task)
                break
            self.in_flight[task.task_id] = task
            self.paths[task.path] += 1
            room -= 1
        todo.extendleft(reversed(skipped))

    # -- sizing and status

    def builds_wanted(self, chunk: int, batch_size: int) -> int:
        """Batches to keep being built for the cluster: --ray-builds, or enough for its queue of slices."""
        if not self.connected:
            return 0
        if self.builds is not None:
            return self.builds
        return batches_to_fill(max(1, self.cpus), chunk, batch_size)

    def status(self) -> RemoteStatus:
        now = time.monotonic()
        return RemoteStatus(
            address=self.address, connected=self.connected, cluster_nodes=self.nodes if self.connected else 0,
            cluster_cpus=self.cpus if self.connected else 0, in_flight=len(self.in_flight), images=self.images,
            slices=self.slices, retries=self.retries, stragglers=self.stragglers, disconnects=self.disconnects,
            message=self.message, copied_bytes=self.copied_bytes, copy_seconds=round(self.copy_seconds, 4),
            nodes=tuple(b.status(node, now) for node, b in sorted(self.node_books.items())), unfit_nodes=self.unfit,
        )


__all__ = ["RemotePool"]
