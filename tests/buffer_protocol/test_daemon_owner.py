"""Which daemon owns a buffer (SPEC rules 4 and 8): while daemon.lock is held, by the pid in it in the reader's own
pid namespace, by the lock alone where the daemon's status says it is of another one (the daemon on the host or in
another container sharing the tmpfs, the reader in this one).  Real daemons in another pid namespace:
tests/integration/test_daemon_pid_namespace.py."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from prefetchd.buffer_protocol import (BufferBusy, DaemonLock, DaemonOwner, ProtocolError, State, Status, daemon_owner,
                                      daemon_pid, lock_holders, read_status, write_status)
from prefetchd.buffer_protocol.layout import LOCK_NAME, STATUS_NAME
from prefetchd.buffer_protocol.ownership import LOCK_RETRY_SECONDS
from tests.owners import owned
from tests.pid_namespace import foreign_lock_holder, free_pid, unavailable
from tests.status_examples import status as status_example

OURS = os.stat("/proc/self/ns/pid").st_ino
OTHER = OURS + 1  # a pid namespace that is not this process's
HOLD = """
import fcntl, sys, time
fd = open(sys.argv[1])
fcntl.flock(fd, fcntl.LOCK_SH if sys.argv[2] == "shared" else fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[3]))
"""


def hold(path: Path, how: str = "exclusive", seconds: float = 60) -> subprocess.Popen[str]:
    """Another process holding ``path``'s flock for ``seconds``: as a daemon does (exclusive), or as a reader
    asking whether one does (shared)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), how, str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_status_names_the_daemons_pid_namespace(tmp_path: Path) -> None:
    write_status(tmp_path, status_example())
    doc = json.loads((tmp_path / STATUS_NAME).read_text())
    assert doc["pid_namespace"] == OURS
    status = read_status(tmp_path)
    assert status is not None and status.pid_namespace == OURS
    (tmp_path / STATUS_NAME).write_text(json.dumps({k: v for k, v in doc.items() if k != "pid_namespace"}))
    older = read_status(tmp_path)  # a daemon that predates the field
    assert older is not None and older.pid_namespace is None and "pid_namespace" not in older.to_doc()
    for bad in (-1, 1.5, True, "pid:[4026531836]"):
        (tmp_path / STATUS_NAME).write_text(json.dumps({**doc, "pid_namespace": bad}))
        with pytest.raises(ProtocolError, match="field 'pid_namespace'"):
            read_status(tmp_path)


def test_a_daemon_of_another_pid_namespace_is_judged_by_its_lock_not_its_pid(shm_dir: Path) -> None:
    """The pid in daemon.lock names a live process here, of the file's owner, started before the file: a daemon
    of this namespace would be taken for running by it.  Of another namespace, only the lock counts."""
    lock = shm_dir / LOCK_NAME
    lock.write_text(f"{os.getpid()}\n")
    write_status(shm_dir, Status(pid=os.getpid(), state=State.WAITING_FOR_JOB, heartbeat=time.time(), pid_namespace=OTHER))
    assert daemon_owner(shm_dir) is None, "nobody holds the lock: gone, whatever the pid names here"
    holder = hold(lock)
    try:
        owner = daemon_owner(shm_dir)
        assert owner == DaemonOwner(os.getpid(), OTHER) and not owner.here
        assert str(owner) == f"pid {os.getpid()} of another pid namespace"
        assert daemon_pid(shm_dir) is None, "nothing here to look at or signal"
        assert daemon_owner(shm_dir / "rank-00001") == owner  # a rank's stream: its buffer's daemon
        # A status of this namespace, an older daemon's without one, or another pid's: the pid decides, as before.
        for status in (Status(pid=os.getpid(), state=State.WAITING_FOR_JOB, heartbeat=time.time()),
                       Status(pid=os.getpid(), state=State.WAITING_FOR_JOB, heartbeat=time.time(), pid_namespace=None),
                       Status(pid=free_pid(), state=State.WAITING_FOR_JOB, heartbeat=time.time(), pid_namespace=OTHER)):
            write_status(shm_dir, status)
            assert daemon_owner(shm_dir) == DaemonOwner(os.getpid())
    finally:
        holder.kill()
        holder.wait()
    write_status(shm_dir, Status(pid=os.getpid(), state=State.WAITING_FOR_JOB, heartbeat=time.time(), pid_namespace=OTHER))
    assert daemon_owner(shm_dir) is None
    taken = DaemonLock(shm_dir)
    taken.acquire()  # the questions kept nothing locked
    taken.release()


@pytest.mark.parametrize("named", ["init", "this test's process"])
def test_a_lock_nobody_holds_names_no_daemon_whatever_process_has_its_pid(shm_dir: Path, named: str) -> None:
    """A daemon of another pid namespace killed before its first status.json said so leaves daemon.lock naming its
    own pid there (1, its namespace's init), let go.  Here that pid is a live process older than the file, run as
    the file's owner (the host's init, for root): it was taken for the daemon, so `prefetchd status` said running.
    Nobody holds the lock: no daemon runs, whatever has the pid."""
    pid = 1 if named == "init" else os.getpid()
    if psutil.Process(pid).uids().effective != os.geteuid():
        pytest.skip(f"pid {pid} runs as another user than this test: the pid alone rules it out")
    lock = shm_dir / LOCK_NAME
    lock.write_text(f"{pid}\n")
    assert daemon_owner(shm_dir) is None and daemon_pid(shm_dir) is None
    with owned(shm_dir, pid):  # the same file, held: the pid passes every other check
        assert daemon_owner(shm_dir) == DaemonOwner(pid) and daemon_pid(shm_dir) == pid
    assert lock.read_text() == f"{pid}\n" and daemon_owner(shm_dir) is None
    taken = DaemonLock(shm_dir)
    taken.acquire()  # a daemon starting there takes it, and the questions kept nothing locked
    taken.release()


