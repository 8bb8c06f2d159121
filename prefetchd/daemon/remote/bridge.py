"""The bridge process: the Ray driver.  It submits the controller's slices to the cluster, writes
what comes back into the batches' temp files, resubmits what the cluster lost, relaunches
stragglers, hands back the slices that hang or kill their Ray workers, and reports the cluster's
nodes and CPUs, the slice that has gone longest without progress, and the Ray workers that die before their
first image (see ``prefetchd.daemon.remote``)."""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from prefetchd import __version__
from prefetchd.buffer_protocol import SlotFiller
from prefetchd.daemon.remote.task import (Answer, NodeAnswer, Sample, Shipment, build_rows, build_slice, node_label,
                                          probe_node, probe_samples, sample_here)
from prefetchd.daemon.sources import SampleReader
from prefetchd.daemon.worker_health import stall_noted_after
from prefetchd.daemon.workers import (Filled, Task, WorkerJob, WriteFailed, prepare_process, replaced_before,
                                     task_slots)
from prefetchd.words import counted

REPORT_SECONDS = 1.0  # the bridge reports the cluster's nodes and CPUs this often
TRACK_POLL_SECONDS = 0.02  # a slice built an item at a time waits for the bridge to take each item: looked at this often
MAX_ATTEMPTS = 3  # submissions of one slice at the cluster before it goes back to the controller
STRAGGLER_FACTOR = 4.0  # a slice outstanding this many times the median is started again
STRAGGLER_MIN_SECONDS = 2.0  # ... but never before this, and only once STRAGGLER_SAMPLES are known
STRAGGLER_SAMPLES = 16
NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node: its id
SHOWN_FAILURES = 3  # unreadable samples named in a node's warning
TOKEN_AUTH = ("start the daemon with RAY_AUTH_MODE=token and the cluster's token in ~/.ray/auth_token (or "
              "RAY_AUTH_TOKEN_PATH); see docs/SCALE.md, 'Token authentication'")
REACH_SECONDS = 5.0  # the TCP check of a head's address before ray.init (``unreachable``)
REPROBE_SECONDS = 30.0  # an unfit node that could read --data again (a mount back, files synced) is probed this often


# -- messages from the bridge to the controller --------------------------------


@dataclass(frozen=True)
class Stalled:
    """The slice at the cluster that has gone longest without progress, once that is long enough to be said
    (``worker_health.stall_noted_after`` of --task-timeout), as a local worker's stall is: the controller
    says it in the status (its message and ``worker_stall``), so that a trainer waits on until the bridge
    hands the slice back (``Hung``) rather than give up first."""

    task_id: int
    sample: int | None  # the one it is on, where it is built an item at a time (``_Copy.track``), else None
    # time.monotonic() when it last moved on (began, or began an item): the bridge is a process of the daemon's
    # box, and CLOCK_MONOTONIC is one clock for all of its processes, so the controller counts the seconds itself.
    moved: float


@dataclass(frozen=True)
class Report:
    """The cluster as the bridge sees it; ``connected`` False: it could not connect and exits."""

    connected: bool
    nodes: int = 0  # alive
    cpus: int = 0  # of the alive nodes that get slices: all but the unfit ones
    message: str = ""
    unfit: tuple[str, ...] = ()  # "node: why" for each alive node that cannot build slices
    stalled: Stalled | None = None


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
class Hung:
    """A slice that made no progress at the cluster for --task-timeout: its Ray tasks were cancelled, their
    workers killed (``ray.cancel(force=True)``), and the controller judges it as a local worker's hang.
    ``sample``: the one it was on, where the slice was built an item at a time (it had hung or killed
    its worker before), else None."""

    task_id: int
    sample: int | None
    seconds: float  # since it last moved on (began, or began an item)
    retries: int


