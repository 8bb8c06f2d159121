"""The worker pool under a real daemon: a worker killed mid-run is replaced and its batches still arrive."""

from __future__ import annotations

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
