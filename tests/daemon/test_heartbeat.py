"""The daemon's heartbeat while a job starts (indexing, the first workers): throttled, never absent."""

from __future__ import annotations

import os
import time
from pathlib import Path

from prefetchd.buffer_protocol import read_status
from prefetchd.daemon.main import StartupBeat
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
