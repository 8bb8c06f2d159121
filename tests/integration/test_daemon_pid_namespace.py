"""A real daemon in another pid namespace than its readers' (a service on the host and the trainer in a container
with /dev/shm bind-mounted, or the other way round): the loader, `prefetchd status` and `prefetchd stop` judge it
by daemon.lock, not by its pid, which names no process of theirs or an unrelated one (SPEC rule 8).

The daemon is `prefetchd start` in ``unshare --pid --fork --mount-proc`` (tests/pid_namespace.py), as a pid the
test picks: one free here, or one of the test's own processes.  Timings are bounds with generous slack, never
speeds: the machine is shared."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from prefetchd.buffer_protocol import DaemonOwner, State, daemon_owner, read_status
from prefetchd.buffer_protocol.layout import LOCK_NAME, STATUS_NAME
from prefetchd.launch import start_argv
from prefetchd.trainer import BufferLoader, DaemonGone, DaemonStuck
from tests.pid_namespace import ForeignProcess, free_pid, in_new_pid_namespace, started_in_new_pid_namespace, unavailable
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(bool(unavailable), reason=unavailable)

OURS = os.stat("/proc/self/ns/pid").st_ino
SMALL = ["--batch-size", "8", "--image-size", "32", "--workers", "1", "--seed", "7"]
GRACE = 1.0
SLACK = 4.0  # the loader looks every GRACE / 4; the daemon beats every second
# A trainer of yet another pid namespace: a loader that has read a batch as consumer ``boxed``, prints its pid, and
# keeps the loader (and with it the consumer's lock) until killed.
LOADER = r"""
import os, sys, time
from prefetchd.trainer import BufferLoader
loader = BufferLoader(sys.argv[1], consumer="boxed", normalize=False, timeout=120)
batches = iter(loader)
next(batches)
print(os.getpid(), flush=True)
time.sleep(600)
"""


def prefetchd(buffer: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`prefetchd ARGS --buffer BUFFER`, run to its end."""
    return subprocess.run([sys.executable, "-m", "prefetchd", *args, "--buffer", str(buffer)],
                          capture_output=True, text=True, timeout=120)


