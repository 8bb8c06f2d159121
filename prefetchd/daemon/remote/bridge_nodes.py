"""The bridge's nodes: each alive node with CPUs, probed when it joins and again now and then while it is unfit,
and the cluster's report made from them (``Report``).

A part of :class:`~prefetchd.daemon.remote.bridge.Bridge`, which sets what is declared here in its ``__init__``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from prefetchd.daemon.remote.messages import Note, Report, Stalled, last_line
from prefetchd.daemon.remote.task import NodeAnswer, Sample, node_label
from prefetchd.daemon.tasks import WorkerJob
from prefetchd.daemon.worker_health import RAY_START, ray_start_checks
from prefetchd.words import counted

NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node: its id
SHOWN_FAILURES = 3  # unreadable samples named in a node's warning
REPROBE_SECONDS = 30.0  # an unfit node that could read --data again (a mount back, files synced) is probed this often


@dataclass
class BridgeNode:
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


class BridgeNodes:
    """The nodes of a :class:`~prefetchd.daemon.remote.bridge.Bridge` and their probes.

    Slices stay off the nodes that failed the probe: a task pinned to each node that joins (its
    label ``ray.io/node-id``) checks there that it runs the daemon's prefetchd, imports what the
    job needs (the transform hook) and reads the job's probe samples, so that a node without the
    dataset's mount, its credentials or the hook's module is named at once, and slices carry a
    label selector that excludes it.  A slice that reaches such a node before its probe answered gets the same
    answer from ``build_slice`` and goes elsewhere: a node never builds a batch it cannot read.
    The selector excludes and never requires a node, so no slice waits for a node that died.

    Unfit nodes are probed again every ``REPROBE_SECONDS``, with the samples they read otherwise than
    the box (found by ``bridge_rows.py``), against the box's bytes.  A probe is a Ray worker's start and a few
    reads, bounded as a slice's start is, by --worker-start-timeout: a node whose probe has not answered by then
    (a hook's module whose import blocks there, --data on a hung mount) is unfit, its probe cancelled and its
    Ray worker killed, so that slices stop going there to block the same way."""

    # Set by Bridge.__init__.
    ray: Any
    conn: Connection
    box: list[Any]
    job: WorkerJob
    start_timeout: float
    probe: Any
    nodes: dict[str, BridgeNode]
    slices: Mapping[int, object]  # of _Slices (``bridge_slices.py``), by task id
    stalled: Stalled | None

    if TYPE_CHECKING:  # the bridge's
        def _watch(self, ref: Any, then: Callable[[Any], None]) -> None: ...
        def _cancel(self, ref: Any, force: bool = False) -> None: ...
        def _start_died(self, task_id: int | None, exc: Exception, node: str = "") -> None: ...

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
                if known.probe is not None and time.monotonic() - known.probed >= self.start_timeout:
                    self._probe_hung(known)
                if (known.reason and known.again and known.probe is None
                        and time.monotonic() - known.probed >= REPROBE_SECONDS):
                    self._start_probe(node_id, known)
                continue
            self._start_probe(node_id, self.nodes.setdefault(
                node_id, BridgeNode(node_label(n.get("NodeManagerHostname", "?"), node_id), cpus)))
        for node_id in set(self.nodes) - seen:
            if self.nodes[node_id].probe is not None:
                self._cancel(self.nodes[node_id].probe)
            del self.nodes[node_id]

    def _start_probe(self, node_id: str, node: BridgeNode) -> None:
        # No CPU: the probe never waits behind slices.
        node.probed = time.monotonic()
        node.covers = node.differs
        # ``differs`` only when there are some: an older prefetchd's probe takes the box alone, and then
        # says which version it runs.
        node.probe = self.probe.options(num_cpus=0, max_retries=0, label_selector={NODE_ID_LABEL: node_id}).remote(
            self.box, *((node.differs,) if node.differs else ()))
        self._watch(node.probe, functools.partial(self._probed, node_id, node.probe))

    def _probe_hung(self, node: BridgeNode) -> None:
        """``node``'s probe has not answered in --worker-start-timeout: cancel it, killing its Ray worker, and
        take the node for unfit, probed again ``REPROBE_SECONDS`` after each probe cut so."""
        self._cancel(node.probe, force=True)
        node.probe = None  # its completion, the cancellation, is no answer (``_probed``)
        self._unfit(node, f"did not answer its probe in {self.start_timeout:g} s (--worker-start-timeout): a Ray "
                          f"worker's start there did not return ({RAY_START}); look at "
                          f"{ray_start_checks(self.job.augment.transform)}")
        node.probed = time.monotonic()  # unfit already (a probe again that hung too): again in REPROBE_SECONDS

    def _probed(self, node_id: str, probe: Any, future: Any) -> None:
        node = self.nodes.get(node_id)
        if node is None or node.probe is not probe:
            return  # it left meanwhile, or this probe was cancelled for not answering (``_probe_hung``)
        node.probe = None
        try:
            answer = future.result()
        except self.ray.exceptions.RayTaskError as exc:  # it cannot run prefetchd's tasks at all
            self._unfit(node, f"cannot run prefetchd's tasks ({last_line(exc)}); install prefetchd[ray], at the "
                              "daemon's version, on every node")
            return
        except self.ray.exceptions.RayError as exc:
            del self.nodes[node_id]  # its worker died: probed again at the next report if it is alive
            self._start_died(None, exc, node.label)
            return
        self._answered(node_id, answer)

    def _answered(self, node_id: str, answer: NodeAnswer) -> None:
        # A slice may answer for a node that joined since the last report: its CPUs come with the next.
        node = self.nodes.setdefault(node_id, BridgeNode(answer.node, 0))
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

    def _unfit(self, node: BridgeNode, reason: str) -> None:
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

    def _node_labelled(self, label: str) -> BridgeNode | None:
        """The node a slice says it was built on (``node_label``: by the start of its id, not its host name,
        which Ray and the node's own ``gethostname`` may spell differently)."""
        return next((n for node_id, n in self.nodes.items() if label.endswith("/" + node_id[:8])), None)


__all__ = ["NODE_ID_LABEL", "REPROBE_SECONDS", "SHOWN_FAILURES", "BridgeNode", "BridgeNodes"]
