"""A real cgroup v1 of a controller, made for one test: its limits written, removed afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def cgroup_v1(controller: str, limits: dict[str, str]) -> Iterator[Path]:
    """A cgroup of its own under ``controller``'s v1 hierarchy, with ``limits`` written to its files; a command
    joins it with ``in_cgroup``.  Skipped where there is none to make (not root; cgroup v2 only, whose files
    ``tests/daemon/test_daemon_config.py``'s fake trees cover)."""
    root = Path("/sys/fs/cgroup") / controller
    if os.geteuid() != 0 or not (root / "cgroup.procs").exists() or (root / "cgroup.controllers").exists():
        pytest.skip(f"needs root and a cgroup v1 {controller} controller at {root}")
    group = root / f"prefetchd-test-{os.getpid()}-{time.monotonic_ns()}"
    group.mkdir()
    try:
        if controller == "memory" and (group / "memory.swappiness").exists():
            # Where the machine has swap, a process over the limit would be swapped out rather than OOM-killed.
            (group / "memory.swappiness").write_text("0")
        for name, value in limits.items():
            (group / name).write_text(value)
        yield group
    finally:
        # Its processes gone, a memory cgroup may still be charged with pages (files its processes read): emptied
        # first; a removal refused meanwhile (EBUSY) is tried again for a while.
        with contextlib.suppress(OSError):
            (group / "memory.force_empty").write_text("0")
        deadline = time.monotonic() + 10
        while True:
            try:
                group.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def in_cgroup(group: Path, argv: list[str]) -> list[str]:
    """``argv`` run in ``group``: a shell that joins it, then becomes the command."""
    return ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *argv]


def oom_killed_in(group: Path) -> None:
    """Run in ``group``, a memory cgroup of a limit under 256 MiB, a process that takes 256 MiB: the kernel's OOM
    killer kills it, and each count of OOM kills (the cgroup's, the machine's) rises by one."""
    hog = subprocess.run(in_cgroup(group, [sys.executable, "-c", "bytearray(256 << 20)"]), timeout=60)
    assert hog.returncode == -signal.SIGKILL, "the OOM killer took the process over its cgroup's limit"