@dataclass(frozen=True)
class Died:
    """A slice whose Ray worker died while it built the item of ``sample`` (the slice was built an item at
    a time, having killed a worker before): the controller counts that death on the file, as a local
    worker's (``CRASHES_TO_BLAME``), and queues the slice again."""

    task_id: int
    sample: int
    how: str  # the Ray error's name: WorkerCrashedError, OutOfMemoryError (Ray's memory monitor), ...
    retries: int


@dataclass(frozen=True)
class StartDied:
    """A Ray worker died before the first image of what it ran: before a slice began (in the worker's start:
    importing prefetchd, torch or the --transform hook's module; loading the job), or, for a slice built an item
    at a time, before its first sample; or running a node's probe (``task_id`` None).  No file is to blame, so
    the bridge submits the slice again as ever (``_again``); the controller counts these deaths
    (``WorkerHealth.ray_start_died``): where the cluster's workers all die so, the job stops instead of sending
    the slices round for good.  Not for a node's death (Ray's NodeDiedError): that is a node leaving."""

    task_id: int | None
    how: str  # the Ray error's name: WorkerCrashedError, OutOfMemoryError, ...
    text: str  # the first line of Ray's message
    node: str = ""  # the node's label, for a probe (pinned to it); "" for a slice (not known where it ran)


@dataclass(frozen=True)
class Cancelled:
    """Slices of a cancelled build (``Cancel``) that the bridge forgot: nothing of them was written into the
    batch's temp file, nor will be.  Each is answered once: with ``Done`` (or ``Returned``) where that went
    first, else with this, at once."""

    task_ids: tuple[int, ...]


@dataclass(frozen=True)
class Note:
    """A line for the daemon's log (the bridge has no logging set up of its own)."""

    level: int
    text: str


# -- messages from the controller to the bridge --------------------------------
# (besides a ``Task`` to build, and None: stop)


@dataclass(frozen=True)
class Cancel:
    """The controller cancelled a build (a rewind, or a failed write): its slices that it sent the bridge and
    has no answer for.

    The controller unlinks the build's temp file once every slice of it is answered, and a later build of
    the same batch creates a file of the same name; so the bridge answers each slice it still holds with
    ``Cancelled`` and never writes it after that.  A slice it answered already (``Done``: written, or
    ``Returned``) is not answered again: the controller drops that answer as the build's."""

    task_ids: tuple[int, ...]


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
class _Copy:
    """One submission of a slice: the stream of its Ray task (``build_slice``) and how far it got."""

    gen: Any  # the ObjectRefGenerator
    track: bool  # built an item at a time, each sample it begins (a replacement too) yielded first
    moved: float | None = None  # when it last moved on (began, or began an item); None: not begun yet
    on: int | None = None  # tracked: the sample of the item it is on
    answer: Answer | None = None  # taken from the stream while polling it
    error: Exception | None = None  # ... or the error it holds instead

    def poll(self, ray: Any, now: float) -> None:
        """Take what the slice has yielded since the last look (what it is on; its answer, if it came)."""
        while self.error is None and self.answer is None and self.gen.next_ready():
            try:
                self._took(ray.get(next(self.gen)), now)
            except StopIteration:
                return
            except Exception as exc:  # the task's failure, raised again by ``outcome``
                self.error = exc

    def outcome(self, ray: Any, completed: Any) -> Answer:
        """The slice's answer once its task completed (``completed``: the future of ``gen.completed()``);
        raises what ended it otherwise: its worker's death, a cancellation, an error there."""
        completed.result()
        for ref in self.gen:
            self._took(ray.get(ref), time.monotonic())
        if self.error is not None:
            raise self.error
        if self.answer is None:
            raise RuntimeError("a slice's Ray task ended without an answer")
        return self.answer

    def _took(self, value: Any, now: float) -> None:
        if isinstance(value, tuple):
            self.answer = value
            return
        self.moved, self.on = now, value if value is not None else self.on


@dataclass
class _Slice:
    task: Task
    submitted: float
    attempts: int = 1
    refs: list[Any] = field(default_factory=list)  # a _Copy each
    straggler: bool = False


