"""The tasks of the batches being built: made, queued, handed back, cancelled, answered.

A batch being built (a ``stream.Build``, in its stream's ``building`` from ``start`` until ``finished``,
``drop_if_answered`` or ``abort_all``: this module alone adds and removes it there) is cut into tasks of
``chunk`` slots each, in slot order; the tasks wait in ``queue``, first in first out, until the local pool
or the cluster takes them from its front (``pool.WorkerPool.dispatch``, ``remote.RemotePool.dispatch``).  Every
task not yet answered, queued or at work, is in ``by_task`` with its build, and in that build's
``outstanding``; the two books agree, so that a build's ``outstanding`` empties with the answer to
its last task, and ``WorkerHealth`` tells a task still wanted by ``by_task`` alone::

    start ──> queue ──dispatch──> at a worker / the cluster ──answered──> filled by the controller
                ^                        │
                └──── requeue, first ────┘  a dead or hung worker's tasks, the cluster's lost slices

A cancelled build (a rewind moved the window off it, or one of its tasks could not write) loses its
queued tasks at once.  Those at work are not recalled: a worker cannot be stopped mid-task, and the
cluster answers its slices unbuilt (``RemotePool.cancel``).  Their answers are ignored, and the
build's temp file is aborted only when the last of them is answered (``drop_if_answered``), so that no
late write reaches the file of a later build of the same batch, which has the same name.  Until then
the build keeps its place under the stream's cap.

The controller (``producer.Producer``) decides which batches to build and what an answer means; this
module keeps the books of their tasks.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from prefetchd.buffer_protocol import PendingBatch
from prefetchd.daemon.stream import Build, Stream
from prefetchd.daemon.tasks import Task

if TYPE_CHECKING:
    from prefetchd.daemon.remote import RemotePool

Crashed = tuple[tuple[int, str], ...]  # samples found to kill their worker, and why (``Task.crashed``)


class Builds:
    """The tasks of the builds in progress.

    ``chunk``: slots per task (``pool.task_images``); ``remote``: the cluster, told of a cancelled
    build's slices it holds (None without --ray).
    """

    def __init__(self, chunk: int, remote: RemotePool | None = None) -> None:
        self.chunk = chunk
        self.remote = remote
        self.queue: deque[Task] = deque()  # made or handed back, not yet taken by a worker or the cluster
        # The build of each task not yet answered, queued or at work; mutated, never replaced: WorkerHealth holds it.
        self.by_task: dict[int, Build] = {}
        self.next_task_id = 0  # never reused: a late answer cannot be taken for a later task

    def start(self, stream: Stream, g: int, epoch: int, step: int, pending: PendingBatch, samples: np.ndarray,
              crashed: Crashed) -> Build:
        """Build batch ``g`` of ``stream`` (``epoch``, ``step``) in ``pending``'s temp file, one slot per sample
        of ``samples``: queue its tasks, at the back, telling each the ``crashed`` samples."""
        n = len(samples)
        build = Build(stream, g, epoch, step, pending, np.empty(n, np.int64), np.empty(n, np.int64), remaining=n)
        stream.building[g] = build
        images, slot_bytes = build.layout.tensors["images"].offset, build.layout.slot_bytes
        indices = samples.tolist()  # Python ints for the tasks' pickles, converted at once
        for start in range(0, n, self.chunk):
            end = min(n, start + self.chunk)
            items = tuple(zip(range(start, end), indices[start:end]))
            task = Task(self.next_task_id, str(pending.tmp), images, slot_bytes, epoch, items, pending.file_id,
                        crashed)
            self.next_task_id += 1
            self.by_task[task.task_id] = build
            build.outstanding.add(task.task_id)
            self.queue.append(task)
        return build

    def requeue(self, tasks: list[Task]) -> list[Task]:
        """Tasks a dead worker or the cluster lost go first to whoever has room: they were taken from the
        queue's front, ahead of what waits there now, and their builds hold a file and a place under the cap
        until they are answered.  A cancelled build's (a rewind;
        the cluster hands those back unbuilt, ``RemotePool.cancel``) are dropped instead, so that its file
        goes at once rather than hold a place under the cap.  Returns the tasks queued again: what the
        cluster's log says of a slice it handed back is decided here, where the cancellations are kept."""
        for task in tasks:
            build = self.by_task.get(task.task_id)
            if build is not None and build.cancelled:
                del self.by_task[task.task_id]
                build.outstanding.discard(task.task_id)
                self.drop_if_answered(build)
        queued = [t for t in tasks if t.task_id in self.by_task]
        self.queue.extendleft(reversed(queued))
        return queued

    def tell_queued(self, crashed: Crashed) -> None:
        """Tell the queued tasks made before a file was found to kill its worker (``WorkerHealth.died``) the
        ``crashed`` samples, so that the workers fail that file unread instead of dying on it again."""
        if crashed:
            self.queue = deque(t if t.crashed == crashed else dataclasses.replace(t, crashed=crashed)
                               for t in self.queue)

    def answered(self, task: Task) -> Build:
        """``task`` is answered (filled, or failed): its build, which no longer waits on it."""
        build = self.by_task.pop(task.task_id)
        build.outstanding.discard(task.task_id)
        return build

    def cancel(self, build: Build) -> None:
        """Stop building ``build``: its queued tasks are dropped, those at work finish and are ignored (the
        cluster is told to answer its slices at once, unbuilt), and its file goes with the last answer.  A
        build cancelled already is only dropped, if that was its last task."""
        if build.cancelled:
            self.drop_if_answered(build)
            return
        build.cancelled = True
        queued = {t.task_id for t in self.queue if t.task_id in build.outstanding}
        self.queue = deque(t for t in self.queue if t.task_id not in queued)
        for task_id in queued:
            del self.by_task[task_id]
        build.outstanding -= queued
        if self.remote is not None:
            self.remote.cancel(build.outstanding)
        self.drop_if_answered(build)

    def finished(self, build: Build) -> None:
        """``build``'s last slot is filled: it leaves its stream's ``building`` for the controller to publish
        (or to drop, its stream gone)."""
        del build.stream.building[build.g]

    def abort_all(self, streams: list[Stream]) -> None:
        """Abort every build in progress, its temp file with it: the daemon stops, and each is built again by the
        next daemon on this buffer."""
        for stream in streams:
            for build in stream.building.values():
                build.pending.abort()
            stream.building.clear()

    def drop_if_answered(self, build: Build) -> None:
        """Abort a cancelled build's temp file, and free its place under its stream's cap, once none of its
        tasks is outstanding."""
        if build.cancelled and not build.outstanding:
            build.pending.abort()
            del build.stream.building[build.g]


__all__ = ["Builds", "Crashed"]
