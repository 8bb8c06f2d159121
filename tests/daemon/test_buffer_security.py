"""The buffer directory is the daemon's own: created 0700 (2770 with --group-access), refused
when a link, another user's, or writable by others; temp files are never opened through a
name someone else put there."""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import prefetchd.cli as prefetchd_cli
from prefetchd.buffer_protocol import (DEFAULT_CONSUMER, BatchLayout, JobRequest, Manifest, Progress, SlotFiller, State,
                                       batch_name, list_batches, readable_status)
from prefetchd.buffer_protocol.batch import temp_name
from prefetchd.buffer_protocol import job_request
from prefetchd.buffer_protocol.job_request import MAX_RECORD_RENAME_SECONDS
from prefetchd.buffer_protocol.layout import (ACCEPTED_JOB_NAME, JOB_NAME, LOCK_NAME, MANIFEST_NAME, PROGRESS_NAME,
                                             STATUS_NAME)
from prefetchd.buffer_protocol.writer import create_exclusive
from prefetchd.daemon.errors import EXIT_USAGE, ConfigError
from prefetchd.daemon.buffer_dir import clear_buffer, let_group_read_files, make_stream_dir, prepare_buffer
from prefetchd.daemon.config import DaemonConfig
from prefetchd.daemon.job_inbox import JobInbox
from prefetchd.daemon.sampler import EpochOrders
from prefetchd.daemon.stream import Stream
from tests.as_nobody import as_nobody
from tests.conftest import Daemon
from tests.status_examples import state_of


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_new_buffer_is_the_owners_alone(shm_buffer: Path) -> None:
    old = os.umask(0)  # even a permissive umask does not open it up
    try:
        prepare_buffer(shm_buffer / "a" / "bf")
    finally:
        os.umask(old)
    assert _mode(shm_buffer / "a" / "bf") == 0o700


def test_a_buffer_on_a_read_only_mount_is_refused_as_such_not_as_its_permissions(shm_dir: Path) -> None:
    """A buffer folder on a tmpfs mounted ro was refused as "not writable by this user; fix its permissions", after a
    warning to chmod 700 it (a walk of filesystems): neither mends a read-only mount."""
    from tests.conftest import mounted_tmpfs

    with mounted_tmpfs(shm_dir / "ro", "size=1m,mode=0755") as mount:
        (mount / "bf").mkdir(mode=0o755)
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        with pytest.raises(ConfigError, match=rf"buffer directory {mount}/bf is on a read-only filesystem; remount it "
                                              rf"read-write \(`mount -o remount,rw {mount}`\)"):
            prepare_buffer(mount / "bf")


def test_group_access_is_setgid_group_rw(shm_buffer: Path) -> None:
    old = os.umask(0o077)  # nor does a strict one close it
    try:
        prepare_buffer(shm_buffer / "bf", group_access=True)
        os.close(make_stream_dir(shm_buffer / "bf" / "rank-00001", group_access=True))
    finally:
        os.umask(old)
    for path in (shm_buffer / "bf", shm_buffer / "bf" / "rank-00001"):
        assert _mode(path) & 0o777 == 0o770
        if os.geteuid() == 0:  # setgid needs membership of the directory's group, which root has
            assert _mode(path) & stat.S_ISGID


def test_an_existing_private_buffer_is_kept_and_opened_up_only_when_asked(shm_buffer: Path) -> None:
    buffer = shm_buffer / "bf"
    buffer.mkdir(mode=0o700)
    prepare_buffer(buffer)
    assert _mode(buffer) == 0o700
    prepare_buffer(buffer, group_access=True)
    assert _mode(buffer) & 0o777 == 0o770


