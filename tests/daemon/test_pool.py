"""The worker pool under a real daemon: a worker killed mid-run is replaced and its batches still arrive."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefetchd.buffer_protocol import Production, Progress, ProtocolError, list_batches
from tests.daemon_workers import daemon_workers
from tests.status_examples import production_of


def _production(buffer: Path) -> Production | None:
    try:
        return production_of(buffer)
    except ProtocolError:  # being replaced
        return None


def test_a_killed_worker_is_replaced_and_its_tasks_requeued(
    shapes_data: Path, shm_dir: Path, start_daemon: Callable[..., Any]
) -> None:
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", "--batch-size", "8", "--image-size", "32",
                          "--workers", "2", "--high-water", "3", "--low-water", "1")
    daemon.wait_until(lambda: (p := _production(buffer)) is not None and p.workers == 2, 120, "two workers")
    workers = daemon_workers(daemon.proc.pid)
    assert len(workers) == 2, workers
    workers[0].kill()
    daemon.wait_until(lambda: (p := _production(buffer)) is not None and p.errors.worker_restarts == 1
                      and p.workers == 2, 60, "the killed worker replaced")
    Progress(0, 5).write(buffer)  # the trainer moves on: the new window is built by the pool
    daemon.wait_until(lambda: set(list_batches(buffer)) == {(0, 5), (0, 6), (0, 7)}, 60, "the window after the kill")
    assert "requeuing" in daemon.log


def test_the_worker_server_starts_under_a_tmpdir_too_long_for_its_socket(tmp_path: Path) -> None:
    """A scheduler's per-job TMPDIR can be longer than a Unix socket path allows: the forkserver's
    socket folder goes under /tmp instead of the bind failing with 'AF_UNIX path too long'."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    script = ("import multiprocessing.util; from prefetchd.daemon.pool import start_worker_server; "
              "start_worker_server(); print(multiprocessing.util.get_temp_dir())")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TMPDIR": str(deep)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().startswith("/tmp/pymp-"), run.stdout
    assert not Path(run.stdout.strip()).exists(), "removed at exit, as multiprocessing's own folder is"
