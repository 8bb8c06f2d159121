"""The daemon runs under SCHED_BATCH (``main.run_as_batch``): its wake-ups do not preempt the trainer,
nor its own workers; a policy the user chose is kept."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from prefetchd.buffer_protocol import State, read_status

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")


def policies(pid: int) -> dict[str, int]:
    """The scheduling policy of each thread of ``pid`` and of its descendants, by "pid/tid"."""
    got = {}
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        for thread in proc.threads():
            got[f"{proc.pid}/{thread.id}"] = os.sched_getscheduler(thread.id)
    return got


def test_the_controller_its_threads_and_its_workers_run_under_sched_batch(
        shapes_data: Path, shm_dir: Path, start_daemon: Callable[..., Any]) -> None:
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", "--batch-size", "8", "--image-size", "32",
                          "--workers", "2", "--high-water", "3")

    def producing() -> bool:
        status = read_status(buffer)
        return status is not None and status.state in (State.FILLING, State.FULL)

    daemon.wait_until(producing, 60, "the daemon producing")
    got = policies(daemon.proc.pid)
    assert len(psutil.Process(daemon.proc.pid).children(recursive=True)) >= 3, "the worker server and 2 workers"
    assert len(got) >= 5 and set(got.values()) == {os.SCHED_BATCH}, got


@pytest.mark.parametrize("chosen", [None, "SCHED_IDLE", "SCHED_BATCH"])
def test_a_policy_the_user_chose_is_kept(chosen: str | None) -> None:
    # The policy is set after the import, as `chrt` would have set it before: under SCHED_IDLE, the import on a
    # busy machine (the suite's other workers) waited minutes for a core (CI, stop 71).
    choose = f"os.sched_setscheduler(0, os.{chosen}, os.sched_param(0)); " if chosen else ""
    code = ("import os; from prefetchd.daemon.main import run_as_batch; " + choose + "run_as_batch(); "
            "print({getattr(os, n): n for n in ('SCHED_OTHER', 'SCHED_BATCH', 'SCHED_IDLE')}[os.sched_getscheduler(0)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (chosen or "SCHED_BATCH")
