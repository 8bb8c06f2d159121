"""Remote producers: slices of batches built on a Ray cluster beside the local workers (``--ray``).

The controller's tasks (a batch's temp file, its slot offsets and a list of
(slot, sample index)) go to the local workers *and* to a Ray cluster, whichever
has room; both run ``workers.run_task``, the same decode/augment code, so a
batch is bit-identical wherever it was built::

    controller ──Task──► bridge process ──remote()──► Ray worker on any node
        ▲                    │                          run_task(job, task, sink=rows)
        │                    │◄── uint8 rows, labels ───┘  (object store)
        └──Filled────────────┘  pwrite rows into the temp file's slots (SlotFiller)

The controller keeps everything it owns today: the manifest, progress, flow
control, begin/commit/abort of every batch, deletion, status and the lock.  Ray
supplies compute only.  The job (sample index, options) goes to the object store
once per job (``ray.put``); each task carries a reference to it, and a Ray
worker keeps the job it last read (``_job_here``).

Why a bridge process and not Ray calls in the controller: a Ray driver whose
cluster disappears blocks in its next call to the cluster (tried here: a 2-node
``cluster_utils.Cluster`` shut down under a driver left it hanging in
``.remote()``/``cluster_resources()`` for more than 40 s), and a driver whose
local raylet dies is ended by Ray.  The bridge is the Ray driver; the controller
talks to it over a pipe, like a worker, and never blocks on the cluster.  The
bridge fills the slots of the temp files it is given exactly as a local worker
does: it is the fill side of the batch writer (``buffer_protocol.writer``).

Faults.  A slice whose Ray worker or node died is submitted again by the bridge
(``MAX_ATTEMPTS`` times, then handed back to the controller, which queues it
for whoever has room); a slice outstanding ``STRAGGLER_FACTOR`` times longer
than the median is started a second time, and the first result wins.  Since a
batch is a pure function of (seed, epoch, step, rank) nothing is lost or
duplicated.  A bridge that dies, or reports nothing for ``SILENT_SECONDS``
(the cluster is gone), is replaced every ``RECONNECT_SECONDS``; meanwhile its
slices go back to the queue and the local workers build them alone.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from prefetchd.buffer_protocol import RemoteNode, RemoteStatus, SlotFiller
from prefetchd.daemon.config import require_ray
from prefetchd.daemon.pool import TASKS_PER_WORKER, with_heartbeat, worker_context
from prefetchd.daemon.sources import SampleReader
from prefetchd.daemon.workers import Filled, Task, WorkerJob, WriteFailed, failure_of, prepare_process, run_task

log = logging.getLogger(__name__)

REPORT_SECONDS = 1.0  # the bridge reports the cluster's nodes and CPUs this often
SILENT_SECONDS = 15.0  # no report for this long while connected: the cluster is gone
CONNECT_SECONDS = 120.0  # ray.init; a private local cluster starts in ~10 s on a busy 2-core box
RECONNECT_SECONDS = 10.0
BRIDGE_STOP_SECONDS = 15.0  # ray.shutdown of a private cluster takes seconds
MAX_ATTEMPTS = 3  # submissions of one slice at the cluster before it goes back to the controller
STRAGGLER_FACTOR = 4.0  # a slice outstanding this many times the median is started again
STRAGGLER_MIN_SECONDS = 2.0  # ... but never before this, and only once STRAGGLER_SAMPLES are known
STRAGGLER_SAMPLES = 16
RATE_WINDOW_SECONDS = 10.0
LOGGED_RETURNS = 10  # slices handed back by the cluster that are logged as warnings; the rest at debug level


# -- messages from the bridge to the controller --------------------------------


@dataclass(frozen=True)
class Report:
    """The cluster as the bridge sees it; ``connected`` False: it could not connect and exits."""

    connected: bool
    nodes: int = 0
    cpus: int = 0
    message: str = ""


@dataclass(frozen=True)
class Done:
    """A slice the cluster built; its pixels are in the temp file already (unless ``result`` failed)."""

    result: Filled | WriteFailed
    node: str
    latency: float  # seconds from the first submission to the result
    copied: tuple[int, float]  # (bytes, seconds) of the copy from the object store into the batch file
    retries: int  # submissions after the first because a worker or node was lost
    straggler: bool  # it was started a second time


@dataclass(frozen=True)
class Returned:
    """A slice the cluster could not build (its workers kept dying): the controller queues it again."""

    task_id: int
    reason: str
    retries: int


@dataclass(frozen=True)
class Note:
    """A line for the daemon's log (the bridge has no logging set up of its own)."""

    level: int
    text: str


