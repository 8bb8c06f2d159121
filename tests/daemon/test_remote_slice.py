"""prefetchd.daemon.remote without a cluster: a remote slice is run_task into rows, and the bridge's
write of those rows leaves the batch file byte for byte as a local worker leaves it; the samples a
node is probed with are ones the daemon's box reads; a node of another prefetchd version, or without
the transform hook's module, is told unable; a slice that does not begin in --worker-start-timeout is
submitted again, and the controller stops the job where it never begins."""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from PIL import Image

import prefetchd
from prefetchd import __version__
from prefetchd.daemon.plan import AugmentOptions
from prefetchd.daemon.remote.bridge import Bridge
from prefetchd.daemon.remote.bridge_nodes import REPROBE_SECONDS, BridgeNode
from prefetchd.daemon.remote.bridge_rows import write_rows
from prefetchd.daemon.remote.bridge_slices import MAX_ATTEMPTS, STRAGGLER_SAMPLES, SliceInFlight
from prefetchd.daemon.remote.messages import Done, Returned, Stalled, StartHung
from prefetchd.daemon.remote.slice_copy import SliceCopy
from prefetchd.daemon.remote.task import (Rows, Shipment, build, build_rows, build_rows_tracked, origin, probe_samples,
                                         unable_here, unreadable)
from prefetchd.daemon.sources import SampleReader
from prefetchd.daemon.fill import run_task
from prefetchd.daemon.tasks import Filled, Task, WorkerJob, WriteFailed
from prefetchd.daemon.whereabouts import Whereabouts
from prefetchd.daemon.worker_health import MAX_TASK_HANGS, stall_noted_after
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


def test_a_slice_built_an_item_at_a_time_says_each_sample_first_and_is_the_same_as_built_whole(tmp_path: Path) -> None:
    """A slice that hung or killed its Ray worker is built an item at a time, yielding each sample it begins
    before it reads it, a replacement tried for one that did not decode too (the bridge then knows the file it
    hangs or dies on: the replacement, where that is what kills its worker): the same images and result, a
    replacement included, so the batch is the same bits however it was built."""
    index = _dataset(tmp_path / "data", broken=(4,))
    job = WorkerJob(index, np.arange(len(index)), SIZE, train=True, seed=7)
    bad = next(i for i in range(len(index)) if index.name(i).endswith("04.jpg"))  # not an image: replaced
    samples = [5, bad, 9, 0]
    task = Task(2, "unused", OFFSET, SLOT, 3, tuple(enumerate(samples)))
    whole, rows = build_rows(job, task, SampleReader(index))
    steps = build_rows_tracked(job, task, SampleReader(index))
    said = []
    while True:
        try:
            said.append(next(steps))
        except StopIteration as end:
            tracked, tracked_rows = end.value
            break
    assert isinstance(whole, Filled)
    replacement = next(used for slot, used, _label in whole.slots if slot == 1)
    assert replacement not in samples and said == [5, bad, replacement, 9, 0], said
    assert isinstance(whole, Filled) and isinstance(tracked, Filled) and rows is not None and tracked_rows is not None
    assert tracked.slots == whole.slots and tracked.failures == whole.failures and len(whole.failures) == 1
    assert [r.tobytes() for r in tracked_rows] == [r.tobytes() for r in rows]


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
    other = unable_here(Shipment(job, (), "0.0.0+abc"))
    assert other.startswith(f"runs prefetchd {build()}, the daemon 0.0.0+abc: "), other
    assert "install prefetchd[ray]==0.0.0 on every node" in other, other
    # The version has not changed since the first commit: a node of another checkout differs in its sources.
    assert build().startswith(f"{__version__}+") and build() == build()
    checkout = unable_here(Shipment(job, (), f"{__version__}+0123456789ab"))
    assert "the same version from other sources (another commit): install the daemon box's prefetchd on every " \
           "node" in checkout, checkout
    # A Ray worker on the daemon's box that imports the daemon's folder after an edit: restarting the daemon mends it.
    edited = unable_here(Shipment(job, (), f"{__version__}+0123456789ab", origin()))
    assert edited == (f"runs prefetchd {build()} from {Path(prefetchd.__file__).parent}, the daemon {__version__}"
                      "+0123456789ab from the same folder: its sources changed since the daemon started; restart the "
                      "daemon (a batch must be the same bits wherever it is built)"), edited
    elsewhere = unable_here(Shipment(job, (), f"{__version__}+0123456789ab", "another-box:/opt/prefetchd"))
    assert "the same version from other sources (another commit)" in elsewhere, elsewhere
    assert unable_here(Shipment(job, (), build())) == ""
    hooked = WorkerJob(index, np.arange(len(index)), SIZE, train=True, seed=7,
                       augment=AugmentOptions(transform="prefetchd_no_such_hook_module:augment"))
    told = unable_here(Shipment(hooked, (), build()))  # as on a node without the hook's module
    assert "cannot import prefetchd_no_such_hook_module (ModuleNotFoundError: " in told, told
    assert "install it or add its folder to PYTHONPATH" in told, told


