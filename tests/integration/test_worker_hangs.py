"""A local worker that hangs on a task (SIGSTOPped, a read of a hung mount, a --transform hook that never
returns on one image): the daemon kills it after --task-timeout, says which worker, batch and file, and its
task is built by a new worker, so the trainer still gets every batch once, the same as without the fault; a
task that hangs again and again stops the job, naming the file."""

from __future__ import annotations

import contextlib
import hashlib
import re
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from prefetchd.buffer_protocol import ProtocolError, State, Status, read_status
from prefetchd.daemon.errors import EXIT_FAILURE
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
