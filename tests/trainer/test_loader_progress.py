"""progress.json as the loader keeps it under faults: rewritten while waiting when someone else
rewound or damaged it, retried (not fatal) while the tmpfs is full, and saying that the trainer
waits while it waits."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from prefetchd.buffer_protocol import DEFAULT_CONSUMER, Progress
from prefetchd.buffer_protocol.progress import PROGRESS_REFRESH_SECONDS
from prefetchd.trainer import BufferLoader, LoaderError, LoaderTimeout, NoAccess
from prefetchd.trainer import progress_file
from tests.conftest import mounted_tmpfs

if TYPE_CHECKING:  # conftest is pytest's to import; only its types are needed here
    from conftest import MakeJob


def test_a_rewound_progress_file_is_written_again_while_the_loader_waits(make_job: MakeJob) -> None:
    job = make_job(samples=12, batch_size=4, write=0)
    job.claim()  # a live owner: the loader waits instead of raising DaemonGone
    for step in range(2):
        job.write(0, step)
    loader = BufferLoader(job.buffer, normalize=False, timeout=20, daemon_grace=20)
    it = iter(loader)
    next(it)
    next(it)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(next(it)))
    waiter.start()  # publishes (0, 2) and waits for that batch
    deadline = time.monotonic() + 10
    while Progress.read(job.buffer) != Progress(0, 2) and time.monotonic() < deadline:
        time.sleep(0.01)
    # A stale writer (another trainer from an old checkpoint, a bad script) rewinds the file:
    # a daemon would now build batches 0 and 1 again and never batch 2.
    Progress(0, 0).write(job.buffer)
    deadline = time.monotonic() + 5
    while Progress.read(job.buffer) != Progress(0, 2) and time.monotonic() < deadline:
        time.sleep(0.01)
    restored = Progress.read(job.buffer)
    job.write(0, 2)
    waiter.join(20)
    assert restored == Progress(0, 2), "the waiting loader must put its position back"
    assert got and got[0].step == 2
    loader.close()


def test_a_trainer_stuck_waiting_for_a_batch_reads_as_waiting_while_it_waits(make_job: MakeJob) -> None:
    """The wait share written while the loader waits (a storage outage) counts the wait going on:
    the daemon's status and prefetchd_trainer_wait_share say near 100 %, not the 0 % of the
    batches that came at once, and the share written once the batch came is not counted twice."""
    job = make_job(samples=12, batch_size=4, write=0)
    job.claim()  # a live owner: the loader waits instead of raising DaemonGone
    for step in range(2):
        job.write(0, step)
    loader = BufferLoader(job.buffer, normalize=False, timeout=30, daemon_grace=30, stall_timeout=None)
    it = iter(loader)
    next(it)
    next(it)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(next(it)))
    waiter.start()  # publishes (0, 2) and waits for that batch, rewriting progress.json as it waits
    shares: list[float] = []  # as written while it waits, each once
    deadline = time.monotonic() + 3 * PROGRESS_REFRESH_SECONDS + 2
    while time.monotonic() < deadline and not (shares and shares[-1] >= 0.9):
        time.sleep(0.05)
        written = Progress.read(job.buffer)
        share = written.wait_share if written is not None and (written.epoch, written.step) == (0, 2) else None
        if share is not None and share not in shares[-1:]:
            shares.append(share)
    job.write(0, 2)
    waiter.join(20)
    assert got and got[0].step == 2
    assert shares and shares[-1] >= 0.9, \
        f"the shares written while the loader waited were {shares}: a stuck trainer must read as waiting"
    loader.close()  # publishes the share with the wait ended: one span, counted once
    after = Progress.read(job.buffer)
    assert after is not None and after.wait_share is not None and 0.9 <= after.wait_share <= 1.0


@pytest.mark.root
def test_a_full_tmpfs_delays_progress_instead_of_killing_the_trainer(make_job: MakeJob, shm_dir: Path) -> None:
    with mounted_tmpfs(shm_dir / "enospc", "size=1m") as mnt:
        job = make_job(mnt / "bf", samples=16, batch_size=4, write=0)
        for step in range(4):
            job.write(0, step)
        loader = BufferLoader(job.buffer, normalize=False, timeout=10, daemon_grace=10)
        it = iter(loader)
        next(it)
        filler = _fill(mnt)  # so progress.json cannot be replaced
        steps = [next(it).step for _ in range(3)]  # each publishes, and each write fails
        assert steps == [1, 2, 3]
        assert Progress.read(job.buffer) == Progress(0, 0)
        filler.unlink()
        loader.close()  # the retry goes through once there is room
        assert Progress.read(job.buffer) == Progress(1, 0)


@pytest.mark.root
def test_a_timeout_while_progress_cannot_be_written_says_so(make_job: MakeJob, shm_dir: Path) -> None:
    """A loader that cannot write progress.json (a full tmpfs) timed out blaming a slow daemon, which had
    not been told where the loader was."""
    with mounted_tmpfs(shm_dir / "enospc", "size=1m") as mnt:
        job = make_job(mnt / "bf", samples=16, batch_size=4, write=0)
        job.write(0, 0)
        job.write(0, 1)
        loader = BufferLoader(job.buffer, normalize=False, timeout=2, daemon_grace=30)
        it = iter(loader)
        next(it)
        filler = _fill(mnt)
        next(it)  # its progress write fails
        with pytest.raises(LoaderTimeout) as timed_out:
            next(it)  # batch 2 is never written
        filler.unlink()
        loader.close()
    said = str(timed_out.value)
    assert "did not appear" in said and re.search(
        rf"But the daemon may not know this loader needs that batch: it has not written "
        rf"{re.escape(str(job.buffer / 'progress.json'))} for \d+ s \(No space left on device\)$", said), said


def _fill(mount: Path) -> Path:
    """Every free block of ``mount`` taken by one file, which is returned: nothing can be written there."""
    filler = mount / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


@pytest.mark.root
def test_progress_failing_on_a_full_tmpfs_is_said_when_it_starts_now_and_then_and_when_it_ends(
        shm_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each failed try was a warning of its own (34 alike lines in the 30 s grace of a waiting trainer).
    Now: one when the writes start failing, saying what the loader does and until when; one each
    PROGRESS_WRITE_WARN_SECONDS (1 s here) while they fail; one when a write goes through again."""
    monkeypatch.setattr(progress_file, "PROGRESS_WRITE_WARN_SECONDS", 1.0)
    with mounted_tmpfs(shm_dir / "enospc", "size=1m") as mnt:
        buffer = mnt / "bf"
        buffer.mkdir()
        writer = progress_file.ProgressFile(buffer, DEFAULT_CONSUMER, "job")
        try:
            writer.publish((0, 0), wait_share=None)
            filler = _fill(mnt)
            failing = 2.5
            start = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="prefetchd.trainer.progress_file"):
                tries = 0
                while time.monotonic() - start < failing:
                    writer.publish((0, 1), wait_share=None)  # a loader tries at each batch and look
                    tries += 1
                    time.sleep(0.02)
                assert Progress.read(buffer) == Progress(0, 0)
                filler.unlink()
                writer.publish((0, 1), wait_share=None)
            assert Progress.read(buffer) == Progress(0, 1)
        finally:
            writer.release()
    said = [r.getMessage() for r in caplog.records]
    path = buffer / "progress.json"
    assert tries > 50 and 3 <= len(said) <= 4, (tries, said)
    assert said[0].startswith(f"cannot write {path} (No space left on device); the loader goes on with the batches "
                              "that are there and tries again"), said
    assert "from now), it stops with an error" in said[0], said
    assert all(line.startswith(f"still cannot write {path} (No space left on device) after ") for line in said[1:-1])
    assert re.fullmatch(rf"wrote {re.escape(str(path))} again after [23] s \(\d+ writes failed\)", said[-1]), said


