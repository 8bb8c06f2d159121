"""Processes in another pid namespace, as a trainer or a daemon in another container sharing the buffer's tmpfs are.

``unshare --pid --fork --mount-proc`` starts a Python process that is pid 1 of a new pid namespace; it runs
a command as pid N there (set through the namespace's ``ns_last_pid``), a number the caller picks: free in
its own namespace (``free_pid``), so that the pid names nobody there, or one of its own processes', so that it
names an unrelated one; pid 1 runs the command itself, named in the test's namespace by its init (there,
started long ago).  The namespace lives until the command exits or the test kills it.

``foreign_writer`` is a trainer that holds a consumer's lock file and writes its progress saying so, as the
trainer's ``ProgressFile`` does (SPEC rule 9); ``foreign_lock_holder`` a daemon that holds ``daemon.lock`` and
writes its status, as ``prefetchd start`` does (SPEC rules 4 and 8), with the protocol alone: the
buffer_protocol tests run where torch, which the trainer and the daemon's workers import, is not installed
(.ci/run's Python 3.10 venv).  A real daemon is ``in_new_pid_namespace`` of its command; a real loader is
``started_in_new_pid_namespace``, a command that prints its pid once it has read a batch.
Needs root and util-linux's unshare: ``unavailable`` says why not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from tests.waiting import wait_for

unavailable = ("needs root" if os.geteuid() != 0 else "needs util-linux's unshare" if not shutil.which("unshare")
               else "")
REPO = Path(__file__).resolve().parents[1]

# pid 1 of the new namespace runs this: the command as pid ``pid`` there, waited for, or itself as pid 1.
LAUNCH = r"""
import os, subprocess, sys
from pathlib import Path
pid, argv = int(sys.argv[1]), sys.argv[2:]
if pid == 1:
    os.execvp(argv[0], argv)
Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
sys.exit(subprocess.Popen(argv).wait())
"""

WRITER = r"""
import fcntl, os, sys, time
from pathlib import Path
from prefetchd.buffer_protocol import Progress, consumer_lock_name
buffer, consumer, job = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
lock = open(buffer / consumer_lock_name(consumer), "a")
fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
Progress(0, 1, job=job, locked=True).write(buffer, consumer)
print(os.getpid(), flush=True)
time.sleep(600)
"""

LOCK_HOLDER = r"""
import os, sys, time
from pathlib import Path
from prefetchd.buffer_protocol import DaemonLock, State, Status, write_status
buffer = Path(sys.argv[1])
DaemonLock(buffer).acquire()
write_status(buffer, Status(pid=os.getpid(), state=State.WAITING_FOR_JOB, heartbeat=time.time()))
print(os.getpid(), flush=True)
time.sleep(600)
"""


class ForeignProcess:
    """A command running as ``pid`` of a new pid namespace, started by ``proc`` (unshare)."""

    def __init__(self, proc: subprocess.Popen[Any], pid: int) -> None:
        self.proc, self.pid = proc, pid

    def processes(self) -> list[psutil.Process]:
        """unshare and every process of the namespace, as this namespace numbers them."""
        try:
            return [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def here(self) -> psutil.Process:
        """The command's process, as this namespace numbers it (to signal it from here)."""
        for p in self.processes()[1:]:
            with contextlib.suppress(OSError):
                numbers = next(line.split()[1:] for line in Path(f"/proc/{p.pid}/status").read_text().splitlines()
                               if line.startswith("NSpid:"))
                if numbers[-1] == str(self.pid):
                    return p
        raise AssertionError(f"no process is pid {self.pid} of the new namespace")

    def kill(self) -> None:
        """SIGKILL unshare and every process of the namespace, and wait until they are gone (and with them
        their locks)."""
        procs = self.processes()
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(procs, timeout=30)
        self.proc.wait(timeout=30)


def in_new_pid_namespace(argv: Sequence[str], pid: int = 1, **popen: Any) -> ForeignProcess:
    """Start ``argv`` as ``pid`` of a new pid namespace (``popen``: subprocess.Popen's arguments); this checkout's
    prefetchd is the one imported there."""
    command = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, "-c", LAUNCH, str(pid),
               *argv]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return ForeignProcess(subprocess.Popen(command, env=env, **popen), pid)


@contextmanager
def started_in_new_pid_namespace(argv: Sequence[str], pid: int, what: str) -> Iterator[ForeignProcess]:
    """``argv`` as ``pid`` of a new pid namespace, once it has printed that pid (when it is set up: a trainer that
    has written its progress, say); killed at the block's end.  ``what`` it is, for the message when it fails."""
    foreign = in_new_pid_namespace(argv, pid, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = foreign.proc
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # its pid, once it is set up
        if line.strip() != str(pid):
            proc.kill()
            raise AssertionError(f"{what} in a new pid namespace did not start: {line!r} {proc.communicate(timeout=30)[1]}")
        yield foreign
    finally:
        if proc.poll() is None:
            foreign.kill()


@contextmanager
def foreign_writer(buffer: Path, consumer: str, job: str, pid: int = 1) -> Iterator[ForeignProcess]:
    """A trainer of another pid namespace that has written ``consumer``'s progress at (0, 1) for ``job``
    (a manifest's job key) and holds its lock file, until ``kill`` or the block's end."""
    argv = [sys.executable, "-c", WRITER, str(buffer), consumer, job]
    with started_in_new_pid_namespace(argv, pid, "the writer") as writer:
        yield writer


@contextmanager
def foreign_lock_holder(buffer: Path, pid: int = 1) -> Iterator[ForeignProcess]:
    """A daemon of another pid namespace, as the protocol sees one: it holds ``buffer``'s daemon.lock and has
    written its status (waiting for a job), until ``kill`` or the block's end."""
    argv = [sys.executable, "-c", LOCK_HOLDER, str(buffer)]
    with started_in_new_pid_namespace(argv, pid, "the lock holder") as holder:
        yield holder


def free_pid() -> int:
    """A pid no process has in this namespace (not too near the last one given out)."""
    taken = set(psutil.pids())
    return next(p for p in range(20000, 30000) if p not in taken and p - 1 not in taken)


__all__ = ["ForeignProcess", "foreign_lock_holder", "foreign_writer", "free_pid", "in_new_pid_namespace",
           "started_in_new_pid_namespace", "unavailable", "wait_for"]
