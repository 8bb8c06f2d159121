"""What comes back of a slice, on its way into the batch: checked against the daemon's box, built again there
where a node read --data otherwise (``BridgeRows``), and written into the slots of the batch's temp file as a
local worker would have (``write_rows``).

A part of :class:`~prefetchd.daemon.remote.bridge.Bridge`, which sets what is declared here in its ``__init__``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from prefetchd.buffer_protocol import SlotFiller
from prefetchd.daemon.remote.bridge_nodes import REPROBE_SECONDS, SHOWN_FAILURES, BridgeNode
from prefetchd.daemon.remote.task import build_rows, sample_here
from prefetchd.daemon.sources import SampleReader
from prefetchd.daemon.fill import replaced_before
from prefetchd.daemon.tasks import Filled, Task, WorkerJob, WriteFailed, task_slots
from prefetchd.daemon.workers import prepare_process
from prefetchd.words import counted

BOX_LABEL = "the daemon's box"  # who built a slice that ``_checked_here`` built again there


class BridgeRows:
    """The check of a :class:`~prefetchd.daemon.remote.bridge.Bridge`'s slices against the daemon's box.

    A node that passed the probe may still lack a file, or hold a damaged copy: it replaces that
    sample, as a local worker replaces one it cannot decode, and its slice would differ from the
    box's.  So a slice that comes back with replaced samples (or using one the box cannot) is built
    again here, on the daemon's box, unless the box replaced the same ones before; the box's build
    is the one written, and a node that read a sample otherwise than the box gets no more slices
    (``_checked_here``); its next probes read those samples, against the box's bytes (``bridge_nodes.py``)."""

    # Set by Bridge.__init__.
    job: WorkerJob
    reader: SampleReader
    prepared: bool
    failing_here: set[int]

    if TYPE_CHECKING:  # the nodes' (bridge_nodes.py)
        def _node_labelled(self, label: str) -> BridgeNode | None: ...
        def _unfit(self, node: BridgeNode, reason: str) -> None: ...

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

    def _build_here(self, task: Task) -> tuple[Filled | WriteFailed, list[np.ndarray] | None]:
        if not self.prepared:
            prepare_process(self.job)
            self.prepared = True
        return build_rows(self.job, task, self.reader)


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


__all__ = ["BOX_LABEL", "BridgeRows", "write_rows"]