def test_a_progress_write_that_keeps_failing_says_what_to_do_about_its_cause(
        make_job: MakeJob, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the grace the loader gives up, with the fix for the cause it met: here a directory
    under progress.json's name, not 'check the free space'."""
    monkeypatch.setattr(progress_file, "PROGRESS_WRITE_GRACE", 0.0)
    job = make_job(samples=16, batch_size=4, write=0)
    for step in range(2):
        job.write(0, step)
    (job.buffer / "progress.json").mkdir()
    with pytest.raises(LoaderError, match=r"progress\.json: cannot write it \(Is a directory\) for 0 s; .*: "
                                          r"remove the directory that took its name"):
        for _batch in BufferLoader(job.buffer, normalize=False, timeout=10, daemon_grace=10):
            pass


@pytest.mark.parametrize("written_first", [True, False], ids=["after-a-write", "never-written"])
def test_a_loader_that_closes_while_its_progress_writes_fail_says_the_daemon_was_not_told(
        make_job: MakeJob, caplog: pytest.LogCaptureFixture, written_first: bool) -> None:
    """Within the grace a failing write is retried at the next publish; closing there is none. The loader
    closed without a word, and a run that read the batches already there ended with exit 0 while the daemon
    still went by an old position (or none) and never saw it leave. Now closing says so, and what to do."""
    job = make_job(samples=16, batch_size=4, write=1)
    path = job.buffer / "progress.json"
    loader = BufferLoader(job.buffer, normalize=False, timeout=10, daemon_grace=10)

    def fail_from_now() -> None:  # every write: a directory took its name
        path.unlink(missing_ok=True)
        path.mkdir()
        (path / "keep").touch()

    with caplog.at_level(logging.WARNING):
        if not written_first:
            fail_from_now()
        it = iter(loader)  # writes step 0
        if written_first:
            next(it), next(it)  # writes step 1
            fail_from_now()
        assert sum(1 for _ in it) == (2 if written_first else 4)
        loader.close()
    said = [r.getMessage() for r in caplog.records]
    told = "epoch 0 step 1, the last position this loader wrote" if written_first else \
        "no position of this loader's, which never wrote it"
    assert said[-1] == (f"closing {job.buffer}: {path}: cannot write it (Is a directory, for 0 s) as the loader "
                        "closes, so the daemon was not told where this trainer stopped nor that it left: it goes by "
                        f"{told}; remove the directory that took its name"), said
    assert said[0].startswith(f"cannot write {path} (Is a directory); the loader goes on"), said
    assert said[0].endswith("it stops with an error; remove the directory that took its name"), said


@pytest.mark.root
def test_a_buffer_mounted_read_only_is_refused_when_the_loader_is_made(make_job: MakeJob, shm_dir: Path) -> None:
    """A trainer's container given the buffer as a read-only volume read the batches there, while the daemon,
    never told, deleted none and built no more. Now the loader stops at once, saying it is the mount, not a
    permission its owner could grant (root, who may write anything else, is refused too)."""
    with mounted_tmpfs(shm_dir / "rw", "size=4m") as mnt:
        job = make_job(mnt / "bf", samples=8, batch_size=4, write=1)
        volume = shm_dir / "ro"
        volume.mkdir()
        subprocess.run(["mount", "--bind", "-o", "ro", str(mnt), str(volume)], check=True)
        try:
            with pytest.raises(NoAccess) as refused:
                BufferLoader(volume / "bf", normalize=False, timeout=5)
        finally:
            subprocess.run(["umount", str(volume)], check=True)
        assert str(refused.value) == (
            f"cannot write progress.json in {volume / 'bf'}: a trainer reading it tells the daemon there which batches "
            "it has consumed, without which the daemon deletes none and builds no further than its high-water mark: "
            f"{volume / 'bf'} is on a filesystem mounted read-only (at {volume}), where no user may write; mount it "
            "read-write (in a container: the volume without :ro)")
        assert not (job.buffer / "progress.json").exists() and not (job.buffer / "progress.json.lock").exists()


def test_a_progress_file_gone_under_a_waiting_loader_is_said_now_and_then_in_words(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Its tmpfs unmounted under it (`umount -l`), a waiting loader's progress.json was gone at every look: "names
    None, not this loader's position (0, 2)", once a second (a walk).  Now in words, every
    PROGRESS_WRITE_WARN_SECONDS at most."""
    writer = progress_file.ProgressFile(tmp_path, DEFAULT_CONSUMER, "job")
    try:
        writer.publish((0, 2), wait_share=None)
        with caplog.at_level(logging.WARNING, logger="prefetchd.trainer.progress_file"):
            for _ in range(20):  # the looks of a few seconds
                (tmp_path / "progress.json").unlink(missing_ok=True)
                assert writer.stale()
    finally:
        writer.release()
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"{tmp_path / 'progress.json'} is not there, or cannot be read: writing this loader's position, "
                    "epoch 0 step 2 again"], said