@dataclass(frozen=True)
class NodeUnfit:
    """What a Ray task answers on a node that cannot read the dataset: building there would replace
    every sample as undecodable (and so differ from a local build), so the slice goes elsewhere."""

    reason: str


# -- what runs on a Ray worker ---------------------------------------------------------

# (object id, job, reader, why this node cannot read the dataset or "") for the job this process read last
_job_here: tuple[str, WorkerJob, SampleReader, str] | None = None
_prepared = False


class _Rows:
    """A ``SlotSink`` writing each slot's image into its row of the array the task returns."""

    def __init__(self, pixels: np.ndarray, rows: dict[int, int]) -> None:
        self.pixels = pixels
        self.rows = rows

    def fill(self, slot: int, image: memoryview) -> None:
        self.pixels[self.rows[slot]] = np.frombuffer(image, np.uint8)


def build_slice(job_box: list[Any], task: Task) -> tuple[Filled | WriteFailed | NodeUnfit, np.ndarray | None, str]:
    """A Ray task: run ``task`` with the local workers' code and return its pixels, one row per item.

    ``job_box`` holds the job's object reference (in a list, so that Ray hands the task the
    reference and this worker fetches the job once, not once per task).  Then it reads the
    split's first sample: a node without the dataset's mount (or credentials) answers
    ``NodeUnfit`` for every slice instead of replacing every sample.
    """
    global _job_here, _prepared
    import ray

    node = f"{socket.gethostname()}/{ray.get_runtime_context().get_node_id()[:8]}"
    if not _prepared:
        prepare_process()
        _prepared = True
    ref = job_box[0]
    if _job_here is None or _job_here[0] != ref.hex():
        job: WorkerJob = ray.get(ref)
        reader = SampleReader(job.index, job.readers)
        _job_here = (ref.hex(), job, reader, _cannot_read(job, reader))
    _, job, reader, unfit = _job_here
    if unfit:
        return NodeUnfit(unfit), None, node
    pixels = np.empty((len(task.items), task.slot_bytes), np.uint8)
    try:
        result = run_task(job, task, reader, sink=_Rows(pixels, {slot: row for row, (slot, _) in enumerate(task.items)}))
    except Exception as exc:
        result = failure_of(task.task_id, exc)
    return result, pixels if isinstance(result, Filled) else None, node


def _cannot_read(job: WorkerJob, reader: SampleReader) -> str:
    """Why this node cannot read the split's first sample, or "" when it can."""
    first = int(job.members[0])
    try:
        reader.read(first)
    except Exception as exc:
        return (f"cannot read {job.index.name(first)} ({type(exc).__name__}: {exc}); mount --data at the same path "
                "on every node (or use an object-storage URL with credentials on every node)")
    return ""


# -- the bridge process: the Ray driver --------------------------------------------------


def connect(address: str) -> None:
    """``ray.init`` for a --ray address (checked by the config)."""
    import ray

    quiet = {"logging_level": logging.WARNING, "log_to_driver": False, "namespace": "prefetchd"}
    if address == "local":
        # The CPUs this process may use (taskset, cgroup cpusets), not the machine's: Ray counts the machine's.
        ray.init(address="local", num_cpus=len(os.sched_getaffinity(0)), include_dashboard=False,
                 **quiet)  # type: ignore[arg-type]
    else:
        ray.init(address=address, **quiet)  # type: ignore[arg-type]


@dataclass
class _Slice:
    task: Task
    submitted: float
    attempts: int = 1
    refs: list[Any] = field(default_factory=list)
    straggler: bool = False


