"""Named consumers on the trainer's side: each loader keeps its own progress file, joins where
it is told (or at the oldest batch still there), marks its file closed when it leaves and
refreshes it while it waits.  The default consumer keeps progress.json exactly as before."""

from __future__ import annotations

import fcntl
import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from click.testing import CliRunner

from prefetchd.buffer_protocol import VERSION, Manifest, Progress, list_consumers
from prefetchd.buffer_protocol.progress import PROGRESS_REFRESH_SECONDS
from prefetchd.trainer import BufferLoader, LoaderError
from prefetchd.trainer.progress_file import _LOCKS, ALONE_CHECK_SECONDS
from prefetchd.trainer.train import main

if TYPE_CHECKING:  # conftest is pytest's to import; only its types are needed here
    from conftest import MakeJob


def write_progress_of(pid: int, path: Path, step: int, **more: object) -> None:
    """A progress document at epoch 0 ``step`` as process ``pid`` would write it (Progress.write signs it as this one)."""
    path.write_text(json.dumps({"format": "prefetchd.progress", "version": VERSION, "epoch": 0, "step": step, "pid": pid,
                                "time": time.time(), **more}))


def test_each_consumer_writes_its_own_progress_file(make_job: MakeJob) -> None:
    job = make_job(samples=12, batch_size=4, write=1)
    with BufferLoader(job.buffer, normalize=False, consumer="trial-3", start=(0, 0)) as a, \
            BufferLoader(job.buffer, normalize=False) as default:
        assert [b.step for b in a] == [0, 1, 2]
        first = next(iter(default))
        assert first.step == 0
        assert Progress.read(job.buffer, "trial-3") == Progress(1, 0)
        assert Progress.read(job.buffer) == Progress(0, 0)
        assert list_consumers(job.buffer) == ["", "trial-3"]
        assert a.consumer == "trial-3" and default.consumer == ""
    # Both left, and their files say so: the daemon tells a trainer that finished from one that went away.
    left = Progress.read(job.buffer, "trial-3")
    assert left is not None and left.closed and (left.epoch, left.step) == (1, 0)
    default_left = Progress.read(job.buffer)
    assert default_left is not None and default_left.closed and (default_left.epoch, default_left.step) == (0, 1)


@pytest.mark.parametrize("name", ["a/b", "x" * 33, "sp ace", ".hidden", "ü"])
def test_a_bad_consumer_name_is_refused_with_the_rule(make_job: MakeJob, name: str) -> None:
    job = make_job(write=0)
    with pytest.raises(ValueError, match="letters, digits"):
        BufferLoader(job.buffer, consumer=name)
    assert list_consumers(job.buffer) == []


def test_a_named_consumer_joins_at_the_oldest_batch_still_there(make_job: MakeJob) -> None:
    job = make_job(samples=12, batch_size=4, write=0)
    for epoch, step in ((0, 2), (1, 0), (1, 1)):
        job.write(epoch, step)
    late = BufferLoader(job.buffer, normalize=False, consumer="late")
    assert late.position == (0, 2)
    assert [(b.epoch, b.step) for b in late] == [(0, 2)]
    # The default consumer still starts at the beginning, as a single trainer always did.
    assert BufferLoader(job.buffer, normalize=False).position == (0, 0)
    with pytest.raises(Exception, match="step 9"):
        BufferLoader(job.buffer, consumer="x", start=(0, 9))
    late.close()


def test_a_named_consumer_joins_the_slowest_live_one_when_no_batch_waits(make_job: MakeJob) -> None:
    """Beside a trainer that reads each batch as soon as it is built, the buffer is mostly empty: a newcomer joined at
    (0, 0) and the daemon built the job again from its start for it (a soak walk).  It follows the live consumers
    of this job that have not left, and no one else."""
    job = make_job(samples=40, batch_size=4, write=0)
    key = Manifest.read(job.buffer).job_key
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        write_progress_of(live.pid, job.buffer / "progress.json", step=6, job=key)
        write_progress_of(live.pid, job.buffer / "progress.fast.json", step=8, job=key)
        write_progress_of(live.pid, job.buffer / "progress.left.json", step=3, job=key, closed=True)
        write_progress_of(gone.pid, job.buffer / "progress.dead.json", step=2, job=key)
        write_progress_of(live.pid, job.buffer / "progress.old.json", step=1, job="another job")
        with BufferLoader(job.buffer, normalize=False, consumer="late") as late:
            assert late.position == (0, 6)
        (job.buffer / "progress.json").unlink()
        (job.buffer / "progress.fast.json").unlink()
        with BufferLoader(job.buffer, normalize=False, consumer="later") as later:
            assert later.position == (0, 0)  # no one live to follow: the job's start, as before
    finally:
        live.kill()
        live.wait()


