"""The bridge's slices in flight: each submitted to the cluster (a ``SliceCopy`` each time, two for a straggler),
its result taken and written, submitted again where a Ray worker or node was lost or where it did not begin in
--worker-start-timeout (its Ray worker's start blocked), handed back where it hung, killed its Ray workers or ran
out of attempts, and forgotten where the controller cancelled its build.

A part of :class:`~prefetchd.daemon.remote.bridge.Bridge`, which sets what is declared here in its ``__init__``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np

from prefetchd.daemon.remote.bridge_nodes import NODE_ID_LABEL, BridgeNode
from prefetchd.daemon.remote.bridge_rows import write_rows
from prefetchd.daemon.remote.messages import (Cancelled, Died, Done, Hung, Note, Returned, Stalled, StartHung,
                                              last_line)
from prefetchd.daemon.remote.slice_copy import SliceCopy, StreamedAnswer
from prefetchd.daemon.remote.task import NodeAnswer
from prefetchd.daemon.tasks import Filled, Task, WriteFailed

MAX_ATTEMPTS = 3  # submissions of one slice at the cluster before it goes back to the controller
STRAGGLER_FACTOR = 4.0  # a slice outstanding this many times the median is started again
STRAGGLER_MIN_SECONDS = 2.0  # ... but never before this, and only once STRAGGLER_SAMPLES are known
STRAGGLER_SAMPLES = 16
# Each slice a streaming task: it says when it begins (and, tracked, each item), which the hang check times.
SLICE_OPTIONS: dict[str, Any] = {"num_cpus": 1, "max_retries": 0, "num_returns": "streaming"}


@dataclass
class SliceInFlight:
    task: Task
    submitted: float
    attempts: int = 1
    copies: list[SliceCopy] = field(default_factory=list)  # one, two for a straggler started again
    straggler: bool = False


class BridgeSlices:
    """The slices of a :class:`~prefetchd.daemon.remote.bridge.Bridge` at the cluster, by task id."""

    # Set by Bridge.__init__.
    ray: Any
    conn: Connection
    box: list[Any]
    build: Any
    _build_on: tuple[frozenset[str], dict[bool, Any]]
    task_timeout: float
    stall_noted: float
    start_timeout: float
    start_noted: float
    stalled: Stalled | None
    nodes: dict[str, BridgeNode]
    slices: dict[int, SliceInFlight]
    track: set[int]
    latencies: deque[float]
    errors: set[str]

    if TYPE_CHECKING:  # the bridge's, its nodes' (bridge_nodes.py) and its rows' (bridge_rows.py)
        def _watch(self, ref: Any, then: Callable[[Any], None]) -> None: ...
        def _cancel(self, ref: Any, force: bool = False) -> None: ...
        def _start_died(self, task_id: int | None, exc: Exception, node: str = "") -> None: ...
        def _answered(self, node_id: str, answer: NodeAnswer) -> None: ...
        def _checked_here(self, task: Task, result: Filled | WriteFailed, pixels: list[np.ndarray] | None,
                          node: str) -> tuple[Filled | WriteFailed, list[np.ndarray] | None, str] | None: ...

    def _forget(self, task_ids: tuple[int, ...]) -> None:
        """Drop the slices of a cancelled build: answered at once, never relaunched, and a result that comes
        later finds no slice (``_finish``), so it is not written into a file that is another build's by then.
        An id not held was answered already (the pipe is ordered: its task came before the cancellation)."""
        forgotten = tuple(task_id for task_id in task_ids if task_id in self.slices)
        for task_id in forgotten:
            self.track.discard(task_id)
            for copy in self.slices.pop(task_id).copies:
                # Frees the cluster's CPUs for the new window: a copy not started yet never runs, a running one
                # gets a KeyboardInterrupt (Ray's cancel without force), as a straggler's losing copy does; its
                # Ray worker lives on, and what it keeps of the job is set only once complete (``_here``).
                self._cancel(copy.gen)
        if forgotten:
            self.conn.send(Cancelled(forgotten))

    def _submit(self, s: SliceInFlight) -> None:
        unfit = frozenset(node_id for node_id, n in self.nodes.items() if n.reason)
        if unfit and unfit == self.nodes.keys():
            del self.slices[s.task.task_id]
            self.conn.send(Returned(s.task.task_id, "no node of the cluster can build it (every one is unfit)",
                                    s.attempts - 1))
            return
        if self._build_on[0] != unfit:
            # Retries are the bridge's own, counted.
            selector = {"label_selector": {NODE_ID_LABEL: f"!in({','.join(sorted(unfit))})"}} if unfit else {}
            self._build_on = (unfit, self._builds(selector))
        track = s.task.task_id in self.track
        copy = SliceCopy(self._build_on[1][track].remote(self.box, s.task, *((True,) if track else ())), track)
        s.copies.append(copy)
        self._watch(copy.gen.completed(),
                    lambda future: self._finish(s.task.task_id, copy, StreamedAnswer(self.ray, copy, future)))

    def _builds(self, selector: dict[str, Any] | None = None) -> dict[bool, Any]:
        """The slice task with its options, by whether it is tracked: a tracked one's every yield waits until
        the bridge took it (Ray's backpressure), so that what it was on when its worker died is not lost on
        the way (without, the sample yielded just before a SIGKILL never arrived: 10 times in 10 here)."""
        return {track: self.build.options(**SLICE_OPTIONS, **(selector or {}),
                                          **({"_generator_backpressure_num_objects": 1} if track else {}))
                for track in (False, True)}

    def _finish(self, task_id: int, copy: SliceCopy, future: Any) -> None:
        s = self.slices.get(task_id)
        if s is None or copy not in s.copies:
            return  # the other copy of a straggler won, its build was cancelled, or it hung
        exceptions = self.ray.exceptions
        try:
            result, pixels, node = future.result()
        except exceptions.TaskCancelledError:
            return
        except exceptions.RayTaskError as exc:
            # build_slice catches what the decoding raises, so this is the node: prefetchd missing or of another
            # version there, say.  Not the job's fault: another node, or a local worker, builds the slice.
            text = last_line(exc)
            if text not in self.errors:
                self.errors.add(text)
                self.conn.send(Note(logging.WARNING, f"a Ray worker could not run a slice: {text}; is prefetchd[ray] "
                                                     "installed, at the daemon's version, on every node?"))
            self._again(s, copy, text)
            return
        except exceptions.RayError as exc:  # its worker or node was lost: build it again
            self._died(s, copy, exc)
            return
        if isinstance(result, NodeAnswer):  # before its probe answered, or it lost its mount since
            self._answered(result.node_id, result)
            self._again(s, copy, f"node {node} is unfit", lost=False)
            return
        checked = self._checked_here(s.task, result, pixels, node)
        if checked is None:  # from a node already found to read --data otherwise: built elsewhere, not here again
            self._again(s, copy, f"node {node} reads --data otherwise than the daemon's box", lost=False)
            return
        result, pixels, node = checked
        del self.slices[task_id]
        self.track.discard(task_id)
        for other in s.copies:
            if other is not copy:
                self._cancel(other.gen)
        copied = (0, 0.0)
        if isinstance(result, Filled) and pixels is not None:  # a Filled always has them
            t0 = time.perf_counter()
            result = write_rows(s.task, result, pixels)
            if isinstance(result, Filled):  # a copy that failed (ENOSPC) copied nothing
                copied = (sum(int(p.nbytes) for p in pixels), time.perf_counter() - t0)
        latency = time.monotonic() - s.submitted
        self.latencies.append(latency)
        self.conn.send(Done(result, node, latency, copied, s.attempts - 1, s.straggler))

    def _again(self, s: SliceInFlight, copy: SliceCopy, reason: str, lost: bool = True) -> None:
        """``copy``, one copy of slice ``s``, failed for ``reason``: submit it again, up to MAX_ATTEMPTS,
        then hand it back to the controller.  Not ``lost`` (a node answered that it is unfit, before its
        probe did, say): submitted elsewhere and not counted as a retry, which the status keeps for
        lost workers and nodes; the selector now excludes that node, so this ends with the nodes."""
        s.copies.remove(copy)
        if s.copies:
            return  # its other copy still runs
        if not lost:
            self.conn.send(Note(logging.INFO, f"slice {s.task.task_id}: {reason}; submitting it to another node"))
            self._submit(s)
            return
        if s.attempts >= MAX_ATTEMPTS:
            del self.slices[s.task.task_id]
            self.conn.send(Returned(s.task.task_id, reason, s.attempts - 1))  # retries, as Done counts them
            return
        s.attempts += 1
        self.conn.send(Note(logging.INFO, f"slice {s.task.task_id}: {reason.splitlines()[0][:200]}; submitting it "
                                          f"again (attempt {s.attempts} of {MAX_ATTEMPTS})"))
        self._submit(s)

    def _died(self, s: SliceInFlight, copy: SliceCopy, exc: Exception) -> None:
        """``copy`` of slice ``s`` ended with its Ray worker or node.  Built an item at a time, it says the
        sample it died on: handed back (``Died``) for the controller to count that death on the file.
        Else it is submitted again (``_again``), an item at a time from now on, so that a file that kills
        whatever decodes it is named by its next death.  One that died before its first image (before it
        began, or built an item at a time, before its first sample) is told to the controller too
        (``StartDied``): no file killed it, and where every Ray worker dies so the slice would go round for
        good."""
        if copy.track:
            copy.poll(self.ray, time.monotonic())  # the items it began before it died
        if copy.track and copy.on is not None:
            del self.slices[s.task.task_id]
            for other in s.copies:
                if other is not copy:
                    self._cancel(other.gen)
            self.conn.send(Died(s.task.task_id, copy.on, type(exc).__name__, s.attempts - 1))
            return
        if copy.moved is None or copy.track:
            self._start_died(s.task.task_id, exc)
        self.track.add(s.task.task_id)
        self._again(s, copy, f"{type(exc).__name__}: {exc}")

    def _hand_back_hung(self, now: float) -> None:
        """Cancel each slice that has made no progress for --task-timeout since it began, killing the Ray workers
        that hold it (a hook that never returns, a read of a hung mount there), and hand it back (``Hung``); and
        each that has not begun --worker-start-timeout after it was submitted, killing its Ray worker (a hook's
        module whose import blocks on a node, --data on a hung mount there during the probe), and submit it again
        (``_start_hung``).  The one of the others that has gone so the longest, past a quarter of its bound
        (``stall_noted_after``), is ``stalled``.

        A slice not begun is timed from its submission, its time queued at Ray included (Ray says when a task
        leaves its queue only through its state API, the dashboard's).  That is sound: the controller sends at
        most ``TASKS_PER_WORKER`` slices per CPU of the nodes that get slices (``RemotePool.dispatch``), so a
        healthy slice waits in Ray's queue behind the few others on its CPU, seconds, against a default bound of
        600 s; one queued behind a start that blocks is cancelled with it, about as long after its own
        submission, and both go again.  A cluster busy with others' tasks may queue ours longer: raise
        --worker-start-timeout there."""
        stalled: Stalled | None = None
        for s in list(self.slices.values()):
            for c in s.copies:
                if c.moved is None or c.track:  # not begun (queued, or its worker starting), or tracked
                    c.poll(self.ray, now)
            if not s.copies or any(c.answer is not None or c.error is not None for c in s.copies):
                continue  # answered: its completion is on the way
            begun = [c for c in s.copies if c.moved is not None]
            latest = max(begun, key=lambda c: c.moved or 0.0) if begun else None
            # Not begun: timed from its latest copy's submission (a straggler's second copy may yet begin).
            since = (latest.moved or now) if latest is not None else max(c.submitted for c in s.copies)
            limit, noted = ((self.task_timeout, self.stall_noted) if latest is not None else
                            (self.start_timeout, self.start_noted))
            still = now - since
            if still < limit:
                if still >= noted and (stalled is None or since < stalled.moved):
                    stalled = Stalled(s.task.task_id, latest.on if latest is not None else None, since,
                                      starting=latest is None)
                continue
            for c in s.copies:
                self._cancel(c.gen, force=True)
            if latest is None:
                self._start_hung(s, still)
                continue
            del self.slices[s.task.task_id]
            self.track.add(s.task.task_id)
            self.conn.send(Hung(s.task.task_id, latest.on, still, s.attempts - 1))
        self.stalled = stalled

    def _start_hung(self, s: SliceInFlight, seconds: float) -> None:
        """The copies of slice ``s``, cancelled (their Ray workers killed) after ``seconds`` without beginning:
        tell the controller (``StartHung``), which counts it and stops the job where the slice never begins, and
        submit the slice again.  No file is to blame (none was read), so it is not built an item at a time for
        this; nor is it an attempt (``MAX_ATTEMPTS`` counts lost workers and nodes): the controller's count
        bounds these."""
        s.copies.clear()  # the cancelled copies' completions, if any come, are no answer (``_finish``)
        self.conn.send(StartHung(s.task.task_id, seconds))
        self._submit(s)

    def _relaunch_stragglers(self, now: float) -> None:
        if len(self.latencies) < STRAGGLER_SAMPLES:
            return
        limit = max(STRAGGLER_MIN_SECONDS, STRAGGLER_FACTOR * float(np.median(self.latencies)))
        for s in list(self.slices.values()):
            if not s.straggler and now - s.submitted > limit:
                s.straggler = True
                self._submit(s)


__all__ = ["MAX_ATTEMPTS", "SLICE_OPTIONS", "STRAGGLER_FACTOR", "STRAGGLER_MIN_SECONDS", "STRAGGLER_SAMPLES",
           "BridgeSlices", "SliceInFlight"]
