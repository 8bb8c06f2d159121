"""The worker processes of a running daemon and their fork server, for tests that kill one."""

from __future__ import annotations

import psutil


def daemon_workers(pid: int) -> list[psutil.Process]:
    """The workers of daemon ``pid``: forked by its fork server, the daemon's child, so the
    daemon's grandchildren.  psutil.Error where the daemon is gone."""
    return [p for p in psutil.Process(pid).children(recursive=True) if p.ppid() != pid]


def worker_server(pid: int) -> psutil.Process:
    """The fork server of daemon ``pid``, its child beside multiprocessing's resource tracker."""
    (server,) = [p for p in psutil.Process(pid).children() if "multiprocessing.forkserver" in " ".join(p.cmdline())]
    return server
