"""Waiting in tests for something a real process does: poll, and fail naming what was awaited."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], timeout: float, what: str,
             proc: subprocess.Popen[Any] | None = None, every: float = 0.02) -> None:
    """Return once ``predicate()`` is true; raise AssertionError after ``timeout`` seconds, or at
    once when ``proc`` (the process that was to make it true) has exited."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"pid {proc.pid} exited with {proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)