def test_a_slice_the_cluster_gives_back_counts_its_retries_not_its_attempts() -> None:
    """A slice whose Ray worker died on each of its MAX_ATTEMPTS submissions was retried MAX_ATTEMPTS - 1
    times; remote.retries counted MAX_ATTEMPTS, as did the log's 'after N attempts' (review)."""
    from collections import Counter

    from prefetchd.daemon.remote.pool import RemotePool

    conn = _Pipe()
    b = object.__new__(Bridge)  # its books alone: no cluster
    b.conn, b.nodes, b.slices, b.track = conn, {}, {}, set()
    submissions: list[int] = []

    def submit(s: SliceInFlight) -> None:
        submissions.append(s.task.task_id)
        s.copies.append(SliceCopy(object(), track=False))

    b._submit = submit  # type: ignore[method-assign]
    task = Task(7, "/dev/shm/none/b.tmp", 0, SLOT, 0, ((0, 1),))
    s = SliceInFlight(task, 0.0)
    b.slices[7] = s
    submit(s)
    while 7 in b.slices:
        b._again(s, s.copies[-1], "RayActorError: the worker died")
    returned = [m for m in conn if isinstance(m, Returned)]
    assert len(submissions) == MAX_ATTEMPTS and [m.retries for m in returned] == [MAX_ATTEMPTS - 1]

    pool = object.__new__(RemotePool)
    pool.in_flight, pool.paths, pool.retries, pool.returned = {7: task}, Counter({task.path: 1}), 0, 0
    pool.conn = _Pipe(returned)  # type: ignore[assignment]
    requeued: list[Task] = []

    def requeue(tasks: list[Task]) -> list[Task]:  # as the producer's, for a live build
        requeued.extend(tasks)
        return tasks

    pool._receive(lambda *_: None, requeue, lambda *_: None, lambda *_: None)
    assert requeued == [task] and pool.retries == MAX_ATTEMPTS - 1


NODE_ID = "0123456789abcdef0123"
NODE = f"worker-7/{NODE_ID[:8]}"  # as node_label names it; Ray's spelling of the host may differ


def _bridge_for(job: WorkerJob, sent: list[object]) -> Any:
    """A Bridge's books for ``job``, with one node, NODE_ID: no cluster."""
    b = object.__new__(Bridge)
    b.conn, b.latencies, b.slices = SimpleNamespace(send=sent.append), [], {}
    b.ray = SimpleNamespace(exceptions=SimpleNamespace(TaskCancelledError=KeyError, RayTaskError=KeyError,
                                                       RayError=KeyError))
    b.job, b.reader, b.prepared, b.failing_here = job, SampleReader(job.index), False, set()
    b.nodes = {NODE_ID: BridgeNode(NODE, 1)}
    b.track = set()
    return b


def _finish_from_node(b: Any, task: Task, built: tuple[Any, Any]) -> Any:
    """Hand ``b`` the node's ``built`` (result, pixels) for ``task``, as Ray's future would; the Done sent."""
    copy = SliceCopy(object(), track=False)
    b.slices[task.task_id] = SliceInFlight(task, 0.0, copies=[copy])
    b._finish(task.task_id, copy, SimpleNamespace(result=lambda: (*built, NODE)))
    done = [m for m in b.conn.send.__self__ if isinstance(m, Done)]
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
    from prefetchd.daemon.builds import Builds
    from prefetchd.daemon.producer import Producer
    from prefetchd.daemon.production_stats import Stats
    from prefetchd.daemon.worker_health import WorkerHealth

    aborted: list[int] = []

    def build(g: int, cancelled: bool, task_ids: set[int]) -> Any:
        stream = SimpleNamespace(building={})
        b = SimpleNamespace(g=g, cancelled=cancelled, outstanding=set(task_ids), stream=stream,
                            pending=SimpleNamespace(abort=lambda: aborted.append(g)))
        stream.building[g] = b
        return b

    old, kept = build(3, True, {1, 2}), build(4, False, {5})
    producer = object.__new__(Producer)
    producer.builds = builds = Builds(1)
    builds.queue.append(Task(9, "queued", OFFSET, SLOT, 0, ((0, 0),)))
    builds.by_task.update({1: old, 2: old, 5: kept})
    tasks = [Task(i, "b.tmp", OFFSET, SLOT, 0, ((0, i),)) for i in (1, 5, 2)]
    builds.requeue(tasks)
    assert [t.task_id for t in builds.queue] == [5, 9], "the live batch's slice first, the cancelled one's dropped"
    assert aborted == [3] and 3 not in old.stream.building and builds.by_task == {5: kept}

    # The same for the tasks a dead local worker held: they were built again, for nothing.
    old = build(6, True, {7})
    builds.by_task[7] = old
    producer.wake, producer.fatal, producer.remote = SimpleNamespace(stop_signal=None), None, None
    pool: Any = SimpleNamespace(add_worker=lambda start_hangs: None, job=None, workers=[])
    producer.health = WorkerHealth(pool, Stats(), 600.0, builds.by_task, str, 1, 600.0)
    task = Task(7, "c.tmp", OFFSET, SLOT, 0, ((0, 7),))
    where = Whereabouts(multiprocessing.RawArray("q", Whereabouts.INITIAL))  # died before its first task
    dead = SimpleNamespace(process=SimpleNamespace(pid=1, exitcode=-9), tasks={7: task}, where=where, start_hangs=())
    producer._replace_worker(dead)
    assert [t.task_id for t in builds.queue] == [5, 9] and aborted == [3, 6] and 7 not in builds.by_task


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
    b.nodes["other-node-id-000"] = BridgeNode("other/other-no", 1)
    _finish_from_node(b, Task(1, str(_batch_file(tmp_path / "1.tmp", 2)), OFFSET, SLOT, 3, items), on_node[0])
    task = Task(2, str(_batch_file(tmp_path / "2.tmp", 2)), OFFSET, SLOT, 3, items)
    copy = SliceCopy(object(), track=False)
    b.slices[2] = SliceInFlight(task, 0.0, copies=[copy])
    b._finish(2, copy, SimpleNamespace(result=lambda: (*on_node[1], NODE)))
    assert built == [1] and submitted == [2] and 2 in b.slices, "the second went to another node, uncounted"
    assert not [m for m in sent if isinstance(m, Done) and m.result.task_id == 2]