def test_a_waiting_consumer_refreshes_its_progress_file(make_job: MakeJob) -> None:
    job = make_job(samples=12, batch_size=4, write=0)
    job.claim()  # a live owner: the loader waits instead of raising DaemonGone
    loader = BufferLoader(job.buffer, normalize=False, timeout=30, daemon_grace=30, consumer="w", start=(0, 0))
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(next(iter(loader))))
    waiter.start()
    deadline = time.monotonic() + 10
    while Progress.read(job.buffer, "w") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    first = Progress.read(job.buffer, "w")
    assert first is not None and first.time is not None
    deadline = time.monotonic() + 4 * PROGRESS_REFRESH_SECONDS + 5
    later = first
    while later.time == first.time and time.monotonic() < deadline:
        time.sleep(0.1)
        later = Progress.read(job.buffer, "w") or first
    job.write(0, 0)
    waiter.join(20)
    assert later.time is not None and later.time > first.time, "the waiting consumer never refreshed its file"
    assert (later.epoch, later.step) == (0, 0) and later.pid == os.getpid()
    assert got and got[0].step == 0
    loader.close()


def test_closed_and_named_progress_documents_round_trip(tmp_path: Path) -> None:
    Progress(2, 5, closed=True).write(tmp_path, "b")
    Progress(1, 0).write(tmp_path, "a")
    (tmp_path / "progress.bad name.json").write_text("{}")  # not a consumer's file: ignored
    assert list_consumers(tmp_path) == ["a", "b"]
    b = Progress.read(tmp_path, "b")
    assert b is not None and b.closed and (b.epoch, b.step) == (2, 5)
    a = Progress.read(tmp_path, "a")
    assert a is not None and not a.closed
    assert Progress.read(tmp_path) is None


def test_prefetchd_train_reads_as_the_named_consumer(make_job: MakeJob) -> None:
    job = make_job(classes=2, samples=8, batch_size=4, image_size=32, epochs=1, write=1)
    result = CliRunner().invoke(main, ["--buffer", str(job.buffer), "--consumer", "lr-0_1", "--lr", "0.1",
                                       "--threads", "1", "--device", "cpu", "--timeout", "10", "-q"])
    assert result.exit_code == 0, result.output
    done = Progress.read(job.buffer, "lr-0_1")
    assert done is not None and (done.epoch, done.step) == (1, 0) and done.closed
    assert Progress.read(job.buffer) is None  # the default consumer's file is not touched

    bad = CliRunner().invoke(main, ["--buffer", str(job.buffer), "--consumer", "a/b", "--device", "cpu"])
    assert bad.exit_code == 2 and "letters, digits" in bad.output


def test_a_second_live_trainer_on_the_same_consumer_is_refused(make_job: MakeJob) -> None:
    """Two trainers on one buffer without consumer names take turns at progress.json: each makes the
    daemon build the other's batches.  A waiting loader that finds a live other writer there says so;
    a position written by a writer that is gone it still puts right."""
    job = make_job(samples=12, batch_size=4, write=0)
    job.write(0, 0)  # and no more: the loader waits for step 1
    job.claim()  # a live owner: the loader waits instead of raising DaemonGone
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()

    def written_by(pid: int) -> None:
        write_progress_of(pid, job.buffer / "progress.json", step=2)

    raised: list[BaseException] = []
    try:
        batches = iter(BufferLoader(job.buffer, normalize=False, timeout=30, daemon_grace=30))
        assert next(batches).step == 0

        def wait_for_step_1() -> None:
            try:
                next(batches)
            except BaseException as exc:  # for the test thread to look at
                raised.append(exc)

        waiter = threading.Thread(target=wait_for_step_1, daemon=True)
        waiter.start()
        written_by(gone.pid)  # put right: the writer is gone
        deadline = time.monotonic() + 10
        while (Progress.read(job.buffer) or Progress(0, 2)).step != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert Progress.read(job.buffer) == Progress(0, 1) and not raised
        written_by(other.pid)  # a live other trainer
        waiter.join(10)
    finally:
        other.kill()
        other.wait()
    assert raised and isinstance(raised[0], LoaderError), raised
    assert (f"another trainer (pid {other.pid}) reads {job.buffer} as the default consumer too, at epoch 0 step 2 "
            "while this one is at epoch 0 step 1") in str(raised[0]) and "--consumer NAME" in str(raised[0])


