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


def test_a_stop_signal_before_the_loop_is_set_up_stops_its_first_turn(tmp_path: Path) -> None:
    """SIGTERM between the daemon's lock and its loop (`prefetchd stop` just after a start, a tool
    stopped at once) took the default action: the process died half set up, leaving the worker
    server's socket folder in TMPDIR (a CI run's leftover pymp-*/listener-*)."""
    import signal

    from prefetchd.daemon.wakeup import STOP_SIGNALS, Wakeup, stop_signals_deferred

    saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    with stop_signals_deferred():
        os.kill(os.getpid(), signal.SIGTERM)  # the default action would end this test process
        with Wakeup(tmp_path) as wake:
            assert wake.stop_signal == signal.SIGTERM and wake.stop_reason == "stopped by SIGTERM"
        with Wakeup(tmp_path) as later:
            assert later.stop_signal is None, "taken once"
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == saved, "the process's handlers back"


def test_a_start_refused_before_its_loop_hands_a_deferred_signal_on_and_the_handlers_back() -> None:
    """A refused start called in-process (tests, embedding) left the deferring handler: Ctrl-C no
    longer raised KeyboardInterrupt there (a CI run's checkpoint test, on the same worker)."""
    import signal

    from prefetchd.daemon.wakeup import STOP_SIGNALS, stop_signals_deferred

    saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    with pytest.raises(KeyboardInterrupt):
        with stop_signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)  # recorded, not raised, until the block ends
            handed_on = False
        handed_on = True
    assert not handed_on and {s: signal.getsignal(s) for s in STOP_SIGNALS} == saved


def test_a_second_stop_signal_does_not_rename_the_first(tmp_path: Path) -> None:
    """A second signal while the daemon stops (systemctl stop, then Ctrl-C) changes nothing but what the
    log and status said stopped it."""
    import signal

    from prefetchd.daemon.wakeup import Wakeup

    with Wakeup(tmp_path) as wake:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert wake.stop_reason == "stopped by SIGTERM"


def test_a_user_out_of_inotify_instances_gets_a_watcher_that_polls(shm_dir: Path) -> None:
    """A user whose inotify instances are all taken (fs.inotify.max_user_instances, 128 by default, per user) could
    not start a daemon at all: watchdog's observer takes its instance as it is made, before the try that falls back
    to polling, and the start ended in a traceback (a walk under OS limits).  Run as nobody, whose instances this
    test takes in a child of its own, so that no other user's are touched."""
    import ctypes

    from tests.as_nobody import as_nobody

    shm_dir.chmod(0o755)

    def start_watcher() -> str:
        libc = ctypes.CDLL(None, use_errno=True)
        taken = 0
        while libc.inotify_init1(os.O_CLOEXEC) >= 0:  # left open: this child exits after the look
            taken += 1
            if taken > 100_000:
                return "no limit on inotify instances here"
        if ctypes.get_errno() != 24:  # EMFILE: this user's instances are taken
            return f"inotify_init1 failed otherwise: errno {ctypes.get_errno()}"
        r, w = os.pipe()
        watcher = BufferWatcher(shm_dir, w)
        return f"watching={watcher.watching}"

    assert as_nobody(start_watcher) == "watching=False"
