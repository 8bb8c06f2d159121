"""How a daemon whose job is done exits: status 0, nothing logged as an error, also when
SIGTERM arrives while it exits, and at once when restarted on a job already consumed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from prefetchd.buffer_protocol import Progress, State, list_batches, read_status
from prefetchd.daemon.pool import ORPHAN_SECONDS, TEMP_PREFIX
from prefetchd.trainer import BufferLoader

JOB = ["--batch-size", "8", "--image-size", "32", "--epochs", "1", "--workers", "1", "--high-water", "3"]
FINISHED = "the trainers consumed the 1 epoch"


def consume_everything(buffer: Path, samples: int = 72) -> None:
    """A trainer in its own process, which reads the job's one epoch and exits, as trainers do."""
    code = ("import sys; from prefetchd.trainer import BufferLoader\n"
            "loader = BufferLoader(sys.argv[1], normalize=False, timeout=60)\n"
            "print(sum(len(b.indices) for b in loader)); loader.close()\n")
    out = subprocess.run([sys.executable, "-c", code, str(buffer)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == [str(samples)], out.stdout + out.stderr


def socket_folders(tmpdir: Path) -> list[Path]:
    """The worker server's socket folders in ``tmpdir`` (multiprocessing's pymp-* is made in one of ours)."""
    return sorted([*tmpdir.glob(f"{TEMP_PREFIX}*"), *tmpdir.glob("pymp-*")])


def errors_in(log: str) -> list[str]:
    return [line for line in log.splitlines() if "ERROR" in line or "Traceback" in line]


def test_finished_daemon_exits_cleanly_and_a_restart_on_it_exits_at_once(shapes_data: Path, shm_dir: Path,
                                                                          start_daemon: Callable[..., Any],
                                                                          child_tmpdir: Path, tmp_path: Path) -> None:
    buffer, textfile = shm_dir / "bf", tmp_path / "bf.prom"
    first = start_daemon(buffer, "--data", shapes_data / "train", *JOB, "--metrics-textfile", textfile)
    consume_everything(buffer)
    assert first.wait_exit() == 0, first.log
    assert FINISHED in first.log and errors_in(first.log) == [], first.log
    # Its last status stays (status.json; the textfile a node-exporter serves on): no rate of a daemon that runs.
    ended = read_status(buffer)
    assert ended is not None and ended.state == State.STOPPED and ended.production is not None
    assert (ended.production.rates.samples_per_s, ended.production.rates.consumed_batches_per_s) == (0, 0)
    assert ended.production.totals.batches == 9  # what it did stays
    metrics = textfile.read_text()
    assert f'prefetchd_state{{buffer="{buffer}",state="stopped"}} 1.0' in metrics
    assert f'prefetchd_produce_samples_per_second{{buffer="{buffer}"}} 0.0' in metrics, metrics
    assert socket_folders(child_tmpdir) == [], "the worker server's socket folder is removed at exit"

    again = start_daemon(buffer, "--data", shapes_data / "train", *JOB)
    assert again.wait_exit() == 0, again.log
    # It saw the consumed progress and left without starting workers or waiting on the trainer,
    # which finished and exited: that trainer is done, not "gone away".
    assert "consumed the 1 epoch before this daemon started" in again.log, again.log
    assert "gone away" not in again.log and errors_in(again.log) == [], again.log
    status = read_status(buffer)
    assert status is not None and status.state == State.STOPPED and status.pid == again.proc.pid


def test_a_restart_on_a_consumed_many_rank_job_names_the_rank_streams_progress(
        shapes_data: Path, shm_dir: Path, start_daemon: Callable[..., Any]) -> None:
    """The files to remove to produce the job again are in the rank streams, not the buffer."""
    buffer = shm_dir / "bf"
    first = start_daemon(buffer, "--data", shapes_data / "train", *JOB, "--world-size", "2")
    for rank in (0, 1):
        consume_everything(buffer / f"rank-0000{rank}", samples=36)
    assert first.wait_exit() == 0, first.log
    again = start_daemon(buffer, "--data", shapes_data / "train", *JOB, "--world-size", "2")
    assert again.wait_exit() == 0, again.log
    assert (f"remove {buffer / 'rank-00000' / 'progress*.json'}, {buffer / 'rank-00001' / 'progress*.json'})"
            in again.log), again.log


def test_sigterm_while_a_finished_daemon_exits_still_exits_0(shapes_data: Path, shm_dir: Path,
                                                             start_daemon: Callable[..., Any]) -> None:
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *JOB)
    loader = BufferLoader(buffer, normalize=False, timeout=60)
    assert sum(len(b.indices) for b in loader) == 72
    # From the moment the trainer has read the last batch until the daemon is gone, SIGTERM keeps
    # coming (as from a `systemctl stop` racing the exit), as often as it can be sent: the exit
    # takes tens of milliseconds, and every stage of it gets signals, the last ones included.
    # (The trainer is this process: one in a process of its own takes longer to exit than the daemon.)
    while daemon.proc.poll() is None:
        try:
            os.kill(daemon.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            break
        time.sleep(0.0002)  # leaves the daemon the CPU to exit on; the window it must survive is longer
    code = daemon.wait_exit()
    loader.close()
    assert code == 0, f"exit status {code}:\n{daemon.log}"
    assert errors_in(daemon.log) == [], daemon.log


SLOW_INDEX = """
import sys, time
import prefetchd.daemon.job_start as job_start

real = job_start.open_dataset


def slow_open_dataset(location, tick=lambda found: None, **options):
    # A tree that takes a minute to walk: the walk tells tick() what it found about once a second, as the real one does.
    for folders in range(300):
        tick(f"{folders * 10} images in {folders} folders listed so far")
        time.sleep(0.2)
    return real(location, tick=tick, **options)


job_start.open_dataset = slow_open_dataset
from prefetchd.cli import main as cli
sys.exit(cli())
"""


def test_a_stop_signal_while_the_dataset_is_indexed_stops_the_daemon_then(shapes_data: Path, shm_dir: Path,
                                                                         tmp_path: Path, child_tmpdir: Path) -> None:
    """Indexing a large tree takes minutes (the unit allows ten): a SIGTERM waited for its end, so
    `systemctl stop` ended in SIGKILL and `prefetchd stop` in its timeout (review)."""
    buffer = shm_dir / "bf"
    script = tmp_path / "slow_index.py"
    script.write_text(SLOW_INDEX)
    proc = subprocess.Popen([sys.executable, str(script), "start", "--buffer", str(buffer), "--data",
                             str(shapes_data / "train"), *JOB], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = read_status(buffer) if buffer.is_dir() else None
            if status is not None and status.message.startswith(f"indexing {shapes_data / 'train'}: ") and \
                    status.message.endswith(" folders listed so far"):  # how far the walk is, not only that it is
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the daemon never said it indexes")
        proc.send_signal(signal.SIGTERM)
        log, _ = proc.communicate(timeout=30)  # not the minute the index would take
    finally:
        proc.kill()
    assert proc.returncode == 0, log
    assert errors_in(log) == [], log
    assert socket_folders(child_tmpdir) == [], "the worker server's socket folder is removed at exit"
    last = read_status(buffer)
    assert last is not None and (last.state, last.message) == (State.STOPPED, "stopped by SIGTERM"), last


def test_a_state_saved_at_the_end_leaves_a_fresh_run_of_the_job_to_its_trainers(
        shapes_data: Path, shm_dir: Path, start_daemon: Callable[..., Any], caplog: Any) -> None:
    """A finished run's checkpoint, loaded into a run of the same job (to validate, or by a script that always
    restores the last one), wrote the job's end: the daemon deleted its batches, said its trainers had consumed
    every epoch and exited, and the end left in progress.json made every later daemon on the job exit at once."""
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *JOB)
    daemon.wait_until(lambda: len(list_batches(buffer)) == 3, 60, "the buffer to fill")
    with BufferLoader(buffer, normalize=False, timeout=60) as loader:
        loader.load_state_dict({**loader.state_dict(), "epoch": 1, "step": 0})  # as a finished run saved it
        assert loader.position == (1, 0) and list(loader) == []
    try:
        code: int | None = daemon.proc.wait(5)  # it reads progress at least every second
    except subprocess.TimeoutExpired:
        code = None
    assert code is None and FINISHED not in daemon.log, daemon.log
    assert len(list_batches(buffer)) == 3 and Progress.read(buffer) is None
    assert "at the end of the job's 1 epoch: there is nothing left to read" in caplog.text
    assert "restart the daemon with a larger --epochs" in caplog.text
    consume_everything(buffer)  # the job is still there for whoever reads it
    assert daemon.wait_exit() == 0 and FINISHED in daemon.log, daemon.log


# A trainer handed the job's last batch that dies before it asks for the next one: its progress.json
# names the last step, the state it saved (state_dict moves at hand-out) names the end.
READ_ALL_THEN_DIE = """
import json, os, sys
from prefetchd.trainer import BufferLoader
loader = BufferLoader(sys.argv[1], normalize=False, timeout=60)
batches = iter(loader)
for _ in range(len(loader)):
    next(batches)
print(json.dumps(loader.state_dict()), flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("resume", ["load_state_dict", "start"])
def test_a_trainer_that_died_after_the_last_batch_is_resumed_to_the_end_and_the_job_ends(
        shapes_data: Path, shm_dir: Path, start_daemon: Callable[..., Any], caplog: Any, resume: str) -> None:
    """Only a loader that read the job's last batch says the end; the one resuming a trainer that read it and
    died before asking again said nothing, and the daemon kept that batch and stayed up for good (review)."""
    import json

    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *JOB)
    out = subprocess.run([sys.executable, "-c", READ_ALL_THEN_DIE, str(buffer)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    state = json.loads(out.stdout)
    found = Progress.read(buffer)
    assert (state["epoch"], state["step"]) == (1, 0) and found is not None and (found.epoch, found.step) == (0, 8)
    # BufferLoader(start=) at the end said nothing, and the daemon stayed up for good (a review).
    start = (state["epoch"], state["step"]) if resume == "start" else None
    with BufferLoader(buffer, normalize=False, timeout=60, start=start) as loader:
        if start is None:
            loader.load_state_dict(state)
        assert list(loader) == []
    assert daemon.wait_exit() == 0 and FINISHED in daemon.log, daemon.log
    assert "nothing left to read" not in caplog.text


# `prefetchd start` whose controller meets a bug once the buffer holds two batches: what any bug in the loop
# does (an exception no branch expects).
BUG_IN_THE_LOOP = """
import sys
import prefetchd.daemon.stream as stream
from prefetchd.buffer_protocol import list_batches

real = stream.Stream.next_missing


def next_missing(self):
    if len(list_batches(self.dir)) >= 2:
        raise RuntimeError("a bug planted by the test")
    return real(self)


stream.Stream.next_missing = next_missing
if __name__ == "__main__":  # not in the workers, which the fork server starts from this script too
    from prefetchd.cli import main as cli
    sys.exit(cli())
"""


def test_a_bug_in_the_controller_fails_the_job_saying_so_and_leaves_no_half_written_batch(
        shapes_data: Path, shm_dir: Path, tmp_path: Path) -> None:
    """The loop's last resort: a status that says the daemon failed and asks for a report, the traceback in
    the log, exit 1, the finished batches kept for the next daemon and no .tmp left (mutation review: no test
    reached it)."""
    from prefetchd.buffer_protocol import list_temp_files

    script = tmp_path / "bug_in_the_loop.py"
    script.write_text(BUG_IN_THE_LOOP)
    buffer = shm_dir / "bf"
    out = subprocess.run([sys.executable, str(script), "start", "--buffer", str(buffer), "--data",
                          str(shapes_data / "train"), *JOB], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "internal error in the controller" in out.stderr and "a bug planted by the test" in out.stderr
    assert "Traceback" in out.stderr, out.stderr
    status = read_status(buffer)
    assert status is not None and status.state is State.FAILED, status
    assert status.message.startswith("internal error: RuntimeError: a bug planted by the test")
    assert "please report it" in status.message
    assert len(list_batches(buffer)) >= 2 and list(list_temp_files(buffer)) == []


# `prefetchd start` whose metrics port is taken, stopped while it starts: SIGTERM arrives just before the
# metrics server is opened, after the worker server started (and made its socket folder in TMPDIR).
STOPPED_THEN_REFUSED = """
import os, signal, sys
import prefetchd.daemon.main as main

real = main.Metrics


def stopped_then_metrics(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kwargs)


main.Metrics = stopped_then_metrics
from prefetchd.cli import main as cli
sys.exit(cli())
"""


def test_a_start_refused_after_a_stop_signal_says_why_and_leaves_no_temp_folder(shapes_data: Path, shm_dir: Path,
                                                                                tmp_path: Path) -> None:
    """The deferred SIGTERM was handed back to its default action once the refused start left its block: the
    daemon died by it, its error never logged and the worker server's pymp-*/listener-* left in TMPDIR."""
    import socket

    script = tmp_path / "stopped_then_refused.py"
    script.write_text(STOPPED_THEN_REFUSED)
    scratch = shm_dir / "tmp"  # short: the socket's path must fit in 107 bytes, or it goes to /tmp
    scratch.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, str(script), "start", "--buffer", str(shm_dir / "bf"), "--data",
                              str(shapes_data / "train"), *JOB, "--metrics-port", str(port)],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "TMPDIR": str(scratch)})
    assert out.returncode == 2, out.stdout + out.stderr  # the refused option's code, not death by SIGTERM (-15)
    assert f"cannot serve metrics on 127.0.0.1:{port}: it is in use" in out.stderr, out.stderr
    assert sorted(p.name for p in scratch.iterdir()) == [], out.stderr