class Bridge:
    """Submits the controller's tasks to Ray and answers with what came back."""

    def __init__(self, conn: Connection, job: WorkerJob) -> None:
        import ray

        self.ray: Any = ray
        self.conn = conn
        self.job_box = [ray.put(job)]  # once per job
        self.build = ray.remote(build_slice).options(num_cpus=1, max_retries=0)  # retries are ours, counted
        self.slices: dict[int, _Slice] = {}
        self.latencies: deque[float] = deque(maxlen=256)
        self.unfit: set[str] = set()  # nodes that cannot read the dataset, errors of nodes that cannot run slices: warned once
        self.done: deque[tuple[int, Any, Any]] = deque()  # (task id, ref, future) completed; appended by Ray's thread
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)

    def run(self) -> None:
        last_report = 0.0
        while True:
            ready = wait([self.conn, self._r], REPORT_SECONDS)
            if self._r in ready:
                os.read(self._r, 4096)
            if self.conn in ready and not self._receive():
                return
            while self.done:
                self._finish(*self.done.popleft())
            now = time.monotonic()
            self._relaunch_stragglers(now)
            if now - last_report >= REPORT_SECONDS:
                self.conn.send(self._report())
                last_report = now

    def _receive(self) -> bool:
        """Submit every task the controller sent; False when it asks the bridge to stop."""
        while self.conn.poll():
            try:
                task = self.conn.recv()
            except (EOFError, OSError):
                return False
            if task is None:
                return False
            self.slices[task.task_id] = _Slice(task, time.monotonic())
            self._submit(self.slices[task.task_id])
        return True

    def _submit(self, s: _Slice) -> None:
        ref = self.build.remote(self.job_box, s.task)
        s.refs.append(ref)
        future = ref.future()
        task_id = s.task.task_id

        def completed(_f: Any) -> None:  # on Ray's thread: queue it and wake the loop
            self.done.append((task_id, ref, future))
            try:
                os.write(self._w, b"\0")
            except BlockingIOError:
                pass

        future.add_done_callback(completed)

    def _finish(self, task_id: int, ref: Any, future: Any) -> None:
        s = self.slices.get(task_id)
        if s is None or ref not in s.refs:
            return  # the other copy of a straggler won
        exceptions = self.ray.exceptions
        try:
            result, pixels, node = future.result()
        except exceptions.TaskCancelledError:
            return
        except exceptions.RayTaskError as exc:
            # build_slice catches what the decoding raises, so this is the node: prefetchd missing or of another
            # version there, say.  Not the job's fault: another node, or a local worker, builds the slice.
            text = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
            if text not in self.unfit:
                self.unfit.add(text)
                self.conn.send(Note(logging.WARNING, f"a Ray worker could not run a slice: {text}; is prefetchd[ray] "
                                                     "installed, at the daemon's version, on every node?"))
            self._again(s, ref, text)
            return
        except exceptions.RayError as exc:  # its worker or node was lost: build it again
            self._again(s, ref, f"{type(exc).__name__}: {exc}")
            return
        if isinstance(result, NodeUnfit):
            if node not in self.unfit:
                self.unfit.add(node)
                self.conn.send(Note(logging.WARNING, f"node {node} {result.reason}; its slices go to other nodes"))
            self._again(s, ref, f"node {node} cannot read the dataset")
            return
        del self.slices[task_id]
        for other in s.refs:
            if other is not ref:
                self._cancel(other)
        copied = (0, 0.0)
        if isinstance(result, Filled):
            t0 = time.perf_counter()
            result = write_rows(s.task, result, pixels)
            copied = (int(pixels.nbytes), time.perf_counter() - t0)
        latency = time.monotonic() - s.submitted
        self.latencies.append(latency)
        self.conn.send(Done(result, node, latency, copied, s.attempts - 1, s.straggler))

    def _again(self, s: _Slice, ref: Any, reason: str) -> None:
        """``ref``, one copy of slice ``s``, failed for ``reason``: submit it again, up to MAX_ATTEMPTS,
        then hand it back to the controller."""
        s.refs.remove(ref)
        if s.refs:
            return  # its other copy still runs
        if s.attempts >= MAX_ATTEMPTS:
            del self.slices[s.task.task_id]
            self.conn.send(Returned(s.task.task_id, reason, s.attempts))
            return
        s.attempts += 1
        self.conn.send(Note(logging.INFO, f"slice {s.task.task_id}: {reason.splitlines()[0][:200]}; submitting it "
                                          f"again (attempt {s.attempts} of {MAX_ATTEMPTS})"))
        self._submit(s)

    def _cancel(self, ref: Any) -> None:
        try:
            self.ray.cancel(ref)
        except Exception:  # already finished or its node gone: nothing to stop
            pass

    def _relaunch_stragglers(self, now: float) -> None:
        if len(self.latencies) < STRAGGLER_SAMPLES:
            return
        limit = max(STRAGGLER_MIN_SECONDS, STRAGGLER_FACTOR * float(np.median(self.latencies)))
        for s in self.slices.values():
            if not s.straggler and now - s.submitted > limit:
                s.straggler = True
                self._submit(s)

    def _report(self) -> Report:
        alive = [n for n in self.ray.nodes() if n.get("Alive")]
        cpus = int(sum(n.get("Resources", {}).get("CPU", 0) for n in alive))
        return Report(True, len(alive), cpus)