def test_a_probe_begun_before_a_node_read_otherwise_does_not_clear_it() -> None:
    from prefetchd.daemon.remote.task import NodeAnswer

    sent: list[object] = []
    b = object.__new__(Bridge)
    b.conn = SimpleNamespace(send=sent.append)
    b.nodes = {NODE_ID: BridgeNode(NODE, 1)}
    node = b.nodes[NODE_ID]
    node.reason, node.differs, node.covers, node.probed = "reads 1 sample otherwise ...", ((5, "d"),), (), 99.0
    b._answered(NODE_ID, NodeAnswer(NODE_ID, "worker-7", 8, ()))  # the probe begun at the node's join
    assert node.reason and node.probed == 0.0, "not cleared; probed again at the next report"
    node.covers = node.differs
    b._answered(NODE_ID, NodeAnswer(NODE_ID, "worker-7", 9, ()))  # one that read sample 5 too
    assert node.reason == "" and sent[-1].text == f"node {NODE} reads --data again (9 samples checked): it builds slices again with its 1 CPU"


def test_a_probe_that_does_not_answer_in_the_worker_start_timeout_makes_its_node_unfit() -> None:
    """A node's probe was not timed: where a Ray worker's start blocks there (a hook's module whose import never
    returns on that node), the probe held one blocked Ray worker for good, the node stayed fit, and every slice
    sent there blocked the same way until it was cut at --worker-start-timeout and sent again, maybe there."""
    from prefetchd.daemon.remote.task import NodeAnswer

    sent: list[object] = []
    cancelled: list[tuple[object, bool]] = []
    watched: list[Any] = []  # the callbacks of the probes' completions
    b = object.__new__(Bridge)
    b.conn, b.nodes, b.box, b.start_timeout = SimpleNamespace(send=sent.append), {}, ["box"], 8.0
    b.job = SimpleNamespace(augment=SimpleNamespace(transform="users.hooks:aug"))
    b.ray = SimpleNamespace(cancel=lambda ref, force=False: cancelled.append((ref, force)),
                            exceptions=SimpleNamespace(RayTaskError=KeyError, RayError=LookupError))
    probes: list[object] = []

    def remote(*_args: Any) -> object:
        probes.append(object())
        return probes[-1]

    b.probe = SimpleNamespace(options=lambda **_kw: SimpleNamespace(remote=remote))
    b._watch = lambda ref, then: watched.append(then)
    alive = [{"NodeID": NODE_ID, "Resources": {"CPU": 2}, "NodeManagerHostname": "worker-7"}]
    b._track(alive)  # it joins: probed
    node = b.nodes[NODE_ID]
    assert node.probe is probes[0] and not node.reason
    node.probed -= 7.9
    b._track(alive)
    assert not cancelled and not node.reason, "not yet 8 s"
    node.probed -= 0.2
    b._track(alive)
    assert cancelled == [(probes[0], True)], "the probe cancelled, its Ray worker killed"
    assert node.reason.startswith("did not answer its probe in 8 s (--worker-start-timeout): a Ray worker's start "
                                  "there did not return (importing prefetchd, torch or the --transform hook's "
                                  "module"), node.reason
    assert "`python -c 'import users.hooks'` returns on the nodes" in node.reason, "where to look, as for a slice"
    (warned,) = [m.text for m in sent if getattr(m, "level", 0) == logging.WARNING]
    assert warned.startswith(f"node {NODE} did not answer its probe") and warned.endswith("it gets no slices"), warned

    def cancelled_probe() -> None:
        raise LookupError("TaskCancelledError")  # as Ray's, a RayError

    watched[0](SimpleNamespace(result=cancelled_probe))  # its completion: the cancellation, no answer
    assert b.nodes.get(NODE_ID) is node and node.reason, "still unfit, not forgotten as a node whose probe died"
    node.probed -= REPROBE_SECONDS
    b._track(alive)  # probed again, as an unfit node is
    assert node.probe is probes[1]
    watched[1](SimpleNamespace(result=lambda: NodeAnswer(NODE_ID, "worker-7", 8, ())))
    assert node.reason == "" and "reads --data again" in sent[-1].text, "it answered: fit again"


