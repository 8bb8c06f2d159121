"""Daemon-side liveness: the heartbeat while a job starts, and whether the trainer is there in the metrics."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from prefetchd.buffer_protocol import Rates, State, Status, Totals, TrainerStatus, read_status
from prefetchd.daemon import logs
from prefetchd.daemon.job_start import StartupBeat
from prefetchd.daemon.metrics import StatusCollector
from prefetchd.daemon.producer_status import STATUS_SECONDS
from prefetchd.daemon.sdnotify import Notifier, status_line
from prefetchd.throttle import Throttle
from tests.status_examples import production, stream
from tests.status_examples import status as status_example


def test_startup_beat_writes_a_throttled_heartbeat(tmp_path: Path) -> None:
    beat = StartupBeat(tmp_path, Notifier(None), lambda: None)
    before = time.time()
    beat("indexing /data/train")
    status = read_status(tmp_path)
    assert status is not None
    assert (status.pid, status.state, status.message) == (os.getpid(), State.STARTING, "indexing /data/train")
    assert before <= status.heartbeat <= time.time()
    assert status.job_result is None and status.production is None
    beat("indexing /data/train")  # called per class folder: at most one write per status period
    assert read_status(tmp_path) == status
    time.sleep(STATUS_SECONDS + 0.05)
    beat("indexing /data/train")
    later = read_status(tmp_path)
    assert later is not None and later.heartbeat > status.heartbeat


def test_startup_beat_survives_an_unwritable_buffer(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs, "_STATUS_LINES", Throttle(60.0))  # as in a daemon that has logged none yet
    missing = tmp_path / "missing"
    beat = StartupBeat(missing, Notifier(None))
    with caplog.at_level(logging.WARNING, logger="prefetchd.daemon"):
        beat("indexing")  # logged, not raised: indexing goes on
        time.sleep(STATUS_SECONDS + 0.05)
        beat("indexing")  # a write a status period later fails too: not logged again within the minute
    assert [r.getMessage() for r in caplog.records] == [
        f"cannot write status to {missing}: No such file or directory; `prefetchd status` shows the last one written"]
    assert not missing.exists()  # it did not make the directory to write into it


def _with_trainer(trainer: TrainerStatus, **changes: Any) -> Status:
    return status_example(State.FULL, production=production(trainer=trainer, streams=(stream(trainer=trainer),), **changes))


def test_metrics_say_whether_the_trainer_is_there() -> None:
    status = _with_trainer(TrainerStatus(pid=12, alive=False, progress_age_s=42.0))
    families = {f.name: f for f in StatusCollector(Path("/dev/shm/bf"), lambda: status).collect()}
    assert families["prefetchd_trainer_alive"].samples[0].value == 0.0
    assert families["prefetchd_trainer_progress_age_seconds"].samples[0].value == 42.0
    status = _with_trainer(TrainerStatus(pid=None, alive=None, progress_age_s=None))  # no trainer yet: no figure
    families = {f.name: f for f in StatusCollector(Path("/dev/shm/bf"), lambda: status).collect()}
    assert "prefetchd_trainer_alive" not in families and "prefetchd_trainer_progress_age_seconds" not in families


def test_metrics_of_a_daemon_waiting_for_a_job_are_its_state_and_heartbeat_only() -> None:
    """The heartbeat too: a killed or SIGSTOPped daemon's textfile kept "full" with nothing to tell it was
    stale but the file's mtime (a user's monitoring walk)."""
    status = Status(pid=1, state=State.WAITING_FOR_JOB, heartbeat=1700000123.5)
    families = {f.name: f for f in StatusCollector(Path("/dev/shm/bf"), lambda: status).collect()}
    assert set(families) == {"prefetchd_state", "prefetchd_heartbeat_timestamp_seconds"}
    assert families["prefetchd_heartbeat_timestamp_seconds"].samples[0].value == 1700000123.5
    states = {s.labels["state"]: s.value for s in families["prefetchd_state"].samples}
    assert states == {str(s): float(s == State.WAITING_FOR_JOB) for s in State}


def test_a_jobs_counters_carry_its_start_and_stay_after_it_ends_until_the_next_job() -> None:
    """Counters start at 0 with each job: a scraper told that from a daemon's restart by nothing, and a finished
    job's counters left /metrics with it, so what it did after the last scrape was never seen."""
    latest: list[Status] = [status_example(State.FILLING)]
    collector = StatusCollector(Path("/dev/shm/bf"), lambda: latest[0])

    def samples() -> dict[str, float]:
        return {sm.name: sm.value for f in collector.collect() for sm in f.samples if "state" not in sm.labels}

    running = samples()
    assert running["prefetchd_produced_batches_total"] == 52.0 and running["prefetchd_batches_waiting"] == 12.0
    assert running["prefetchd_produced_batches_created"] == 1700000000.0, "the job's start"
    latest[0] = Status(pid=1, state=State.WAITING_FOR_JOB, heartbeat=1700000123.5)
    ended = samples()
    assert ended["prefetchd_produced_batches_total"] == 52.0 and ended["prefetchd_consumed_batches_total"] == 40.0
    assert ended["prefetchd_produced_batches_created"] == 1700000000.0
    assert "prefetchd_batches_waiting" not in ended, "the gauges of a job that ended are not its now"
    latest[0] = status_example(State.FILLING, production=production(started=1700000200.0,
                                                                    totals=Totals(batches=3, samples=192,
                                                                                  consumed_batches=1)))
    assert samples()["prefetchd_produced_batches_created"] == 1700000200.0


def test_systemd_status_line_says_the_trainer_is_gone() -> None:
    rates = Rates(samples_per_s=0.0, consumed_batches_per_s=0.0)
    status = _with_trainer(TrainerStatus(pid=12, alive=False, progress_age_s=42.0), waiting=4, high_water=4, rates=rates)
    assert status_line(status) == "full 4/4 batches, 0 img/s, trainer at epoch 1 step 40 (gone)"
    status = _with_trainer(TrainerStatus(pid=12, alive=True, progress_age_s=1.0), waiting=4, high_water=4, rates=rates)
    assert status_line(status) == "full 4/4 batches, 0 img/s, trainer at epoch 1 step 40"
