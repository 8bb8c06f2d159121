"""A --transform hook for test_ray_faults.py whose module kills the Ray worker that imports it (SIGKILL), as a
module whose native extension segfaults when imported on a node, or one the OOM killer stops there, would: every
Ray worker dies before its first image.  The daemon's own check of the hook (its main process) and the bridge (a
Ray driver, not a worker) import it unharmed.  With $PREFETCHD_TEST_KILL_LOCAL_WORKERS set, the other way round:
it kills the daemon's local workers (their processes are named "prefetchd-worker") and no Ray worker, as a module
broken on the daemon's box only would."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from typing import Any

KILL_LOCAL = "PREFETCHD_TEST_KILL_LOCAL_WORKERS"


def _in_a_ray_worker() -> bool:
    worker = sys.modules.get("ray._private.worker")
    return worker is not None and getattr(worker.global_worker, "mode", None) == worker.WORKER_MODE


def _doomed() -> bool:
    if os.environ.get(KILL_LOCAL):
        return multiprocessing.current_process().name == "prefetchd-worker"
    return _in_a_ray_worker()


if _doomed():
    os.kill(os.getpid(), signal.SIGKILL)


def identity(image: Any, rng: Any) -> Any:
    return image
