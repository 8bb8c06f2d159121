"""Liveness with real processes and real signals: a stopped daemon is called stuck and a killed
one gone, and the daemon says whether its trainer is still there.  (Restarts under
prefetchd-train --spawn-daemon: tests/trainer/test_spawn_daemon.py.)

Timings are bounds with generous slack, never speeds: the machine is shared."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from prefetchd.buffer_protocol import Progress, State, batch_name, daemon_pid, list_batches, read_status
from prefetchd.daemon.status_view import describe_status, format_status
from prefetchd.trainer import BufferLoader, DaemonGone, DaemonStuck, LoaderTimeout
from tests import slow_hook
from tests.cgroups import cgroup_v1, oom_killed_in
from tests.status_examples import production_of, state_of
from tests.waiting import wait_for

SMALL = ["--batch-size", "8", "--image-size", "32", "--workers", "1", "--seed", "7"]
STALL = 3.0
SLACK = 4.0  # the loader checks every STALL / 4; the daemon beats every second



def wait_running(buffer: Path, pid: int) -> None:
    """Until the daemon's controller loop beats (a stall bound of seconds is for a running daemon,
    not for one whose fork server is still importing torch on a busy machine)."""
    def running() -> bool:
        status = read_status(buffer)
        return status is not None and status.pid == pid and status.state in (State.FILLING, State.FULL)
    wait_for(running, 60, f"the daemon (pid {pid}) to run")


def test_stopped_daemon_is_reported_stuck_within_the_stall_timeout(shapes_data: Path, shm_dir: Path,
                                                                   start_daemon) -> None:
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *SMALL, "--epochs", "1",
                          "--high-water", "2", "--low-water", "1")
    wait_running(buffer, daemon.proc.pid)
    loader = BufferLoader(buffer, normalize=False, timeout=120, stall_timeout=STALL)
    it = iter(loader)
    steps = [next(it).step]
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(DaemonStuck) as info:
            for batch in it:  # the batches already published are served; the next one never comes
                steps.append(batch.step)
        elapsed = time.monotonic() - start
        assert elapsed < STALL + SLACK + 2 * 1.0, f"took {elapsed:.1f} s to notice"
        msg = str(info.value)
        pid = daemon.proc.pid
        assert f"pid {pid}" in msg and str(buffer) in msg
        # Stopped, not hung: what lets it go on, not py-spy (a walk: it quoted the stopped daemon as stuck).
        assert "is stopped (SIGSTOP" in msg and f"`kill -CONT {pid}`" in msg and "py-spy" not in msg
        assert "stall_timeout 3 s" in msg and "last state" in msg and "prefetchd start --buffer" in msg
        # Stuck is not gone: the stopped daemon still owns the buffer.
        assert daemon_pid(buffer) == pid
        assert f"`kill -CONT {pid}`" in format_status(describe_status(buffer)).splitlines()[-1]
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    resumed = time.time()
    wait_for(lambda: (s := read_status(buffer)) is not None and s.heartbeat > resumed, 30, "a heartbeat after SIGCONT")
    # Running again it beats again, and the same iterator goes on from the batch it waited for.
    steps += [b.step for b in it]
    assert steps == list(range(len(loader)))


def test_a_daemon_stopped_with_its_workers_as_ctrl_z_stops_them_is_stopped_by_prefetchd_stop(
        shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """Ctrl-Z stops the daemon's whole process group.  `prefetchd stop` sent SIGTERM only, which a stopped process
    takes once continued: it waited its timeout and said to kill -9.  Continued alone, the daemon then hung at exit
    in multiprocessing's join of a worker that the still stopped forkserver never reported (a walk)."""
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *SMALL, "--high-water", "2", "--low-water", "1")
    wait_running(buffer, daemon.proc.pid)
    group = [psutil.Process(daemon.proc.pid), *psutil.Process(daemon.proc.pid).children(recursive=True)]
    assert len(group) >= 3, group  # the forkserver, its worker, the resource tracker
    for proc in group:
        proc.send_signal(signal.SIGSTOP)
    try:
        stop = subprocess.run([sys.executable, "-m", "prefetchd", "stop", "--buffer", str(buffer), "--timeout", "20"],
                              capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert daemon.wait_exit(10) == 0
        assert "stopped by SIGTERM" in daemon.log
    finally:
        for proc in group:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGCONT)