def test_two_trainers_that_never_wait_are_caught_taking_turns_at_one_consumer(make_job: MakeJob) -> None:
    """Every batch is there, so neither waits (where the check above runs): a publish looks too."""
    job = make_job(samples=40, batch_size=4, epochs=1, write=1)
    job.claim()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        loader = BufferLoader(job.buffer, normalize=False, timeout=30, consumer="same")
        batches = iter(loader)
        assert next(batches).step == 0
        next(batches)  # published: the batch before is consumed

        def written_by_the_other(**more: object) -> None:
            write_progress_of(other.pid, job.buffer / "progress.same.json", step=7, **more)

        # The other trainer of consumer "same" writes its own position, then this one goes on.
        written_by_the_other()
        time.sleep(ALONE_CHECK_SECONDS)
        with pytest.raises(LoaderError, match=rf"another trainer \(pid {other.pid}\) reads .* as consumer 'same' too"):
            next(batches)
        # One that left (closed its file) is no other trainer: this one takes the consumer over.
        written_by_the_other(closed=True)
        time.sleep(ALONE_CHECK_SECONDS)
        assert next(iter(loader)).step >= 2
    finally:
        other.kill()
        other.wait()



def test_a_trainer_of_another_pid_namespace_is_caught_whatever_its_pid_names_here(make_job: MakeJob) -> None:
    """A trainer in another container writing without the lock (it could not take it): its pid means nothing
    here, even where it is this process's own, so its writes are another trainer's."""
    job = make_job(samples=40, batch_size=4, epochs=1, write=1)
    job.claim()
    elsewhere = os.stat("/proc/self/ns/pid").st_ino + 1
    loader = BufferLoader(job.buffer, normalize=False, timeout=30, consumer="same")
    batches = iter(loader)
    assert next(batches).step == 0
    next(batches)
    write_progress_of(os.getpid(), job.buffer / "progress.same.json", step=7, pid_namespace=elsewhere)
    time.sleep(ALONE_CHECK_SECONDS)
    with pytest.raises(LoaderError, match=rf"another trainer \(pid {os.getpid()} of another pid namespace\) reads "):
        next(batches)
    loader.close()


HOLD_FOR_A_MOMENT = """
import fcntl, sys, time
fd = open(sys.argv[1], "a")
fcntl.flock(fd, fcntl.LOCK_SH)
print("held", flush=True)
time.sleep(0.1)
fcntl.flock(fd, fcntl.LOCK_UN)
time.sleep(60)
"""


