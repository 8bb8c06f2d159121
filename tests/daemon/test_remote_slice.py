"""prefetchd.daemon.remote without a cluster: a remote slice is run_task into rows, and the bridge's
write of those rows leaves the batch file byte for byte as a local worker leaves it; the samples a
node is probed with are ones the daemon's box reads; a node of another prefetchd version, or without
the transform hook's module, is told unable."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from PIL import Image

from prefetchd import __version__
from prefetchd.daemon.plan import AugmentOptions
from prefetchd.daemon.remote import bridge
from prefetchd.daemon.remote.bridge import write_rows
from prefetchd.daemon.remote.task import Rows, Shipment, build_rows, probe_samples, unable_here, unreadable
from prefetchd.daemon.sources import SampleReader
from prefetchd.daemon.workers import Filled, Task, WorkerJob, WriteFailed, run_task
from tests.daemon.test_workers import OFFSET, SIZE, SLOT, _batch_file, _dataset

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")


def test_rows_written_by_the_bridge_equal_a_local_workers_batch(tmp_path: Path) -> None:
    index = _dataset(tmp_path / "data", broken=(4,))  # one replacement on the way, as in a real split
    job = WorkerJob(index, np.arange(len(index)), SIZE, train=True, seed=7)
    items = ((0, 5), (1, 4), (2, 9), (3, 0))
    local = _batch_file(tmp_path / "local.tmp", 4)
    remote = _batch_file(tmp_path / "remote.tmp", 4)

    by_worker = run_task(job, Task(1, str(local), OFFSET, SLOT, 3, items))
    task = Task(2, str(remote), OFFSET, SLOT, 3, items)
    rows = Rows(items)
    in_rows = run_task(job, task, sink=rows)
    pixels = rows.pixels
    assert isinstance(by_worker, Filled) and isinstance(in_rows, Filled)
    assert in_rows.slots == by_worker.slots and in_rows.failures == by_worker.failures
    assert remote.read_bytes() == bytes(remote.stat().st_size), "a remote task never touches the batch file"
    assert write_rows(task, in_rows, pixels) is in_rows
    assert remote.read_bytes() == local.read_bytes()


def test_rows_for_a_batch_aborted_meanwhile_fail_the_write_not_the_job(tmp_path: Path) -> None:
    gone = tmp_path / "aborted.tmp"
    task = Task(3, str(gone), OFFSET, SLOT, 0, ((0, 1),))
    result = write_rows(task, Filled(3, ((0, 1, 0),), (), 0.0), [np.zeros(SLOT, np.uint8)])
    assert isinstance(result, WriteFailed) and not result.fatal and str(gone) in result.reason


def test_a_copy_into_a_batch_that_fails_counts_no_bytes_copied(tmp_path: Path) -> None:
    """remote.copied_bytes (and the copy rate in the status) counted the pixels of copies that failed."""
    index = _dataset(tmp_path / "data")
    sent: list[object] = []
    b = _bridge_for(WorkerJob(index, np.arange(len(index)), SIZE, train=True, seed=7), sent)
    task = Task(3, str(tmp_path / "aborted.tmp"), OFFSET, SLOT, 0, ((0, 1),))
    done = _finish_from_node(b, task, (Filled(3, ((0, 1, 0),), (), 0.0), [np.zeros(SLOT, np.uint8)]))
    assert sent == [done] and isinstance(done.result, WriteFailed) and done.copied == (0, 0.0)
    assert done.node == NODE, "a slice without replaced samples is the node's, not built again"


def test_nodes_are_probed_with_samples_spread_over_the_split_that_the_daemons_box_reads(tmp_path: Path) -> None:
    index = _dataset(tmp_path / "data")
    job = WorkerJob(index, np.arange(len(index)), SIZE, train=True, seed=7)
    reader = SampleReader(index)
    spread = probe_samples(job, reader, count=4)
    assert [i for i, _digest in spread] == [0, 3, 6, 9], "first, last and evenly between"
    (tmp_path / "data" / index.name(3)).unlink()  # gone here too: a bad file, not a bad node
    again = probe_samples(job, reader, count=4)
    assert [i for i, _digest in again] == [0, 6, 9] and unreadable(job, reader, again) == ()


def test_a_node_that_cannot_read_names_each_file_and_the_error(tmp_path: Path) -> None:
    index = _dataset(tmp_path / "data")
    job = WorkerJob(index, np.arange(len(index)), SIZE, train=True, seed=7)
    probe = probe_samples(job, SampleReader(index))
    first, last = index.name(probe[0][0]), index.name(probe[-1][0])
    for name in (first, last):
        (tmp_path / "data" / name).unlink()  # as on a node where the mount lacks them
    failures = unreadable(job, SampleReader(index), probe)
    assert len(failures) == 2, failures
    assert failures[0].startswith(f"{first} (FileNotFoundError: "), failures


def test_a_node_with_another_copy_of_a_file_names_it(tmp_path: Path) -> None:
    """A node whose copy of --data is another version (a resized ImageNet, files re-encoded) read every
    probe sample, so it built slices: every one of them other pixels than the box's."""
    index = _dataset(tmp_path / "data")
    job = WorkerJob(index, np.arange(len(index)), SIZE, train=True, seed=7)
    probe = probe_samples(job, SampleReader(index))
    other = tmp_path / "data" / index.name(probe[1][0])
    Image.open(other).convert("RGB").save(other, quality=50)  # still an image, decodes: other bytes
    (failure,) = unreadable(job, SampleReader(index), probe)
    assert failure == f"{other} (its {other.stat().st_size} bytes here differ from the daemon's box's copy)"