@pytest.mark.parametrize(("mode", "group_access", "words", "fix"), [
    (0o777, False, "writable by every user", "`chmod 700 {buffer}`"),
    (0o770, False, "pass --group-access if that group's trainers should use it", "`chmod 700 {buffer}` if not, which "
     "locks them out"),
    # Sticky, as /dev/shm and /tmp are: a folder to make the buffer in, never to chmod.
    (0o1777, True, "is a folder every user shares", "such as --buffer {buffer}/bf"),
])
def test_buffers_others_can_write_are_refused(shm_buffer: Path, mode: int, group_access: bool, words: str,
                                              fix: str) -> None:
    buffer = shm_buffer / "bf"
    buffer.mkdir()
    os.chmod(buffer, mode)
    with pytest.raises(ConfigError, match=words) as info:
        prepare_buffer(buffer, group_access)
    assert str(buffer) in str(info.value) and fix.format(buffer=buffer) in str(info.value), info.value
    assert _mode(buffer) == mode  # refused, not silently changed
    # `prefetchd config` says what `start` refuses (a review: "configuration is valid", exit 0): exit 2 where every
    # user's start would refuse it, a note where another user's (a service's, passing --group-access) may not.
    checked = CliRunner().invoke(prefetchd_cli.main, ["config", "--buffer", str(buffer),
                                                      *(["--group-access"] if group_access else [])])
    assert words in checked.output and fix.format(buffer=buffer) in checked.output, checked.output
    group_writable = mode == 0o770
    assert checked.exit_code == (0 if group_writable else EXIT_USAGE), checked.output
    assert checked.output.startswith("configuration is valid, but") == group_writable, checked.output
    assert _mode(buffer) == mode


def test_a_group_writable_buffer_is_fine_with_group_access(shm_buffer: Path) -> None:
    buffer = shm_buffer / "bf"
    buffer.mkdir()
    os.chmod(buffer, 0o770)
    prepare_buffer(buffer, group_access=True)


def test_a_buffer_of_another_user_is_refused(shm_buffer: Path) -> None:
    if os.geteuid() == 0:
        buffer = shm_buffer / "bf"
        buffer.mkdir(mode=0o700)
        os.chown(buffer, 65534, 65534)
    else:
        buffer = Path("/")  # root's
    with pytest.raises(ConfigError, match="belongs to") as info:
        prepare_buffer(buffer)
    assert "another --buffer" in str(info.value)


def test_symlinks_are_refused_as_buffer_and_as_stream(shm_buffer: Path) -> None:
    real = shm_buffer / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, shm_buffer / "bf")
    with pytest.raises(ConfigError, match="symbolic link"):
        prepare_buffer(shm_buffer / "bf")
    checked = CliRunner().invoke(prefetchd_cli.main, ["config", "--buffer", str(shm_buffer / "bf")])
    assert checked.exit_code == EXIT_USAGE and f"buffer {shm_buffer / 'bf'} is a symbolic link" in checked.output, \
        checked.output
    buffer = shm_buffer / "bf2"
    prepare_buffer(buffer)
    os.symlink(real, buffer / "rank-00000")
    with pytest.raises(ConfigError, match="symbolic link"):
        make_stream_dir(buffer / "rank-00000", group_access=False)