def write_rows(task: Task, result: Filled, pixels: np.ndarray) -> Filled | WriteFailed:
    """Write a remote slice's rows into the slots of its batch's temp file, as a local worker would have."""
    try:
        with SlotFiller(task.path, task.images_offset, task.slot_bytes) as slots:
            for row, (slot, _index) in enumerate(task.items):
                slots.fill(slot, memoryview(pixels[row]))
    except OSError as exc:  # no space, or the batch was aborted meanwhile
        return WriteFailed(task.task_id, f"cannot write {task.path}: {exc.strerror}")
    return result


def bridge_main(conn: Connection, job: WorkerJob, address: str) -> None:
    # Ctrl-C reaches the whole process group; the controller alone decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ray

        connect(address)
    except Exception as exc:  # no cluster there, a version mismatch, ...
        conn.send(Report(False, message=f"cannot connect to the Ray cluster at {address}: {type(exc).__name__}: {exc}"))
        return
    try:
        Bridge(conn, job).run()
    except (EOFError, OSError):  # the controller went away
        pass
    finally:
        ray.shutdown()


# -- the controller's side ----------------------------------------------------------------


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

    def __init__(self, job: WorkerJob, address: str, builds: int | None, local_workers: int) -> None:
        require_ray()
        self.job = job
        self.address = address
        self.builds = builds
        self.local_workers = local_workers
        self._ctx = worker_context()
        self.process: Any = None
        self.conn: Connection | None = None
        self.started = 0.0
        self.last_report = 0.0
        self.cpus_seen = 0.0  # when the cluster last had a CPU
        self.retry_at = 0.0
        self.connected = False
        self.failed_attempts = 0
        self.refusal: str | None = None  # why the bridge could not connect, as it said before exiting
        self.nodes = 0
        self.cpus = 0
        self.message = "connecting"
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
        self.process = self._ctx.Process(target=bridge_main, args=(child, self.job, self.address),
                                         name="prefetchd-ray-bridge", daemon=True)
        with_heartbeat(self.process.start, heartbeat, every)
        child.close()
        self.conn = parent
        self.started = time.monotonic()
        self.refusal = None
        log.info("connecting to the Ray cluster at %s", self.address)

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
            return max(0.0, min(timeout, self.retry_at - time.monotonic()))
        return min(timeout, REPORT_SECONDS)

    def handle(self, on_result: Callable[[Task, Filled | WriteFailed], None],
               requeue: Callable[[list[Task]], None]) -> None:
        """Hand on what the bridge sent; notice a dead or silent one; reconnect when it is time."""
        now = time.monotonic()
        if self.process is None:
            if now >= self.retry_at:
                self.start()
            return
        self._receive(on_result, requeue)
        if not self.process.is_alive():
            self._receive(on_result, requeue)  # what it sent before it exited still counts
            self._lose(self.refusal or f"the bridge process exited (code {self.process.exitcode})", requeue)
        elif self.connected and now - self.last_report > SILENT_SECONDS:
            self._lose(f"no answer from the cluster for {SILENT_SECONDS:.0f} s", requeue)
        elif self.connected and self.in_flight and self.cpus == 0 and now - self.cpus_seen > SILENT_SECONDS:
            # Its slices wait at Ray for a node with a CPU; the local workers can build them meanwhile.
            self._lose(f"no node with a CPU for {SILENT_SECONDS:.0f} s", requeue)
        elif not self.connected and now - self.started > CONNECT_SECONDS:
            self._lose(f"could not connect within {CONNECT_SECONDS:.0f} s", requeue)

    def _receive(self, on_result: Callable[[Task, Filled | WriteFailed], None],
                 requeue: Callable[[list[Task]], None]) -> None:
        assert self.conn is not None
        while True:
            try:
                if not self.conn.poll():
                    return
                msg = self.conn.recv()
            except (EOFError, OSError):
                return
            if isinstance(msg, Report):
                self._on_report(msg)
            elif isinstance(msg, Note):
                log.log(msg.level, "ray: %s", msg.text)
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
            elif isinstance(msg, Returned):
                task = self._take(msg.task_id)
                self.retries += msg.retries
                if task is not None:
                    self.returned += 1
                    (log.warning if self.returned <= LOGGED_RETURNS else log.debug)(
                        "slice %d of %s came back from the cluster after %d attempts (%s); queuing it again%s",
                        msg.task_id, os.path.basename(task.path), msg.retries, msg.reason.splitlines()[0][:300],
                        "; further ones are logged at debug level" if self.returned == LOGGED_RETURNS else "")
                    requeue([task])

    def _on_report(self, report: Report) -> None:
        if not report.connected:
            self.refusal = report.message
            return
        if not self.connected:
            log.info("Ray cluster at %s: %d nodes, %d CPUs; building batches there beside %d local workers",
                     self.address, report.nodes, report.cpus, self.local_workers)
            self.cpus_seen = time.monotonic()
        self.connected = True
        self.failed_attempts = 0
        self.message = ""
        self.nodes, self.cpus = report.nodes, report.cpus
        self.last_report = time.monotonic()
        if self.cpus:
            self.cpus_seen = self.last_report

    def _take(self, task_id: int) -> Task | None:
        task = self.in_flight.pop(task_id, None)
        if task is not None:
            self.paths[task.path] -= 1
            if self.paths[task.path] <= 0:
                del self.paths[task.path]
        return task

    def _lose(self, reason: str, requeue: Callable[[list[Task]], None]) -> None:
        """Give up on this bridge: its slices go back to the queue, and a new one connects later."""
        lost = list(self.in_flight.values())
        fallback = (f"the {self.local_workers} local workers build alone" if self.local_workers
                    else "no local workers (--workers 0): production waits for the cluster")
        again = f"trying again every {RECONNECT_SECONDS:.0f} s"
        if self.connected:
            self.disconnects += 1
            self.message = f"lost: {reason}; {fallback}"
            log.warning("Ray cluster at %s lost: %s; %s (%d slices queued again); %s", self.address, reason,
                        fallback, len(lost), again)
        else:
            self.message = f"not connected: {reason}; {fallback}"
            (log.warning if self.failed_attempts == 0 else log.debug)(
                "cannot use the Ray cluster at %s: %s; %s; %s", self.address, reason, fallback, again)
            self.failed_attempts += 1
        self.connected = False
        self.in_flight.clear()
        self.paths.clear()
        if self.process is not None:
            if self.process.is_alive():
                self.process.kill()
            self.process.join(1.0)
        if self.conn is not None:
            self.conn.close()
        self.process = self.conn = None
        self.retry_at = time.monotonic() + RECONNECT_SECONDS
        if lost:
            requeue(lost)

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
        return math.ceil(TASKS_PER_WORKER * max(1, self.cpus) * chunk / batch_size) + 1

    def status(self) -> RemoteStatus:
        now = time.monotonic()
        return RemoteStatus(
            address=self.address, connected=self.connected, cluster_nodes=self.nodes if self.connected else 0,
            cluster_cpus=self.cpus if self.connected else 0, in_flight=len(self.in_flight), images=self.images,
            slices=self.slices, retries=self.retries, stragglers=self.stragglers, disconnects=self.disconnects,
            message=self.message, copied_bytes=self.copied_bytes, copy_seconds=round(self.copy_seconds, 4), nodes=tuple(b.status(node, now) for node, b in sorted(self.node_books.items())),
        )


__all__ = ["RemotePool", "build_slice"]