@dataclass
class _Node:
    """An alive node with CPUs, as the bridge knows it: unfit once it failed the probe."""

    label: str
    cpus: int
    probe: Any = None  # the probe's reference while it runs
    reason: str = ""  # why it is unfit; "" while it is probed, and once it passed
    probed: float = 0.0  # when its last probe was started (time.monotonic)
    # Samples it read otherwise than the daemon's box: its next probes read them too.
    differs: tuple[Sample, ...] = ()
    covers: tuple[Sample, ...] = ()  # the ``differs`` its running probe reads: a pass clears only what it read
    again: bool = True  # unfit for what a probe can find mended: not its prefetchd version or hook module


class Bridge:
    """Submits the controller's tasks to Ray and answers with what came back.

    Slices stay off the nodes that failed the probe: a task pinned to each node that joins (its
    label ``ray.io/node-id``) checks there that it runs the daemon's prefetchd, imports what the
    job needs (the transform hook) and reads the job's probe samples, so that a node without the
    dataset's mount, its credentials or the hook's module is named at once, and slices carry a
    label selector that excludes it.  A slice that reaches such a node before its probe answered gets the same
    answer from ``build_slice`` and goes elsewhere: a node never builds a batch it cannot read.
    The selector excludes and never requires a node, so no slice waits for a node that died.

    A node that passed the probe may still lack a file, or hold a damaged copy: it replaces that
    sample, as a local worker replaces one it cannot decode, and its slice would differ from the
    box's.  So a slice that comes back with replaced samples (or using one the box cannot) is built
    again here, on the daemon's box, unless the box replaced the same ones before; the box's build
    is the one written, and a node that read a sample otherwise than the box gets no more slices
    (``_checked_here``).  Unfit nodes are probed again every ``REPROBE_SECONDS``, with the samples
    they read otherwise, against the box's bytes."""

    def __init__(self, conn: Connection, job: WorkerJob, task_timeout: float) -> None:
        import ray

        self.ray: Any = ray
        self.conn = conn
        self.job = job
        self.task_timeout = task_timeout  # --task-timeout: a slice without progress this long is hung
        self.stall_noted = stall_noted_after(task_timeout)  # ... and one without for this long is said (``Stalled``)
        self.stalled: Stalled | None = None  # the slice longest without progress, past ``stall_noted``
        self.reader = SampleReader(job.index, job.readers)
        self.prepared = False  # for building slices here (``_build_here``)
        self.failing_here: set[int] = set()  # samples the box itself could not use: a node failing them is no news
        probe = probe_samples(job, self.reader)
        self.box = [ray.put(Shipment(job, probe, __version__))]  # once per job
        self.build = ray.remote(build_slice)
        self.probe = ray.remote(probe_node)
        self._build_on: tuple[frozenset[str], dict[bool, Any]] = (frozenset(), self._builds())
        self.nodes: dict[str, _Node] = {}  # by Ray's node id
        self.slices: dict[int, _Slice] = {}
        # The slices that hung or killed their Ray worker here: built an item at a time from then on (``_Copy``).
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
            tracking = any(c.track for s in self.slices.values() for c in s.refs if isinstance(c, _Copy))
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
            self.slices[task.task_id] = _Slice(task, time.monotonic())
            self._submit(self.slices[task.task_id])
        return True

    def _forget(self, task_ids: tuple[int, ...]) -> None:
        """Drop the slices of a cancelled build: answered at once, never relaunched, and a result that comes
        later finds no slice (``_finish``), so it is not written into a file that is another build's by then.
        An id not held was answered already (the pipe is ordered: its task came before the cancellation)."""
        forgotten = tuple(task_id for task_id in task_ids if task_id in self.slices)
        for task_id in forgotten:
            self.track.discard(task_id)
            for ref in self.slices.pop(task_id).refs:
                # Frees the cluster's CPUs for the new window: a copy not started yet never runs, a running one
                # gets a KeyboardInterrupt (Ray's cancel without force), as a straggler's losing copy does; its
                # Ray worker lives on, and what it keeps of the job is set only once complete (``_here``).
                self._cancel(ref)
        if forgotten:
            self.conn.send(Cancelled(forgotten))

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

    def _submit(self, s: _Slice) -> None:
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
        copy = _Copy(self._build_on[1][track].remote(self.box, s.task, *((True,) if track else ())), track)
        s.refs.append(copy)
        self._watch(copy.gen.completed(),
                    lambda future: self._finish(s.task.task_id, copy, _Streamed(self.ray, copy, future)))

    def _builds(self, selector: dict[str, Any] | None = None) -> dict[bool, Any]:
        """The slice task with its options, by whether it is tracked: a tracked one's every yield waits until
        the bridge took it (Ray's backpressure), so that what it was on when its worker died is not lost on
        the way (without, the sample yielded just before a SIGKILL never arrived: 10 times in 10 here)."""
        return {track: self.build.options(**SLICE_OPTIONS, **(selector or {}),
                                          **({"_generator_backpressure_num_objects": 1} if track else {}))
                for track in (False, True)}

    def _finish(self, task_id: int, ref: Any, future: Any) -> None:
        s = self.slices.get(task_id)
        if s is None or ref not in s.refs:
            return  # the other copy of a straggler won, its build was cancelled, or it hung
        exceptions = self.ray.exceptions
        try:
            result, pixels, node = future.result()
        except exceptions.TaskCancelledError:
            return
        except exceptions.RayTaskError as exc:
            # build_slice catches what the decoding raises, so this is the node: prefetchd missing or of another
            # version there, say.  Not the job's fault: another node, or a local worker, builds the slice.
            text = _last_line(exc)
            if text not in self.errors:
                self.errors.add(text)
                self.conn.send(Note(logging.WARNING, f"a Ray worker could not run a slice: {text}; is prefetchd[ray] "
                                                     "installed, at the daemon's version, on every node?"))
            self._again(s, ref, text)
            return
        except exceptions.RayError as exc:  # its worker or node was lost: build it again
            self._died(s, ref, exc)
            return
        if isinstance(result, NodeAnswer):  # before its probe answered, or it lost its mount since
            self._answered(result.node_id, result)
            self._again(s, ref, f"node {node} is unfit", lost=False)
            return
        checked = self._checked_here(s.task, result, pixels, node)
        if checked is None:  # from a node already found to read --data otherwise: built elsewhere, not here again
            self._again(s, ref, f"node {node} reads --data otherwise than the daemon's box", lost=False)
            return
        result, pixels, node = checked
        del self.slices[task_id]
        self.track.discard(task_id)
        for other in s.refs:
            if other is not ref:
                self._cancel(other)
        copied = (0, 0.0)
        if isinstance(result, Filled) and pixels is not None:  # a Filled always has them
            t0 = time.perf_counter()
            result = write_rows(s.task, result, pixels)
            if isinstance(result, Filled):  # a copy that failed (ENOSPC) copied nothing
                copied = (sum(int(p.nbytes) for p in pixels), time.perf_counter() - t0)
        latency = time.monotonic() - s.submitted
        self.latencies.append(latency)
        self.conn.send(Done(result, node, latency, copied, s.attempts - 1, s.straggler))

    def _checked_here(self, task: Task, result: Filled | WriteFailed, pixels: list[np.ndarray] | None,
                      node: str) -> tuple[Filled | WriteFailed, list[np.ndarray] | None, str] | None:
        """``result``, a node's build of ``task``, as the daemon's box builds it: (result, pixels, who built
        it); None: the node is unfit already, and the slice is to be built elsewhere.

        A slice whose every sample is used or replaced as on the box (the box could not use the samples
        the node replaced, and uses the ones the node used) is the box's.  Otherwise the box builds it
        (rare: a bad file, each remembered once the box failed it), and that build is the one written.
        Where the two differ, the node's copy of --data differs from the box's: it gets no slices until
        a probe that reads those samples with the box's bytes passes."""
        if isinstance(result, Filled):
            # Less the samples found to kill their workers, which every build fails unread (``Task.crashed``).
            tried = self._tried(task, result) - {i for i, _reason in task.crashed}
            if not tried - self.failing_here and not {i for _slot, i, _label in result.slots} & self.failing_here:
                return result, pixels, node
        elif not result.failures:
            return result, pixels, node  # not a sample's failure: the batch file's, or the store's
        builder = self._node_labelled(node)
        if builder is not None and builder.reason:
            return None  # one build here per finding: a node that sends many such slices must not stall the bridge
        here, rows = self._build_here(task)
        used_here: set[int] = set()
        if isinstance(here, Filled):
            self.failing_here |= self._tried(task, here)
            used_here = {i for _slot, i, _label in here.slots}
        why = dict(result.failures)
        # Samples the node could not use that the box uses, and samples the node used that the box cannot.
        differs = {i: why[i] for i in sorted(used_here) if i in why}
        if isinstance(result, Filled):
            differs |= {i: "the node used it; the daemon's box cannot" for _slot, i, _label in result.slots
                        if i in self.failing_here}
        if differs and builder is not None:
            here_now = (sample_here(self.reader, i) for i in differs)
            builder.differs = tuple(sorted({*builder.differs, *(sample for sample in here_now if sample is not None)}))
            shown = "; ".join(f"{self.job.index.name(i)} ({reason})" for i, reason in list(differs.items())[:SHOWN_FAILURES])
            self._unfit(builder, f"reads {counted(len(differs), 'sample')} otherwise than the daemon's box: {shown}; "
                                 "its copy of --data differs from the box's, and so would its batches: sync it (it "
                                 f"is probed again every {REPROBE_SECONDS:.0f} s, with these samples)")
        return here, rows, BOX_LABEL

    def _tried(self, task: Task, result: Filled) -> set[int]:
        """The samples ``result`` tried and could not use."""
        requested = dict(task.items)
        return {i for slot, used, _label in result.slots for i in replaced_before(self.job, requested[slot], used)}

    def _node_labelled(self, label: str) -> _Node | None:
        """The node a slice says it was built on (``node_label``: by the start of its id, not its host name,
        which Ray and the node's own ``gethostname`` may spell differently)."""
        return next((n for node_id, n in self.nodes.items() if label.endswith("/" + node_id[:8])), None)

    def _build_here(self, task: Task) -> tuple[Filled | WriteFailed, list[np.ndarray] | None]:
        if not self.prepared:
            prepare_process(self.job)
            self.prepared = True
        return build_rows(self.job, task, self.reader)

    def _again(self, s: _Slice, ref: Any, reason: str, lost: bool = True) -> None:
        """``ref``, one copy of slice ``s``, failed for ``reason``: submit it again, up to MAX_ATTEMPTS,
        then hand it back to the controller.  Not ``lost`` (a node answered that it is unfit, before its
        probe did, say): submitted elsewhere and not counted as a retry, which the status keeps for
        lost workers and nodes; the selector now excludes that node, so this ends with the nodes."""
        s.refs.remove(ref)
        if s.refs:
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

    def _died(self, s: _Slice, copy: Any, exc: Exception) -> None:
        """``copy`` of slice ``s`` ended with its Ray worker or node.  Built an item at a time, it says the
        sample it died on: handed back (``Died``) for the controller to count that death on the file.
        Else it is submitted again (``_again``), an item at a time from now on, so that a file that kills
        whatever decodes it is named by its next death.  One that died before its first image (before it
        began, or built an item at a time, before its first sample) is told to the controller too
        (``StartDied``): no file killed it, and where every Ray worker dies so the slice would go round for
        good."""
        if isinstance(copy, _Copy) and copy.track:
            copy.poll(self.ray, time.monotonic())  # the items it began before it died
        if isinstance(copy, _Copy) and copy.track and copy.on is not None:
            del self.slices[s.task.task_id]
            for other in s.refs:
                if other is not copy:
                    self._cancel(other)
            self.conn.send(Died(s.task.task_id, copy.on, type(exc).__name__, s.attempts - 1))
            return
        if isinstance(copy, _Copy) and (copy.moved is None or copy.track):
            self._start_died(s.task.task_id, exc)
        self.track.add(s.task.task_id)
        self._again(s, copy, f"{type(exc).__name__}: {exc}")

    def _start_died(self, task_id: int | None, exc: Exception, node: str = "") -> None:
        """Tell the controller of a Ray worker that died before its first image (``StartDied``), unless its
        node died: a node that leaves takes its workers with it, however far they got."""
        if not isinstance(exc, self.ray.exceptions.NodeDiedError):
            self.conn.send(StartDied(task_id, type(exc).__name__, _first_line(exc), node))

    def _hand_back_hung(self, now: float) -> None:
        """Cancel each slice that has made no progress for --task-timeout, killing the Ray workers that
        hold it (a hook that never returns, a read of a hung mount there), and hand it back (``Hung``).
        The one of the others that has made none the longest, past ``stall_noted``, is ``stalled``."""
        stalled: Stalled | None = None
        for s in list(self.slices.values()):
            copies = [c for c in s.refs if isinstance(c, _Copy)]
            for c in copies:
                if c.moved is None or c.track:  # not begun (queued, or its worker starting), or tracked
                    c.poll(self.ray, now)
            begun = [c for c in copies if c.moved is not None]
            if not begun:
                continue  # queued at Ray, or its worker starts (importing torch for a hook): not timed
            latest = max(begun, key=lambda c: c.moved or 0.0)
            still = now - (latest.moved or now)
            if any(c.answer is not None or c.error is not None for c in copies):
                continue  # answered: its completion is on the way
            if still < self.task_timeout:
                if still >= self.stall_noted and (stalled is None or (latest.moved or now) < stalled.moved):
                    stalled = Stalled(s.task.task_id, latest.on, latest.moved or now)
                continue
            del self.slices[s.task.task_id]
            for c in copies:
                self._cancel(c, force=True)
            self.track.add(s.task.task_id)
            self.conn.send(Hung(s.task.task_id, latest.on, still, s.attempts - 1))
        self.stalled = stalled

    def _cancel(self, ref: Any, force: bool = False) -> None:
        """Cancel a Ray task (a slice's ``_Copy``, or a probe's reference); ``force``: kill its worker too."""
        try:
            self.ray.cancel(ref.gen if isinstance(ref, _Copy) else ref, force=force)
        except Exception:  # already finished or its node gone: nothing to stop
            pass

    def _relaunch_stragglers(self, now: float) -> None:
        if len(self.latencies) < STRAGGLER_SAMPLES:
            return
        limit = max(STRAGGLER_MIN_SECONDS, STRAGGLER_FACTOR * float(np.median(self.latencies)))
        for s in list(self.slices.values()):
            if not s.straggler and now - s.submitted > limit:
                s.straggler = True
                self._submit(s)

    # -- the nodes

    def _track(self, alive: list[dict[str, Any]]) -> None:
        """Probe each node with CPUs that joined; forget the ones that left."""
        seen = set()
        for n in alive:
            node_id, cpus = n["NodeID"], int(n.get("Resources", {}).get("CPU", 0))
            if not cpus:
                continue  # a head without CPUs, say: it never gets a slice
            seen.add(node_id)
            known = self.nodes.get(node_id)
            if known is not None:
                known.cpus = cpus
                if (known.reason and known.again and known.probe is None
                        and time.monotonic() - known.probed >= REPROBE_SECONDS):
                    self._start_probe(node_id, known)
                continue
            self._start_probe(node_id, self.nodes.setdefault(
                node_id, _Node(node_label(n.get("NodeManagerHostname", "?"), node_id), cpus)))
        for node_id in set(self.nodes) - seen:
            if self.nodes[node_id].probe is not None:
                self._cancel(self.nodes[node_id].probe)
            del self.nodes[node_id]

    def _start_probe(self, node_id: str, node: _Node) -> None:
        # No CPU: the probe never waits behind slices.
        node.probed = time.monotonic()
        node.covers = node.differs
        # ``differs`` only when there are some: an older prefetchd's probe takes the box alone, and then
        # says which version it runs.
        node.probe = self.probe.options(num_cpus=0, max_retries=0, label_selector={NODE_ID_LABEL: node_id}).remote(
            self.box, *((node.differs,) if node.differs else ()))
        self._watch(node.probe, functools.partial(self._probed, node_id))

    def _probed(self, node_id: str, future: Any) -> None:
        node = self.nodes.get(node_id)
        if node is None:
            return  # it left meanwhile
        node.probe = None
        try:
            answer = future.result()
        except self.ray.exceptions.RayTaskError as exc:  # it cannot run prefetchd's tasks at all
            self._unfit(node, f"cannot run prefetchd's tasks ({_last_line(exc)}); install prefetchd[ray], at the "
                              "daemon's version, on every node")
            return
        except self.ray.exceptions.RayError as exc:
            del self.nodes[node_id]  # its worker died: probed again at the next report if it is alive
            self._start_died(None, exc, node.label)
            return
        self._answered(node_id, answer)

    def _answered(self, node_id: str, answer: NodeAnswer) -> None:
        # A slice may answer for a node that joined since the last report: its CPUs come with the next.
        node = self.nodes.setdefault(node_id, _Node(answer.node, 0))
        if answer.unable:
            node.again = False  # its prefetchd or the hook's module: a probe finds the same until the node restarts
            self._unfit(node, f"cannot build the job's slices: {answer.unable}")
            return
        if not answer.failures:
            if not set(node.differs) <= set(node.covers):
                node.probed = 0.0  # begun before the node read samples otherwise: probed again, with them
                return
            again = " again" if node.reason else ""
            node.reason = ""
            self.conn.send(Note(logging.INFO, f"node {node.label} reads --data{again} ({answer.checked} samples "
                                              f"checked): it builds slices{again}"
                                              + (f" with its {counted(node.cpus, 'CPU')}" if node.cpus else "")))
            return
        more = len(answer.failures) - SHOWN_FAILURES
        named = "; ".join(answer.failures[:SHOWN_FAILURES]) + (f"; and {more} more" if more > 0 else "")
        self._unfit(node, f"cannot read {len(answer.failures)} of the {answer.checked} samples probed: {named}; "
                          "mount the same --data at the same path on every node, or give every node credentials "
                          "for its object storage")

    def _unfit(self, node: _Node, reason: str) -> None:
        if not node.reason:  # once: the probe and a slice may both answer
            self.conn.send(Note(logging.WARNING, f"node {node.label} {reason}; it gets no slices"))
            node.probed = time.monotonic()  # probed again in REPROBE_SECONDS, not at once
        node.reason = reason

    def _report(self) -> Report:
        alive = [n for n in self.ray.nodes() if n.get("Alive")]
        self._track(alive)
        stalled = self.stalled if self.stalled is not None and self.stalled.task_id in self.slices else None
        return Report(True, len(alive), sum(n.cpus for n in self.nodes.values() if not n.reason),
                      unfit=tuple(f"{n.label}: {n.reason}" for n in self.nodes.values() if n.reason), stalled=stalled)


