"""A --transform hook for test_ray_faults.py whose module never finishes importing in a Ray worker, as a module
on a node's hung mount, or one that waits on a lock there when imported, would: every Ray worker's start blocks
before it begins a slice (and the node's probe with it).  The daemon's own check of the hook (its main process)
and the bridge (a Ray driver, not a worker) import it at once."""

from __future__ import annotations

import sys
import time
from typing import Any


def _in_a_ray_worker() -> bool:
    worker = sys.modules.get("ray._private.worker")
    return worker is not None and getattr(worker.global_worker, "mode", None) == worker.WORKER_MODE


while _in_a_ray_worker():
    time.sleep(0.1)


def identity(image: Any, rng: Any) -> Any:
    return image