@contextmanager
def foreign_daemon(buffer: Path, pid: int, log: Path, *args: str | os.PathLike[str]) -> Iterator[ForeignProcess]:
    """`prefetchd start --buffer BUFFER ARGS` as ``pid`` of a new pid namespace, once it produces; killed after."""
    with open(log, "wb") as out:
        daemon = in_new_pid_namespace(start_argv(buffer, extra=[str(a) for a in args]), pid,
                                      stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        def producing() -> bool:
            status = read_status(buffer)
            return status is not None and status.pid == pid and status.state in (State.FILLING, State.FULL)
        try:
            wait_for(producing, 120, f"the daemon (pid {pid} of a new pid namespace) to produce", daemon.proc)
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{log.read_text()}") from None
        yield daemon
    finally:
        if daemon.proc.poll() is None:
            daemon.kill()


def test_a_loader_waits_on_a_daemon_of_another_pid_namespace_and_sees_it_go(shapes_data: Path, shm_dir: Path,
                                                                           tmp_path: Path) -> None:
    """Its pid names no process here: a loader that judged it by that pid took it for gone once a batch had been
    waited for longer than the grace, though it was there."""
    buffer, pid = shm_dir / "bf", free_pid()
    with foreign_daemon(buffer, pid, tmp_path / "daemon.log", "--data", shapes_data / "train", *SMALL, "--epochs", "1",
                        "--high-water", "2", "--low-water", "1") as daemon:
        loader = BufferLoader(buffer, normalize=False, timeout=120, daemon_grace=GRACE, stall_timeout=30)
        it = iter(loader)
        steps = [next(it).step]
        # Stopped for three graces, the daemon builds nothing: the loader waits for a batch past the high-water mark.
        process = daemon.here()
        process.suspend()
        resume = threading.Timer(3 * GRACE, process.resume)
        resume.start()
        try:
            started = time.monotonic()
            steps += [next(it).step for _ in range(4)]
            assert time.monotonic() - started >= 2 * GRACE, "the loader waited for a batch while the daemon was stopped"
        finally:
            resume.cancel()
            resume.join()
            with contextlib.suppress(psutil.NoSuchProcess):
                process.resume()
        process.kill()
        daemon.proc.wait(30)  # the namespace ends with it, and the lock with it
        started = time.monotonic()
        with pytest.raises(DaemonGone, match="no prefetchd daemon owns this buffer"):
            for batch in it:  # the batches built before it died are served; the next one never comes
                steps.append(batch.step)
        assert time.monotonic() - started < GRACE + SLACK
    assert steps == list(range(len(steps))) and len(steps) < len(loader)


def test_a_stopped_daemon_of_another_pid_namespace_is_called_stuck(shapes_data: Path, shm_dir: Path,
                                                                  tmp_path: Path) -> None:
    """Its heartbeat is read across namespaces: the status that its own pid of its own namespace wrote."""
    buffer, pid = shm_dir / "bf", free_pid()
    with foreign_daemon(buffer, pid, tmp_path / "daemon.log", "--data", shapes_data / "train", *SMALL, "--epochs", "1",
                        "--high-water", "2", "--low-water", "1") as daemon:
        loader = BufferLoader(buffer, normalize=False, timeout=120, daemon_grace=GRACE, stall_timeout=3.0)
        it = iter(loader)
        next(it)
        process = daemon.here()
        process.suspend()
        try:
            started = time.monotonic()
            with pytest.raises(DaemonStuck) as info:
                for _ in it:
                    pass
            assert time.monotonic() - started < 3.0 + SLACK
        finally:
            process.resume()
    message = str(info.value)
    assert f"the daemon (pid {pid} of another pid namespace) owns this buffer" in message
    assert f"py-spy dump --pid {pid}` where it runs" in message


def test_status_and_stop_of_a_daemon_of_another_pid_namespace(shapes_data: Path, shm_dir: Path, tmp_path: Path) -> None:
    """The daemon is, in its namespace, the pid of a process of the test's (root's, older than the lock): judged
    by that pid, `prefetchd stop` SIGTERMed that process and left the daemon running."""
    victim = subprocess.Popen(["sleep", "300"])
    buffer = shm_dir / "bf"
    try:
        with foreign_daemon(buffer, victim.pid, tmp_path / "daemon.log", "--data", shapes_data / "train", *SMALL):
            shown = prefetchd(buffer, "status")
            assert shown.returncode == 0, shown.stdout + shown.stderr
            assert f"running (pid {victim.pid} of another pid namespace)" in shown.stdout
            doc = json.loads(prefetchd(buffer, "status", "--json").stdout)
            assert doc["running"] is True and doc["pid"] == victim.pid and doc["other_pid_namespace"] is True
            assert doc["status"]["pid_namespace"] not in (None, OURS)

            asked = time.time()
            stop = prefetchd(buffer, "stop", "--timeout", "5")
            assert stop.returncode == 1, stop.stdout + stop.stderr
            assert f"cannot stop the daemon on {buffer} (pid {victim.pid} of another pid namespace) from here, and " \
                   "signalled nothing" in stop.stderr
            assert "where it runs" in stop.stderr and "systemctl stop" in stop.stderr
            # Nothing was signalled: the process of ours lives, and the daemon beats on.
            wait_for(lambda: (s := read_status(buffer)) is not None and s.heartbeat > asked + 1, 30,
                     "a heartbeat after the refused stop")
            assert victim.poll() is None
            owner = daemon_owner(buffer)
            assert owner is not None and owner.pid == victim.pid and not owner.here
    finally:
        victim.kill()
        victim.wait()


def test_stop_before_a_daemon_of_another_pid_namespace_writes_its_status(shapes_data: Path, shm_dir: Path,
                                                                        tmp_path: Path) -> None:
    """From taking daemon.lock until it writes its first status.json, which says its pid namespace, a daemon is judged
    by the lock's pid as one of the reader's namespace: here a process of the test's (root's, older than the lock),
    which `prefetchd stop` SIGTERMed.  The daemon, stopped (SIGSTOP) and its status removed, is in that moment."""
    victim = subprocess.Popen(["sleep", "300"])
    buffer = shm_dir / "bf"
    try:
        with foreign_daemon(buffer, victim.pid, tmp_path / "daemon.log", "--data", shapes_data / "train",
                            *SMALL) as daemon:
            process = daemon.here()
            process.suspend()
            try:
                (buffer / STATUS_NAME).unlink()
                assert daemon_owner(buffer) == DaemonOwner(victim.pid), "taken for a daemon of this namespace"
                stop = prefetchd(buffer, "stop", "--timeout", "5")
                assert stop.returncode == 1, stop.stdout + stop.stderr
                lock = buffer / LOCK_NAME
                assert (f"cannot stop the daemon on {buffer}, and signalled nothing: {lock} names pid {victim.pid}, "
                        f"but here its lock is held by pid {process.pid}, not by pid {victim.pid}: most likely a "
                        "daemon of another pid namespace") in stop.stderr, stop.stderr
                assert "try again in a moment" in stop.stderr and f"`fuser -v {lock}`" in stop.stderr
                assert victim.poll() is None
            finally:
                process.resume()
            # Its next status says its namespace: judged by its lock from then on.
            wait_for(lambda: (owner := daemon_owner(buffer)) is not None and not owner.here, 30,
                     "the resumed daemon's status")
            assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_status_from_a_third_pid_namespace_says_whose_pids_are_its_own(shapes_data: Path, shm_dir: Path,
                                                                      tmp_path: Path) -> None:
    """The daemon, a trainer and `prefetchd status` each in a namespace of their own, and a trainer in the command's:
    status.json carried the trainers' pids alone, shown bare.  The boxed trainer is pid 1 of its namespace, which
    here is init."""
    buffer = shm_dir / "bf"
    with foreign_daemon(buffer, free_pid(), tmp_path / "daemon.log", "--data", shapes_data / "train", *SMALL):
        argv = [sys.executable, "-c", LOADER, str(buffer)]
        with started_in_new_pid_namespace(argv, 1, "the boxed loader") as boxed, \
                BufferLoader(buffer, normalize=False, timeout=120) as ours:
            next(iter(ours))
            theirs = os.stat(f"/proc/{boxed.here().pid}/ns/pid").st_ino

            def both_seen() -> bool:
                status = read_status(buffer)
                consumers = status.production.streams[0].consumers if status is not None and status.production else ()
                return {(c.name, c.trainer.alive) for c in consumers} == {("", True), ("boxed", True)}
            wait_for(both_seen, 60, "the daemon's status of both trainers")
            shown = prefetchd(buffer, "status")
            doc = json.loads(prefetchd(buffer, "status", "--json").stdout)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert re.search(r"consumer  boxed at epoch \d+ step \d+; pid 1 of another pid namespace alive", shown.stdout), \
        shown.stdout
    assert re.search(rf"consumer  \(default\) at epoch \d+ step \d+; pid {os.getpid()} alive", shown.stdout), shown.stdout
    assert doc["command_pid_namespace"] == OURS
    trainers = {c["name"]: c["trainer"] for c in doc["status"]["streams"][0]["consumers"]}
    assert (trainers["boxed"]["pid"], trainers["boxed"]["pid_namespace"]) == (1, theirs)
    assert (trainers[""]["pid"], trainers[""]["pid_namespace"]) == (os.getpid(), OURS)
    assert len({doc["status"]["pid_namespace"], theirs, OURS}) == 3