def test_a_node_with_another_prefetchd_or_without_the_hook_cannot_build(tmp_path: Path) -> None:
    index = _dataset(tmp_path / "data")
    job = WorkerJob(index, np.arange(len(index)), SIZE, train=True, seed=7)
    other = unable_here(Shipment(job, (), "0.0.0+other"))
    assert other.startswith(f"runs prefetchd {__version__}, the daemon 0.0.0+other: "), other
    assert "install prefetchd[ray]==0.0.0+other on every node" in other, other
    hooked = WorkerJob(index, np.arange(len(index)), SIZE, train=True, seed=7,
                       augment=AugmentOptions(transform="prefetchd_no_such_hook_module:augment"))
    told = unable_here(Shipment(hooked, (), __version__))  # as on a node without the hook's module
    assert "cannot import prefetchd_no_such_hook_module (ModuleNotFoundError: " in told, told
    assert "install it or add its folder to PYTHONPATH" in told, told


def test_a_slice_the_cluster_gives_back_counts_its_retries_not_its_attempts() -> None:
    """A slice whose Ray worker died on each of its MAX_ATTEMPTS submissions was retried MAX_ATTEMPTS - 1
    times; remote.retries counted MAX_ATTEMPTS, as did the log's 'after N attempts' (review)."""
    from collections import Counter

    from prefetchd.daemon.remote.pool import RemotePool

    class Sent(list):  # type: ignore[type-arg]
        def send(self, message: object) -> None:
            self.append(message)

        def poll(self) -> bool:
            return bool(self)

        def recv(self) -> object:
            return self.pop(0)

    conn = Sent()
    b = object.__new__(bridge.Bridge)  # its books alone: no cluster
    b.conn, b.nodes, b.slices = conn, {}, {}
    submissions: list[int] = []

    def submit(s: bridge._Slice) -> None:
        submissions.append(s.task.task_id)
        s.refs.append(object())

    b._submit = submit  # type: ignore[method-assign]
    task = Task(7, "/dev/shm/none/b.tmp", 0, SLOT, 0, ((0, 1),))
    s = bridge._Slice(task, 0.0)
    b.slices[7] = s
    submit(s)
    while 7 in b.slices:
        b._again(s, s.refs[-1], "RayActorError: the worker died")
    returned = [m for m in conn if isinstance(m, bridge.Returned)]
    assert len(submissions) == bridge.MAX_ATTEMPTS and [m.retries for m in returned] == [bridge.MAX_ATTEMPTS - 1]

    pool = object.__new__(RemotePool)
    pool.in_flight, pool.paths, pool.retries, pool.returned = {7: task}, Counter({task.path: 1}), 0, 0
    pool.conn = Sent(returned)  # type: ignore[assignment]
    requeued: list[Task] = []
    pool._receive(lambda *_: None, requeued.extend)
    assert requeued == [task] and pool.retries == bridge.MAX_ATTEMPTS - 1


