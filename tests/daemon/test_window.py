"""The window of batches a stream keeps: what it builds next and when the hysteresis holds it back."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from prefetchd.buffer_protocol import DEFAULT_CONSUMER, Manifest, Progress, StorageWait, batch_name
from prefetchd.daemon.config import DaemonConfig
from prefetchd.daemon.sampler import EpochOrders
from prefetchd.daemon.stream import Stream

if TYPE_CHECKING:
    from prefetchd.daemon.producer import Producer
    from prefetchd.daemon.tasks import Task

HIGH, LOW = 4, 2


def stream(tmp_path: Path, cap: int | None = None) -> Stream:
    manifest = Manifest(
        dataset_root="/data", fingerprint="f", classes=["a"], num_samples=80, split="all", seed=0,
        batch_size=8, image_size=32, samples_per_epoch=80, steps_per_epoch=10, epochs=2, producer="test",
    )
    return Stream(tmp_path, manifest, EpochOrders(np.arange(80), shuffle=False), high=HIGH, low=LOW, cap=cap)


def books(tmp_path: Path, *streams: Stream) -> Producer:
    """The controller's books alone, no workers: what ``Producer._complete`` and what it calls use."""
    from prefetchd.buffer_protocol import SpareFiles
    from prefetchd.daemon.build_failures import BuildFailures
    from prefetchd.daemon.buffer_space import BufferSpace
    from prefetchd.daemon.builds import Builds
    from prefetchd.daemon.producer import FAILURE_LOG_SECONDS, Producer
    from prefetchd.daemon.production_stats import Stats
    from prefetchd.daemon.worker_health import WorkerHealth
    from prefetchd.throttle import Throttle

    producer = Producer.__new__(Producer)
    producer.streams, producer.builds, producer.fatal = list(streams), Builds(8), None
    producer.stats = Stats()
    producer.failures, producer.retry_at, producer.failure_lines = BuildFailures(), 0.0, Throttle(FAILURE_LOG_SECONDS)
    producer.message, producer.remote = "", None
    producer.cfg, producer.spares = DaemonConfig(buffer=tmp_path, seed=0, batch_size=8), SpareFiles()
    producer.health = WorkerHealth(None, producer.stats, 600.0, producer.builds.by_task, str, len(streams), 600.0)  # type: ignore[arg-type]
    producer.space = BufferSpace(tmp_path, producer.streams, 8, 32, 0)
    return producer


def one_slot_build(producer: Producer, s: Stream, g: int) -> Task:
    """Begin batch ``g`` of ``s`` as ``_start_build`` does, with one slot in one task; returns the task."""
    from prefetchd.buffer_protocol import BatchLayout, PendingBatch
    from prefetchd.daemon.stream import Build
    from prefetchd.daemon.tasks import Task

    epoch, step = s.key(g)
    pending = PendingBatch.begin(s.dir / batch_name(epoch, step), BatchLayout.plan(1, 8, 8), dir_fd=s.fd)
    build = Build(s, g, epoch, step, pending, np.empty(1, np.int64), np.empty(1, np.int64), remaining=1)
    s.building[g] = build
    producer.builds.by_task[g] = build
    build.outstanding.add(g)
    return Task(g, str(pending.tmp), 0, 0, epoch, ((0, g),), pending.file_id)


def publish(s: Stream, *positions: int) -> None:
    for g in positions:
        s.published[g] = s.dir / f"{g}.batch"


def move_to(s: Stream, g: int) -> None:
    Progress(*s.key(g)).write(s.dir)
    s.read_progress()
    for stale in s.outside_window()[0]:
        del s.published[stale]


def test_fills_to_high_water_then_waits_for_the_low_water_mark(tmp_path: Path) -> None:
    s = stream(tmp_path)
    publish(s, 0, 1, 2)
    assert s.next_missing() == 3
    publish(s, 3)
    assert s.next_missing() is None
    move_to(s, 1)  # three waiting: above the low-water mark, production stays off
    assert s.next_missing() is None
    move_to(s, 2)  # two waiting: production resumes
    assert s.next_missing() == 4


