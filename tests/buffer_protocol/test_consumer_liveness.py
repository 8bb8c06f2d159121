"""Whether a consumer's writer is still there (SPEC rule 8): by its pid in the reader's own pid namespace,
by the consumer's lock file from another one (a trainer in another container sharing the tmpfs)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefetchd.buffer_protocol import (VERSION, Progress, ProtocolError, consumer_held, consumer_lock_name,
                                      progress_name, writer_alive)
from tests.pid_namespace import foreign_writer, free_pid, unavailable, wait_for

OURS = os.stat("/proc/self/ns/pid").st_ino
HOLD = """
import fcntl, sys, time
fd = open(sys.argv[1], "a")
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def write_doc(directory: Path, consumer: str, **fields: object) -> Progress:
    """A progress document as another writer left it, read back."""
    doc = {"format": "prefetchd.progress", "version": VERSION, "epoch": 0, "step": 1, "pid": os.getpid(),
           "time": time.time(), **fields}
    (directory / progress_name(consumer)).write_text(json.dumps(doc))
    progress = Progress.read(directory, consumer)
    assert progress is not None
    return progress


def hold(path: Path) -> subprocess.Popen[str]:
    """Another process holding ``path``'s flock, as a trainer does its consumer's."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_progress_names_its_pid_namespace_and_whether_it_holds_the_lock(tmp_path: Path) -> None:
    Progress(3, 4, locked=True).write(tmp_path, "a")
    p = Progress.read(tmp_path, "a")
    assert p is not None and p.pid_namespace == OURS and p.locked
    Progress(3, 4).write(tmp_path, "a")
    p = Progress.read(tmp_path, "a")
    assert p is not None and not p.locked and "locked" not in (tmp_path / progress_name("a")).read_text()
    old = write_doc(tmp_path, "old")  # a writer that predates both
    assert old.pid_namespace is None and not old.locked
    for bad in ({"locked": "yes"}, {"locked": None}, {"pid_namespace": -1}, {"pid_namespace": "pid:[4026531836]"}):
        with pytest.raises(ProtocolError, match=next(iter(bad))):
            write_doc(tmp_path, "bad", **bad)


def test_the_lock_is_asked_for_and_let_go_at_once(shm_dir: Path) -> None:
    path = shm_dir / consumer_lock_name("a")
    assert consumer_held(shm_dir, "a") is None, "no lock file: its holder may hold one unlinked since"
    path.touch()
    assert consumer_held(shm_dir, "a") is False
    with open(path) as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the question kept nothing locked
    holder = hold(path)
    try:
        assert consumer_held(shm_dir, "a") is True
    finally:
        holder.kill()
        holder.wait()
    assert consumer_held(shm_dir, "a") is False
    path.unlink()
    path.mkdir()
    assert consumer_held(shm_dir, "a") is None


def test_a_writer_of_this_pid_namespace_is_judged_by_its_pid_not_its_lock(shm_dir: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    holder = hold(shm_dir / consumer_lock_name("a"))
    try:
        assert writer_alive(shm_dir, "a", write_doc(shm_dir, "a", pid=holder.pid, pid_namespace=OURS, locked=True))
        assert writer_alive(shm_dir, "a", write_doc(shm_dir, "a", pid=gone.pid, pid_namespace=OURS, locked=True)) is False
        assert writer_alive(shm_dir, "a", write_doc(shm_dir, "a", pid=gone.pid)) is False, "an older writer, as before"
        assert writer_alive(shm_dir, "a", write_doc(shm_dir, "a", pid=None)) is None
    finally:
        holder.kill()
        holder.wait()


def test_a_writer_of_another_pid_namespace_without_the_lock_is_unknown(shm_dir: Path) -> None:
    """Its pid is not looked up, even where a live process has it here (this one)."""
    holder = hold(shm_dir / consumer_lock_name("a"))
    try:
        assert writer_alive(shm_dir, "a", write_doc(shm_dir, "a", pid_namespace=OURS + 1)) is None
    finally:
        holder.kill()
        holder.wait()
    assert writer_alive(shm_dir, "a", write_doc(shm_dir, "a", pid_namespace=OURS + 1, locked=True)) is False


@pytest.mark.skipif(bool(unavailable), reason=unavailable)
@pytest.mark.parametrize("numbered", ["as init here", "as nobody here"])
def test_a_trainer_in_another_pid_namespace_is_there_while_it_runs_and_gone_after(shm_dir: Path, numbered: str) -> None:
    """A real trainer's ProgressFile in a new pid namespace: pid 1 there is init here (alive for ever: it was
    never taken for gone), a pid free here was taken for gone while the trainer read."""
    pid = 1 if numbered == "as init here" else free_pid()
    with foreign_writer(shm_dir, "boxed", "0123456789abcdef", pid=pid) as writer:
        progress = Progress.read(shm_dir, "boxed")
        assert progress is not None and progress.pid == pid and progress.locked
        assert progress.pid_namespace is not None and progress.pid_namespace != OURS
        assert writer_alive(shm_dir, "boxed", progress) is True
        writer.kill()
        wait_for(lambda: writer_alive(shm_dir, "boxed", progress) is False, 10, "the lock to go with the trainer")
