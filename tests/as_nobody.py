"""Run a piece of a test as user nobody (uid and gid 65534), in a forked child of the test's process.

Forked rather than started: the child has the test's modules already imported, so nobody needs no access to
the interpreter's files (CI's Python lives under root's home, which nobody cannot enter)."""

from __future__ import annotations

import os
from collections.abc import Callable

NOBODY = 65534


def as_nobody(work: Callable[[], str], gid: int = NOBODY) -> str:
    """What ``work`` returns, run as nobody (in group ``gid``: another than its own plays a session that began before
    nobody joined its own); an exception it raises comes back as "TypeName: message"."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            os.setgroups([]), os.setgid(gid), os.setuid(NOBODY)
            try:
                said = work()
            except BaseException as exc:
                said = f"{type(exc).__name__}: {exc}"
            os.write(write, said.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read().decode()
    os.waitpid(pid, 0)
    return said


__all__ = ["NOBODY", "as_nobody"]