def test_a_stream_directory_swapped_for_a_link_after_its_mkdir_is_not_chmodded_through(
        shm_buffer: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group member may rename entries of a --group-access buffer: one who swapped in a link between the
    stream directory's mkdir and its chmod (which follows links) had another folder of the daemon's user
    opened to the group (2770)."""
    private = shm_buffer / "private"
    private.mkdir(mode=0o700)
    buffer = shm_buffer / "bf"
    prepare_buffer(buffer, group_access=True)
    real_mkdir = os.mkdir

    def mkdir_then_swap(path: str | os.PathLike[str], mode: int = 0o777) -> None:
        real_mkdir(path, mode)
        os.rename(path, f"{os.fspath(path)}.moved")
        os.symlink(private, path)

    monkeypatch.setattr(os, "mkdir", mkdir_then_swap)
    with pytest.raises(ConfigError, match="symbolic link"):
        make_stream_dir(buffer / "rank-00001", group_access=True)
    monkeypatch.undo()
    assert _mode(private) == 0o700


@pytest.mark.parametrize("planted", ["symlink", "hardlink", "file"])
def test_batch_temp_files_are_created_not_reused(shm_buffer: Path, planted: str, caplog: pytest.LogCaptureFixture) -> None:
    victim = shm_buffer / "victim"
    victim.write_bytes(b"precious")
    tmp = shm_buffer / "e000000-s00000003.tmp"
    {"symlink": lambda: os.symlink(victim, tmp), "hardlink": lambda: os.link(victim, tmp),
     "file": lambda: tmp.write_bytes(b"planted")}[planted]()
    fd = create_exclusive(tmp)
    try:
        os.ftruncate(fd, 4096)  # what the controller does next
        os.pwrite(fd, b"batch", 0)
    finally:
        os.close(fd)
    assert victim.read_bytes() == b"precious"
    assert not tmp.is_symlink() and tmp.stat().st_size == 4096 and os.stat(tmp).st_nlink == 1
    assert "did not create it" in caplog.text


def test_the_cli_refuses_a_world_writable_buffer(shm_buffer: Path) -> None:
    buffer = shm_buffer / "bf"
    buffer.mkdir()
    os.chmod(buffer, 0o777)
    run = subprocess.run([sys.executable, "-m", "prefetchd", "start", "--buffer", str(buffer), "--data",
                          str(shm_buffer / "data")], capture_output=True, text=True, timeout=120)
    assert run.returncode == EXIT_USAGE, run.stderr
    assert "writable by every user" in run.stderr and f"chmod 700 {buffer}" in run.stderr
    assert not (buffer / "daemon.lock").exists()  # refused before touching it
    # submit too: it wrote job.json there, "waits until one starts", for a daemon that never takes it (a review)
    submitted = CliRunner().invoke(prefetchd_cli.main, ["submit", "--buffer", str(buffer), "--data",
                                                        str(shm_buffer / "data")])
    assert submitted.exit_code == EXIT_USAGE and "writable by every user" in submitted.output, submitted.output
    assert "(nothing written)" in submitted.output and list(buffer.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="gives the shared folder to another user, as /dev/shm is to one not root")
def test_a_folder_every_user_shares_is_refused_as_the_buffer_with_a_folder_of_its_own_to_use(shm_buffer: Path) -> None:
    """`--buffer /dev/shm` was refused with "`chmod 700 /dev/shm`, or remove it" (or, to a user who is not root,
    "remove it (or chown it)"): advice that breaks every other program's shared memory.  `start`, `config` and
    `submit` refuse it alike, before writing anything there."""
    shared = shm_buffer / "shm"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    os.chown(shared, 65534, 65534)  # someone else's, as /dev/shm is root's to everyone else
    before = os.stat(shared)
    said = f"buffer {shared} is a folder every user shares (mode 1777, as /dev/shm and /tmp are), not one the " \
           f"daemon can keep to itself: give it a folder of its own there, such as --buffer {shared / 'bf'}"
    run = subprocess.run([sys.executable, "-m", "prefetchd", "start", "--buffer", str(shared), "--data",
                          str(shm_buffer / "data")], capture_output=True, text=True, timeout=120)
    assert run.returncode == EXIT_USAGE and said in run.stderr, run.stderr
    assert "chmod" not in run.stderr and "remove it" not in run.stderr
    for command in ("config", "submit"):
        result = CliRunner().invoke(prefetchd_cli.main, [command, "--buffer", str(shared), "--data",
                                                         str(shm_buffer / "data")])
        assert result.exit_code == EXIT_USAGE and said in " ".join(result.output.split()), result.output
    after = os.stat(shared)
    assert list(shared.iterdir()) == [] and (after.st_mode, after.st_uid) == (before.st_mode, before.st_uid)


@pytest.mark.skipif(os.geteuid() != 0, reason="plays a trainer user, who makes the buffer, and the service's user")
def test_start_on_a_buffer_another_user_made_and_keeps_to_itself_names_its_owner(shm_buffer: Path) -> None:
    """`prefetchd submit` before the service first ran leaves /dev/shm/bf 0700, the trainer user's: `start` as
    the service's user said only click's "Path '...' is not readable" (exit 2), never whose it is or what to do."""
    os.chmod(shm_buffer, 0o755)
    buffer = shm_buffer / "bf"
    buffer.mkdir(mode=0o700)
    os.chown(buffer, 65533, 65533)
    data = shm_buffer / "data"
    data.mkdir(mode=0o755)

    def start() -> str:
        said: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("prefetchd").addHandler(handler)
        result = CliRunner().invoke(prefetchd_cli.main, ["start", "--buffer", str(buffer), "--data", str(data)])
        # `config` sized the job with the batches the buffer holds, which this user may not list.
        checked = CliRunner().invoke(prefetchd_cli.main, ["config", "--buffer", str(buffer), "--data", str(data)])
        return json.dumps({"code": result.exit_code, "output": result.output, "log": said,
                           "config": [checked.exit_code, checked.output, repr(checked.exception)]})

    # `start` imports the daemon lazily: imported here, so that the forked child need not read the interpreter's
    # files (as_nobody); the CLI no longer imports the producer (and multiprocessing) on its own.
    importlib.import_module("prefetchd.daemon.main")
    said = json.loads(as_nobody(start) or "{}")
    assert said.get("code") == EXIT_USAGE, said
    assert "not readable" not in said["output"], said
    # Valid values (exit 0), and what `start` by this user stops at: whose the buffer is.
    assert said["config"][0] == 0 and said["config"][1].startswith(
        f"configuration is valid, but this user may not use buffer {buffer}"), said
    assert "belongs to uid 65533" in said["config"][1], said
    assert any(f"buffer directory {buffer} belongs to uid 65533, not to nobody (uid 65534) who runs the daemon" in line
               and "ask uid 65533 or root to remove it" in line for line in said["log"]), said  # nobody may not
    # remove it (nor chown it): it said "remove it (or chown it)" (a review, in a sticky /dev/shm)
    assert sorted(os.listdir(buffer)) == []  # refused before touching it


def _private_folder(root: Path) -> Path:
    """A folder of the daemon's user outside the buffer, with what a buffer holds."""
    private = root / "private"
    (private / "rank-00000").mkdir(parents=True, mode=0o700)
    for name in ("e000000-s00000000.batch", "manifest.json", "progress.json", "progress.json.lock",
                 "rank-00000/e000000-s00000000.batch"):
        (private / name).write_bytes(b"precious")
    return private


def _stream(folder: Path, world_size: int, dir_fd: int) -> Stream:
    """A stream of rank 0 of ``world_size`` over 40 samples a rank, 5 steps of 8 an epoch, 2 epochs."""
    manifest = Manifest(dataset_root="/data", fingerprint="f", classes=["a"], num_samples=40 * world_size, split="all",
                        seed=0, batch_size=8, image_size=8, samples_per_epoch=40, steps_per_epoch=5, epochs=2,
                        producer="test", rank=0, world_size=world_size)
    return Stream(folder, manifest, EpochOrders(np.arange(40 * world_size), shuffle=False), high=4, low=2,
                  dir_fd=dir_fd)


def _contents(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_clearing_the_buffer_never_deletes_through_a_stream_folder_a_member_swapped_for_a_link(
        shm_buffer: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A group member may rename entries of a --group-access buffer: one who swapped a stream folder for a link
    to another folder of the daemon's user while the daemon cleared it had that folder's files deleted (the
    daemon went on by path).  Here the swap happens at the clear's first deletion: the folder being cleared
    and one not reached yet both become links; a member's own folder is left to them."""
    private = _private_folder(shm_buffer)
    before = _contents(private)
    buffer = shm_buffer / "bf"
    prepare_buffer(buffer, group_access=True)
    for rank in ("rank-00005", "rank-00006", "rank-00007"):
        os.close(make_stream_dir(buffer / rank, group_access=True))
        for step in range(3):
            (buffer / rank / f"e000000-s{step:08d}.batch").write_bytes(b"old job")
    if os.geteuid() == 0:  # a member's own folder (and its files) is theirs to clean
        for path in (buffer / "rank-00007", *(buffer / "rank-00007").iterdir()):
            os.chown(path, 65534, 65534)
    real_unlink = os.unlink
    swapped = []

    def unlink_then_swap(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> None:
        real_unlink(path, dir_fd=dir_fd)
        if not swapped:
            swapped.append(path)
            for rank in ("rank-00005", "rank-00006"):
                os.rename(buffer / rank, buffer / f"{rank}.moved")
                os.symlink(private, buffer / rank)

    monkeypatch.setattr(os, "unlink", unlink_then_swap)
    clear_buffer(buffer)
    monkeypatch.undo()
    assert swapped, "the clear deleted nothing"
    assert _contents(private) == before
    assert (buffer / "rank-00005").is_symlink() and (buffer / "rank-00006").is_symlink()
    if os.geteuid() == 0:
        assert len(list((buffer / "rank-00007").iterdir())) == 3
        assert "rank-00007 alone: it belongs to nobody" in caplog.text


def test_a_folder_put_in_a_stream_folder_is_logged_not_raised(shm_buffer: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A member's folder inside a stream folder of the daemon's keeps it from going; the clear goes on."""
    buffer = shm_buffer / "bf"
    prepare_buffer(buffer, group_access=True)
    os.close(make_stream_dir(buffer / "rank-00009", group_access=True))
    (buffer / "rank-00009" / "sub").mkdir()
    (buffer / "rank-00009" / "e000000-s00000000.batch").write_bytes(b"old job")
    (buffer / "e000000-s00000000.batch").write_bytes(b"old job")
    clear_buffer(buffer)
    assert os.listdir(buffer) == ["rank-00009"] and os.listdir(buffer / "rank-00009") == ["sub"]
    assert f"could not remove {buffer}/rank-00009" in caplog.text


def test_a_stream_folder_swapped_for_a_link_just_after_the_check_gets_no_file(
        shm_buffer: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller checks a stream's folder before it begins or publishes a batch (and each second), and
    stops once a member swapped it for a link; a swap landing just after the check used to have the batch's
    temp file, its fill, its publish, a spare's reuse and a manifest rewrite go by path into the folder the
    link leads to.  They go through the folder's fd now (the fill checks it opened the file begun), into the
    daemon's own folder wherever it was moved, and the link's folder gets nothing."""
    from tests.daemon.test_window import books

    private = _private_folder(shm_buffer)
    (private / "rank-00000" / "e000000-s00000001.batch").write_bytes(b"precious")  # a spare's reuse could land here
    (private / "rank-00000" / "progress.json").write_bytes(b"precious")  # read by path, it moved the window
    before = _contents(private)
    buffer = shm_buffer / "bf"
    prepare_buffer(buffer, group_access=True)
    folder, moved = buffer / "rank-00000", buffer / "moved"
    stream = _stream(folder, 2, make_stream_dir(folder, group_access=True))
    producer = books(buffer, stream)
    layout = BatchLayout.plan(8, 8, 8)

    def checked_then_swapped(self: Stream) -> None:
        if not moved.exists():
            os.rename(folder, moved)
            os.symlink(private / "rank-00000", folder)

    monkeypatch.setattr(Stream, "replaced", checked_then_swapped)
    assert producer._start_build(stream, 0, layout)
    task = producer.builds.queue.popleft()
    with pytest.raises(FileNotFoundError):  # a worker opens the temp file by its path, which leads elsewhere now
        SlotFiller(task.path, task.images_offset, task.slot_bytes, range(8), task.file_id)
    producer._publish(stream.building[0])
    assert sorted(os.listdir(moved)) == [batch_name(0, 0)]
    Progress(0, 0).write(moved)  # the trainer's, in the daemon's own folder wherever it was moved
    stream.read_progress()
    assert stream.consumers[DEFAULT_CONSUMER].document == Progress.read(moved) and not stream.progress_error
    assert stream.reconcile() == [] and 0 in stream.published
    os.unlink(moved / PROGRESS_NAME)
    producer.spares.retire(stream.published.pop(0), stream.fd)  # consumed: kept as a spare, as _read_progress does
    assert producer._start_build(stream, 1, layout)
    assert stream.building[1].pending.reused == producer.spares.enabled
    stream.manifest.write(stream.dir, stream.fd)  # as _check_buffer writes a deleted manifest again
    assert stream.holds(MANIFEST_NAME)
    assert sorted(os.listdir(moved)) == sorted([MANIFEST_NAME, temp_name(folder / batch_name(0, 1)).name])
    assert _contents(private) == before
    monkeypatch.undo()
    assert f"stream folder {folder} of rank 0 was replaced by a link to {private}" in (stream.replaced() or "")
    stream.close()


def test_a_replaced_buffer_that_is_its_ranks_stream_folder_is_said_as_the_buffers_loss(shm_buffer: Path) -> None:
    """Serving one rank, the stream folder is the buffer: which of the two checks saw the replacement first
    decided whether the daemon said the buffer was replaced or that a group member moved a stream folder
    away (fresh CI, `test_a_buffer_that_is_no_longer_the_daemons_stops_it_in_one_line[a job]`)."""
    from prefetchd.buffer_protocol.ownership import DaemonLock
    from tests.daemon.test_window import books

    buffer = shm_buffer / "bf"
    prepare_buffer(buffer)
    lock = DaemonLock(buffer)
    lock.acquire()
    stream = _stream(buffer, 1, make_stream_dir(buffer, group_access=False))
    producer = books(buffer, stream)
    producer.lock_lost = lock.lost
    os.rename(buffer, shm_buffer / "old")
    buffer.mkdir(mode=0o700)
    try:
        assert not producer._start_build(stream, 0, BatchLayout.plan(8, 8, 8))
        assert producer.fatal is not None and f"{buffer}: the buffer directory was replaced by another" in producer.fatal
        assert os.listdir(buffer) == []
    finally:
        stream.close()
        lock.release()


def test_the_batches_an_earlier_daemon_left_are_read_through_the_stream_folders_fd(shm_buffer: Path) -> None:
    """A group member may rename entries of a --group-access buffer: a stream folder swapped for a link to another
    folder of the daemon's user after the daemon opened it had the batches it found there read by path, through
    the link (``adopt_published``), and that folder's files decided which of them were kept: one there that was
    no batch, or none at all, had the daemon's deleted.  They are read through the folder's fd now, and a link
    planted under a batch's name before the daemon started is neither adopted nor followed."""
    from prefetchd.buffer_protocol import write_batch

    private = _private_folder(shm_buffer)
    before = _contents(private)
    buffer = shm_buffer / "bf"
    prepare_buffer(buffer, group_access=True)
    folder, moved = buffer / "rank-00000", buffer / "moved"
    fd = make_stream_dir(folder, group_access=True)
    images = np.zeros((8, 8, 8, 3), np.uint8)
    stream = _stream(folder, 2, fd)
    for step in (0, 1):  # what an earlier daemon of the same job left
        write_batch(folder / batch_name(0, step), images, np.zeros(8, np.int64), np.arange(8), epoch=0, step=step,
                    seed=0, producer="earlier", job=stream.manifest.job_key, rank=0)
    os.symlink(private / "e000000-s00000000.batch", folder / batch_name(0, 2))
    os.rename(folder, moved)
    os.symlink(private / "rank-00000", folder)
    try:
        stream.adopt_published()
        assert sorted(stream.published) == [0, 1]
        assert sorted(os.listdir(moved)) == [batch_name(0, 0), batch_name(0, 1), batch_name(0, 2)]
        assert (moved / batch_name(0, 2)).is_symlink()
        assert _contents(private) == before
    finally:
        stream.close()


def test_a_restart_builds_again_the_batches_left_that_are_not_its_streams(
        shm_buffer: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A member of a --group-access buffer's group may rename the daemon's batches while no daemon runs: another
    rank's over this rank's, one kept from an earlier job, one of another position.  A restart kept them as its own
    and published them to its trainers.  It builds them again now, with a warning that names each, and so it does
    the batches of an earlier prefetchd that name no stream (its manifests say that its batches do)."""
    from prefetchd.buffer_protocol import write_batch

    buffer = shm_buffer / "bf"
    prepare_buffer(buffer, group_access=True)
    folder = buffer / "rank-00000"
    stream = _stream(folder, 2, make_stream_dir(folder, group_access=True))
    ours = stream.manifest
    rank_1, earlier = dataclasses.replace(ours, rank=1), dataclasses.replace(ours, fingerprint="earlier")
    written = {0: (ours, 0), 1: (rank_1, 1), 2: (earlier, 2), 3: (ours, 4), 4: (None, 4)}  # step: as whose, at
    for step, (manifest, holds) in written.items():
        write_batch(folder / batch_name(0, step), np.zeros((8, 8, 8, 3), np.uint8), np.zeros(8, np.int64),
                    np.arange(8), epoch=0, step=holds, seed=0, producer="earlier",
                    job=None if manifest is None else manifest.job_key, rank=None if manifest is None else manifest.rank)
    try:
        with caplog.at_level(logging.INFO, logger="prefetchd.daemon.stream"):
            stream.adopt_published()
        assert sorted(stream.published) == [0]
        assert sorted(os.listdir(folder)) == [batch_name(0, 0)]
        for step, (manifest, holds) in list(written.items())[1:4]:
            assert (f"{folder / batch_name(0, step)} holds epoch 0 step {holds} of rank {manifest.rank} of job "
                    f"{manifest.job_key}, where its name says epoch 0 step {step} of rank 0 of job {ours.job_key}: "
                    "someone who may rename the buffer's files (a member of its group?) put it there; building it "
                    "again") in caplog.text
        assert ("building 1 kept batch of rank 0 again: written by a prefetchd before batches named their job and "
                "rank") in caplog.text
    finally:
        stream.close()


@pytest.mark.parametrize(("group_access", "mode"), [(True, 0o640), (False, 0o600)])
def test_a_daemon_under_umask_077_lets_its_group_read_with_group_access(
        shm_buffer: Path, shapes_data: Path, start_daemon: Callable[..., Daemon], group_access: bool,
        mode: int) -> None:
    """Started by hand under umask 077 (not the unit's UMask=0007), a --group-access daemon made its batches,
    manifest.json, status.json and daemon.lock 0600, which the group's trainers could not read.  Without
    --group-access they stay the daemon's user's alone."""
    buffer = shm_buffer / "bf"
    flags = ["--data", shapes_data / "train", "--batch-size", "4", "--image-size", "32", "--workers", "1",
             "--high-water", "2", *(["--group-access"] if group_access else [])]
    old = os.umask(0o077)  # the daemon inherits it
    try:
        daemon = start_daemon(buffer, *flags)
    finally:
        os.umask(old)
    daemon.wait_until(lambda: state_of(buffer) == State.FULL, 60, "a full buffer")
    written = [buffer / name for name in (LOCK_NAME, STATUS_NAME, MANIFEST_NAME)] + list(list_batches(buffer).values())
    assert {path.name: _mode(path) for path in written} == {path.name: mode for path in written}, daemon.log
    assert ("umask 0077 -> 0037" in daemon.log) == group_access, daemon.log


def test_the_record_of_an_accepted_job_an_earlier_daemon_left_0600_is_left_as_it_is_and_resumed(
        shm_buffer: Path) -> None:
    """Only the daemon reads job.accepted.json, and a chmod sets its ctime, by which a record renamed back is told
    (``JobRequest.recorded``): opened up to the group at start, it was refused, and the job not resumed."""
    buffer = shm_buffer / "bf"
    buffer.mkdir()
    os.close(JobRequest({"data": "/data/theirs", "batch_size": 4}, owner=os.geteuid()).record(buffer))
    (buffer / ACCEPTED_JOB_NAME).chmod(0o600)  # at once, as an earlier daemon's umask 077 left it
    time.sleep(MAX_RECORD_RENAME_SECONDS + 0.1)
    assert let_group_read_files(buffer) == 0
    assert _mode(buffer / ACCEPTED_JOB_NAME) == 0o600
    job = JobInbox(buffer, DaemonConfig(buffer=buffer), ignore_current=False).resumable()
    assert job is not None and str(job.data) == "/data/theirs"


def test_a_job_json_an_earlier_submit_left_0600_is_left_as_it_is_and_still_read(
        shm_buffer: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the daemon reads job.json, and a chmod sets its ctime, by which a request renamed back is told
    (``JobRequest.read``): opened up to the group at start, the request an older `prefetchd submit` of the daemon's
    user left 0600 was refused at the restarted daemon's first look as "put in place N s after it was written: an
    old request renamed back", also where the job it asked for was the one resumed."""
    monkeypatch.setattr(job_request, "MAX_JOB_RENAME_SECONDS", 1.0)  # 10 s: not worth waiting for here
    buffer = shm_buffer / "bf"
    buffer.mkdir()
    request = JobRequest({"data": "/data/mine", "batch_size": 4})
    request.write(buffer)
    (buffer / JOB_NAME).chmod(0o600)  # at once, as an older submit under umask 077 left it
    time.sleep(job_request.MAX_JOB_RENAME_SECONDS + 0.1)
    assert let_group_read_files(buffer) == 0
    assert _mode(buffer / JOB_NAME) == 0o600
    read = JobRequest.read(buffer)
    assert read is not None and read.job_id == request.job_id


def test_the_files_an_earlier_daemon_left_0600_are_opened_up_to_the_group_never_through_a_link(
        shm_buffer: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A --group-access daemon's start gives the group read on its own files at the buffer's top and in its rank
    folders that lack it (``let_group_read_files``, what the integration test runs with real users); a link to a
    file or to a folder is not followed, a file with a second name elsewhere is left and warned of, and (as root,
    which could chmod it) another user's file is left as it is."""
    buffer, elsewhere = shm_buffer / "bf", shm_buffer / "elsewhere"
    (buffer / "rank-00001").mkdir(parents=True)
    elsewhere.mkdir()
    closed = [buffer / "e000000-s00000000.batch", buffer / "rank-00001" / "e000000-s00000000.batch"]
    kept = [elsewhere / "private", elsewhere / "linked", buffer / "theirs"]
    for path in closed + kept:
        path.write_bytes(b"x")
        path.chmod(0o600)
    (buffer / "manifest.json").write_bytes(b"{}")
    (buffer / "manifest.json").chmod(0o644)  # has it already
    (buffer / "rank-00002").symlink_to(elsewhere)
    (buffer / "link").symlink_to(elsewhere / "private")
    os.link(elsewhere / "linked", buffer / "hard")
    if os.geteuid() == 0:
        os.chown(buffer / "theirs", 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="prefetchd.daemon.buffer_dir"):
        assert let_group_read_files(buffer) == 2
    assert [_mode(path) for path in closed] == [0o640, 0o640]
    assert [_mode(path) for path in kept] == [0o600, 0o600, 0o600]
    assert _mode(buffer / "manifest.json") == 0o644
    assert [r.getMessage() for r in caplog.records] == [
        f"leaving {buffer}/hard as it is (mode 0600): it has 2 names, so it is also a file elsewhere, whose mode is "
        "not the buffer's to set; remove it if it is none of the daemon's"]


def _immutable(path: Path, on: bool) -> None:
    subprocess.run(["chattr", "+i" if on else "-i", str(path)], check=True, capture_output=True)


@pytest.mark.parametrize("which", ["batch", STATUS_NAME])
def test_a_file_whose_mode_cannot_be_changed_is_left_with_a_warning_unless_the_daemon_replaces_it(
        shm_buffer: Path, shapes_data: Path, start_daemon: Callable[..., Daemon], which: str) -> None:
    """A --group-access daemon opens up to its group the files an earlier daemon left 0600; a file it may not chmod
    (an immutable one: EPERM) stopped its start with a traceback.  A batch is left as it is, with a warning naming
    it, and the daemon serves; status.json, which it replaces every second (and an immutable file refuses that
    too), stops the start with the file named and what to do."""
    probe = shm_buffer / "probe"
    probe.touch()
    if os.geteuid() != 0 or subprocess.run(["chattr", "+i", str(probe)], capture_output=True).returncode != 0:
        pytest.skip("needs root and a filesystem that takes chattr +i")
    _immutable(probe, False)
    buffer = shm_buffer / "bf"
    flags = ["--data", shapes_data / "train", "--batch-size", "4", "--image-size", "32", "--workers", "1",
             "--high-water", "2"]
    old = os.umask(0o077)  # the earlier daemon's files are 0600
    try:
        earlier = start_daemon(buffer, *flags)
    finally:
        os.umask(old)
    earlier.wait_until(lambda: state_of(buffer) == State.FULL, 60, "a full buffer")
    earlier.terminate()
    batches = sorted(list_batches(buffer).values())
    fixed = batches[0] if which == "batch" else buffer / which
    _immutable(fixed, True)
    try:
        daemon = start_daemon(buffer, *flags, "--group-access")
        refused = f"cannot give the group read access to {fixed} (mode 0600): Operation not permitted"
        if which == STATUS_NAME:
            assert daemon.wait_exit(60) == 1, daemon.log
            assert f"ERROR   prefetchd: {refused}. The daemon replaces that file as it runs" in daemon.log, daemon.log
            return
        daemon.wait_until(lambda: refused in daemon.log, 60, "the warning")
        daemon.wait_until(lambda: (s := readable_status(buffer)) is not None and s.pid == daemon.proc.pid
                          and s.state == State.FULL, 60, "a full buffer")
        assert f"WARNING prefetchd.daemon.buffer_dir: {refused}; the group's trainers cannot read it" in daemon.log
        assert _mode(fixed) == 0o600 and [_mode(path) for path in batches[1:]] == [0o640], daemon.log
        assert _mode(buffer / MANIFEST_NAME) & stat.S_IRGRP and daemon.proc.poll() is None, daemon.log
    finally:
        _immutable(fixed, False)


def test_a_buffer_under_a_folder_this_user_may_not_enter_is_said_not_a_traceback(shm_dir: Path) -> None:
    """`submit` and `config` asked whether the buffer existed, and Path.exists raised PermissionError where a folder
    above it may not be entered (/root, a home of mode 0700): a traceback, exit 1 (a walk as a non-root user)."""
    from prefetchd.access import no_access

    private = shm_dir / "private"
    private.mkdir(mode=0o700)
    shm_dir.chmod(0o755)
    for write in (True, False):
        said = as_nobody(lambda write=write: str(no_access(private / "bf", write=write)))
        assert said.startswith(("cannot create it: " if write else "") + f"{private}: permission denied: it belongs "
                               "to root (uid 0)"), said