def test_the_socket_folder_a_killed_daemon_left_is_removed_by_the_next_start(
        shapes_data: Path, shm_dir: Path, start_daemon: Callable[..., Any], child_tmpdir: Path) -> None:
    """SIGKILL (the OOM killer's, a `kill -9`) leaves the worker server's socket folder: each one left a pymp-*
    in TMPDIR for good.  The next daemon to start removes it, and not the folder of one that runs."""
    killed = start_daemon(shm_dir / "killed", "--data", shapes_data / "train", *JOB)
    killed.wait_until(lambda: bool(list_batches(killed.buffer)), 120, "a first batch")
    left = socket_folders(child_tmpdir)
    assert len(left) == 1 and list(left[0].glob("pymp-*/listener-*")) != [], left
    killed.proc.kill()
    killed.proc.wait(30)
    os.utime(left[0], (time.time() - 2 * ORPHAN_SECONDS,) * 2)  # as one killed a while ago: not being made now
    running = start_daemon(shm_dir / "running", "--data", shapes_data / "train", *JOB)
    running.wait_until(lambda: bool(list_batches(running.buffer)), 120, "a first batch")
    assert f"removed {left[0]}, the worker server's socket folder of a daemon that was killed" in running.log
    (own,) = socket_folders(child_tmpdir)
    assert own != left[0]
    os.utime(own, (time.time() - 2 * ORPHAN_SECONDS,) * 2)
    third = start_daemon(shm_dir / "third", "--data", shapes_data / "train", *JOB)
    third.wait_until(lambda: bool(list_batches(third.buffer)), 120, "a first batch")
    assert own in socket_folders(child_tmpdir), third.log  # held by the daemon that runs
    assert "socket folder of a daemon that was killed" not in third.log, third.log