BOX_LABEL = "the daemon's box"  # who built a slice that ``_checked_here`` built again there
# Each slice a streaming task: it says when it begins (and, tracked, each item), which the hang check times.
SLICE_OPTIONS: dict[str, Any] = {"num_cpus": 1, "max_retries": 0, "num_returns": "streaming"}


class _Streamed:
    """A slice's completion as ``Bridge._finish`` takes it: ``result()`` is its answer, or raises."""

    def __init__(self, ray: Any, copy: _Copy, completed: Any) -> None:
        self.ray, self.copy, self.completed = ray, copy, completed

    def result(self) -> Answer:
        return self.copy.outcome(self.ray, self.completed)


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1][:300] if text else type(exc).__name__


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def write_rows(task: Task, result: Filled, pixels: Sequence[np.ndarray]) -> Filled | WriteFailed:
    """Write a remote slice's images (one per item, in order) into the slots of its batch's temp file,
    as a local worker would have."""
    try:
        with SlotFiller(task.path, task.images_offset, task.slot_bytes, task_slots(task), task.file_id) as slots:
            for row, (slot, _index) in enumerate(task.items):
                slots.fill(slot, pixels[row].data)
    except OSError as exc:  # no space, or the batch was aborted meanwhile
        return WriteFailed(task.task_id, f"cannot write {task.path}: {exc.strerror}")
    return result


