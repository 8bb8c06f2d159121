"""prefetchd.daemon.sdnotify against real AF_UNIX datagram sockets standing in for
systemd's notify socket: the exact datagrams, their order and sender, the
watchdog's rate limit, and a socket that points nowhere."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefetchd.buffer_protocol import Errors, Position, Rates, State, Status, TrainerStatus
from prefetchd.daemon.sdnotify import Notifier, status_line
from prefetchd.daemon.status_view import format_status
from tests.status_examples import CONSUMER, production, production_without_trainer, report, stream
from tests.status_examples import status as status_example

LOGGER = "prefetchd.daemon.sdnotify"
SYSTEMD_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "SYSTEMD_EXEC_PID")


class Listener:
    """A bound SOCK_DGRAM socket that reads datagrams like systemd does (with the sender's pid)."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(address)

    def recv(self, timeout: float = 2.0) -> tuple[str, int]:
        """The next datagram and the pid the kernel says sent it."""
        self.sock.settimeout(timeout)
        data, ancdata, _flags, _addr = self.sock.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("3i")))
        pid = -1
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = struct.unpack("3i", payload[: struct.calcsize("3i")])[0]
        return data.decode(), pid

    def messages(self) -> list[str]:
        """Everything queued now, without waiting."""
        self.sock.setblocking(False)
        out = []
        while True:
            try:
                out.append(self.sock.recv(4096).decode())
            except BlockingIOError:
                return out

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # A desktop session exports SYSTEMD_EXEC_PID to every shell; the tests set what they need.
    for name in SYSTEMD_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # sun_path holds 108 bytes: pytest's tmp_path can be longer than that.
    path = Path(tempfile.mkdtemp(prefix="sdn-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def listener(short_dir: Path) -> Iterator[tuple[str, Listener]]:
    path = str(short_dir / "notify")
    lst = Listener(path)
    yield path, lst
    lst.close()


def test_messages_in_order_over_a_path_socket(listener: tuple[str, Listener], monkeypatch: pytest.MonkeyPatch) -> None:
    path, lst = listener
    pid = os.getpid()
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(pid))
    notifier = Notifier.from_env()
    assert notifier.enabled and notifier.watchdog_interval == 2.0

    assert notifier.ready("producing train split of /data into /dev/shm/bf")
    assert notifier.status("filling 1/3 batches, 0 img/s, trainer at epoch 0 step 0")
    assert notifier.watchdog()
    assert not notifier.watchdog()  # within half the interval: not sent
    assert notifier.stopping("stopping: SIGTERM")
    notifier.close()

    got = [lst.recv() for _ in range(4)]
    assert got == [
        (f"READY=1\nSTATUS=producing train split of /data into /dev/shm/bf\nMAINPID={pid}", pid),
        ("STATUS=filling 1/3 batches, 0 img/s, trainer at epoch 0 step 0", pid),
        ("WATCHDOG=1", pid),
        ("STOPPING=1\nSTATUS=stopping: SIGTERM", pid),
    ]
    assert lst.messages() == []


def test_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"prefetchd-test-{uuid.uuid4().hex}"
    lst = Listener("\0" + name)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        notifier = Notifier.from_env()
        assert notifier.ready("up") and notifier.status("busy") and notifier.stopping()
        assert [lst.recv()[0] for _ in range(3)] == [f"READY=1\nSTATUS=up\nMAINPID={os.getpid()}", "STATUS=busy", "STOPPING=1"]
    finally:
        lst.close()


def test_watchdog_pings_at_most_every_half_interval(listener: tuple[str, Listener]) -> None:
    path, lst = listener
    now = [100.0]
    notifier = Notifier(path, watchdog_usec=10_000_000, clock=lambda: now[0])
    sent = []
    for t in (100.0, 101.0, 104.9, 105.0, 105.1, 109.9, 110.0, 130.0):
        now[0] = t
        sent.append(notifier.watchdog())
    assert sent == [True, False, False, True, False, False, True, True]
    assert lst.messages() == ["WATCHDOG=1"] * 4


def test_no_watchdog_without_watchdog_usec(listener: tuple[str, Listener], monkeypatch: pytest.MonkeyPatch) -> None:
    path, lst = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    notifier = Notifier.from_env()
    assert notifier.watchdog_interval is None
    assert not notifier.watchdog()
    assert lst.messages() == []


def test_watchdog_pid_of_another_process_means_no_pings(listener: tuple[str, Listener], monkeypatch: pytest.MonkeyPatch) -> None:
    path, lst = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    notifier = Notifier.from_env()
    assert notifier.watchdog_interval is None
    for _ in range(3):
        assert not notifier.watchdog()
    assert notifier.status("still talking")  # only the pings are for another process
    assert lst.messages() == ["STATUS=still talking"]


def test_invalid_watchdog_usec_is_ignored_with_a_warning(
    listener: tuple[str, Listener], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path, lst = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "30s")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        notifier = Notifier.from_env()
    assert notifier.watchdog_interval is None and not notifier.watchdog()
    assert "WATCHDOG_USEC='30s'" in caplog.text
    assert lst.messages() == []


def test_a_socket_inherited_from_another_service_process_is_not_used(
    listener: tuple[str, Listener], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A daemon started by a trainer that itself runs under systemd inherits the trainer's socket.
    path, lst = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("SYSTEMD_EXEC_PID", str(os.getpid() + 1))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        notifier = Notifier.from_env()
    assert not notifier.enabled
    assert not notifier.ready("up") and not notifier.stopping()
    assert lst.messages() == []
    assert "SYSTEMD_EXEC_PID" in caplog.text
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("SYSTEMD_EXEC_PID", str(os.getpid()))
    assert Notifier.from_env().ready("up")
    assert lst.messages() == [f"READY=1\nSTATUS=up\nMAINPID={os.getpid()}"]


def test_variables_are_removed_so_children_do_not_inherit_them(
    listener: tuple[str, Listener], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    notifier = Notifier.from_env()
    assert notifier.enabled and notifier.watchdog_interval == 2.0  # read before removal
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        assert name not in os.environ
    # The C environment that a spawned worker inherits is cleared too.
    out = subprocess.run(
        [sys.executable, "-c", "import os; print([os.environ.get(n) for n in ('NOTIFY_SOCKET', 'WATCHDOG_USEC', 'WATCHDOG_PID')])"],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "[None, None, None]"


def test_unset_false_keeps_the_variables(listener: tuple[str, Listener]) -> None:
    path, _ = listener
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"}
    assert Notifier.from_env(env, unset=False).enabled
    assert env == {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"}
    assert Notifier.from_env(env).enabled
    assert env == {}


@pytest.mark.parametrize("kind", ["missing", "not-listening"])
def test_a_socket_that_points_nowhere_warns_once_and_goes_quiet(
    kind: str, short_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = short_dir / "notify"
    if kind == "not-listening":  # the socket file of a listener that has gone away
        Listener(str(path)).close()
        assert path.exists()
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        notifier = Notifier.from_env()
        assert notifier.ready("up") is False
        assert not notifier.enabled and notifier.watchdog_interval is None
        for _ in range(3):
            assert not notifier.status("busy")
            assert not notifier.watchdog()
        assert not notifier.stopping("bye")
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert f"NOTIFY_SOCKET={path} points nowhere" in message
    assert "READY=1" in message and "Type=notify" in message


def test_without_notify_socket_everything_is_a_no_op(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        notifier = Notifier.from_env()
        assert not notifier.enabled and notifier.watchdog_interval is None
        assert not notifier.ready("up")
        assert not notifier.status("busy")
        assert not notifier.watchdog()
        assert not notifier.stopping("bye")
        notifier.close()
    assert notifier._sock is None  # no socket was even created
    assert caplog.records == []


@pytest.mark.parametrize("address", ["run/systemd/notify", "vsock:2:1234", "@"])
def test_an_address_that_is_not_a_unix_socket_is_refused(
    address: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        notifier = Notifier.from_env()
        assert not notifier.ready("up")
    assert not notifier.enabled
    assert f"NOTIFY_SOCKET={address} is neither" in caplog.text


def test_status_text_cannot_inject_other_assignments(listener: tuple[str, Listener]) -> None:
    path, lst = listener
    notifier = Notifier(path)
    assert notifier.status("paused:\nWATCHDOG=1\r\n  low space")
    assert notifier.status("x" * 5000)
    assert lst.messages() == ["STATUS=paused: WATCHDOG=1 low space", "STATUS=" + "x" * 1024]


def test_a_busy_socket_drops_status_lines_without_blocking(
    listener: tuple[str, Listener], caplog: pytest.LogCaptureFixture
) -> None:
    path, lst = listener
    notifier = Notifier(path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        sent = 0
        while notifier.status(f"line {sent}"):  # nobody reads: the queue fills up
            sent += 1
            assert sent < 100_000
        start = time.monotonic()
        assert not notifier.ready("up")  # retried briefly, then given up on
        assert time.monotonic() - start < 2.0
    assert caplog.records == [] and notifier.enabled
    assert len(lst.messages()) == sent
    assert notifier.status("after")  # room again
    assert lst.messages() == ["STATUS=after"]


def test_ready_is_sent_once_then_only_the_status(listener: tuple[str, Listener]) -> None:
    # A daemon serving jobs is ready once; each later job only changes the status line.
    path, lst = listener
    notifier = Notifier(path)
    assert notifier.ready("waiting for a job")
    assert notifier.ready("producing job 2")
    assert lst.messages() == [f"READY=1\nSTATUS=waiting for a job\nMAINPID={os.getpid()}", "STATUS=producing job 2"]


def test_stopping_is_sent_once_then_only_the_status(listener: tuple[str, Listener]) -> None:
    # Every exit path may call stopping(): on the signal, and again where the daemon returns.
    path, lst = listener
    notifier = Notifier(path)
    assert notifier.stopping("stopping: SIGTERM")
    assert not notifier.stopping()
    assert notifier.stopping("stopped by SIGTERM")
    assert lst.messages() == ["STOPPING=1\nSTATUS=stopping: SIGTERM", "STATUS=stopped by SIGTERM"]


STATUS = status_example(production=production(streams=(stream(trainer=TrainerStatus(None, None, None)),),
                                              trainer=TrainerStatus(None, None, None)))


def test_status_line() -> None:
    assert status_line(STATUS) == "filling 12/32 batches, 850 img/s, trainer at epoch 1 step 40"


def test_status_line_with_consumption_errors_and_a_message() -> None:
    progress = Position(1, 40, trainer_wait_share=0.0234)
    assert STATUS.production is not None
    status = dataclasses.replace(
        STATUS,
        state=State.PAUSED_LOW_SPACE,
        message="paused: /dev/shm/bf would fall to 10 MiB free",
        production=dataclasses.replace(
            STATUS.production,
            progress=progress,
            streams=(dataclasses.replace(STATUS.production.streams[0], progress=progress),),
            rates=Rates(samples_per_s=0.0, consumed_batches_per_s=3.25),
            errors=Errors(replaced_samples=0, undecodable_files=1, undecodable=(), worker_restarts=2, write_failures=0,
                          progress_file="bad json"),
        ),
    )
    assert status_line(status) == (
        "paused-low-space 12/32 batches, 0 img/s, trainer at epoch 1 step 40 (3.2 batches/s, waits 2% for data), "
        "1 bad file, 2 worker restarts, progress file ignored; paused: /dev/shm/bf would fall to 10 MiB free"
    )


def test_status_line_for_several_ranks_names_the_slowest() -> None:
    ranks = (
        stream(0, progress=Position(2, 3, 0.01)),
        stream(1, progress=Position(1, 90, 0.20)),
        stream(2, progress=Position(2, 0, None)),
    )
    status = status_example(production=production(progress=ranks[0].progress, streams=ranks, waiting=40, high_water=96))
    assert status_line(status) == "filling 40/96 batches, 850 img/s, 3 trainers, slowest at epoch 1 step 90 (waits 20% for data)"


def test_status_line_says_no_trainer_yet_as_prefetchd_status_does() -> None:
    """It said "trainer at epoch 0 step 0" before any trainer had connected."""
    status = status_example(production=production_without_trainer())
    said = "no trainer yet (the buffer starts at epoch 0 step 0)"
    assert status_line(status) == f"filling 12/32 batches, 850 img/s, {said}"
    assert f"  progress  {said}" in format_status(report(status))
    # One rank of two has a trainer: the slowest is that one, not the other's start position.
    ranks = production_without_trainer(2, streams=(stream(0), production_without_trainer(2).streams[1]),
                                       progress=stream(0).progress, trainer=stream(0).trainer)
    assert status_line(status_example(production=ranks)).endswith(", 1 of 2 trainers, slowest at epoch 1 step 40")


def test_status_line_says_a_trainer_that_closed_its_loader_left_as_prefetchd_status_does() -> None:
    """It said "gone" where `prefetchd status` (and the log) said the trainer left."""
    away = TrainerStatus(pid=12, alive=False, progress_age_s=42.0)
    closed = dataclasses.replace(CONSUMER, name="", trainer=away, closed=True)
    one = production(trainer=away, streams=(stream(trainer=away, consumers=(closed,)),), waiting=32)
    status = status_example(State.FULL, production=one)
    assert status_line(status) == "full 32/32 batches, 850 img/s, trainer at epoch 1 step 40 (left)"
    assert "; trainer pid 12 left (closed its loader;" in format_status(report(status))
    # Closed, its process running on (a notebook's kernel): it said "alive", where the log said it left.
    here = TrainerStatus(pid=12, alive=True, progress_age_s=2.0)
    open_kernel = production(trainer=here, streams=(stream(trainer=here, consumers=(
        dataclasses.replace(closed, trainer=here),)),), waiting=32)
    status = status_example(State.FULL, production=open_kernel)
    assert status_line(status) == "full 32/32 batches, 850 img/s, trainer at epoch 1 step 40 (left)"
    assert "; trainer pid 12 left (closed its loader;" in format_status(report(status))
    status = status_example(State.FULL, production=one)
    killed = dataclasses.replace(closed, closed=False)  # went without closing it
    status = dataclasses.replace(status, production=dataclasses.replace(one, streams=(stream(trainer=away, consumers=(killed,)),)))
    assert status_line(status).endswith("trainer at epoch 1 step 40 (gone)")
    assert "; trainer pid 12 GONE (" in format_status(report(status))
    ranks = tuple(stream(r, trainer=away, consumers=(closed if r else killed,)) for r in range(3))
    assert status_line(status_example(production=production(streams=ranks))).endswith(
        "3 trainers, slowest at epoch 1 step 40 (2 left, 1 gone)")
    # `prefetchd status` of the whole buffer: its progress line is rank 0's trainer, which left though rank 1's
    # was killed (it said "GONE", where rank 0's own directory said "left").
    rank0_left = (stream(0, trainer=away, consumers=(closed,)), stream(1, trainer=away, consumers=(killed,)))
    shown = format_status(report(status_example(production=production(trainer=away, streams=rank0_left))))
    assert "; trainer pid 12 left (closed its loader;" in shown, shown


def test_status_line_while_waiting_for_a_job() -> None:
    status = Status(pid=1, state=State.WAITING_FOR_JOB, heartbeat=0.0, message="waiting for a job: `prefetchd submit ...`")
    assert status_line(status) == "waiting for a job: `prefetchd submit ...`"
    assert status_line(Status(pid=1, state=State.STARTING, heartbeat=0.0)) == "starting"