class _Wired:
    """A controller's books (``Producer``), its ``RemotePool`` and a ``Bridge`` on a real pipe, with stand-ins
    for Ray, and one build of batch 3 in two slices (1 and 2) at the cluster."""

    def __init__(self, tmp_path: Path) -> None:
        from collections import Counter
        from multiprocessing import Pipe

        from prefetchd.daemon.builds import Builds
        from prefetchd.daemon.producer import Producer
        from prefetchd.daemon.remote.pool import RemotePool

        index = _dataset(tmp_path / "data")
        self.job = WorkerJob(index, np.arange(len(index)), SIZE, train=True, seed=7)
        self.path = _batch_file(tmp_path / "b.tmp", 4)
        self.tasks = [Task(1, str(self.path), OFFSET, SLOT, 0, ((0, 5), (1, 2))),
                      Task(2, str(self.path), OFFSET, SLOT, 0, ((2, 9), (3, 0)))]
        controller_end, bridge_end = Pipe()
        self.bridge_end = bridge_end
        self.answers: list[object] = []  # what the bridge sent the controller
        self.aborted: list[bytes] = []  # the temp file's bytes when the controller dropped the build

        pool = object.__new__(RemotePool)
        pool.conn, pool.process, pool.in_flight, pool.paths = controller_end, None, {}, Counter()
        pool.connected, pool.cpus, pool.builds, pool.local_workers, pool.address = True, 4, None, 1, "local"
        pool.retries = pool.returned = pool.images = pool.slices = pool.stragglers = pool.disconnects = 0
        pool.copied_bytes, pool.copy_seconds, pool.node_books, pool.warned = 0, 0.0, {}, set()
        self.pool = pool

        stream = SimpleNamespace(building={})
        self.build = SimpleNamespace(g=3, cancelled=False, failed=False, outstanding={1, 2}, stream=stream,
                                     pending=SimpleNamespace(abort=self._abort))
        stream.building[3] = self.build
        producer = object.__new__(Producer)
        producer.fatal, producer.remote, producer.builds = None, pool, Builds(2, pool)
        producer.builds.queue.extend(self.tasks)
        producer.builds.by_task.update({t.task_id: self.build for t in self.tasks})
        self.producer = producer
        self.builds = producer.builds

        b = _bridge_for(self.job, self.answers)
        answers = self.answers

        class Conn:  # the bridge's end, keeping what it sends
            poll, recv = bridge_end.poll, bridge_end.recv

            def send(self, message: object) -> None:
                answers.append(message)
                bridge_end.send(message)

        b.conn = Conn()
        self.submitted: list[int] = []
        self.copies: dict[int, SliceCopy] = {}
        self.cancelled: list[object] = []  # the streams of the copies cancelled
        b.ray.cancel = lambda ref, force=False: self.cancelled.append(ref)
        b.latencies = [0.01] * STRAGGLER_SAMPLES  # stragglers are relaunched after 2 s

        def submit(s: SliceInFlight) -> None:
            self.submitted.append(s.task.task_id)
            s.copies.append(self.copies.setdefault(s.task.task_id, SliceCopy(object(), track=False)))

        b._submit = submit
        self.bridge = b
        pool.dispatch(self.builds.queue)
        b._receive()
        assert self.submitted == [1, 2] and not self.builds.queue

    def _abort(self) -> None:  # as PendingBatch.abort: the temp file goes
        self.aborted.append(self.path.read_bytes())
        self.path.unlink()

    def built(self, task: Task) -> SimpleNamespace:
        """Ray's future of ``task`` built on the node."""
        result, pixels = build_rows(self.job, task, SampleReader(self.job.index))
        assert isinstance(result, Filled)
        return SimpleNamespace(result=lambda: (result, pixels, NODE))

    def controller_turn(self) -> None:
        self.pool._receive(self.producer._complete, self.builds.requeue, self.producer._remote_fault,
                           self.producer._ray_start_fault)


