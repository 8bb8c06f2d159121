"""A --transform hook for test_worker_hangs.py whose module does not finish importing while the file that
$PREFETCHD_TEST_IMPORT_GATE names is there, as a module that reads a hung mount or waits on a lock when imported
would.  With $PREFETCHD_TEST_IMPORT_WHERE=workers only in the daemon's workers (their processes are named
"prefetchd-worker"): the daemon's own check of the hook, in its main process, imports it at once, as where what
the module waits for is there for the daemon and not for its workers."""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any

GATE = "PREFETCHD_TEST_IMPORT_GATE"
WHERE = "PREFETCHD_TEST_IMPORT_WHERE"


def _held_here() -> bool:
    return (os.environ.get(WHERE) != "workers" or multiprocessing.current_process().name == "prefetchd-worker")


while _held_here() and os.path.exists(os.environ.get(GATE, "")):
    time.sleep(0.1)


def identity(image: Any, rng: Any) -> Any:
    return image