@pytest.mark.parametrize("shm", ["read-only", "missing"])
def test_a_daemon_works_where_dev_shm_is_read_only_or_missing(shapes_data: Path, tmp_path: Path, shm: str) -> None:
    """A container's /dev/shm may be read-only or absent: multiprocessing's shared arrays went there whatever the
    buffer's place, and the first worker's start failed, an internal error (a user's walk; `prefetchd demo`,
    which puts its buffer under the temp folder then, failed with it)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a /dev/shm of its own")
    # Read-only: a tmpfs mounted so over it. Missing: /dev itself a read-only tmpfs without it.
    hide = ("mount -t tmpfs -o size=1m,ro tmpfs /dev/shm" if shm == "read-only" else
            "mount -t tmpfs -o size=1m tmpfs /dev && mount -o remount,ro /dev")
    buffer = tmp_path / "bf"
    code, log = served_to_the_end(buffer, ["unshare", "-m", "sh", "-c", f'{hide} && exec "$@"', "sh", sys.executable,
                                           "-m", "prefetchd", "start", "--buffer", str(buffer), "--data",
                                           str(shapes_data / "train"), *JOB])
    assert code == 0 and FINISHED in log and errors_in(log) == [], log


def test_a_temp_folder_too_long_for_the_worker_servers_socket_is_passed_over_once(shapes_data: Path, tmp_path: Path,
                                                                                  shm_dir: Path) -> None:
    """The forkserver's socket, TMPDIR/pymp-*/listener-*, has room for 107 bytes: under a longer TMPDIR (a
    scheduler's per-job scratch folder) it goes under /tmp, which the log said twice."""
    long_tmp = tmp_path / ("t" * 60) / ("u" * 60)
    long_tmp.mkdir(parents=True)
    buffer = shm_dir / "bf"
    code, log = served_to_the_end(buffer, [sys.executable, "-m", "prefetchd", "start", "--buffer", str(buffer),
                                           "--data", str(shapes_data / "train"), *JOB],
                                  env={**os.environ, "TMPDIR": str(long_tmp)})
    assert code == 0 and FINISHED in log and errors_in(log) == [], log
    assert log.count(f"TMPDIR {long_tmp} is too long for the worker server's socket; its socket is in /tmp/{TEMP_PREFIX}") \
        == 1, log
    assert list(long_tmp.iterdir()) == []


