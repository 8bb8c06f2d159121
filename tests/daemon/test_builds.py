"""The tasks of the batches being built (builds.Builds): cut in slot order, cancelled without recalling
those at work, and a cancelled build's file kept until the last of those is answered."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from prefetchd.buffer_protocol import BatchLayout, PendingBatch, batch_name
from prefetchd.daemon.builds import Builds
from prefetchd.daemon.stream import Build, Stream
from tests.daemon.test_window import stream


def begin(builds: Builds, s: Stream, g: int, samples: np.ndarray) -> Build:
    """Begin batch ``g`` of ``s`` in a real temp file, as the controller's ``_start_build`` does."""
    epoch, step = s.key(g)
    pending = PendingBatch.begin(s.dir / batch_name(epoch, step), BatchLayout.plan(len(samples), 8, 8), dir_fd=s.fd)
    return builds.start(s, g, epoch, step, pending, samples, ())


def test_a_batch_is_cut_into_tasks_of_chunk_slots_in_slot_order(tmp_path: Path) -> None:
    builds, s = Builds(3), stream(tmp_path)
    first = begin(builds, s, 0, np.arange(10, 18))
    second = begin(builds, s, 1, np.arange(20, 22))
    tasks = list(builds.queue)
    assert [t.items for t in tasks] == [((0, 10), (1, 11), (2, 12)), ((3, 13), (4, 14), (5, 15)), ((6, 16), (7, 17)),
                                        ((0, 20), (1, 21))]
    assert [t.task_id for t in tasks] == [0, 1, 2, 3] and first.outstanding == {0, 1, 2} and second.outstanding == {3}
    assert builds.by_task == {0: first, 1: first, 2: first, 3: second} and s.building == {0: first, 1: second}
    images = first.layout.tensors["images"]
    assert (tasks[0].path, tasks[0].images_offset, tasks[0].slot_bytes) == (str(first.tmp), images.offset,
                                                                            first.layout.slot_bytes)


def test_a_cancel_drops_the_queued_tasks_and_aborts_the_file_once_those_at_work_are_answered(tmp_path: Path) -> None:
    """Tasks at a worker cannot be recalled; the file goes only after their answers, so that no late write
    reaches a later build of the same batch, in a file of the same name."""
    builds, s = Builds(2), stream(tmp_path)
    cancelled = begin(builds, s, 0, np.arange(8))  # tasks 0-3
    live = begin(builds, s, 1, np.arange(2))  # task 4
    at_work = [builds.queue.popleft(), builds.queue.popleft()]  # as the pool's dispatch takes them: tasks 0, 1
    builds.cancel(cancelled)
    assert [t.task_id for t in builds.queue] == [4], "the cancelled build's queued tasks dropped, the live one's kept"
    assert cancelled.outstanding == {0, 1} and set(builds.by_task) == {0, 1, 4}
    assert cancelled.tmp.exists() and s.building == {0: cancelled, 1: live}, "kept while tasks of it are at work"

    assert builds.answered(at_work[0]) is cancelled
    builds.drop_if_answered(cancelled)
    assert cancelled.tmp.exists() and 0 in s.building

    builds.requeue([at_work[1]])  # its worker died: handed back, dropped rather than queued
    assert [t.task_id for t in builds.queue] == [4] and set(builds.by_task) == {4}
    assert not cancelled.tmp.exists() and s.building == {1: live}, "the file aborted with the last answer"
    assert live.tmp.exists() and live.outstanding == {4} and not live.cancelled


def test_tasks_handed_back_go_before_those_queued_in_their_order(tmp_path: Path) -> None:
    builds, s = Builds(1), stream(tmp_path)
    begin(builds, s, 0, np.arange(4))  # tasks 0-3, one slot each
    taken = [builds.queue.popleft(), builds.queue.popleft()]
    assert builds.requeue(taken) == taken
    assert [t.task_id for t in builds.queue] == [0, 1, 2, 3]
