"""A local worker that hangs on a task (SIGSTOPped, a read of a hung mount, a --transform hook that never
returns on one image): the daemon kills it after --task-timeout, says which worker, batch and file, and its
task is built by a new worker, so the trainer still gets every batch once, the same as without the fault; a
task that hangs again and again stops the job, naming the file."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from prefetchd.buffer_protocol import ProtocolError, State, Status, read_status
from prefetchd.daemon.errors import EXIT_FAILURE, EXIT_USAGE
from prefetchd.daemon.worker_health import MAX_TASK_HANGS
from prefetchd.daemon.status_view import describe_status, format_status
from prefetchd.trainer import BufferLoader
from prefetchd.trainer.errors import DaemonGone
from prefetchd.words import counted
from tests.daemon_workers import daemon_workers

JOB = ["--batch-size", "8", "--image-size", "32", "--seed", "7", "--high-water", "3", "--low-water", "1"]


def status(buffer: Path) -> Status | None:
    try:
        return read_status(buffer)
    except (ProtocolError, OSError):  # being replaced
        return None


def received(batch: Any) -> tuple[int, int, list[int], str]:
    images = np.ascontiguousarray(batch.images.numpy())
    return batch.epoch, batch.step, batch.indices.tolist(), hashlib.sha256(images.tobytes()).hexdigest()


def test_a_stopped_worker_is_killed_and_replaced_and_every_batch_arrives_once_the_same(
        shapes_data: Path, shm_dir: Path, start_daemon: Any) -> None:
    data = shapes_data / "train"
    job = [*JOB, "--data", data, "--epochs", "2", "--workers", "2"]
    start_daemon(shm_dir / "ref", *job)
    ref_loader = BufferLoader(shm_dir / "ref", normalize=False, timeout=60)
    reference = [received(b) for epoch in range(2) for b in ref_loader]
    ref_loader.close()

    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, *job, "--task-timeout", "3")
    loader = BufferLoader(buffer, normalize=False, timeout=60)  # the code before: LoaderTimeout after these 60 s
    got: list[tuple[int, int, list[int], str]] = []
    victim: psutil.Process | None = None
    times: list[float] = []  # when each batch after the SIGSTOP came
    try:
        for epoch in range(2):
            for batch in loader:
                got.append(received(batch))
                if victim is None and len(got) == 2:
                    victim = daemon_workers(daemon.proc.pid)[0]
                    victim.send_signal(signal.SIGSTOP)  # it holds tasks, or is given the next (the least busy is)
                    stopped = time.monotonic()
                if victim is not None:
                    times.append(time.monotonic())
    finally:
        loader.close()
        if victim is not None:
            with contextlib.suppress(psutil.Error):  # gone, as it should be
                victim.send_signal(signal.SIGCONT)
    assert got == reference  # each (epoch, step) once, in order, bit-identical, the same samples
    waits = np.diff([stopped, *times])
    print(f"after the SIGSTOP the trainer waited at most {waits.max():.1f} s for a batch "
          f"(batch {int(waits.argmax())} after it, {times[int(waits.argmax())] - stopped:.1f} s after the SIGSTOP)")
    assert daemon.wait_exit(30) == 0, daemon.log
    assert victim is not None
    assert not psutil.pid_exists(victim.pid) or psutil.Process(victim.pid).status() == psutil.STATUS_ZOMBIE, "killed"
    final = status(buffer)
    assert final is not None and final.production is not None, daemon.log
    errors = final.production.errors
    assert errors.worker_hangs >= 1 and errors.worker_restarts >= 1, daemon.log
    # `prefetchd status` shows it beside the other error counters.
    assert f"{counted(errors.worker_hangs, 'hung worker')} killed" in format_status(describe_status(buffer))
    # Said before it is killed (at a quarter of --task-timeout), and when it is, with the pid and the batch.
    assert f"worker pid {victim.pid} has made no progress for" in daemon.log, daemon.log
    assert f"worker pid {victim.pid} made no progress for" in daemon.log and "killed it;" in daemon.log, daemon.log


def test_a_trainer_waits_on_past_its_timeout_while_the_daemon_says_a_worker_is_stalled(
        shapes_data: Path, shm_dir: Path, start_daemon: Any, caplog: Any) -> None:
    """--task-timeout (600 s) is longer than a loader's timeout (120 s): a loader gave up with LoaderTimeout while
    the daemon was still to kill the hung worker and build its batch, and its message quoted the status's note cut
    before the option's name.  Now the status says a worker is stalled (``worker_stall``), and the loader waits on
    while the daemon beats and says so, saying why in its log; every batch comes once."""
    caplog.set_level(logging.WARNING, logger="prefetchd.trainer.batch_waiter")
    buffer = shm_dir / "bf"
    # The kill comes 16 s after the stall began, twice the loader's timeout; the note 4 s after, within it.
    daemon = start_daemon(buffer, *JOB, "--data", shapes_data / "train", "--epochs", "1", "--workers", "2",
                          "--task-timeout", "16")
    loader = BufferLoader(buffer, normalize=False, timeout=8)
    steps: list[tuple[int, int]] = []
    victim: psutil.Process | None = None
    try:
        for batch in loader:
            steps.append((batch.epoch, batch.step))
            if victim is None and len(steps) == 2:
                victim = daemon_workers(daemon.proc.pid)[0]
                victim.send_signal(signal.SIGSTOP)
    finally:
        loader.close()
        if victim is not None:
            with contextlib.suppress(psutil.Error):
                victim.send_signal(signal.SIGCONT)
    assert steps == [(0, step) for step in range(len(loader))], daemon.log
    assert daemon.wait_exit(30) == 0, daemon.log
    assert victim is not None and f"worker pid {victim.pid} made no progress for" in daemon.log, daemon.log
    said = [r.getMessage() for r in caplog.records if "says that a worker building its batches is stalled" in r.getMessage()]
    assert said and f"(worker pid {victim.pid} has made no progress for" in said[0], caplog.text
    assert "at its --task-timeout of 16 s, in " in said[0], said[0]
    assert "this loader waits on past its timeout of 8 s" in said[0], said[0]
    # Once: the stall lasts 12 s, under WORKER_STALL_LOG_SECONDS.  Its `since` (the daemon's wall clock less the
    # seconds it counted) moves by microseconds from one status to the next, and each was said as a new stall.
    assert len(said) == 1, said


def test_a_hook_that_never_returns_on_one_file_is_named_and_its_task_tried_3_times_before_the_job_stops(
        magenta_data: tuple[Path, Path], shm_dir: Path, start_daemon: Any) -> None:
    data, magenta = magenta_data
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, *JOB, "--data", data, "--epochs", "1", "--workers", "1", "--task-timeout", "2",
                          "--transform", "tests.integration.hung_hook:never_returns_on_magenta")
    # Before the worker is killed, the status's message names it and the file (a trainer's timeout quotes it).
    notes: list[str] = []

    def noted() -> bool:
        st = status(buffer)
        if st is not None and "has made no progress for" in st.message:
            notes.append(st.message)
        return bool(notes)

    daemon.wait_until(noted, 120, "the status to say that the worker makes no progress")
    assert str(magenta) in notes[0] and "(--task-timeout)" in notes[0], notes[0]
    # The trainer reads what comes, and is told why the batch with the magenta image never does.
    with pytest.raises(DaemonGone) as gone:
        for _batch in BufferLoader(buffer, normalize=False, timeout=120):
            pass
    assert f"its task hung {MAX_TASK_HANGS} times" in str(gone.value) and str(magenta) in str(gone.value), gone.value
    assert daemon.wait_exit(30) == EXIT_FAILURE, daemon.log
    final = status(buffer)
    assert final is not None and final.state == State.FAILED and final.production is not None, daemon.log
    assert final.production.errors.worker_hangs == MAX_TASK_HANGS, daemon.log
    assert f"{MAX_TASK_HANGS} hung workers killed" in format_status(describe_status(buffer))
    assert f"each time on {magenta}" in final.message, final.message
    kills = [line for line in daemon.log.splitlines() if "(--task-timeout 2) on batch" in line]
    assert len(kills) == MAX_TASK_HANGS and all(str(magenta) in line for line in kills), daemon.log
    assert "the job stops" in kills[-1], kills[-1]
    hung = [int(re.search(r"worker pid (\d+) made", line).group(1)) for line in kills]  # type: ignore[union-attr]
    assert len(set(hung)) == MAX_TASK_HANGS, "a new worker each time"
    assert not [pid for pid in hung if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


HUNG_IMPORT = "tests.integration.hung_import_hook"
FIFO_IMPORT = "tests.integration.fifo_import_hook"


@pytest.fixture
def import_gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file whose presence holds hung_import_hook's import (the daemons started inherit the environment)."""
    gate = tmp_path / "import-gate"
    gate.touch()
    monkeypatch.setenv("PREFETCHD_TEST_IMPORT_GATE", str(gate))
    return gate