def test_a_gone_trainers_window_is_topped_up_to_high_water_at_once(tmp_path: Path) -> None:
    s = stream(tmp_path)
    publish(s, 0, 1, 2, 3)
    assert s.next_missing() is None
    move_to(s, 1)  # three waiting, above the low-water mark: a live trainer's window waits for it
    assert s.next_missing() is None
    # Now the trainer that wrote step 1 is gone (its pid exited): still three waiting, but nobody
    # consumes any more, so the window is made full at once for the trainer that comes back.
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    doc = {"format": "prefetchd.progress", "version": 1, "epoch": 0, "step": 1, "pid": int(exited.stdout),
           "time": time.time() - 1}
    (s.dir / "progress.json").write_text(json.dumps(doc))
    s.read_progress()
    s.check_trainer()
    assert sorted(s.published) == [1, 2, 3]
    assert s.next_missing() == 4
    publish(s, 4)
    assert s.next_missing() is None  # at the high-water mark: nothing more


def test_a_rewind_builds_the_batch_the_trainer_needs_despite_the_hysteresis(tmp_path: Path) -> None:
    s = stream(tmp_path)
    move_to(s, 1)
    publish(s, 1, 2, 3, 4)
    assert s.next_missing() is None
    move_to(s, 0)  # a trainer restarted from an older checkpoint: 1, 2 and 3 stay, 0 is missing
    assert sorted(s.published) == [1, 2, 3]
    # Three waiting is above the low-water mark, but none of them is the one the trainer waits for.
    assert s.next_missing() == 0


def test_a_rewinds_cancelled_builds_count_against_the_cap_until_their_files_go(tmp_path: Path) -> None:
    """A rewind cancels the builds past the new window, but their tasks at workers finish first and
    their temp files stay meanwhile: building the new window at once held cap + those on the tmpfs
    (more than --max-buffer-bytes, review)."""
    s = stream(tmp_path)
    move_to(s, 10)
    for g in range(10, 10 + HIGH):  # the whole window being built
        s.building[g] = SimpleNamespace(g=g, cancelled=False)  # type: ignore[assignment]
    move_to(s, 0)  # a trainer restarted from an older checkpoint
    stale = s.outside_window()[1]
    assert sorted(b.g for b in stale) == [10, 11, 12, 13]
    for build in stale:
        build.cancelled = True
    assert s.next_missing() is None, "four files on the tmpfs already: the cap"
    from prefetchd.daemon.producer import Producer

    producer = Producer.__new__(Producer)  # the controller's books alone, no workers
    producer.streams = [s]
    assert producer._spare_room() == 0, "no spare kept beside them either"
    del s.building[10], s.building[11]  # two builds' last tasks came back: their files went
    assert s.next_missing() == 0
    s.building[0] = SimpleNamespace(g=0, cancelled=False)  # type: ignore[assignment]
    assert s.next_missing() == 1
    s.building[1] = SimpleNamespace(g=1, cancelled=False)  # type: ignore[assignment]
    assert s.next_missing() is None, "two cancelled and two new builds: the cap"


def test_a_lost_waiting_batch_is_rebuilt_even_with_a_full_buffer(tmp_path: Path) -> None:
    s = stream(tmp_path)
    publish(s, 0, 1, 2, 3)
    assert s.next_missing() is None
    del s.published[0]  # deleted or found corrupt while waiting
    assert s.next_missing() == 0


def test_nothing_is_built_past_the_last_epoch(tmp_path: Path) -> None:
    s = stream(tmp_path)
    move_to(s, 19)
    publish(s, 19)
    assert s.next_missing() is None
    move_to(s, 20)
    assert s.finished and s.next_missing() is None


