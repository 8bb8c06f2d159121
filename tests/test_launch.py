"""prefetchd.launch: the `prefetchd start` command line, the wait until a daemon serves, and
the graceful stop; with real processes and real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from prefetchd.buffer_protocol.layout import MANIFEST_NAME
from prefetchd.launch import (
    DaemonExited,
    DaemonNotReady,
    last_words,
    launch,
    option_args,
    start_argv,
    stop_daemon_process,
    wait_ready,
)

# Exits 0 on SIGTERM, as the daemon does; says "ready" once its handler is installed.
GRACEFUL = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
            "print('ready', flush=True)\n"
            "time.sleep(600)\n")


def test_options_become_flags_in_order() -> None:
    args = option_args({"data": Path("/d"), "batch_size": 64, "epochs": None, "reset": True, "pin": False,
                        "ranks": "0-3"})
    assert args == ["--data", "/d", "--batch-size", "64", "--reset", "--no-pin", "--ranks", "0-3"]


def test_start_argv_runs_this_interpreter() -> None:
    argv = start_argv(Path("/b"), {"log_level": "warning"}, extra=["--seed", "1"])
    assert argv == [sys.executable, "-m", "prefetchd", "start", "--buffer", "/b", "--log-level", "warning",
                    "--seed", "1"]


def test_a_stopped_daemon_still_stops_gracefully() -> None:
    proc = subprocess.Popen([sys.executable, "-c", GRACEFUL], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        proc.send_signal(signal.SIGSTOP)  # its SIGTERM handler cannot run until it is continued
        assert stop_daemon_process(proc, 30) is False
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_daemon_that_ignores_sigterm_is_killed() -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    assert stop_daemon_process(proc, 0.5) is True
    assert proc.returncode == -signal.SIGKILL


def test_wait_ready_names_the_exit_code_the_log_and_the_command(tmp_path: Path) -> None:
    log = tmp_path / "daemon.log"
    proc = launch([sys.executable, "-c", "import sys; print('bad --data'); sys.exit(4)"], log=log)
    with pytest.raises(DaemonExited, match=r"exited with code 4 .*its messages are in .*daemon\.log.*the command was: ") as got:
        wait_ready(proc, tmp_path / "bf", since=0.0, timeout=60, log=log)
    assert log.read_text() == "bad --data\n"
    assert got.value.brief.endswith("exited with code 4 before serving it: bad --data")  # its last line


def test_a_daemon_that_wrote_its_manifest_and_finished_at_once_served(tmp_path: Path) -> None:
    """A finished run resumed: the daemon writes its manifest, finds every epoch consumed and exits 0. Where it
    exited before the wait looked, the resume failed with "exited with code 0 before serving it" (a user's
    walk: 4 of 12).  A daemon that exits 0 without a fresh manifest still did not serve."""
    (tmp_path / "bf").mkdir()
    since = time.time()
    code = f"open({str(tmp_path / 'bf' / MANIFEST_NAME)!r}, 'w').close()"
    proc = launch([sys.executable, "-c", code])
    proc.wait()
    wait_ready(proc, tmp_path / "bf", since=since, timeout=60)  # served
    with pytest.raises(DaemonExited, match="exited with code 0 before serving it"):
        wait_ready(proc, tmp_path / "bf", since=time.time() + 60, timeout=60)  # that manifest is older: not its


def test_last_words_are_the_daemons_error_not_its_info(tmp_path: Path) -> None:
    log = tmp_path / "daemon.log"
    log.write_text("2026-01-01 10:00:00,001 INFO    prefetchd.daemon.main: default: readers = 1\n"
                   "2026-01-01 10:00:00,002 ERROR   prefetchd: dataset root /d has no class folders; expected ...\n"
                   "2026-01-01 10:00:00,003 INFO    prefetchd.daemon.main: stopped\n\n")
    assert last_words(log) == "dataset root /d has no class folders; expected ..."
    assert last_words(tmp_path / "missing.log") == ""


def test_wait_ready_gives_up_on_a_daemon_that_never_serves(tmp_path: Path) -> None:
    proc = launch([sys.executable, "-c", GRACEFUL], stdout=subprocess.DEVNULL)
    try:
        with pytest.raises(DaemonNotReady, match=rf"\(pid {proc.pid}\) wrote no manifest within 0.2 s.*--timeout"):
            wait_ready(proc, tmp_path / "bf", since=0.0, timeout=0.2, more_time="pass a larger --timeout")
    finally:
        stop_daemon_process(proc, 30)


# A program wrapped in stops_cleanly that holds a temp folder and a child it must stop; says "ready"
# with both paths once it is inside the wrapped function.
STOPS_CLEANLY = ("import subprocess, sys, tempfile, time, shutil\n"
                 "from prefetchd.launch import stops_cleanly\n"
                 "@stops_cleanly\n"
                 "def main():\n"
                 "    work = tempfile.mkdtemp()\n"
                 "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                 "    try:\n"
                 "        print(work, child.pid, flush=True)\n"
                 "        time.sleep(600)\n"
                 "    finally:\n"
                 "        child.kill(); child.wait()\n"
                 "        shutil.rmtree(work)\n"
                 "main()\n")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_stops_cleanly_unwinds_a_terminated_program_through_its_cleanup(signum: int, tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", STOPS_CLEANLY], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        assert proc.stdout is not None
        work, child = proc.stdout.readline().split()
        assert Path(work).is_dir()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum
    # One line, no traceback; Ctrl-C's exited 1 with click's "Aborted!", or a traceback (a walk of the demo).
    assert err == ("interrupted\n" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}\n")
    assert not Path(work).exists() and not psutil.pid_exists(int(child))