def test_a_cancelled_builds_slices_at_the_cluster_are_answered_at_once_and_never_relaunched(tmp_path: Path,
                                                                                          caplog: Any) -> None:
    """A rewind cancelled a build whose slices were at the cluster: it kept its place under the cap until the
    cluster built them (production waited), and the bridge even relaunched them as stragglers."""
    w = _Wired(tmp_path)
    w.builds.cancel(w.build)  # a rewind
    w.bridge._receive()
    with caplog.at_level(logging.DEBUG):
        w.controller_turn()
    assert len(w.aborted) == 1 and not w.build.stream.building, "the build dropped at the bridge's answer"
    assert not w.builds.by_task and not w.pool.in_flight and not w.pool.paths
    assert [type(m).__name__ for m in w.answers] == ["Cancelled"] and w.answers[0].task_ids == (1, 2)
    assert w.cancelled == [w.copies[1].gen, w.copies[2].gen], "their Ray tasks cancelled: the cluster's CPUs are free"
    assert w.pool.returned == w.pool.retries == 0 and not caplog.records, "no news: not a slice the cluster lost"
    w.bridge._relaunch_stragglers(time.monotonic() + 100.0)
    assert w.submitted == [1, 2], "not relaunched"

    # The next cancellation meets a bridge that died: no error; the loss hands its slices back, and they are dropped.
    w.pool.dispatch(deque([Task(4, str(tmp_path / "c.tmp"), OFFSET, SLOT, 0, ((0, 1),))]))
    other = SimpleNamespace(g=4, cancelled=False, outstanding={4}, stream=SimpleNamespace(building={}),
                            pending=SimpleNamespace(abort=lambda: w.aborted.append(b"other")))
    other.stream.building[4] = other
    w.builds.by_task[4] = other
    w.bridge_end.close()
    w.builds.cancel(other)
    assert w.aborted[1:] == [] and 4 in w.pool.in_flight, "its file stays until the slice is answered"
    caplog.clear()
    w.pool._lose("the bridge process exited (code -9)", w.builds.requeue)
    assert w.aborted[1:] == [b"other"] and not w.builds.by_task and not w.pool.in_flight
    lost = [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
    assert len(lost) == 1 and "(0 slices queued again, 1 slice of cancelled batches dropped)" in lost[0], lost


def test_a_late_result_of_a_cancelled_slice_never_reaches_the_next_build_of_its_batch(tmp_path: Path) -> None:
    """The controller unlinks a cancelled build's temp file once its slices are answered, and the next build
    of the same batch makes a file of the same name: a slice the cluster finished after the cancellation
    must not be written there."""
    w = _Wired(tmp_path)
    w.builds.cancel(w.build)
    w.bridge._receive()
    w.controller_turn()
    w.path.write_bytes(bytes(OFFSET + 4 * SLOT))  # the batch built again, in a file of the same name
    for task in w.tasks:  # the cancelled copies' results arrive
        w.bridge._finish(task.task_id, w.copies[task.task_id], w.built(task))
    assert w.path.read_bytes() == bytes(OFFSET + 4 * SLOT), "nothing written into the new build's file"
    assert not [m for m in w.answers if isinstance(m, Done)] and len(w.aborted) == 1


def test_a_slice_written_before_its_build_was_cancelled_is_reported_as_built(tmp_path: Path) -> None:
    """The bridge wrote slice 1 and sent its Done while the controller cancelled the build: the bridge
    answers only slice 2 (1 it does not hold any more), and the controller counts slice 1 as built."""
    w = _Wired(tmp_path)
    w.bridge._finish(1, w.copies[1], w.built(w.tasks[0]))  # written, and its Done sent ...
    written = w.path.read_bytes()
    assert written != bytes(len(written))
    w.builds.cancel(w.build)  # ... before the controller read it: it cancels both
    w.bridge._receive()
    w.controller_turn()
    assert w.aborted == [written], "dropped once both were answered, slice 1 in the file"
    assert [type(m).__name__ for m in w.answers] == ["Done", "Cancelled"] and w.answers[1].task_ids == (2,)
    assert w.pool.slices == 1 and w.pool.images == 2 and not w.pool.in_flight and not w.builds.by_task
    assert w.cancelled == [w.copies[2].gen]
    w.bridge._forget((99,))  # an id the bridge never held, or answered already: nothing to answer
    assert len(w.answers) == 2


def test_a_slice_the_cluster_gives_back_after_its_build_was_cancelled_is_dropped_and_not_said_queued_again(
        tmp_path: Path, caplog: Any) -> None:
    """The bridge gave up on a slice (its workers kept dying) as a rewind cancelled its build: the controller
    dropped it, but warned that it was "queuing it again"."""
    w = _Wired(tmp_path)
    lost = "RayActorError: the worker died"
    for s in w.bridge.slices.values():
        s.attempts = MAX_ATTEMPTS  # its last attempt runs
    with caplog.at_level(logging.DEBUG):
        w.bridge._again(w.bridge.slices[2], w.copies[2], lost)  # handed back while its build is live ...
        w.controller_turn()
        assert [t.task_id for t in w.builds.queue] == [2], "... it is queued again, for the local workers"
        w.bridge._again(w.bridge.slices[1], w.copies[1], lost)  # handed back ...
        w.builds.cancel(w.build)  # ... as a rewind cancels its build, before the controller read it
        w.bridge._receive()
        w.controller_turn()
    assert [type(m).__name__ for m in w.answers] == ["Returned", "Returned"], "the bridge held neither any more"
    assert len(w.aborted) == 1 and not w.build.stream.building, "the build dropped at the bridge's answer"
    assert not w.builds.queue and not w.builds.by_task and not w.pool.in_flight and not w.pool.paths
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said == [
        (logging.WARNING, f"slice 2 of b.tmp came back from the cluster after 3 attempts ({lost}); queuing it again"),
        (logging.DEBUG, f"slice 1 of b.tmp came back from the cluster after 3 attempts ({lost}); dropped: its batch "
                        "was cancelled"),
    ], said
    # Both were retried at the cluster; only the live one counts against the warnings' budget.
    assert w.pool.retries == 2 * (MAX_ATTEMPTS - 1) and w.pool.returned == 1


class _Stream:
    """The stream of a slice's Ray task (an ``ObjectRefGenerator``) as ``SliceCopy.poll`` reads it: what the task
    has yielded so far, each its own reference (the stand-in for Ray's ``get`` hands it back)."""

    def __init__(self, *items: object) -> None:
        self.items = list(items)

    def next_ready(self) -> bool:
        return bool(self.items)

    def __next__(self) -> object:
        return self.items.pop(0)


class _Pipe(list):  # type: ignore[type-arg]
    """The bridge's pipe to the controller, both ends: what the bridge sent, read in order."""

    def send(self, message: object) -> None:
        self.append(message)

    def poll(self) -> bool:
        return bool(self)

    def recv(self) -> object:
        return self.pop(0)


def test_a_slice_not_begun_in_the_worker_start_timeout_is_submitted_again_until_the_job_stops(caplog: Any) -> None:
    """A slice was timed only once it had begun (``SliceCopy.moved``): one whose Ray worker's start blocked (a hook's
    module whose import never returns on a node, --data on a hung mount there during the probe) held its slice for
    good, nothing said, and the trainer's batch never came.  Now it is said as a starting worker's stall a quarter of
    --worker-start-timeout after its submission (its latest copy's: a straggler's second one may yet begin), and at
    --worker-start-timeout its copies are cancelled, their Ray workers killed, and it is submitted again, the
    controller told: the third such start of the slice in a row stops the job, saying what to look at."""
    from collections import Counter

    from prefetchd.buffer_protocol import batch_name
    from prefetchd.daemon.producer import Producer
    from prefetchd.daemon.production_stats import Stats
    from prefetchd.daemon.remote.pool import RemotePool
    from prefetchd.daemon.worker_health import WorkerHealth

    sent = _Pipe()
    cancelled: list[tuple[object, bool]] = []
    b = object.__new__(Bridge)  # its books alone: no cluster
    b.conn, b.slices, b.track, b.nodes = sent, {}, set(), {}
    b.ray = SimpleNamespace(get=lambda ref: ref, cancel=lambda ref, force=False: cancelled.append((ref, force)))
    b.task_timeout, b.stall_noted = 600.0, stall_noted_after(600.0)
    b.start_timeout, b.start_noted = 8.0, stall_noted_after(8.0)
    t0 = time.monotonic()
    clock = [t0]  # when the next copy is submitted

    def submit(s: SliceInFlight) -> None:
        s.copies.append(SliceCopy(_Stream(), False, clock[0]))

    b._submit = submit  # type: ignore[method-assign]
    task = Task(7, "/dev/shm/none/b.tmp", OFFSET, SLOT, 0, ((0, 1), (1, 2)))
    s = SliceInFlight(task, t0)
    b.slices[7] = s
    submit(s)
    b._hand_back_hung(t0 + 1.9)
    assert b.stalled is None and not sent
    b._hand_back_hung(t0 + 2.0)  # a quarter of 8 s
    assert b.stalled == Stalled(7, None, t0, starting=True) and not sent
    clock[0] = t0 + 5.0  # relaunched as a straggler: its second copy may yet begin
    submit(s)
    b._hand_back_hung(t0 + 12.0)
    assert b.stalled == Stalled(7, None, t0 + 5.0, starting=True) and not sent and not cancelled

    pool = object.__new__(RemotePool)  # the controller's side, and its books
    pool.conn, pool.in_flight, pool.paths, pool.slices = sent, {7: task}, Counter({task.path: 1}), 0
    build = SimpleNamespace(cancelled=False, epoch=0, step=2, stream=SimpleNamespace(rank=0))
    job = SimpleNamespace(augment=SimpleNamespace(transform="users.hooks:aug"))
    producer = object.__new__(Producer)
    producer.remote, producer.fatal, producer.workers_wanted = pool, None, 0  # remote only: nothing builds without it
    producer.health = WorkerHealth(SimpleNamespace(job=job, size=0), Stats(), 600.0, {7: build}, str, 1, 8.0)
    for hang in range(1, MAX_TASK_HANGS + 1):
        copies = list(s.copies)
        clock[0] = max(c.submitted for c in copies) + 8.25
        b._hand_back_hung(clock[0])
        assert cancelled[-len(copies):] == [(c.gen, True) for c in copies], "each copy cancelled, its Ray worker killed"
        assert [type(m) for m in sent] == [StartHung] and sent[0].task_id == 7
        assert sent[0].seconds == pytest.approx(8.25), "since its latest copy's submission"
        assert b.slices[7] is s and len(s.copies) == 1 and s.copies[0] not in copies
        assert s.attempts == 1 and b.stalled is None, "submitted again, not counted as an attempt, its stall ended"
        pool.stalled = Stalled(7, None, copies[-1].submitted, starting=True)  # as the bridge's last report said
        with caplog.at_level(logging.WARNING):
            pool._receive(lambda *_: None, lambda tasks: tasks, lambda *_: None, producer._ray_start_fault)
        assert not sent and pool.stalled is None and pool.stalled_slice() is None
        assert pool.in_flight == {7: task}, "still at the bridge, submitted again"
        assert (producer.fatal is None) == (hang < MAX_TASK_HANGS), producer.fatal
    said = [r.getMessage() for r in caplog.records if "did not begin in" in r.getMessage()]
    batch = f"batch {batch_name(0, 2)} (epoch 0, step 2)"
    assert said[0].startswith(f"a slice on the Ray cluster (slice 7 of {batch}) did not begin in 8 s "
                              "(--worker-start-timeout 8): cancelled it, killing its Ray worker; submitted it again "
                              f"(start hang 1 of {MAX_TASK_HANGS} in a row for that slice"), said
    assert "`python -c 'import users.hooks'` returns on the nodes" in said[0] and "Ray worker logs" in said[0], said
    assert producer.fatal is not None and producer.fatal.startswith(
        f"{batch} cannot be built on the Ray cluster: its slice 7 did not begin {MAX_TASK_HANGS} times in a row, each "
        "cancelled (its Ray worker killed) 8 s after it was submitted (--worker-start-timeout), and the cluster built "
        "no slice since"), producer.fatal
    assert producer.health.stats.worker_hangs == MAX_TASK_HANGS

    # A copy that has begun is timed by --task-timeout from then, its start by nothing more.
    s.copies[0].gen.items.append(None)  # it began
    began = clock[0] + 30.0
    b._hand_back_hung(began)
    assert b.stalled is None and not sent and s.copies[0].moved == began
    b._hand_back_hung(began + 60.0)  # a quarter of 600 s is 60 at most
    assert b.stalled == Stalled(7, None, began) and not sent, "a stall of a begun slice, not a starting one"


@pytest.mark.parametrize("local_workers", [1, 0])
def test_ray_workers_that_all_die_at_start_give_the_cluster_up_beside_local_workers_and_stop_a_remote_only_job(
        local_workers: int, caplog: Any) -> None:
    """Ray workers that all died before their first image (a hook's module missing or broken on the nodes, not on
    the daemon's box) stopped the job even beside local workers, which build every batch alone as they do while a
    cluster is lost.  Now such a job gives the cluster up: the bridge is stopped, the slices it held go back to the
    queue for the local workers, it is not connected again, and the status says why.  With --workers 0 the job
    stops, as before, saying where to look."""
    from collections import Counter

    from prefetchd.daemon.producer import Producer
    from prefetchd.daemon.production_stats import Stats
    from prefetchd.daemon.remote.messages import StartDied
    from prefetchd.daemon.remote.pool import RemotePool
    from prefetchd.daemon.worker_health import MAX_WORKER_RESTARTS, WorkerHealth

    tasks = [Task(i, "/dev/shm/none/b.tmp", OFFSET, SLOT, 0, ((0, i),)) for i in (7, 8)]
    pool = object.__new__(RemotePool)  # the controller's books of a connected bridge: no cluster
    bridge = SimpleNamespace(alive=True, stops=0)
    # told to stop (None on its pipe), it cancels its slices and exits: no kill
    bridge.process = SimpleNamespace(is_alive=lambda: bridge.alive, join=lambda timeout: setattr(bridge, "alive", False),
                                     kill=None)
    pool.conn = _Pipe([StartDied(t.task_id, "WorkerCrashedError", "the worker died") for t in tasks]
                      + [StartDied(None, "WorkerCrashedError", "the worker died", node="worker-7")] * MAX_WORKER_RESTARTS)
    pool.conn.close = lambda: setattr(bridge, "stops", bridge.stops + 1)  # type: ignore[attr-defined]
    pool.process, pool.connected, pool.cpus, pool.builds = bridge.process, True, 2, None
    pool.in_flight, pool.paths = {t.task_id: t for t in tasks}, Counter({tasks[0].path: 2})
    pool.address, pool.local_workers, pool.slices, pool.given_up = "head:6379", local_workers, 0, ""
    pool.retry_at, pool.unfit, pool.stalled, pool.message = 0.0, (), None, ""
    builds = {t.task_id: SimpleNamespace(cancelled=False, epoch=0, step=t.task_id, stream=SimpleNamespace(rank=0))
              for t in tasks}
    requeued: list[Task] = []

    def requeue(lost: list[Task]) -> list[Task]:  # as the controller's Builds.requeue, for live builds
        requeued.extend(lost)
        return lost

    producer = object.__new__(Producer)
    producer.remote, producer.fatal, producer.workers_wanted = pool, None, local_workers
    producer.builds = SimpleNamespace(requeue=requeue)
    statuses: list[int] = []
    producer._write_status = lambda: statuses.append(1)  # type: ignore[method-assign]
    job = SimpleNamespace(augment=SimpleNamespace(transform="users.hooks:aug"))
    producer.health = WorkerHealth(SimpleNamespace(job=job, size=local_workers), Stats(), 600.0, builds, str, 1, 600.0)
    with caplog.at_level(logging.WARNING):
        pool._receive(lambda *_: None, requeue, lambda *_: None, producer._ray_start_fault)

    died = "the Ray cluster's workers die before their first image: 11 in a row"
    if not local_workers:
        assert producer.fatal is not None and producer.fatal.startswith(died), producer.fatal
        assert not pool.given_up and pool.connected and not requeued, "a remote-only job stops, its cluster kept"
        return
    assert producer.fatal is None, producer.fatal
    assert bridge.stops == 1 and pool.process is None and not pool.connected, "the bridge stopped"
    assert requeued == tasks and not pool.in_flight and not pool.paths, "its slices queued again for the local workers"
    assert pool.given_up.startswith(died) and pool.message.startswith(f"given up for this job, 1 local worker builds "
                                                                      f"alone: {died}"), pool.message
    pool.images = pool.retries = pool.stragglers = pool.disconnects = pool.copied_bytes = 0  # the status' books
    pool.nodes, pool.copy_seconds, pool.node_books = 0, 0.0, {}
    assert pool.status().message == pool.message and not pool.status().connected
    deaths = [r.getMessage() for r in caplog.records if r.getMessage().startswith("a Ray worker died")]
    assert len(deaths) == MAX_WORKER_RESTARTS and deaths[0].endswith(
        "more than 10: the cluster is given up for this job)"), deaths[0]
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("the Ray cluster at")]
    assert said == [f"the Ray cluster at head:6379 is given up for this job, 1 local worker builds alone (2 slices it "
                    f"held queued again): {pool.given_up}"], said
    # No reconnection, however long it has been: nothing more goes to the cluster for this job.
    todo = deque(tasks)
    pool.handle(lambda *_: None, requeue, lambda *_: None, producer._ray_start_fault)
    pool.dispatch(todo)
    assert pool.process is None and list(todo) == tasks and pool.poll_interval(1.0) == 1.0
    assert pool.builds_wanted(8, 16) == 0


