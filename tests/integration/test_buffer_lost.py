"""The buffer changed under a running daemon by hand: removed, replaced, its lock or manifest deleted, a
directory made under a batch's name.  The daemon stops with one line where the buffer is no longer its
own, writes a deleted manifest again and says in its status what keeps a batch from being published."""

from __future__ import annotations

import ctypes
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from prefetchd.buffer_protocol import Manifest, read_status
from prefetchd.daemon.errors import EXIT_FAILURE
from prefetchd.trainer import BufferLoader

JOB = ["--batch-size", "8", "--image-size", "32", "--workers", "1", "--high-water", "3"]
STOPS = "stopping, since this daemon no longer owns what is there (another one may): start it again"


def remove(buffer: Path) -> str:
    shutil.rmtree(buffer)
    return "the buffer directory was removed"


def exchange(path: Path, other: Path) -> None:
    """Swap ``path`` and ``other`` at once (renameat2's RENAME_EXCHANGE): a rename away and a new entry after it
    let the daemon look in between, and it rightly said "removed" (a CI run)."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, os.fsencode(path), at_fdcwd, os.fsencode(other), rename_exchange) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno), str(path))


def replace(buffer: Path) -> str:
    new = buffer.with_name("new")
    new.mkdir()  # a new one where it was: another daemon could lock it
    exchange(buffer, new)
    return "the buffer directory was replaced by another"


def by_a_file(buffer: Path) -> str:
    """Was an internal error: the job inbox's look at job.json met NotADirectoryError, and the lock's own check
    took it for "cannot tell now" (a review)."""
    file = buffer.with_name("file")
    file.write_text("x")
    exchange(buffer, file)
    return "the buffer directory was replaced by a file"


def unlock(buffer: Path) -> str:
    (buffer / "daemon.lock").unlink()
    return "daemon.lock was removed"


@pytest.mark.parametrize("change", [remove, replace, by_a_file, unlock])
@pytest.mark.parametrize("serving", ["a job", "jobs"])
def test_a_buffer_that_is_no_longer_the_daemons_stops_it_in_one_line(
        shapes_data: Path, shm_dir: Path, tmp_path: Path, start_daemon: Callable[..., Any],
        change: Callable[[Path], str], serving: str) -> None:
    """It went on writing batches and status.json into a directory it no longer locked (a second daemon
    was let in, `prefetchd status` and `stop` no longer found it), or died of a FileNotFoundError with
    two tracebacks when the directory was removed.  Its metrics textfile said "filling" for good (a walk)."""
    buffer, textfile = shm_dir / "bf", tmp_path / "bf.prom"
    if serving == "a job":
        daemon = start_daemon(buffer, "--data", shapes_data / "train", *JOB, "--metrics-textfile", textfile)
        daemon.wait_until(lambda: (buffer / "e000000-s00000001.batch").exists(), 60, "batches")
    else:
        daemon = start_daemon(buffer, "--workers", "1", "--metrics-textfile", textfile)
        daemon.wait_until(lambda: "waiting for a job" in daemon.log, 60, "the daemon to wait for a job")
    said = change(buffer)
    assert daemon.wait_exit(30) == EXIT_FAILURE, daemon.log
    assert f"{buffer}: {said}; {STOPS}" in daemon.log and "Traceback" not in daemon.log, daemon.log
    if serving == "a job":
        assert f'prefetchd_state{{buffer="{buffer}",state="failed"}} 1.0' in textfile.read_text(), daemon.log
    if change is replace:
        assert not (buffer / "status.json").exists(), "it wrote into a buffer that is not its own"


def test_a_deleted_manifest_is_written_again(shapes_data: Path, shm_dir: Path,
                                             start_daemon: Callable[..., Any]) -> None:
    """A trainer starting after it was deleted waited its whole timeout to be told the daemon 'may still be
    indexing a large dataset'."""
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *JOB)
    daemon.wait_until(lambda: (buffer / "e000000-s00000000.batch").exists(), 60, "batches")
    job = Manifest.read(buffer)
    (buffer / "manifest.json").unlink()
    started = time.monotonic()
    loader = BufferLoader(buffer, normalize=False, timeout=30)
    assert time.monotonic() - started < 10 and loader.manifest.identity_diff(job) == []
    assert next(iter(loader)).step == 0
    assert "manifest.json was deleted while the daemon ran; writing it again" in daemon.log


def test_a_directory_under_a_batchs_name_is_named_in_the_status(shapes_data: Path, shm_dir: Path,
                                                               start_daemon: Callable[..., Any]) -> None:
    """The daemon retried it once a second for ever, logging each, while the status showed only a count."""
    buffer = shm_dir / "bf"
    planted = buffer / "e000000-s00000001.batch"
    planted.mkdir(parents=True)
    buffer.chmod(0o700)
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *JOB)
    daemon.wait_until(lambda: (s := read_status(buffer)) is not None and planted.name in s.message, 60,
                      "the status to name the directory")
    assert f"({planted} is a directory: remove it)" in str(read_status(buffer))
    time.sleep(3)  # three more tries
    planted.rmdir()
    daemon.wait_until(lambda: planted.is_file(), 60, "the batch once the name is free")
    assert daemon.log.count("could not publish") <= 2, daemon.log  # one line a few seconds, not one a second