def test_a_buffer_open_to_other_users_is_warned_about_once(shapes_data: Path, shm_dir: Path) -> None:
    """A one-rank job's stream folder is the buffer itself, checked again when the job starts: said twice."""
    buffer = shm_dir / "bf"
    buffer.mkdir(mode=0o755)
    buffer.chmod(0o755)
    code, log = served_to_the_end(buffer, [sys.executable, "-m", "prefetchd", "start", "--buffer", str(buffer),
                                           "--data", str(shapes_data / "train"), *JOB])
    assert code == 0 and FINISHED in log, log
    assert log.count(f"buffer directory {buffer} has mode 0755: other users can list or read its batches") == 1, log


def served_to_the_end(buffer: Path, argv: list[str], **popen: Any) -> tuple[int, str]:
    """Run the daemon ``argv`` starts on ``buffer`` while a trainer reads its one epoch; its exit code and log."""
    daemon = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
    try:
        consume_everything(buffer)
        log, _ = daemon.communicate(timeout=60)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    return daemon.returncode, log


def test_a_daemon_refused_threads_says_which_limit_not_a_traceback(shapes_data: Path, tmp_path: Path) -> None:
    """Under a low `ulimit -u` the index's thread pool could not start a thread: the daemon died with a raw
    traceback, its status left at "starting" (a user's walk).  The pool here is one that fails so."""
    refuse = ("import sys, prefetchd.daemon.dataset as dataset\n"
              "class NoThreads:\n"
              "    def __init__(self, *args, **kwargs): pass\n"
              "    def __enter__(self): return self\n"
              "    def __exit__(self, *exc): return False\n"
              "    def submit(self, *args, **kwargs): raise RuntimeError(\"can't start new thread\")\n"
              "dataset.ThreadPoolExecutor = NoThreads\n"
              "from prefetchd.cli import main\n"
              "sys.exit(main())\n")
    out = subprocess.run([sys.executable, "-c", refuse, "start", "--buffer", str(tmp_path / "bf"), "--data",
                          str(shapes_data / "train"), "--refresh-index", "--index-cache", str(tmp_path / "cache"),
                          *JOB], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert "cannot start another thread or process (can't start new thread): the processes and threads allowed" \
        in out.stderr and "pids.max" in out.stderr and "lower --workers" in out.stderr, out.stderr


def test_a_low_soft_open_file_limit_is_raised_before_the_worker_server_starts(shapes_data: Path, tmp_path: Path) -> None:
    """Under a soft limit of 16 the worker server kept it, failed the first worker's start (its files handed over:
    "AssertionError: Len is 6 but msg[0] is 7", a traceback in the log) and was started again (a user's walk)."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 64:
        pytest.skip("the hard open-file limit leaves no room to raise")
    buffer = tmp_path / "bf"
    code, log = served_to_the_end(
        buffer, [sys.executable, "-m", "prefetchd", "start", "--buffer", str(buffer), "--data",
                 str(shapes_data / "train"), *JOB],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (16, hard)))
    assert code == 0 and FINISHED in log and errors_in(log) == [], log
    assert "raised the open-file limit from 16 to" in log, log
