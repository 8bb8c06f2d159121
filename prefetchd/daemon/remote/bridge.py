"""The bridge process: the Ray driver.  It submits the controller's slices to the cluster, writes
what comes back into the batches' temp files, resubmits what the cluster lost and what did not begin in
--worker-start-timeout, relaunches stragglers, hands back the slices that hang or kill their Ray workers, and
reports the cluster's nodes and CPUs, the slice that has gone longest without progress, the Ray workers that die
before their first image and the slices whose start hung (see ``prefetchd.daemon.remote``).

``bridge_main`` connects to the cluster (``connect.py``) and runs a ``Bridge``: its loop, the pipe and Ray's
completions are here, and three parts, each a module: the slices in flight (``bridge_slices.py``; each
submission of one a ``slice_copy.SliceCopy``), the nodes and their probes (``bridge_nodes.py``), and what comes
back of a slice, checked against the daemon's box and written into the batch's temp file
(``bridge_rows.py``).  What it says to the controller, and hears, is ``messages.py``."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from prefetchd.daemon.remote.bridge_nodes import BridgeNodes, BridgeNode
from prefetchd.daemon.remote.bridge_rows import BridgeRows
from prefetchd.daemon.remote.bridge_slices import BridgeSlices, SliceInFlight
from prefetchd.daemon.remote.connect import connect, connect_failure, unreachable
from prefetchd.daemon.remote.messages import REPORT_SECONDS, Cancel, Note, Report, Stalled, StartDied, first_line
from prefetchd.daemon.remote.task import Shipment, build, build_slice, origin, probe_node, probe_samples
from prefetchd.daemon.sources import SampleReader
from prefetchd.daemon.worker_health import stall_noted_after
from prefetchd.daemon.tasks import WorkerJob

TRACK_POLL_SECONDS = 0.02  # a slice built an item at a time waits for the bridge to take each item: looked at this often


class Bridge(BridgeSlices, BridgeNodes, BridgeRows):
    """Submits the controller's tasks to Ray and answers with what came back.

    Its books are kept by its three parts: the slices in flight (``BridgeSlices``), the nodes and their
    probes (``BridgeNodes``), and the check of a node's build against the daemon's box (``BridgeRows``)."""

    def __init__(self, conn: Connection, job: WorkerJob, task_timeout: float, start_timeout: float) -> None:
        import ray

        self.ray: Any = ray
        self.conn = conn
        self.job = job
        self.task_timeout = task_timeout  # --task-timeout: a slice without progress this long is hung
        self.stall_noted = stall_noted_after(task_timeout)  # ... and one without for this long is said (``Stalled``)
        # --worker-start-timeout: a slice not begun this long after its submission is submitted again (``StartHung``)
        self.start_timeout = start_timeout
        self.start_noted = stall_noted_after(start_timeout)  # ... and one not begun for this long is said (``Stalled``)
        self.stalled: Stalled | None = None  # the slice longest without progress, past ``stall_noted``
        self.reader = SampleReader(job.index, job.readers)
        self.prepared = False  # for building slices here (``_build_here``)
        self.failing_here: set[int] = set()  # samples the box itself could not use: a node failing them is no news
        probe = probe_samples(job, self.reader)
        self.box = [ray.put(Shipment(job, probe, build(), origin()))]  # once per job
        self.build = ray.remote(build_slice)
        self.probe = ray.remote(probe_node)
        self._build_on: tuple[frozenset[str], dict[bool, Any]] = (frozenset(), self._builds())
        self.nodes: dict[str, BridgeNode] = {}  # by Ray's node id
        self.slices: dict[int, SliceInFlight] = {}
        # The slices that hung or killed their Ray worker here: built an item at a time from then on (``SliceCopy``).
        self.track: set[int] = set()
        self.latencies: deque[float] = deque(maxlen=256)
        self.errors: set[str] = set()  # errors of Ray workers that could not run a slice, each warned once
        # (what to call with the future, the future) of each completed task; appended by Ray's thread
        self.done: deque[tuple[Callable[[Any], None], Any]] = deque()
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        if not probe:
            self.conn.send(Note(logging.WARNING, "the daemon's box reads none of the samples it probes, so the "
                                                 "cluster's nodes are not probed"))

    def run(self) -> None:
        last_report = 0.0
        while True:
            tracking = any(c.track for s in self.slices.values() for c in s.copies)
            ready = wait([self.conn, self._r], TRACK_POLL_SECONDS if tracking else REPORT_SECONDS)
            if self._r in ready:
                os.read(self._r, 4096)
            if self.conn in ready and not self._receive():
                return
            while self.done:
                then, future = self.done.popleft()
                then(future)
                last_report = self._report_if_due(last_report)  # a slice built here takes a while
            self._relaunch_stragglers(time.monotonic())
            self._hand_back_hung(time.monotonic())
            last_report = self._report_if_due(last_report)

    def _report_if_due(self, last: float) -> float:
        """Report the cluster if ``REPORT_SECONDS`` have passed since ``last``; when it was last reported."""
        now = time.monotonic()
        if now - last < REPORT_SECONDS:
            return last
        self.conn.send(self._report())
        return now

    def _receive(self) -> bool:
        """Submit every task the controller sent, forget the ones it cancelled; False when it asks the bridge
        to stop."""
        while self.conn.poll():
            try:
                task = self.conn.recv()
            except (EOFError, OSError):
                return False
            if task is None:
                return False
            if isinstance(task, Cancel):
                self._forget(task.task_ids)
                continue
            self.slices[task.task_id] = SliceInFlight(task, time.monotonic())
            self._submit(self.slices[task.task_id])
        return True

    def _watch(self, ref: Any, then: Callable[[Any], None]) -> None:
        """Call ``then(future)`` on the bridge's loop when ``ref`` completes."""
        future = ref.future()

        def completed(_f: Any) -> None:  # on Ray's thread: queue it and wake the loop
            self.done.append((then, future))
            try:
                os.write(self._w, b"\0")
            except BlockingIOError:
                pass

        future.add_done_callback(completed)

    def _start_died(self, task_id: int | None, exc: Exception, node: str = "") -> None:
        """Tell the controller of a Ray worker that died before its first image (``StartDied``), unless its
        node died: a node that leaves takes its workers with it, however far they got."""
        if not isinstance(exc, self.ray.exceptions.NodeDiedError):
            self.conn.send(StartDied(task_id, type(exc).__name__, first_line(exc), node))

    def _cancel(self, ref: Any, force: bool = False) -> None:
        """Cancel a Ray task (a slice's stream, ``SliceCopy.gen``, or a probe's reference); ``force``: kill its
        worker too."""
        try:
            self.ray.cancel(ref, force=force)
        except Exception:  # already finished or its node gone: nothing to stop
            pass


def bridge_main(conn: Connection, job: WorkerJob, address: str, task_timeout: float, start_timeout: float) -> None:
    # Ctrl-C reaches the whole process group; the controller alone decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    why = unreachable(address)  # before the import of Ray: seconds sooner
    if why:
        conn.send(Report(False, message=why))
        return
    # Ray logs an error it holds for an object nobody took it from ("Unhandled error ... The worker died
    # unexpectedly"): the streams of slices whose Ray worker died, whose deaths the bridge has taken from
    # their completion and the daemon has said (twice per file that kills its Ray worker in test_ray_faults).
    os.environ["RAY_IGNORE_UNHANDLED_ERRORS"] = "1"
    try:
        import ray

        connect(address)
    except Exception as exc:  # no cluster there, a version mismatch, ...
        conn.send(Report(False, message=connect_failure(address, exc)))
        return
    try:
        Bridge(conn, job, task_timeout, start_timeout).run()
    except (EOFError, OSError):  # the controller went away
        pass
    finally:
        ray.shutdown()


__all__ = ["Bridge", "bridge_main"]