def test_a_trainer_starting_while_the_daemon_asks_for_its_lock_is_not_refused(make_job: MakeJob) -> None:
    """A daemon asks a trainer of another pid namespace for its lock (a shared flock, let go at once): a loader
    starting in that moment tries again rather than take the daemon for another trainer.  Here the question
    is held for 0.1 s by another process, longer than the daemon's microseconds."""
    job = make_job(samples=12, batch_size=4, write=3)
    job.claim()
    asking = subprocess.Popen([sys.executable, "-c", HOLD_FOR_A_MOMENT, str(job.buffer / "progress.json.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert asking.stdout is not None and asking.stdout.readline() == "held\n"
        with BufferLoader(job.buffer, normalize=False, timeout=30) as loader:
            assert next(iter(loader)).step == 0
    finally:
        asking.kill()
        asking.wait()
    progress = Progress.read(job.buffer)
    assert progress is not None and progress.locked and progress.closed

OPEN_AND_HOLD = """
import sys, time
from prefetchd.trainer import BufferLoader, LoaderError
try:
    loader = BufferLoader(sys.argv[1], normalize=False, timeout=30, daemon_grace=30)
except LoaderError as exc:
    print("refused:", exc, flush=True)
    sys.exit(3)
next(iter(loader))
print("reading", flush=True)
if sys.argv[2] == "hold":
    time.sleep(60)
"""


def _trainer(buffer: Path, then: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", OPEN_AND_HOLD, str(buffer), then], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_second_trainer_on_a_consumer_is_refused_at_once_and_a_dead_ones_consumer_is_free(make_job: MakeJob) -> None:
    """The check by writes lets a second trainer read for up to a second, and two that start together both
    read batches meant for one (stop 42's note).  The first holds the consumer's lock file while its loader
    is open; the second's loader refuses to start, naming the first; a trainer that dies lets go."""
    job = make_job(samples=12, batch_size=4, write=3)
    job.claim()
    first = _trainer(job.buffer, "hold")
    try:
        assert first.stdout is not None and first.stdout.readline() == "reading\n", first.stderr
        with pytest.raises(LoaderError) as refused:
            BufferLoader(job.buffer, normalize=False, timeout=30)
        assert str(refused.value) == (
            f"{job.buffer}: another trainer (pid {first.pid}) reads it as the default consumer (it holds "
            f"{job.buffer / 'progress.json.lock'}). Several trainers on one buffer each need a consumer name of "
            "their own: --consumer NAME (BufferLoader(consumer=NAME))")
        with BufferLoader(job.buffer, normalize=False, timeout=30, consumer="b") as named:  # another consumer
            assert next(iter(named)).step == 0
    finally:
        first.kill()
        first.wait()
    with BufferLoader(job.buffer, normalize=False, timeout=30) as loader:  # SIGKILLed: its lock went with it
        assert next(iter(loader)).step == 0
        second = _trainer(job.buffer, "exit")
        out, err = second.communicate(timeout=60)
        assert second.returncode == 3 and out.startswith(f"refused: {job.buffer}: another trainer (pid {os.getpid()})"), (out, err)
    third = _trainer(job.buffer, "exit")  # closed: the consumer is free
    out, err = third.communicate(timeout=60)
    assert third.returncode == 0 and out == "reading\n", (out, err)


def _refused(buffer: Path) -> bool:
    """Whether a trainer in another process is refused the default consumer of ``buffer``."""
    other = _trainer(buffer, "exit")
    out, err = other.communicate(timeout=60)
    assert other.returncode in (0, 3), (out, err)
    return other.returncode == 3


def test_this_processs_loaders_of_a_consumer_share_its_lock_until_the_last_lets_go(
        make_job: MakeJob, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A notebook cell run twice: the second loader found the lock taken and held none, and once the
    first was collected the consumer was free for another process while the second still read; by
    another spelling of the buffer's path, the second was refused as if another trainer held it (review)."""
    import gc

    job = make_job(samples=12, batch_size=4, write=3)
    job.claim()
    link = tmp_path / "the-same-buffer"
    link.symlink_to(job.buffer)
    first = BufferLoader(job.buffer, normalize=False, timeout=30)
    with caplog.at_level("WARNING", logger="prefetchd.trainer.progress_file"):
        second = BufferLoader(link, normalize=False, timeout=30)
    assert any("another BufferLoader of this process reads it" in r.getMessage() for r in caplog.records), caplog.text
    del first
    gc.collect()
    assert _refused(job.buffer), "the second loader still holds the consumer"
    second.close()
    assert not _refused(job.buffer)


def test_a_forked_child_keeps_no_consumer_locked_once_its_parent_closes(make_job: MakeJob) -> None:
    """flock belongs to the open file, which a fork shares: a DataLoader worker forked while a loader was
    open kept the consumer locked after the loader closed (review)."""
    import multiprocessing

    job = make_job(samples=12, batch_size=4, write=3)
    job.claim()
    loader = BufferLoader(job.buffer, normalize=False, timeout=30)
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    child.start()
    try:
        assert _refused(job.buffer)
        loader.close()
        assert not _refused(job.buffer), "the child's copy of the descriptor kept the lock"
    finally:
        child.kill()
        child.join()


def test_a_lock_file_that_cannot_be_locked_is_warned_about_and_the_loader_reads(
        make_job: MakeJob, caplog: pytest.LogCaptureFixture) -> None:
    job = make_job(samples=12, batch_size=4, write=3)
    job.claim()
    (job.buffer / "progress.json.lock").mkdir()  # planted, or left by something else
    with caplog.at_level("WARNING", logger="prefetchd.trainer.progress_file"):
        with BufferLoader(job.buffer, normalize=False, timeout=30) as loader:
            assert next(iter(loader)).step == 0
    assert f"{job.buffer / 'progress.json.lock'}: cannot lock it (" in caplog.text, caplog.text
    assert "another trainer reading" in caplog.text and "is noticed only by its writes" in caplog.text


def test_the_consumer_lock_is_0644_whatever_the_umask(make_job: MakeJob) -> None:
    """A service's daemon asks whether the lock is held, another member's trainer locks it: both need to read it,
    which a trainer under umask 077 did not let them; one this user's older trainer left 0600 is opened up."""
    job = make_job(samples=12, batch_size=4, write=3)
    job.claim()
    lock = job.buffer / "progress.json.lock"
    old = os.umask(0o077)
    try:
        with BufferLoader(job.buffer, normalize=False, timeout=30) as loader:
            assert next(iter(loader)).step == 0
        assert stat.S_IMODE(lock.stat().st_mode) == 0o644
        lock.chmod(0o600)
        with BufferLoader(job.buffer, normalize=False, timeout=30):
            assert stat.S_IMODE(lock.stat().st_mode) == 0o644
        # Another file of this user's, which a member of the buffer's group hard-linked under the lock's name
        # (a tmpfs holds both): locked as it is, never opened up to the group.
        private = job.buffer / "private-key"  # in the buffer folder, removed with it: the same tmpfs as the lock
        private.write_bytes(b"secret")
        private.chmod(0o600)
        lock.unlink()
        os.link(private, lock)
        with BufferLoader(job.buffer, normalize=False, timeout=30):
            assert stat.S_IMODE(private.stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_a_loader_refused_for_its_arguments_holds_no_consumer(make_job: MakeJob,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    job = make_job(samples=12, batch_size=4, write=3)
    job.claim()
    with pytest.raises(ValueError, match="needs a CUDA device") as refused:  # its traceback kept, as IPython keeps it
        BufferLoader(job.buffer, normalize=False, timeout=30, pin="register")
    with caplog.at_level("WARNING", logger="prefetchd.trainer.progress_file"):
        BufferLoader(job.buffer, normalize=False, timeout=30).close()
    assert "another BufferLoader of this process" not in caplog.text and refused.traceback


def test_a_loader_collected_while_another_takes_its_lock_lets_go_without_a_deadlock(
        make_job: MakeJob, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loader's consumer lock is let go by a finalizer, which the garbage collector may run at any allocation,
    also inside another loader's ``take`` on the thread that holds the locks' mutex.  The release waited there
    for that mutex for ever: a full run of the suite hung in BufferLoader() for pytest's 300 s."""
    job = make_job(samples=8, batch_size=4, write=1)
    first = BufferLoader(job.buffer, normalize=False, timeout=5)
    next(iter(first))  # its first write takes the consumer's lock
    real_fstat = os.fstat
    collected = threading.Event()

    def fstat_collecting_first(fd: int) -> os.stat_result:  # as the collector would, inside take()
        if _LOCKS._mutex.locked() and not collected.is_set():  # inside take()
            collected.set()
            first._progress.release()
        return real_fstat(fd)

    made: list[BufferLoader] = []
    monkeypatch.setattr(os, "fstat", fstat_collecting_first)

    def read_as_another_consumer() -> None:
        loader = BufferLoader(job.buffer, normalize=False, consumer="other", start=(0, 0), timeout=5)
        next(iter(loader))  # its first write takes its lock: take(), where the first loader is collected
        made.append(loader)

    second = threading.Thread(target=read_as_another_consumer, daemon=True)
    second.start()
    second.join(10)
    monkeypatch.undo()
    assert collected.is_set() and len(made) == 1, "the release waited for the mutex its own thread held"
    fd = os.open(job.buffer / "progress.json.lock", os.O_RDONLY)
    try:  # the first loader's lock was let go once take() was done: another trainer may take the consumer
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    made[0].close()