def test_a_worker_that_never_gets_ready_is_said_and_killed_and_the_next_one_builds_every_batch(
        shapes_data: Path, shm_dir: Path, start_daemon: Any, import_gate: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's start (importing torch and the hook's module, opening the dataset's storage) was not timed: one
    whose hook's module never finished importing held its tasks for good, with nothing said, and the trainer timed
    out.  Now its start is timed (--worker-start-timeout): the status says what it is stuck on, the log too, and it is
    killed and another started in its place; once that one gets ready, the job is built as ever."""
    monkeypatch.setenv("PREFETCHD_TEST_IMPORT_WHERE", "workers")
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, *JOB, "--data", shapes_data / "train", "--epochs", "1", "--workers", "1",
                          "--worker-start-timeout", "10", "--transform", f"{HUNG_IMPORT}:identity")
    notes: list[str] = []

    def noted() -> bool:
        st = status(buffer)
        if st is not None and "has not got ready in" in st.message and "hook" in st.message:  # past torch's import
            notes.append(st.message)
        return bool(notes)

    daemon.wait_until(noted, 120, "the status to say that the worker does not get ready")
    assert f"it is importing the --transform hook's module {HUNG_IMPORT}" in notes[0], notes[0]
    assert "(--worker-start-timeout) it is killed and another started" in notes[0], notes[0]
    daemon.wait_until(lambda: "did not get ready in" in daemon.log, 60, "the worker to be killed")
    import_gate.unlink()  # what the module waited for is there: the next worker gets ready
    loader = BufferLoader(buffer, normalize=False, timeout=60)
    try:
        steps = [(batch.epoch, batch.step) for batch in loader]
    finally:
        loader.close()
    assert steps == [(0, step) for step in range(len(loader))], daemon.log
    assert daemon.wait_exit(30) == 0, daemon.log
    final = status(buffer)
    assert final is not None and final.production is not None and final.production.errors.worker_hangs >= 1
    kill = next(line for line in daemon.log.splitlines() if "did not get ready in" in line)
    assert (f"(--worker-start-timeout 10): it was importing the --transform hook's module {HUNG_IMPORT}; killed it; "
            f"another starts in its place (hang 1 of {MAX_TASK_HANGS} in a row there)") in kill, kill
    pid = int(re.search(r"worker pid (\d+) did not", kill).group(1))  # type: ignore[union-attr]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, "killed"


def test_workers_that_never_get_ready_stop_the_job_naming_what_they_were_stuck_on(
        shapes_data: Path, shm_dir: Path, start_daemon: Any, import_gate: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """MAX_TASK_HANGS workers in a row in one place that never get ready stop the job, as a task that hangs that
    often does: the trainer's DaemonGone and the status say what they were doing and what to run."""
    monkeypatch.setenv("PREFETCHD_TEST_IMPORT_WHERE", "workers")
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, *JOB, "--data", shapes_data / "train", "--epochs", "1", "--workers", "1",
                          "--worker-start-timeout", "10", "--transform", f"{HUNG_IMPORT}:identity")
    with pytest.raises(DaemonGone) as gone:
        for _batch in BufferLoader(buffer, normalize=False, timeout=120):
            pass
    # 10 s: more than importing torch takes a worker on a busy 2-core box (over 3 s), which a start's time counts.
    said = (f"no worker gets ready: {MAX_TASK_HANGS} workers in a row, each killed after 10 s without getting ready "
            f"(--worker-start-timeout), were each importing the --transform hook's module {HUNG_IMPORT}. Something "
            "never returns there: the --transform hook's module when it is imported (does "
            f"`python -c 'import {HUNG_IMPORT}'` return?)")
    assert said in str(gone.value), str(gone.value)
    assert daemon.wait_exit(30) == EXIT_FAILURE, daemon.log
    final = status(buffer)
    assert final is not None and final.state == State.FAILED and said in final.message, daemon.log
    assert final.production is not None and final.production.errors.worker_hangs == MAX_TASK_HANGS, daemon.log
    kills = [line for line in daemon.log.splitlines() if "did not get ready in" in line]
    assert len(kills) == MAX_TASK_HANGS and "the job stops" in kills[-1], daemon.log


