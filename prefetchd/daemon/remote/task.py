"""What runs on a Ray worker: one slice of a batch, by the local workers' ``run_task``, into rows
that the task returns through the object store (see ``prefetchd.daemon.remote``)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import numpy as np

from prefetchd.daemon.sources import SampleReader
from prefetchd.daemon.workers import Filled, Task, WorkerJob, WriteFailed, failure_of, prepare_process, run_task


@dataclass(frozen=True)
class NodeUnfit:
    """What a Ray task answers on a node that cannot read the dataset: building there would replace
    every sample as undecodable (and so differ from a local build), so the slice goes elsewhere."""

    reason: str


# (object id, job, reader, why this node cannot read the dataset or "") for the job this process read last
_job_here: tuple[str, WorkerJob, SampleReader, str] | None = None
_prepared = False


class Rows:
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
        result = run_task(job, task, reader, sink=Rows(pixels, {slot: row for row, (slot, _) in enumerate(task.items)}))
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


__all__ = ["NodeUnfit", "Rows", "build_slice"]