NODE_ID = "0123456789abcdef0123"
NODE = f"worker-7/{NODE_ID[:8]}"  # as node_label names it; Ray's spelling of the host may differ


def _bridge_for(job: WorkerJob, sent: list[object]) -> Any:
    """A Bridge's books for ``job``, with one node, NODE_ID: no cluster."""
    b = object.__new__(bridge.Bridge)
    b.conn, b.latencies, b.slices = SimpleNamespace(send=sent.append), [], {}
    b.ray = SimpleNamespace(exceptions=SimpleNamespace(TaskCancelledError=KeyError, RayTaskError=KeyError,
                                                       RayError=KeyError))
    b.job, b.reader, b.prepared, b.failing_here = job, SampleReader(job.index), False, set()
    b.nodes = {NODE_ID: bridge._Node(NODE, 1)}
    return b


def _finish_from_node(b: Any, task: Task, built: tuple[Any, Any]) -> Any:
    """Hand ``b`` the node's ``built`` (result, pixels) for ``task``, as Ray's future would; the Done sent."""
    ref = object()
    b.slices[task.task_id] = bridge._Slice(task, 0.0, refs=[ref])
    b._finish(task.task_id, ref, SimpleNamespace(result=lambda: (*built, NODE)))
    done = [m for m in b.conn.send.__self__ if isinstance(m, bridge.Done)]
    return done[-1]


def test_a_node_missing_a_file_the_box_reads_does_not_change_the_batch_and_gets_no_more_slices(tmp_path: Path) -> None:
    """A node that passed the probe but lacks one file replaced that sample, and the bridge wrote its
    slice: the batch differed from the box's build (Ray review).  The box now builds such a slice again."""
    index = _dataset(tmp_path / "data")
    job = WorkerJob(index, np.arange(len(index)), SIZE, train=True, seed=7)
    items = ((0, 5), (1, 2), (2, 9))
    local = _batch_file(tmp_path / "local.tmp", 3)
    assert isinstance(by_worker := run_task(job, Task(1, str(local), OFFSET, SLOT, 3, items)), Filled)
    missing = tmp_path / "data" / index.name(5)
    hidden = missing.rename(tmp_path / "hidden")  # as on the node, whose copy of --data lacks it
    on_node = build_rows(job, Task(2, "unused", OFFSET, SLOT, 3, items), SampleReader(index))
    hidden.rename(missing)
    assert isinstance(on_node[0], Filled) and on_node[0].slots != by_worker.slots, "the node replaced sample 5"

    sent: list[object] = []
    b = _bridge_for(job, sent)
    remote = _batch_file(tmp_path / "remote.tmp", 3)
    done = _finish_from_node(b, Task(2, str(remote), OFFSET, SLOT, 3, items), on_node)
    assert isinstance(done.result, Filled) and done.result.slots == by_worker.slots and not done.result.failures
    assert done.node == "the daemon's box"
    assert remote.read_bytes() == local.read_bytes(), "the batch is the box's, byte for byte"
    node = b.nodes[NODE_ID]
    assert [i for i, _digest in node.differs] == [5] and node.again, "its next probes read sample 5 too"
    assert unreadable(job, SampleReader(index), node.differs) == (), "with the box's bytes"
    assert f"reads 1 sample otherwise than the daemon's box: {index.name(5)} (FileNotFoundError: " in node.reason
    (warned,) = [m.text for m in sent if getattr(m, "level", 0) == logging.WARNING]
    assert warned.startswith(f"node {NODE} reads 1 sample otherwise") and warned.endswith("it gets no slices"), warned