def test_a_heartbeat_is_the_owners_when_its_pid_and_pid_namespace_are() -> None:
    """Pids of one namespace are compared, whichever it is: the daemon's own in the lock and in its status."""
    here, there = DaemonOwner(42), DaemonOwner(42, OTHER)
    assert here.wrote(status_example(pid=42)) and here.wrote(status_example(pid=42, pid_namespace=None))
    assert not here.wrote(status_example(pid=42, pid_namespace=OTHER)), "another namespace's pid 42"
    assert not here.wrote(status_example(pid=43)) and not here.wrote(None)
    assert there.wrote(status_example(pid=42, pid_namespace=OTHER))
    for other in (status_example(pid=42), status_example(pid=42, pid_namespace=None),
                  status_example(pid=42, pid_namespace=OTHER + 1), status_example(pid=43, pid_namespace=OTHER)):
        assert not there.wrote(other), other.pid_namespace


def test_a_daemon_starting_while_a_reader_asks_for_its_lock_is_not_refused(shm_dir: Path) -> None:
    """A reader asks with a shared lock for a moment (``daemon_owner``): a daemon taking daemon.lock then tries
    again for LOCK_RETRY_SECONDS, and is refused only by a lock held longer."""
    lock = shm_dir / LOCK_NAME
    lock.touch()
    asking = hold(lock, "shared", seconds=0.2)
    try:
        started = time.monotonic()
        daemon = DaemonLock(shm_dir)
        daemon.acquire()
        assert time.monotonic() - started < LOCK_RETRY_SECONDS + 0.2
        daemon.release()
    finally:
        asking.wait()
    held = hold(lock, "shared")
    try:
        started = time.monotonic()
        with pytest.raises(BufferBusy):
            DaemonLock(shm_dir).acquire()
        assert time.monotonic() - started >= LOCK_RETRY_SECONDS
    finally:
        held.kill()
        held.wait()


def test_lock_holders_are_the_processes_holding_that_files_flock(shm_dir: Path) -> None:
    """/proc/locks, as `prefetchd stop` reads it before it signals the pid daemon.lock names: the pids holding the
    flock on that file (its inode), not on another one, and none once the lock is let go."""
    lock, other = shm_dir / LOCK_NAME, shm_dir / "other"
    lock.touch()
    other.touch()
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert lock_holders(lock) == {os.getpid()}
        assert lock_holders(other) == set()
        fcntl.flock(fd, fcntl.LOCK_UN)
        assert lock_holders(lock) == set()
    finally:
        os.close(fd)
    shared = [hold(lock, "shared"), hold(lock, "shared")]
    try:
        assert lock_holders(lock) == {p.pid for p in shared}
    finally:
        for p in shared:
            p.kill()
            p.wait()
    assert lock_holders(shm_dir / "gone") == set()


@pytest.mark.skipif(bool(unavailable), reason=unavailable)
@pytest.mark.parametrize("numbered", ["as init here", "as nobody here"])
def test_a_daemon_in_another_pid_namespace_owns_the_buffer_while_it_runs(shm_dir: Path, numbered: str) -> None:
    """A process of a new pid namespace holding daemon.lock as a daemon does: pid 1 there is init here (alive,
    root's, older than the lock: taken for the daemon, and signalled by `prefetchd stop`, by its pid), a pid free
    here was taken for gone while it ran."""
    pid = 1 if numbered == "as init here" else free_pid()
    with foreign_lock_holder(shm_dir, pid) as daemon:
        status = read_status(shm_dir)
        assert status is not None and status.pid == pid and status.pid_namespace not in (None, OURS)
        owner = daemon_owner(shm_dir)
        assert owner == DaemonOwner(pid, status.pid_namespace) and owner.wrote(status)
        assert daemon_pid(shm_dir) is None
        # /proc/locks numbers the holder as this namespace does: not the pid its lock file names.
        assert lock_holders(shm_dir / LOCK_NAME) == {daemon.here().pid} != {pid}
        with pytest.raises(BufferBusy, match=rf"pid {pid} of another pid namespace\).* where it runs"):
            DaemonLock(shm_dir).acquire()
        daemon.kill()
        assert daemon_owner(shm_dir) is None, "its lock went with it"


def test_the_status_goes_into_the_locked_folder_not_one_made_under_its_name(tmp_path: Path) -> None:
    """The daemon notices a replaced buffer once a second (``DaemonLock.lost``) and stops; a status written
    by path in between went into the new folder, where another daemon may be starting (a test of the
    daemon's saw it now and then).  Written through the lock's folder fd, it goes where the lock is."""
    buffer = tmp_path / "bf"
    buffer.mkdir()
    lock = DaemonLock(buffer)
    lock.acquire()
    try:
        os.rename(buffer, tmp_path / "moved")
        buffer.mkdir()  # `rm -rf` and `mkdir`, or another buffer moved there
        status = status_example(State.FILLING, pid=os.getpid())
        write_status(buffer, status, lock.dir_fd)
        assert not (buffer / STATUS_NAME).exists()
        assert json.loads((tmp_path / "moved" / STATUS_NAME).read_text())["state"] == State.FILLING.value
        assert lock.lost() == f"{buffer}: the buffer directory was replaced by another"
    finally:
        lock.release()
    assert lock.dir_fd is None
