"""Transform hooks for test_worker_crashes.py and test_ray_faults.py, imported by the daemon's workers (and Ray
workers): the identity, but the one image of the dataset that is magenta all over kills the worker with
SIGSEGV, as a decoder that segfaults on one file would (or SIGKILL, as the OOM killer)."""

from __future__ import annotations

import os
import resource
import signal
from typing import Any

from tests.integration.hung_hook import is_magenta


def segfaults_on_magenta(image: Any, rng: Any) -> Any:
    if is_magenta(image):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file for each death
        os.kill(os.getpid(), signal.SIGSEGV)
    return image


def killed_on_magenta(image: Any, rng: Any) -> Any:
    """The same, with SIGKILL (the OOM killer's): what a Ray worker cannot survive to report either."""
    if is_magenta(image):
        os.kill(os.getpid(), signal.SIGKILL)
    return image