def test_sigusr1_has_a_running_daemon_write_its_threads_stacks_into_its_log(shapes_data: Path, shm_dir: Path,
                                                                            start_daemon) -> None:
    """DaemonStuck names py-spy, which is rarely installed; SIGUSR1 ended the daemon without a word (a walk)."""
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *SMALL, "--high-water", "2", "--low-water", "1")
    wait_running(buffer, daemon.proc.pid)
    daemon.proc.send_signal(signal.SIGUSR1)
    daemon.wait_until(lambda: "Current thread" in daemon.log, 30, "its stacks in its log")
    assert "most recent call first" in daemon.log and "prefetchd/daemon/" in daemon.log, daemon.log
    resumed = time.time()
    wait_for(lambda: (s := read_status(buffer)) is not None and s.heartbeat > resumed + 1, 30, "a heartbeat after it")
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.wait_exit() == 0


def test_a_daemon_whose_workers_take_seconds_per_image_still_beats(shapes_data: Path, shm_dir: Path,
                                                                   start_daemon) -> None:
    """RELIABILITY.md, Liveness: the controller loop never blocks on the workers, so a daemon whose workers are
    busy with huge images still beats. One that waited for a worker's result would miss its heartbeat for as long
    as a task takes: a loader would call a healthy daemon stuck after its stall_timeout (and --spawn-daemon kill
    it and start it again on the same images), and the unit's watchdog (WatchdogSec=30) kill it. Here each image
    takes its worker 2.5 s (a hook), so each batch of 2 takes 5 s; no trainer writes progress meanwhile (a write
    wakes the controller, which would hide a blocked wait)."""
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", "--batch-size", "2", "--image-size", "32",
                          "--workers", "1", "--high-water", "2", "--low-water", "1", "--transform",
                          "tests.slow_hook:slow")
    wait_running(buffer, daemon.proc.pid)
    oldest, looks_while_building = 0.0, 0
    deadline = time.monotonic() + 2 * 2 * slow_hook.SECONDS  # both batches of the high-water mark built meanwhile
    while time.monotonic() < deadline:
        status = read_status(buffer)
        assert status is not None and status.pid == daemon.proc.pid and status.production is not None, status
        oldest = max(oldest, time.time() - status.heartbeat)
        looks_while_building += status.production.building > 0
        time.sleep(0.05)
    assert looks_while_building > 20, "the test looked while no batch was built"
    assert oldest < STALL - 0.5, f"the heartbeat went {oldest:.1f} s old while a worker was busy: {daemon.log}"
    assert daemon.proc.poll() is None


def test_killed_daemon_is_reported_gone_with_a_restart_that_resumes(shapes_data: Path, shm_dir: Path,
                                                                    tmp_path: Path, start_daemon) -> None:
    """The message's `prefetchd start` serves the same job again: a file list (not its folder),
    with every flag of the job's identity, so the new daemon takes the buffer over and goes on."""
    listing = tmp_path / "train.csv"
    listing.write_text("".join(f"{p},{p.parent.name}\n" for p in sorted((shapes_data / "train").rglob("*.jpg"))))
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", listing, *SMALL, "--epochs", "1", "--color-jitter", "0.2",
                          "--high-water", "2", "--low-water", "1")
    wait_running(buffer, daemon.proc.pid)
    loader = BufferLoader(buffer, normalize=False, timeout=120, daemon_grace=1.0, stall_timeout=STALL)
    it = iter(loader)
    steps = [next(it).step]
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait(10)
    start = time.monotonic()
    with pytest.raises(DaemonGone, match="no prefetchd daemon owns this buffer") as info:
        for batch in it:
            steps.append(batch.step)
    assert time.monotonic() - start < 1.0 + SLACK
    command = shlex.split(str(info.value).split("Restart it with `")[1].split("`")[0])
    assert command[:4] == ["prefetchd", "start", "--buffer", str(buffer)]
    assert command[command.index("--data") + 1] == str(listing)
    restarted = start_daemon(buffer, *command[4:], "--workers", "1")
    steps += [b.step for b in BufferLoader(buffer, normalize=False, timeout=120, start=(0, steps[-1] + 1))]
    assert steps == list(range(len(loader)))
    assert restarted.proc.poll() in (None, 0)  # took the buffer over as the same job, no refusal