def test_the_daemons_own_import_of_a_hook_that_never_returns_is_bounded_and_heeds_a_stop(
        shapes_data: Path, shm_dir: Path, start_daemon: Any, import_gate: Path) -> None:
    """The daemon imports the hook's module itself when a job starts, to say a typo at once.  One that never
    returned held the daemon there for good: status.json stood still, SIGTERM (whose handler only sets a flag)
    did not stop it, and nothing said why.  Now the start beats on and says what it waits for, a stop stops it,
    and at --worker-start-timeout the job is refused with the line the import is at."""
    job = [*JOB, "--data", shapes_data / "train", "--epochs", "1", "--workers", "1",
           "--transform", f"{HUNG_IMPORT}:identity"]
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, *job)
    waiting = f"importing the --transform hook's module {HUNG_IMPORT}"
    daemon.wait_until(lambda: (st := status(buffer)) is not None and waiting in st.message, 60, "the status to say so")
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.wait_exit(30) == 0, daemon.log
    assert "stopped by SIGTERM" in daemon.log, daemon.log

    daemon = start_daemon(shm_dir / "bf2", *job, "--worker-start-timeout", "3")
    assert daemon.wait_exit(60) == EXIT_USAGE, daemon.log
    hook_file = Path(__file__).with_name("hung_import_hook.py")
    said = (f"transform = '{HUNG_IMPORT}:identity': importing {HUNG_IMPORT} did not return in 3 s "
            f"(--worker-start-timeout); it is at {hook_file}:")
    assert said in daemon.log and "(`time.sleep(0.1)`)" in daemon.log, daemon.log
    final = status(shm_dir / "bf2")
    assert final is not None and final.state == State.FAILED and said in final.message, daemon.log


