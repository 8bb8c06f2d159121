"""Daemon-side liveness: the heartbeat while a job starts, and whether the trainer is there in the metrics."""

from __future__ import annotations

import os
import time
from pathlib import Path

from prefetchd.buffer_protocol import read_status
from prefetchd.daemon.main import StartupBeat
from prefetchd.daemon.metrics import StatusCollector
from prefetchd.daemon.producer import STATUS_SECONDS
from prefetchd.daemon.sdnotify import Notifier


def test_startup_beat_writes_a_throttled_heartbeat(tmp_path: Path) -> None:
    beat = StartupBeat(tmp_path, Notifier(None), lambda: {"job_result": None})
    before = time.time()
    beat("indexing /data/train")
    status = read_status(tmp_path)
    assert status is not None
    assert (status["pid"], status["state"], status["message"]) == (os.getpid(), "starting", "indexing /data/train")
    assert before <= status["heartbeat"] <= time.time() and "job_result" in status
    beat("indexing /data/train")  # called per class folder: at most one write per status period
    assert read_status(tmp_path) == status
    time.sleep(STATUS_SECONDS + 0.05)
    beat("indexing /data/train")
    later = read_status(tmp_path)
    assert later is not None and later["heartbeat"] > status["heartbeat"]


def test_startup_beat_survives_an_unwritable_buffer(tmp_path: Path) -> None:
    beat = StartupBeat(tmp_path / "missing", Notifier(None))
    beat("indexing")  # logged, not raised: indexing goes on


def test_metrics_say_whether_the_trainer_is_there() -> None:
    status = {"state": "full", "trainer": {"pid": 12, "alive": False, "progress_age_s": 42.0}}
    families = {f.name: f for f in StatusCollector(Path("/dev/shm/bf"), lambda: status).collect()}
    assert families["prefetchd_trainer_alive"].samples[0].value == 0.0
    assert families["prefetchd_trainer_progress_age_seconds"].samples[0].value == 42.0
    status["trainer"] = {"pid": None, "alive": None, "progress_age_s": None}  # no trainer yet: no figure
    families = {f.name: f for f in StatusCollector(Path("/dev/shm/bf"), lambda: status).collect()}
    assert "prefetchd_trainer_alive" not in families and "prefetchd_trainer_progress_age_seconds" not in families
