"""A consumer in another pid namespace, as a trainer in another container sharing the buffer's tmpfs is.

``unshare --pid --fork --mount-proc`` starts a Python process that is pid 1 of a new pid namespace;
it holds the consumer's lock file and writes its progress saying so, as the trainer's
``ProgressFile`` does (SPEC rule 9), and lives until the test kills it.  Its pid means nothing in the test's
namespace: pid 1 is the test machine's init (there, started long ago), and ``pid=N`` makes the writer
a child with pid N of the new namespace (set through its ``ns_last_pid``), a number the caller picks
free in its own namespace.  Needs root and util-linux's unshare: ``unavailable`` says why not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from tests.waiting import wait_for

unavailable = ("needs root" if os.geteuid() != 0 else "needs util-linux's unshare" if not shutil.which("unshare")
               else "")

# pid 1 of the new namespace runs this: it starts the writer (itself again, as pid ``pid``) or is it.
SCRIPT = r"""
import os, subprocess, sys, time
from pathlib import Path
buffer, consumer, job, pid = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
if os.getpid() != pid:
    Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
    child = subprocess.Popen(sys.orig_argv)
    sys.exit(child.wait())
import fcntl
from prefetchd.buffer_protocol import Progress, consumer_lock_name
# As the trainer's ProgressFile does (SPEC rule 9), with the protocol alone: the buffer_protocol tests run
# where torch, which the trainer package imports, is not installed (.ci/run's Python 3.10 venv).
lock = open(buffer / consumer_lock_name(consumer), "a")
fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
Progress(0, 1, job=job, locked=True).write(buffer, consumer)
print(os.getpid(), flush=True)
time.sleep(600)
"""


class ForeignWriter:
    """The running writer: ``pid`` as its own namespace numbers it."""

    def __init__(self, proc: subprocess.Popen[str], pid: int) -> None:
        self.proc, self.pid = proc, pid

    def kill(self) -> None:
        """SIGKILL unshare and every process of the namespace, and wait until they are gone (and with them
        the writer's lock)."""
        try:
            procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(procs, timeout=30)
        self.proc.wait(timeout=30)


@contextmanager
def foreign_writer(buffer: Path, consumer: str, job: str, pid: int = 1) -> Iterator[ForeignWriter]:
    """A trainer of another pid namespace that has written ``consumer``'s progress at (0, 1) for ``job``
    (a manifest's job key) and holds its lock file, until ``kill`` or the block's end."""
    command = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
               sys.executable, "-c", SCRIPT, str(buffer), consumer, job, str(pid)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]),
                                                                      os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    writer = ForeignWriter(proc, pid)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # its pid, once the document is written
        if line.strip() != str(pid):
            proc.kill()
            raise AssertionError(f"the writer in a new pid namespace did not start: {line!r} "
                                 f"{proc.communicate(timeout=30)[1]}")
        yield writer
    finally:
        if proc.poll() is None:
            writer.kill()


def free_pid() -> int:
    """A pid no process has in this namespace (not too near the last one given out)."""
    taken = set(psutil.pids())
    return next(p for p in range(20000, 30000) if p not in taken and p - 1 not in taken)


__all__ = ["ForeignWriter", "foreign_writer", "free_pid", "unavailable", "wait_for"]