def test_a_daemon_gone_while_the_oom_killer_killed_is_said_with_those_kills(shapes_data: Path, shm_dir: Path,
                                                                             start_daemon: Any) -> None:
    """A daemon the kernel's OOM killer kills leaves a status that says it runs and no word in its log: the trainer
    said only that no daemon owns the buffer.  Here a real OOM kill (a process in a 64 MiB cgroup) while the loader
    reads, then the daemon SIGKILLed as the OOM killer would."""
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *SMALL, "--high-water", "2", "--low-water", "1")
    wait_running(buffer, daemon.proc.pid)
    loader = BufferLoader(buffer, normalize=False, timeout=120, daemon_grace=1.0, stall_timeout=STALL)
    it = iter(loader)
    next(it)
    with cgroup_v1("memory", {"memory.limit_in_bytes": str(64 << 20)}) as group:
        oom_killed_in(group)
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait(10)
    with pytest.raises(DaemonGone, match=r"no prefetchd daemon owns this buffer .*\. The kernel's out-of-memory "
                                         r"killer killed \d+ process(es)? on this machine since this loader started "
                                         r"\(`dmesg` names them\): if the daemon was one, give it more memory, or "
                                         r"lower its --high-water or --workers$"):
        for _ in it:
            pass


# It dies without closing its loader, as a trainer that crashes (OOM-killed, a segfault) does.
TRAINER = """
import os, signal, sys
from prefetchd.trainer import BufferLoader
it = iter(BufferLoader(sys.argv[1], normalize=False, timeout=60))
next(it), next(it)
os.kill(os.getpid(), signal.SIGKILL)
"""

# A stock training script (docs/DROP_IN.md): it reads and ends, without loader.close(); argv[2], when
# given, ends it with an uncaught exception instead.
DROP_IN_TRAINER = """
import sys
from prefetchd.trainer import BufferLoader
loader = BufferLoader(sys.argv[1], normalize=False, timeout=60)
for step, (images, labels) in enumerate(loader):
    if step == 1:
        break
if len(sys.argv) > 2:
    raise RuntimeError(sys.argv[2])
"""


def test_status_says_when_the_trainer_is_gone_and_back(shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *SMALL, "--high-water", "3", "--low-water", "1")
    trainer = subprocess.run([sys.executable, "-c", TRAINER, str(buffer)], capture_output=True, text=True, timeout=120)
    assert trainer.returncode == -signal.SIGKILL, trainer.stderr

    def trainer_is(alive: bool) -> bool:
        p = production_of(buffer)
        return p is not None and p.trainer.alive is alive

    wait_for(lambda: trainer_is(False), 30, "the status to say the trainer is gone")
    status = read_status(buffer)
    assert status is not None and status.production is not None
    assert status.production.trainer.pid == trainer_pid(buffer)
    assert (status.production.progress.epoch, status.production.progress.step) == (0, 1)  # the 2nd not yet consumed
    # It keeps the window full and then sleeps there.
    wait_for(lambda: state_of(buffer) == State.FULL, 30, "a full buffer")
    assert len(list_batches(buffer)) == 3
    text = format_status(describe_status(buffer))
    assert f"trainer pid {trainer_pid(buffer)} GONE (the daemon fills the buffer" in text and "progress written" in text
    time.sleep(2.5)  # a few more status periods: still one message
    assert daemon.log.count("has gone away") == 1, daemon.log
    assert f"trainer (pid {trainer_pid(buffer)}) has gone away" in daemon.log

    # A trainer comes back (this process): said once, and the status shows it alive.
    with BufferLoader(buffer, normalize=False, timeout=60) as loader:
        next(iter(loader))  # a new trainer without a checkpoint starts over: the daemon regenerates
        wait_for(lambda: trainer_is(True), 30, "the status to say the trainer is back")
        assert f"trainer is back (pid {os.getpid()})" in daemon.log
        assert f"trainer pid {os.getpid()} alive" in format_status(describe_status(buffer))

    # One that closes its loader before the job's end left: no warning, said as such in the status.
    trainer = subprocess.run([sys.executable, "-c", "import sys; from prefetchd.trainer import BufferLoader\n"
                              "with BufferLoader(sys.argv[1], normalize=False, timeout=60) as l: next(iter(l))",
                              str(buffer)], capture_output=True, text=True, timeout=120)
    assert trainer.returncode == 0, trainer.stderr
    wait_for(lambda: trainer_is(False), 30, "the status to say the trainer is not there")
    wait_for(lambda: "the trainer of rank 0 left at epoch 0 step 1; its window stays filled for whoever comes next"
             in daemon.log, 30, "the log to say it left")
    assert f"trainer pid {trainer_pid(buffer)} left (closed its loader" in format_status(describe_status(buffer))
    time.sleep(2.5)  # a few more status periods
    assert daemon.log.count("has gone away") == 1, daemon.log
    assert daemon.log.count("is back") == 1

    # One that comes after it joined, said once: not also "is back" (a walk of SPEC.md).
    joined = daemon.log.count("the trainer joined rank 0")  # the one that left, too
    with BufferLoader(buffer, normalize=False, timeout=60) as loader:
        next(iter(loader))
        wait_for(lambda: trainer_is(True), 30, "the status to say the new trainer is there")
        wait_for(lambda: daemon.log.count("the trainer joined rank 0") == joined + 1, 30, "the log to say it joined")
        time.sleep(2.5)  # a few more looks at the trainer
        assert daemon.log.count("is back") == 1, daemon.log


