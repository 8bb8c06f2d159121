"""A real `prefetchd start` talking sd_notify to a socket standing in for systemd:
READY=1 from the main pid, STATUS= lines, rate-limited WATCHDOG=1 pings, and
STOPPING=1 after SIGTERM; its workers do not inherit the socket."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from prefetchd.buffer_protocol import ProtocolError, State, read_status
from prefetchd.daemon.sdnotify import status_line

CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid


class FakeSystemd:
    """The notify socket: records (arrival time, sender pid, message) as systemd would see them."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(path)
        self.got: list[tuple[float, int, str]] = []

    def pump(self, timeout: float) -> None:
        self.sock.settimeout(timeout)
        try:
            data, ancdata, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(CREDS.size))
        except TimeoutError:
            return
        pid = next((CREDS.unpack(p[: CREDS.size])[0] for lvl, kind, p in ancdata
                    if lvl == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS), -1)
        self.got.append((time.monotonic(), pid, data.decode()))

    def wait_for(self, predicate: Callable[[], bool], proc: subprocess.Popen[bytes], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}; got {self.messages()}")
            if proc.poll() is not None:
                self.pump(0.2)  # what it sent before exiting
                if not predicate():
                    raise AssertionError(f"daemon exited ({proc.returncode}) before {what}; got {self.messages()}")
            self.pump(0.2)

    def messages(self) -> list[str]:
        return [m for _, _, m in self.got]

    def count(self, prefix: str) -> int:
        return sum(m.startswith(prefix) for m in self.messages())

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def fake_systemd() -> Iterator[FakeSystemd]:
    directory = tempfile.mkdtemp(prefix="sdn-", dir="/tmp")  # sun_path holds 108 bytes
    server = FakeSystemd(os.path.join(directory, "notify"))
    yield server
    server.close()
    shutil.rmtree(directory, ignore_errors=True)


def producing(buffer: Path) -> bool:
    try:
        status = read_status(buffer)
    except ProtocolError:
        return False
    return status is not None and status.state in (State.FILLING, State.FULL)


def test_daemon_notifies_ready_status_watchdog_and_stopping(
    shapes_data: Path, shm_dir: Path, fake_systemd: FakeSystemd, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "SYSTEMD_EXEC_PID")}
    env.update(NOTIFY_SOCKET=fake_systemd.path, WATCHDOG_USEC="2000000")
    log = open(tmp_path / "daemon.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefetchd", "start", "--buffer", str(shm_dir / "bf"), "--data", str(shapes_data / "train"),
         "--batch-size", "8", "--image-size", "32", "--workers", "1", "--high-water", "3"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        # READY=1 comes once the workers run: give up 5 s after status.json says it is producing.
        fake_systemd.wait_for(lambda: fake_systemd.count("READY=1") > 0 or producing(shm_dir / "bf"), proc, 60, "READY=1")
        fake_systemd.wait_for(lambda: fake_systemd.count("READY=1") > 0, proc, 5, "READY=1 from a producing daemon")
        ready = next(m for m in fake_systemd.messages() if m.startswith("READY=1"))
        assert re.fullmatch(rf"READY=1\nSTATUS=.+\nMAINPID={proc.pid}", ready), ready

        # The workers run by now; none may see the socket (they would ping for a hung controller).
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert workers
        for child in workers:
            assert "NOTIFY_SOCKET" not in child.environ(), child.cmdline()

        fake_systemd.wait_for(
            lambda: fake_systemd.count("WATCHDOG=1") >= 3 and fake_systemd.count("STATUS=") >= 2,
            proc, 30, "3 watchdog pings and 2 status lines",
        )
        pings = [t for t, _, m in fake_systemd.got if m == "WATCHDOG=1"]
        gaps = [b - a for a, b in zip(pings, pings[1:])]
        # Rate-limited to half of WatchdogSec=2. No upper bound: how late a ping comes
        # depends on how busy the machine is, not on the code.
        assert all(g >= 0.9 for g in gaps), f"pings must be at least ~1 s apart for WatchdogSec=2: {gaps}"
        statuses = [m for m in fake_systemd.messages() if m.startswith("STATUS=")]
        assert any(re.match(r"STATUS=(filling|full) \d+/3 batches, \d+ img/s, no trainer yet \(the buffer starts at epoch 0 step 0\)", s) for s in statuses), statuses

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        fake_systemd.wait_for(lambda: fake_systemd.count("STOPPING=1") > 0, proc, 5, "STOPPING=1")
        messages = fake_systemd.messages()
        after = messages[next(i for i, m in enumerate(messages) if m.startswith("STOPPING=1")) + 1:]
        assert all(m.startswith("STATUS=") for m in after), f"only a last status line may follow STOPPING=1: {after}"
        # NotifyAccess=main: systemd drops whatever does not come from the main pid.
        assert {pid for _, pid, _ in fake_systemd.got} == {proc.pid}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_a_daemon_waiting_for_jobs_says_stopping_first(shm_dir: Path, fake_systemd: FakeSystemd, tmp_path: Path) -> None:
    """Stopped while it waited for a job, STOPPING=1 came last, after the status saying it stopped, once the
    lock was let go (review)."""
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "SYSTEMD_EXEC_PID")}
    env.update(NOTIFY_SOCKET=fake_systemd.path)
    buffer = shm_dir / "bf"
    with open(tmp_path / "daemon.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "prefetchd", "start", "--buffer", str(buffer)], env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            fake_systemd.wait_for(lambda: fake_systemd.count("READY=1") > 0, proc, 60, "READY=1")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
            for _ in range(10):
                fake_systemd.pump(0.1)  # what it sent before it exited, one datagram a call
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stopping = [m for m in fake_systemd.messages() if "STOPPING=1" in m or "stopped by" in m]
    assert stopping and stopping[0] == "STOPPING=1\nSTATUS=stopped by SIGTERM", fake_systemd.messages()
    last = read_status(buffer)
    assert last is not None and (last.state, last.message) == (State.STOPPED, "stopped by SIGTERM"), last


def test_status_line_reads_a_real_daemons_status(shapes_data: Path, shm_dir: Path, start_daemon: Callable[..., Any]) -> None:
    # Independent of the wiring: the formatter understands what a running daemon writes now.
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", "--batch-size", "8", "--image-size", "32",
                          "--workers", "1", "--high-water", "3")
    found: list[str] = []

    def seen() -> bool:
        if producing(buffer):
            status = read_status(buffer)
            if status is not None and status.production is not None:
                found.append(status_line(status))
                return True
        return False

    daemon.wait_until(seen, 60, "status.json with the producer's state")
    assert re.fullmatch(r"(filling|full) \d/3 batches, \d+ img/s, no trainer yet \(the buffer starts at epoch 0 step 0\)", found[-1]), found[-1]