def unreachable(address: str) -> str:
    """Why nothing accepts a connection at a ``HOST:PORT`` or ``ray://HOST:PORT`` address, or "".

    ray.init does not fail for a head that is not there: it retries (tried with Ray 2.60, a port
    nobody listens on: still trying after 200 s) while the daemon says only "connecting".  A TCP
    connection to the same address fails at once for a refused port or an unknown host, and
    within ``REACH_SECONDS`` for one that drops packets, and says why."""
    if address in ("local", "auto"):
        return ""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=REACH_SECONDS).close()
    except OSError as exc:  # socket.gaierror (no such host) and TimeoutError included
        return (f"nothing answers there ({type(exc).__name__}: {exc.strerror or exc}); start the head "
                "(`ray start --head`), or check the address and that its port is open to this machine")
    return ""


def connect_failure(address: str, exc: Exception) -> str:
    """Why ``connect`` failed, in prefetchd's terms (the daemon's warning names the address before it):
    for ``auto`` with no cluster found, Ray's own
    hint names its CLI's ``--address`` flag, which prefetchd does not have.  (RAY_ADDRESS, which
    ``auto`` follows when set, leaves Ray's message as it is: it names that address.)"""
    why = f"{type(exc).__name__}: {exc}"
    text = str(exc)
    if address == "auto" and isinstance(exc, ConnectionError) and not os.environ.get("RAY_ADDRESS"):
        why = ("no Ray cluster runs on this machine (--ray auto joins one that `ray start` started here); "
               "name a head with --ray HOST:6379, or use --ray local for a private one")
    elif "ray[client]" in text:
        why += ("; prefetchd[ray] does not install Ray's client: pip install 'ray[client]' (of the cluster's Ray "
                "version) here, or join the head's GCS with --ray HOST:6379")
    elif "auth" in text.lower():
        why += f"; {TOKEN_AUTH}"
    elif (isinstance(exc, ConnectionError) and address not in ("local", "auto")
          and os.environ.get("RAY_AUTH_MODE", "").lower() != "token"):
        # A head with token authentication refuses a driver without the token with only "Failed to connect to
        # Ray cluster" after 20 s (Ray 2.60); its port answered (``unreachable``), so that is the likeliest cause.
        why += ("; if the head uses token authentication (Ray 2.60 turns it on where a token exists when "
                f"`ray start --head` runs): {TOKEN_AUTH}")
    return why


def bridge_main(conn: Connection, job: WorkerJob, address: str, task_timeout: float) -> None:
    # Ctrl-C reaches the whole process group; the controller alone decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    why = unreachable(address)  # before the import of Ray: seconds sooner
    if why:
        conn.send(Report(False, message=why))
        return
    try:
        import ray

        connect(address)
    except Exception as exc:  # no cluster there, a version mismatch, ...
        conn.send(Report(False, message=connect_failure(address, exc)))
        return
    try:
        Bridge(conn, job, task_timeout).run()
    except (EOFError, OSError):  # the controller went away
        pass
    finally:
        ray.shutdown()


__all__ = ["Bridge", "Cancel", "Cancelled", "Died", "Done", "Hung", "Note", "Report", "Returned", "Stalled",
           "StartDied", "bridge_main", "connect", "unreachable", "write_rows"]
