"""The buffer watcher: a real inotify watch on a real directory."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from prefetchd.buffer_protocol import Progress
from prefetchd.daemon.watcher import BufferWatcher


def test_stopping_while_progress_is_written_logs_no_error(shm_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """watchdog logs an ERROR when an event is read while its observer stops; the daemon stops its
    watcher right after writing status.json, so each exit met that race."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    done = threading.Event()

    def keep_writing() -> None:
        step = 0
        while not done.is_set():
            Progress(0, step).write(shm_dir)  # a rename, as the trainer publishes it
            step += 1

    with caplog.at_level(logging.DEBUG, logger="watchdog"):
        for _ in range(20):
            watcher = BufferWatcher(shm_dir, w)
            assert watcher.watching
            writer = threading.Thread(target=keep_writing)
            writer.start()
            assert os.read(r, 1) == b"p"  # it sees the renames: events are in flight as it stops
            watcher.stop()
            done.set()
            writer.join()
            done.clear()
    os.close(r)
    os.close(w)
    assert [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR] == []
