"""Daemon-side liveness: the heartbeat while a job starts, and whether the trainer is there in the metrics."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from prefetchd.buffer_protocol import read_status
from prefetchd.daemon.main import StartupBeat
from prefetchd.daemon.metrics import StatusCollector
from prefetchd.daemon.producer import STATUS_SECONDS
from prefetchd.daemon.sdnotify import Notifier, status_line


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


def test_startup_beat_survives_an_unwritable_buffer(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = tmp_path / "missing"
    beat = StartupBeat(missing, Notifier(None))
    with caplog.at_level(logging.WARNING, logger="prefetchd.daemon.main"):
        beat("indexing")  # logged, not raised: indexing goes on
    assert [r.getMessage() for r in caplog.records] == [f"cannot write status to {missing}: No such file or directory"]
    assert not missing.exists()  # it did not make the directory to write into it


def test_metrics_say_whether_the_trainer_is_there() -> None:
    status = {"state": "full", "trainer": {"pid": 12, "alive": False, "progress_age_s": 42.0}}
    families = {f.name: f for f in StatusCollector(Path("/dev/shm/bf"), lambda: status).collect()}
    assert families["prefetchd_trainer_alive"].samples[0].value == 0.0
    assert families["prefetchd_trainer_progress_age_seconds"].samples[0].value == 42.0
    status["trainer"] = {"pid": None, "alive": None, "progress_age_s": None}  # no trainer yet: no figure
    families = {f.name: f for f in StatusCollector(Path("/dev/shm/bf"), lambda: status).collect()}
    assert "prefetchd_trainer_alive" not in families and "prefetchd_trainer_progress_age_seconds" not in families


def test_systemd_status_line_says_the_trainer_is_gone() -> None:
    status = {"state": "full", "waiting": 4, "high_water": 4, "progress": {"epoch": 1, "step": 40},
              "trainer": {"pid": 12, "alive": False, "progress_age_s": 42.0}}
    assert status_line(status) == "full 4/4 batches, 0 img/s, trainer at epoch 1 step 40 (gone)"
    status["trainer"] = {"pid": 12, "alive": True, "progress_age_s": 1.0}
    assert status_line(status) == "full 4/4 batches, 0 img/s, trainer at epoch 1 step 40"