def test_a_position_past_the_jobs_end_is_ignored_not_taken_for_its_end(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Epoch 999 written into a 2-epoch job's progress file (by hand; any group member may) was taken as "the
    trainers consumed all 2 epochs": the daemon finished (exit 0, which systemd does not restart) while its
    trainer read epoch 0, and the trainer lost the rest of the job (a review)."""
    s = stream(tmp_path)
    move_to(s, 2)
    Progress(999, 0).write(s.dir)
    s.read_progress()
    assert s.progress_error is not None and ("epoch 999 step 0 is past the end of the job, epoch 2 step 0 (after 2 "
                                             "epochs of 10 steps)") in s.progress_error, s.progress_error
    assert s.consumers[DEFAULT_CONSUMER].position == 2 and not s.finished  # the bad position is ignored
    # Removed, as its message says to: the problem goes with it (it stayed in the status until a trainer wrote).
    (s.dir / "progress.json").unlink()
    s.read_progress()
    assert s.progress_error == "" and s.consumers[DEFAULT_CONSUMER].position == 2
    # A file that is no progress document: its path said once ("ignoring P: P: not valid JSON", a review).
    (s.dir / "progress.json").write_text("{")
    with caplog.at_level(logging.WARNING, "prefetchd"):
        s.read_progress()
    path = str(s.dir / "progress.json")
    said = [m for r in caplog.records if (m := r.getMessage()).startswith(f"ignoring {path}: ") and "JSON" in m]
    assert len(said) == 1 and said[0].count(path) == 1 and "not valid JSON" in said[0], said
    move_to(s, 20)  # the job's end itself is the trainer's last position
    assert s.finished


def test_a_job_without_an_end_builds_nothing_a_batch_name_cannot_hold(tmp_path: Path) -> None:
    """Without --epochs, a progress position at epoch 999999 (or past it: any group member may write one)
    planned a window into epoch 1000000, whose batch name raised out of the controller: exit 1, and the
    same again at every restart on the same progress file (review)."""
    from prefetchd.buffer_protocol.layout import MAX_EPOCH

    manifest = Manifest(
        dataset_root="/data", fingerprint="f", classes=["a"], num_samples=80, split="all", seed=0,
        batch_size=8, image_size=32, samples_per_epoch=80, steps_per_epoch=10, epochs=None, producer="test",
    )
    s = Stream(tmp_path, manifest, EpochOrders(np.arange(80), shuffle=False), high=HIGH, low=LOW)
    move_to(s, s.g((MAX_EPOCH, 8)))
    assert sorted(s.key(g) for g in s.held) == [(MAX_EPOCH, 8), (MAX_EPOCH, 9)]
    for g in s.held:
        batch_name(*s.key(g))  # every batch the windows hold has a name
    Progress(MAX_EPOCH + 1, 0).write(s.dir)
    s.read_progress()
    assert "epoch 1000000 is past 999999" in s.progress_error
    assert s.consumers[DEFAULT_CONSUMER].position == s.g((MAX_EPOCH, 8))  # the bad position is ignored


def test_all_is_produced_once_the_last_batch_is_published_not_while_it_is_built(tmp_path: Path) -> None:
    s = stream(tmp_path)
    move_to(s, 17)  # the window holds the job's last three batches: 17, 18, 19
    publish(s, 17, 18)
    s.building[19] = object()  # type: ignore[assignment]  # only its presence counts here
    assert not s.produced_all, "a trainer may be waiting for batch 19"
    del s.building[19]
    publish(s, 19)
    assert s.produced_all


def test_a_batch_file_deleted_behind_the_daemons_back_is_noticed_and_rebuilt(tmp_path: Path) -> None:
    s = stream(tmp_path)
    for g in range(HIGH):
        path = tmp_path / batch_name(*s.key(g))
        path.write_bytes(b"")
        s.published[g] = path
    assert s.reconcile() == [] and s.next_missing() is None
    (tmp_path / batch_name(0, 0)).unlink()  # the one the trainer waits for
    (tmp_path / batch_name(0, 2)).unlink()
    assert s.reconcile() == [0, 2]
    assert sorted(s.published) == [1, 3]
    assert s.next_missing() == 0, "the trainer's batch is built again although three are waiting"


def test_status_counts_rewinds_rejected_progress_and_vanished_batches(tmp_path: Path) -> None:
    # What the fault suite (and `prefetchd status --json`) reads instead of the log's wording.
    s = stream(tmp_path)

    def counts() -> dict[str, int]:
        return {k: getattr(s.status(), k) for k in ("progress_rewinds", "progress_rejected", "vanished_batches")}

    assert counts() == {"progress_rewinds": 0, "progress_rejected": 0, "vanished_batches": 0}
    move_to(s, 3)
    move_to(s, 1)
    assert counts()["progress_rewinds"] == 1
    (tmp_path / "progress.json").write_bytes(b"\x00garbage")
    s.read_progress()
    s.read_progress()  # the same problem again is not counted twice
    assert counts()["progress_rejected"] == 1
    move_to(s, 1)
    (tmp_path / "progress.json").write_bytes(b"{")  # a new problem after a good read counts again
    s.read_progress()
    assert counts()["progress_rejected"] == 2
    for g in (1, 2):
        (tmp_path / batch_name(*s.key(g))).write_bytes(b"x")
        s.published[g] = tmp_path / batch_name(*s.key(g))
    (tmp_path / batch_name(*s.key(2))).unlink()
    assert s.reconcile() == [2]
    assert counts()["vanished_batches"] == 1


def test_a_build_whose_tasks_all_fail_counts_one_failed_build(tmp_path: Path) -> None:
    """errors.write_failures is 'batch builds that failed and were retried' (SPEC): a batch of four tasks
    on a full tmpfs counted four."""
    from prefetchd.buffer_protocol import BatchLayout, PendingBatch
    from prefetchd.daemon.stream import Build
    from prefetchd.daemon.tasks import Task, WriteFailed

    s = stream(tmp_path)
    producer = books(tmp_path, s)
    pending = PendingBatch.begin(tmp_path / batch_name(0, 0), BatchLayout.plan(8, 8, 8))
    build = Build(s, 0, 0, 0, pending, np.empty(8, np.int64), np.empty(8, np.int64), remaining=8)
    s.building[0] = build
    tasks = [Task(i, str(pending.tmp), 0, 0, 0, ((2 * i, 2 * i), (2 * i + 1, 2 * i + 1))) for i in range(4)]
    for task in tasks:
        producer.builds.by_task[task.task_id] = build
        build.outstanding.add(task.task_id)
    for task in tasks:  # all four were at workers when the tmpfs filled up
        producer._complete(task, WriteFailed(task.task_id, "cannot write: No space left on device"))
    assert producer.stats.write_failures == 1 and 0 not in s.building
    # One a rewind cancelled before its task failed counts too: the tmpfs is as full (the fault suite's check).
    pending = PendingBatch.begin(tmp_path / batch_name(0, 1), BatchLayout.plan(8, 8, 8))
    cancelled = Build(s, 1, 0, 1, pending, np.empty(8, np.int64), np.empty(8, np.int64), remaining=8, cancelled=True)
    s.building[1] = cancelled
    task = Task(9, str(pending.tmp), 0, 0, 0, ((0, 0),))
    producer.builds.by_task[9] = cancelled
    cancelled.outstanding.add(9)
    producer._complete(task, WriteFailed(9, "cannot write: No space left on device"))
    assert producer.stats.write_failures == 2 and 1 not in s.building


def test_a_failed_build_is_named_in_the_status_until_a_batch_is_published(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """It was named for 10 s after each failure: a hung object store, whose reads each try for minutes (six
    tries of a 15 s read timeout), left the status blank nine tenths of the time (review)."""
    from prefetchd.buffer_protocol import BatchLayout, PendingBatch
    from prefetchd.daemon.stream import Build
    from prefetchd.daemon.tasks import Filled, Task, WriteFailed

    s = stream(tmp_path)
    producer = books(tmp_path, s)

    def build(g: int, step: int) -> tuple[Build, Task]:
        pending = PendingBatch.begin(tmp_path / batch_name(0, step), BatchLayout.plan(1, 8, 8))
        b = Build(s, g, 0, step, pending, np.empty(1, np.int64), np.empty(1, np.int64), remaining=1)
        s.building[g] = b
        task = Task(g, str(pending.tmp), 0, 0, 0, ((0, step),))
        producer.builds.by_task[g] = b
        b.outstanding.add(g)
        return b, task

    _, task = build(0, 0)
    producer._complete(task, WriteFailed(0, "reading s3://b/x.jpg: still failing after 6 tries"))
    said = "retrying: batch e000000-s00000000.tmp: reading s3://b/x.jpg: still failing after 6 tries"
    assert producer.status_message() == said
    from prefetchd.daemon import producer as controller

    monkeypatch.setattr(controller, "FAILURE_LOG_SECONDS", 0.0)  # as if long after the failure: still named
    assert producer.status_message() == said
    _, task = build(1, 1)
    producer._complete(task, Filled(1, ((0, 1, 0),), (), 0.0))
    assert producer.status_message() == "" and 1 in s.published


def test_a_wait_on_storage_ends_when_something_else_holds_production(tmp_path: Path) -> None:
    """storage_wait keeps the trainers' loaders waiting past --timeout. Set by an outage, only a publish
    cleared it: a daemon held up by something else once the store was back (a temp file it cannot create,
    a failed write) kept them waiting for good, its status still naming the outage (review)."""
    from prefetchd.buffer_protocol import BatchLayout
    from prefetchd.buffer_protocol.batch import temp_name
    from prefetchd.daemon.tasks import WriteFailed

    s = stream(tmp_path)
    producer = books(tmp_path, s)

    def fail(g: int, reason: str, storage: bool) -> None:
        producer._complete(one_slot_build(producer, s, g), WriteFailed(g, reason, storage=storage))

    fail(0, "reading s3://b/x.jpg: still failing after 6 tries", storage=True)
    wait = producer.failures.wait
    assert wait is not None
    assert wait.reason == "batch e000000-s00000000.tmp: reading s3://b/x.jpg: still failing after 6 tries"
    fail(1, "reading s3://b/y.jpg: still failing after 6 tries", storage=True)
    assert producer.failures.wait is not None and producer.failures.wait.since == wait.since, "one wait, since its start"
    # The store is back, but the next batch's temp file cannot be made (a directory planted under its name).
    (tmp_path / temp_name(tmp_path / batch_name(0, 2))).mkdir()
    assert not producer._start_build(s, 2, BatchLayout.plan(8, 32, 32))
    assert producer.failures.wait is None
    assert producer.status_message() == "retrying: cannot create e000000-s00000002.tmp: Is a directory"
    fail(3, "reading s3://b/z.jpg: still failing after 6 tries", storage=True)
    assert producer.failures.wait is not None
    fail(4, "cannot write e000000-s00000004.tmp: No space left on device", storage=False)
    assert producer.failures.wait is None, "a full tmpfs is no wait on storage"


OUTAGE = "reading s3://b/x.jpg: still failing after 6 tries"


def test_a_wait_on_storage_lasts_until_the_batch_that_failed_is_published(tmp_path: Path, caplog: Any) -> None:
    """In a partial outage the batches of other objects publish while the trainer's next one fails: any
    publish ended the wait, and the trainer, which needs the failing batch, timed out after its --timeout
    though the daemon still retried it for the storage.  The wait's end is logged, as its failures were (the
    log's last word on the storage was a failure)."""
    from prefetchd.daemon.tasks import Filled, WriteFailed

    caplog.set_level(logging.INFO, logger="prefetchd.daemon.producer")

    (tmp_path / "r0").mkdir(), (tmp_path / "r1").mkdir()
    s, t = stream(tmp_path / "r0"), stream(tmp_path / "r1")
    t.manifest = dataclasses.replace(t.manifest, rank=1)
    producer = books(tmp_path, s, t)
    producer._complete(one_slot_build(producer, s, 0), WriteFailed(0, OUTAGE, storage=True))
    wait = producer.failures.wait
    assert wait is not None and wait.reason == f"batch e000000-s00000000.tmp: {OUTAGE}"
    for g in (1, 2):  # batches of other objects, and the same position of another rank
        producer._complete(one_slot_build(producer, s, g), Filled(g, ((0, g, 0),), (), 0.0))
    producer._complete(one_slot_build(producer, t, 0), Filled(0, ((0, 0, 0),), (), 0.0))
    assert sorted(s.published) == [1, 2] and sorted(t.published) == [0]
    assert producer.failures.wait == wait, "batch 0 of rank 0 still waits for the storage"
    assert producer.status_message() == f"retrying: {wait.reason}"
    assert "storage answers again" not in caplog.text, "other batches publishing end no wait"
    producer._complete(one_slot_build(producer, s, 0), Filled(0, ((0, 0, 0),), (), 0.0))
    assert producer.failures.wait is None and producer.status_message() == ""
    assert "the dataset's storage answers again: batch e000000-s00000000.batch built after" in caplog.text


def test_a_wait_on_storage_names_the_ranks_whose_batches_failed(tmp_path: Path) -> None:
    """Only the loaders of those ranks wait on past their timeout: as one wait for the whole daemon, it kept
    the loader of a rank none of whose batches failed waiting on, though its batch was late for another reason."""
    from prefetchd.daemon.tasks import Filled, WriteFailed

    (tmp_path / "r0").mkdir(), (tmp_path / "r1").mkdir()
    s, t = stream(tmp_path / "r0"), stream(tmp_path / "r1")
    t.manifest = dataclasses.replace(t.manifest, rank=1)
    producer = books(tmp_path, s, t)

    def ranks() -> tuple[int, ...] | None:
        assert producer.failures.wait is not None
        return producer.failures.wait.ranks

    producer._complete(one_slot_build(producer, s, 0), WriteFailed(0, OUTAGE, storage=True))
    assert ranks() == (0,)
    producer._complete(one_slot_build(producer, t, 1), WriteFailed(1, OUTAGE, storage=True))
    assert ranks() == (0, 1)
    producer._complete(one_slot_build(producer, s, 0), WriteFailed(0, OUTAGE, storage=True))  # retried, failing again
    assert ranks() == (0, 1), "sorted, whichever failed last"
    producer._complete(one_slot_build(producer, s, 0), Filled(0, ((0, 0, 0),), (), 0.0))
    assert ranks() == (1,)
    producer._complete(one_slot_build(producer, t, 1), Filled(1, ((0, 1, 0),), (), 0.0))
    assert producer.failures.wait is None


def test_a_wait_on_storage_says_since_when_each_rank_waits(tmp_path: Path) -> None:
    """One time for the whole daemon said rank 1's builds had waited since rank 0's first failed, minutes
    before rank 1's did, and still did once rank 0's batches were built."""
    from prefetchd.daemon.tasks import Filled, WriteFailed

    (tmp_path / "r0").mkdir(), (tmp_path / "r1").mkdir()
    s, t = stream(tmp_path / "r0"), stream(tmp_path / "r1")
    t.manifest = dataclasses.replace(t.manifest, rank=1)
    producer = books(tmp_path, s, t)

    def wait() -> StorageWait:
        assert producer.failures.wait is not None
        return producer.failures.wait

    producer._complete(one_slot_build(producer, s, 0), WriteFailed(0, OUTAGE, storage=True))
    first = wait().since
    assert wait().ranks_since == (first,)
    time.sleep(0.01)
    producer._complete(one_slot_build(producer, t, 1), WriteFailed(1, OUTAGE, storage=True))
    later = wait().since_of(1)
    assert later is not None and later > first
    assert wait().ranks_since == (first, later) and wait().since == first
    producer._complete(one_slot_build(producer, s, 0), WriteFailed(0, OUTAGE, storage=True))  # retried, failing again
    assert wait().ranks_since == (first, later), "each rank's wait runs on from its first failure"
    producer._complete(one_slot_build(producer, s, 0), Filled(0, ((0, 0, 0),), (), 0.0))
    assert wait().ranks == (1,) and wait().ranks_since == (later,)
    assert wait().since == later, "the daemon's time is that of the ranks still waiting: older readers show it"
    time.sleep(0.01)
    producer._complete(one_slot_build(producer, s, 2), WriteFailed(2, OUTAGE, storage=True))
    again = wait().since_of(0)
    assert again is not None and again > later, "rank 0's wait ended with its batch: a new one begins now"
    assert wait().ranks_since == (again, later) and wait().since == later


def test_a_wait_on_storage_ends_when_no_window_holds_the_batches_that_failed(tmp_path: Path) -> None:
    """A failed batch the trainers moved past (or back before) is not built again: a wait on it kept the
    loaders waiting for good behind a daemon their storage no longer held up."""
    from prefetchd.daemon.tasks import WriteFailed

    s = stream(tmp_path)
    producer = books(tmp_path, s)
    for g in (1, 2):
        producer._complete(one_slot_build(producer, s, g), WriteFailed(g, OUTAGE, storage=True))
    wait = producer.failures.wait
    assert wait is not None and wait.reason == f"batch e000000-s00000002.tmp: {OUTAGE}"
    Progress(*s.key(2)).write(s.dir)
    producer._read_progress()  # batch 1 is behind the trainer now
    assert producer.failures.wait == wait and list(producer.failures.storage_failed) == [(0, 2)]
    Progress(*s.key(7)).write(s.dir)
    producer._read_progress()
    assert producer.failures.wait is None
    # Nor does a failure start one for a batch no window holds (its build cancelled as the trainer moved on).
    producer._complete(one_slot_build(producer, s, 3), WriteFailed(3, OUTAGE, storage=True))
    assert producer.failures.wait is None and producer.status_message() == f"retrying: batch e000000-s00000003.tmp: {OUTAGE}"


def test_a_restart_says_which_batches_of_an_earlier_run_it_kept_after_the_windows_deleted_the_rest(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """"kept N finished batches" counted the batches found, before the controller deleted those the
    trainer had passed and those a lower --high-water than the earlier run's leaves out (review)."""
    from prefetchd.buffer_protocol import list_batches, write_batch

    def restart(buffer: Path, cap: int | None = None) -> Stream:
        """A stream over 8 batches an earlier run left, its trainer needing batch 2 next, taken as a start does."""
        buffer.mkdir()
        s = stream(buffer, cap)
        for g in range(8):
            epoch, step = s.key(g)
            write_batch(buffer / batch_name(epoch, step), np.zeros((8, 8, 8, 3), np.uint8), np.zeros(8, np.int64),
                        np.arange(8), epoch=epoch, step=step, seed=0, producer="test", job=s.manifest.job_key,
                        rank=s.manifest.rank)
        Progress(*s.key(2)).write(buffer)
        producer = books(buffer, s)
        producer._positioned = False
        producer.take_positions()
        return s

    with caplog.at_level(logging.INFO, logger="prefetchd.daemon.stream"):
        s = restart(tmp_path / "a")
    assert (f"kept 4 finished batches of rank 0, built earlier for the same job (deleted 2 beyond --high-water "
            f"{HIGH}, 2 already consumed)") in caplog.text, caplog.text
    assert sorted(list_batches(tmp_path / "a")) == [s.key(g) for g in range(2, 6)]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="prefetchd.daemon.stream"):
        restart(tmp_path / "b", cap=3)
    assert (f"kept 3 finished batches of rank 0, built earlier for the same job (deleted 3 beyond --high-water "
            f"{HIGH} and the --max-buffer-bytes cap of 3 batches, 2 already consumed)") in caplog.text, caplog.text


def test_the_streams_of_a_daemon_share_each_epochs_order_and_keep_their_share_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stream computed the epoch's permutation of every member again (256 ranks of a 65536-rank job
    at ImageNet size: ~70 ms each at every epoch boundary, the controller stalled for seconds) and kept
    a view of the whole padded order for its share of it (~20 MB a rank and epoch, 15 GB for 256 ranks x
    3 epochs: past the unit's MemoryMax).  Batches must not change: each share is the sampler's."""
    import os

    from prefetchd.buffer_protocol.layout import DIR_FLAGS
    from prefetchd.daemon.dataset import SampleIndex, pack_paths
    from prefetchd.daemon.producer import Producer
    from prefetchd.daemon.sampler import epoch_order, samples_per_rank, steps_per_epoch
    from prefetchd.daemon.wakeup import Wakeup

    n, world, seed = 1000, 8, 5
    members = np.arange(0, 2 * n, 2, dtype=np.int64)
    blob, offsets = pack_paths([f"a/{i}.jpg".encode() for i in range(2 * n)])
    index = SampleIndex(str(tmp_path), ("a",), blob, offsets, np.zeros(2 * n, np.int64), "f")
    per = samples_per_rank(n, world)
    cfg = DaemonConfig(buffer=tmp_path, data=str(tmp_path / "data"), split="train", seed=seed, batch_size=8, image_size=32,
                       workers=1, high_water=HIGH, low_water=LOW, world_size=world, ranks="0-2")
    streams = []
    for rank in range(3):
        folder = tmp_path / f"rank-{rank:05d}"
        folder.mkdir()
        manifest = Manifest(dataset_root=str(tmp_path), fingerprint="f", classes=["a"], num_samples=2 * n,
                            split="train", seed=seed, batch_size=8, image_size=32, samples_per_epoch=per,
                            steps_per_epoch=steps_per_epoch(per, 8), epochs=3, producer="test", rank=rank,
                            world_size=world)
        streams.append((folder, manifest, os.open(folder, DIR_FLAGS)))
    producer = Producer(cfg, index, members, streams, Wakeup(tmp_path))
    try:
        expected = {(e, r): epoch_order(members, seed, e, shuffle=True, rank=r, world_size=world)
                    for e in range(2) for r in range(3)}
        permutations: list[int] = []

        class Counting(np.random.Generator):
            def permutation(self, x: int, axis: int = 0) -> np.ndarray:  # type: ignore[override]
                permutations.append(x)
                return super().permutation(x, axis)

        monkeypatch.setattr(np.random, "Generator", Counting)
        for epoch in range(2):
            for s in producer.streams:
                order = s.order(epoch)
                assert np.array_equal(order, expected[epoch, s.rank]), "a rank's samples changed"
                assert order.base is None and order.nbytes == per * 8, "a rank's order keeps more than its share"
        assert permutations == [n, n], "one permutation per epoch, for every stream of the daemon"
    finally:
        producer.shutdown()