def test_a_sample_the_box_cannot_use_either_leaves_the_node_fit_and_is_checked_once(tmp_path: Path) -> None:
    index = _dataset(tmp_path / "data", broken=(4,))
    (bad,) = [i for i in range(len(index)) if index.name(i).endswith("04.jpg")]
    job = WorkerJob(index, np.arange(len(index)), SIZE, train=True, seed=7)
    items = ((0, bad), (1, 1))
    local = _batch_file(tmp_path / "local.tmp", 2)
    assert isinstance(by_worker := run_task(job, Task(1, str(local), OFFSET, SLOT, 0, items)), Filled)
    assert by_worker.failures, "the broken file is replaced on the box too"
    sent: list[object] = []
    b = _bridge_for(job, sent)
    built: list[Task] = []
    build_here = b._build_here
    b._build_here = lambda task: (built.append(task), build_here(task))[1]
    for task_id in (2, 3):  # the same bad file in two slices: built again here the first time only
        task = Task(task_id, str(_batch_file(tmp_path / f"{task_id}.tmp", 2)), OFFSET, SLOT, 0, items)
        done = _finish_from_node(b, task, build_rows(job, task, SampleReader(index)))
        assert isinstance(done.result, Filled) and done.result.slots == by_worker.slots
        assert Path(task.path).read_bytes() == local.read_bytes()
    assert [t.task_id for t in built] == [2] and b.failing_here == {bad}
    assert b.nodes[NODE_ID].reason == "" and not [m for m in sent if getattr(m, "level", 0) == logging.WARNING]


def test_tasks_of_a_cancelled_batch_handed_back_are_dropped_not_built_again() -> None:
    """A rewind cancels a batch; its slices at the cluster came back (lost, or no node fit), or the worker
    holding its task died, and they were queued first, to be built and thrown away (stop 42's Ray review)."""
    from collections import deque
    from prefetchd.daemon.producer import Producer
    from prefetchd.daemon.production_stats import Stats

    aborted: list[int] = []

    def build(g: int, cancelled: bool, task_ids: set[int]) -> Any:
        stream = SimpleNamespace(building={})
        b = SimpleNamespace(g=g, cancelled=cancelled, outstanding=set(task_ids), stream=stream,
                            pending=SimpleNamespace(abort=lambda: aborted.append(g)))
        stream.building[g] = b
        return b

    old, kept = build(3, True, {1, 2}), build(4, False, {5})
    producer = object.__new__(Producer)
    producer.todo = deque([Task(9, "queued", OFFSET, SLOT, 0, ((0, 0),))])
    producer.task_build = {1: old, 2: old, 5: kept}
    tasks = [Task(i, "b.tmp", OFFSET, SLOT, 0, ((0, i),)) for i in (1, 5, 2)]
    producer._requeue(tasks)
    assert [t.task_id for t in producer.todo] == [5, 9], "the live batch's slice first, the cancelled one's dropped"
    assert aborted == [3] and 3 not in old.stream.building and producer.task_build == {5: kept}

    # The same for the tasks a dead local worker held: they were built again, for nothing.
    old = build(6, True, {7})
    producer.task_build[7] = old
    producer.wake, producer.stats, producer.fatal = SimpleNamespace(stop_signal=None), Stats(), None
    producer.pool = SimpleNamespace(replace=lambda worker: None)
    task = Task(7, "c.tmp", OFFSET, SLOT, 0, ((0, 7),))
    dead = SimpleNamespace(process=SimpleNamespace(pid=1, exitcode=-9), tasks={7: task})
    producer._replace_worker(dead)
    assert [t.task_id for t in producer.todo] == [5, 9] and aborted == [3, 6] and 7 not in producer.task_build