def test_a_script_that_ends_without_closing_its_loader_left_and_is_not_gone(shapes_data: Path, shm_dir: Path,
                                                                             start_daemon) -> None:
    """A loader still open at the interpreter's exit closes then: the daemon says the trainer left (an
    INFO line), not that it went away, and so does a script ended by an uncaught exception (as its
    loader would have in a with block)."""
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *SMALL, "--high-water", "3", "--low-water", "1")

    def script(*args: str) -> tuple[int, int, str]:
        """(pid, exit code, stderr) of DROP_IN_TRAINER run to its end."""
        proc = subprocess.Popen([sys.executable, "-c", DROP_IN_TRAINER, str(buffer), *args],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _, stderr = proc.communicate(timeout=120)
        return proc.pid, proc.returncode, stderr

    def left(pid: int) -> bool:
        p = production_of(buffer)
        return (p is not None and p.trainer.pid == pid and p.trainer.alive is False
                and f"trainer pid {pid} left (closed its loader" in format_status(describe_status(buffer)))

    pid, code, stderr = script()
    assert code == 0 and stderr == "", stderr
    wait_for(lambda: left(pid), 30, "the status to say the trainer left")
    written = Progress.read(buffer)
    assert written is not None and written.closed and (written.epoch, written.step) == (0, 2)  # both consumed
    wait_for(lambda: "the trainer of rank 0 left at epoch 0 step 2" in daemon.log, 30, "the log to say it left")

    pid, code, stderr = script("a bug in the training step")
    assert code == 1 and "RuntimeError: a bug in the training step" in stderr, stderr
    assert stderr.count("Traceback") == 1 and "at exit" not in stderr, stderr  # closing at exit said nothing
    wait_for(lambda: left(pid), 30, "the status to say the second trainer left")
    time.sleep(2.5)  # a few more status periods
    assert "gone away" not in daemon.log, daemon.log


def test_a_daemon_started_after_its_trainer_died_says_so_calmly_and_its_status_still_calls_it_gone(
        shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """A run killed with its daemon (a job scheduler ends both) leaves a progress file whose trainer is gone;
    the daemon started next (by the run's restart, --spawn-daemon --resume) finds it so at its first look.
    That is an INFO line saying the trainer was gone before this daemon started, not the warning that it went
    away, which the daemon that watched it die gives; the status still calls it GONE until a trainer writes."""
    buffer = shm_dir / "bf"
    args = ["--data", shapes_data / "train", *SMALL, "--high-water", "3", "--low-water", "1"]
    first = start_daemon(buffer, *args)
    trainer = subprocess.run([sys.executable, "-c", TRAINER, str(buffer)], capture_output=True, text=True, timeout=120)
    assert trainer.returncode == -signal.SIGKILL, trainer.stderr
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    pid = trainer_pid(buffer)
    assert pid is not None

    second = start_daemon(buffer, *args)

    def said_gone() -> bool:
        status = read_status(buffer)  # the new daemon's, not the one the killed daemon left
        p = status.production if status is not None and status.pid == second.proc.pid else None
        return p is not None and p.trainer.pid == pid and p.trainer.alive is False

    wait_for(said_gone, 60, "the new daemon's status to say the trainer is gone", second.proc)
    assert f"trainer pid {pid} GONE (the daemon fills the buffer" in format_status(describe_status(buffer))
    said = f"rank 0's trainer (pid {pid}) is not running: it wrote its progress (epoch 0 step 1) "  # the 2nd: unconsumed
    wait_for(lambda: said in second.log, 30, "the log to say the trainer was gone before the daemon started")
    line = next(line for line in second.log.splitlines() if said in line)
    assert "INFO" in line and "before this daemon started; the buffer fills from there" in line, line
    time.sleep(2.5)  # a few more status periods: nothing more said of it
    assert "gone away" not in second.log and second.log.count(said) == 1, second.log


def trainer_pid(buffer: Path) -> int | None:
    p = Progress.read(buffer)
    return p.pid if p is not None else None


def test_a_daemon_that_fails_before_its_manifest_is_named_by_the_waiting_loader(
        shapes_data: Path, shm_dir: Path, tmp_path: Path, start_daemon, caplog: pytest.LogCaptureFixture) -> None:
    """The daemon refuses a dataset with an empty class folder and exits: a loader waiting for its
    manifest says so at once, with the daemon's reason (not after its timeout, as 'no daemon owns
    it').  One that starts after that failure waits its timeout for another daemon (a service may be
    restarting it), and says so at once: the failure, how long it waits, and to fix it first; its
    timeout leads with the failure, where it said "no daemon owns it" with a bare start command first."""
    data = tmp_path / "data"
    shutil.copytree(shapes_data / "train", data)
    (data / "empty").mkdir()
    buffer = shm_dir / "bf"
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            BufferLoader(buffer, normalize=False, timeout=120)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    waiting = threading.Thread(target=wait)
    waiting.start()
    daemon = start_daemon(buffer, "--data", data, *SMALL)
    assert daemon.wait_exit(60) == 1, daemon.log
    started = time.monotonic()
    waiting.join(60)
    assert not waiting.is_alive() and time.monotonic() - started < 30, "the loader waited on after the failure"
    [gone] = outcome
    assert isinstance(gone, DaemonGone), gone
    assert "the daemon failed before it wrote a manifest: " in str(gone) and f"{data / 'empty'}" in str(gone), gone
    reason = str(gone).split("the daemon failed before it wrote a manifest: ", 1)[1].split(". Start it again")[0]
    assert f"{data / 'empty'}" in reason, reason
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prefetchd.trainer.manifest_wait"), \
            pytest.raises(LoaderTimeout) as timed_out:
        BufferLoader(buffer, normalize=False, timeout=2)
    [said] = [r.getMessage() for r in caplog.records]
    assert said.startswith(f"the daemon last on {buffer} failed before this loader started, and none runs there "
                           f"now: ") and reason in said, said
    assert ("Waiting up to 2 s in case another starts (its service restarting it, or you); fix that first, then "
            f"start it again (`prefetchd status --buffer {buffer}` shows it)") in said, said
    message = str(timed_out.value)
    assert message.startswith(f"{buffer}: the daemon last on it failed before this loader started ({reason}"), message
    assert "and no other started within the 2 s waited: fix that first, then start it again. " in message, message
    assert f"Start one with `prefetchd start --buffer {buffer} --data ROOT`" in message, message


# -- a store's outage longer than the loader's timeout ------------------------------------------

OUTAGE_TIMEOUT = 3.0  # the loader's; the store stays down well past it


def _into_the_outage(s3: Any, proxy: Any, shapes_data: Path, buffer: Path, start_daemon: Any
                     ) -> tuple[Any, BufferLoader, Iterator[Any], list[int]]:
    """A daemon reading the bucket through ``proxy``, and a loader (timeout OUTAGE_TIMEOUT) that has taken
    every batch published before the store went down, the daemon's builds failing since: the next batch
    is waited for only once the daemon has failed to read the store (the first failure takes the reads'
    retries, ~3 s, which would race a wait of 3 s)."""
    url = s3.upload(shapes_data / "train", "outage/train")
    daemon = start_daemon(buffer, "--data", url, *SMALL, "--epochs", "1", "--high-water", "2", "--low-water", "1")
    wait_running(buffer, daemon.proc.pid)
    loader = BufferLoader(buffer, normalize=False, timeout=OUTAGE_TIMEOUT, daemon_grace=1.0)
    it = iter(loader)
    # The first batch, read from the store, took over OUTAGE_TIMEOUT once under a full suite's load: waited for here.
    wait_for(lambda: (buffer / batch_name(0, 0)).exists(), 60, "the first batch", daemon.proc)
    steps = [next(it).step]
    proxy.fail_next = 10**9  # every request answered 503 SlowDown from now on

    def failing() -> bool:
        p = production_of(buffer)
        return p is not None and p.storage_wait is not None

    while not failing():  # take what is published (no wait), so that the daemon builds, and fails
        if (buffer / batch_name(0, steps[-1] + 1)).exists():
            steps.append(next(it).step)
        time.sleep(0.05)
        assert daemon.proc.poll() is None, daemon.log
    while (buffer / batch_name(0, steps[-1] + 1)).exists():
        steps.append(next(it).step)
    return daemon, loader, it, steps


@pytest.mark.timeout(180)
def test_a_loader_waits_out_an_object_store_outage_longer_than_its_timeout(
        s3: Any, proxy: Any, shapes_data: Path, shm_dir: Path, start_daemon: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The daemon waits for the store and resumes when it answers; the trainer, its status saying so, waits
    with it past its timeout (it raised LoaderTimeout after 3 s, ending the training: review), and gets
    every batch once the store is back, said once in its log."""
    buffer = shm_dir / "bf"
    daemon, loader, it, steps = _into_the_outage(s3, proxy, shapes_data, buffer, start_daemon)
    wait = production_of(buffer)
    assert wait is not None and wait.storage_wait is not None and "is the object store reachable" in wait.storage_wait.reason
    outage = 3 * OUTAGE_TIMEOUT
    back = threading.Timer(outage, lambda: setattr(proxy, "fail_next", 0))
    back.start()
    start = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, "prefetchd.trainer.batch_waiter"):
            steps.append(next(it).step)
    finally:
        back.cancel()
        proxy.fail_next = 0
    assert time.monotonic() - start > outage - 1.0
    said = [r.getMessage() for r in caplog.records if "for its dataset's storage" in r.getMessage()]
    assert len(said) == 1 and f"pid {daemon.proc.pid}" in said[0] and "past its timeout of 3 s" in said[0], said
    steps += [b.step for b in it]
    assert steps == list(range(len(loader)))
    assert daemon.wait_exit(60) == 0, daemon.log
    p = production_of(buffer)  # its last status, written as it exited
    assert p is not None and p.storage_wait is None and p.errors.replaced_samples == 0, p


@pytest.mark.timeout(180)
def test_a_daemon_killed_during_an_outage_still_ends_the_wait(s3: Any, proxy: Any, shapes_data: Path, shm_dir: Path,
                                                               start_daemon: Any) -> None:
    """Waiting on past the timeout is for a daemon that beats: one killed meanwhile is gone, as ever."""
    buffer = shm_dir / "bf"
    daemon, _loader, it, _steps = _into_the_outage(s3, proxy, shapes_data, buffer, start_daemon)
    kill = threading.Timer(2 * OUTAGE_TIMEOUT, daemon.proc.send_signal, (signal.SIGKILL,))
    kill.start()
    start = time.monotonic()
    try:
        with pytest.raises(DaemonGone, match="no prefetchd daemon owns this buffer"):
            next(it)
    finally:
        kill.cancel()
    assert 2 * OUTAGE_TIMEOUT - 0.5 < time.monotonic() - start < 2 * OUTAGE_TIMEOUT + 1.0 + SLACK