@pytest.mark.parametrize("cluster", ["connected", "given up", "none"])
def test_local_workers_past_the_restart_limit_beside_a_cluster_are_given_up_once_and_never_replaced(
        cluster: str, caplog: Any) -> None:
    """More than 10 local workers dead within 60 s stopped the job though a Ray cluster beside them could build every
    batch.  Now, beside a cluster not given up, the local workers left are killed, every task they and the dead held
    is queued again (for the cluster), none starts again, and the log says it once, for the deaths of one wait too;
    without a cluster, or with it given up already, the job stops as before."""
    from prefetchd.daemon.producer import Producer

    too_many = "11 workers died within 60 s (the last: signal SIGKILL)"
    live, dead = SimpleNamespace(tasks={1: "t1"}), [SimpleNamespace(tasks={2: "t2"}), SimpleNamespace(tasks={3: "t3"})]
    killed: list[Any] = []
    requeued: list[str] = []
    told: list[int] = []

    def kill(worker: Any, on_result: Any) -> None:
        killed.append(worker)
        pool.workers.remove(worker)

    pool = SimpleNamespace(workers=[live], size=1, kill=kill)
    producer = object.__new__(Producer)
    producer.pool, producer.fatal = pool, None  # type: ignore[assignment]
    producer.workers_wanted = 1
    producer.wake = SimpleNamespace(stop_signal=None)  # type: ignore[assignment]
    producer.builds = SimpleNamespace(requeue=requeued.extend, tell_queued=lambda items: None)  # type: ignore[assignment]
    producer.health = SimpleNamespace(died=lambda worker: None, crashed_items=[],  # type: ignore[assignment]
                                      replace=lambda worker: too_many)

    def given_up(why: str) -> None:  # RemotePool.local_workers_given_up, counted
        told.append(1)
        producer.remote.locals_given_up = why  # type: ignore[union-attr]

    producer.remote = (None if cluster == "none" else SimpleNamespace(  # type: ignore[assignment]
        given_up="its workers cannot start" if cluster == "given up" else "", connected=True, address="head:6379",
        locals_given_up="", local_workers_given_up=given_up))
    with caplog.at_level(logging.WARNING):
        for worker in dead:  # two deaths seen in one wait
            producer._replace_worker(worker)  # type: ignore[arg-type]

    if cluster != "connected":
        assert producer.fatal == too_many and not killed and not told, "nothing else builds: the job stops"
        return
    assert producer.fatal is None and producer.local_given_up == too_many
    assert killed == [live] and requeued == ["t2", "t1", "t3"], "every task of the local workers queued again"
    assert pool.size == producer.workers_wanted == 0 and told == [1]
    said = [r.getMessage() for r in caplog.records if "the local workers are given up" in r.getMessage()]
    assert said == [f"the local workers are given up for this job, the Ray cluster at head:6379 builds alone "
                    f"(connected): {too_many}"], said