def test_a_node_using_a_sample_the_box_cannot_is_caught_once_the_box_failed_it(tmp_path: Path) -> None:
    """A node whose copy of a file decodes where the box's does not built a slice with no replaced
    sample, so it was written as it came: not the box's batch (review of this change)."""
    index = _dataset(tmp_path / "data")
    (bad,) = [i for i in range(len(index)) if index.name(i).endswith("04.jpg")]
    job = WorkerJob(index, np.arange(len(index)), SIZE, train=True, seed=7)
    items = ((0, bad), (1, 1))
    good_copy = build_rows(job, Task(2, "unused", OFFSET, SLOT, 0, items), SampleReader(index))  # the node's
    Path(index.name(bad)).write_bytes(b"\xff\xd8\xff\xe0 damaged here")  # the box's copy
    assert isinstance(good_copy[0], Filled) and not good_copy[0].failures
    sent: list[object] = []
    b = _bridge_for(job, sent)
    damaged_too = build_rows(job, Task(1, "unused", OFFSET, SLOT, 0, items), SampleReader(index))
    first = _finish_from_node(b, Task(1, str(_batch_file(tmp_path / "1.tmp", 2)), OFFSET, SLOT, 0, items), damaged_too)
    assert first.node == "the daemon's box" and b.failing_here == {bad} and b.nodes[NODE_ID].reason == ""
    task = Task(2, str(_batch_file(tmp_path / "2.tmp", 2)), OFFSET, SLOT, 0, items)
    done = _finish_from_node(b, task, good_copy)
    assert done.node == "the daemon's box" and done.result.slots == first.result.slots != good_copy[0].slots
    assert f"{index.name(bad)} (the node used it; the daemon's box cannot)" in b.nodes[NODE_ID].reason


def test_a_node_found_reading_otherwise_has_its_next_such_slice_built_elsewhere_not_here(tmp_path: Path) -> None:
    """Each such slice was built again on the bridge's one thread: a node sending many at once held the
    bridge's reports back past SILENT_SECONDS, and the cluster was taken for lost (review)."""
    index = _dataset(tmp_path / "data")
    job = WorkerJob(index, np.arange(len(index)), SIZE, train=True, seed=7)
    items = ((0, 5), (1, 2))
    hidden = Path(index.name(5)).rename(tmp_path / "hidden")
    on_node = [build_rows(job, Task(i, "unused", OFFSET, SLOT, 3, items), SampleReader(index)) for i in (1, 2)]
    hidden.rename(index.name(5))
    sent: list[object] = []
    b = _bridge_for(job, sent)
    built, submitted = [], []
    build_here = b._build_here
    b._build_here = lambda task: (built.append(task.task_id), build_here(task))[1]
    b._submit = lambda s: submitted.append(s.task.task_id)
    b.nodes["other-node-id-000"] = bridge._Node("other/other-no", 1)
    _finish_from_node(b, Task(1, str(_batch_file(tmp_path / "1.tmp", 2)), OFFSET, SLOT, 3, items), on_node[0])
    task = Task(2, str(_batch_file(tmp_path / "2.tmp", 2)), OFFSET, SLOT, 3, items)
    ref = object()
    b.slices[2] = bridge._Slice(task, 0.0, refs=[ref])
    b._finish(2, ref, SimpleNamespace(result=lambda: (*on_node[1], NODE)))
    assert built == [1] and submitted == [2] and 2 in b.slices, "the second went to another node, uncounted"
    assert not [m for m in sent if isinstance(m, bridge.Done) and m.result.task_id == 2]


def test_a_probe_begun_before_a_node_read_otherwise_does_not_clear_it() -> None:
    from prefetchd.daemon.remote.task import NodeAnswer

    sent: list[object] = []
    b = object.__new__(bridge.Bridge)
    b.conn = SimpleNamespace(send=sent.append)
    b.nodes = {NODE_ID: bridge._Node(NODE, 1)}
    node = b.nodes[NODE_ID]
    node.reason, node.differs, node.covers, node.probed = "reads 1 sample otherwise ...", ((5, "d"),), (), 99.0
    b._answered(NODE_ID, NodeAnswer(NODE_ID, "worker-7", 8, ()))  # the probe begun at the node's join
    assert node.reason and node.probed == 0.0, "not cleared; probed again at the next report"
    node.covers = node.differs
    b._answered(NODE_ID, NodeAnswer(NODE_ID, "worker-7", 9, ()))  # one that read sample 5 too
    assert node.reason == "" and sent[-1].text == f"node {NODE} reads --data again (9 samples checked): it builds slices again with its 1 CPU"