def test_the_daemons_own_import_is_bounded_where_the_hooks_source_cannot_be_read_either(
        shapes_data: Path, shm_dir: Path, start_daemon: Any, import_gate: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the daemon says of an import that does not return names the line it is at, which it read from the
    module's file on the daemon's own thread: where the import waits on a hung mount, a module there (the hook's
    own) cannot be read either, and that read held the daemon for good (status.json still, deaf to SIGTERM), as
    the import itself did before it ran on a thread.  A FIFO stands for such a file here: opened for its lines, it
    blocks.  Now the lines are read on a thread of their own, for a moment, and left out where they do not come."""
    fifo = tmp_path / "on-a-hung-mount.py"
    os.mkfifo(fifo)
    monkeypatch.setenv("PREFETCHD_TEST_IMPORT_FIFO", str(fifo))
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, *JOB, "--data", shapes_data / "train", "--epochs", "1", "--workers", "1",
                          "--worker-start-timeout", "3", "--transform", f"{FIFO_IMPORT}:identity")
    try:
        code = daemon.proc.wait(60)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        with contextlib.suppress(OSError):  # a reader blocked on it (the code before) gets an end of file
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert code == EXIT_USAGE, daemon.log
    said = (f"transform = '{FIFO_IMPORT}:identity': importing {FIFO_IMPORT} did not return in 3 s "
            f"(--worker-start-timeout); it is at {fifo}:")
    came = f", called from {Path(__file__).with_name('fifo_import_hook.py')}:"
    assert said in daemon.log and came in daemon.log, daemon.log
    final = status(buffer)
    assert final is not None and final.state == State.FAILED and said in final.message, daemon.log
