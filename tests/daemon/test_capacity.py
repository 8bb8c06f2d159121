"""check_capacity: a high-water mark the buffer's filesystem cannot hold is refused at start with
the numbers and the fix, instead of a SIGBUS when a mapped batch's pages cannot be allocated."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prefetchd.buffer_protocol import DaemonOwner, State, Status, batch_name, daemon_owner, read_status
from prefetchd.daemon.status_view import describe_status, format_status
from prefetchd.daemon.config import DaemonConfig, fill_defaults
from prefetchd.daemon.errors import ConfigError
from prefetchd.daemon.buffer_dir import check_capacity
from prefetchd.trainer import BufferLoader
from tests.conftest import mounted_tmpfs
from tests.status_examples import production_of, state_of

def config(buffer: Path, high_water: int, min_free_mb: int = 0) -> DaemonConfig:
    return DaemonConfig(buffer=buffer, batch_size=4, image_size=32, high_water=high_water, low_water=0,
                        min_free_mb=min_free_mb)


def free_bytes(path: Path) -> int:
    fs = os.statvfs(path)
    return fs.f_bavail * fs.f_frsize


def size_bytes(path: Path) -> int:
    fs = os.statvfs(path)
    return fs.f_blocks * fs.f_frsize


def test_a_high_water_mark_beyond_the_filesystem_is_refused_with_the_numbers(shm_buffer: Path) -> None:
    batch = config(shm_buffer, 1).batch_bytes
    too_many = size_bytes(shm_buffer) // batch + 1000
    with pytest.raises(ConfigError) as info:
        check_capacity(config(shm_buffer, too_many))
    message = str(info.value)
    assert f"high_water {too_many} x" in message and str(shm_buffer) in message
    fits = size_bytes(shm_buffer) // batch
    assert f"lower --high-water (at most {fits} fits), --batch-size or --min-free-mb, or enlarge the tmpfs" in message
    check_capacity(config(shm_buffer, 2))  # what fits is accepted


def test_the_floor_and_the_job_own_batches_count(small_tmpfs: Path) -> None:
    cfg = config(small_tmpfs, 1)
    fits = free_bytes(small_tmpfs) // cfg.batch_bytes
    assert fits >= 4, "the small tmpfs should hold a few batches"
    check_capacity(config(small_tmpfs, fits))
    with pytest.raises(ConfigError, match=f"high_water {fits + 1} x"):
        check_capacity(config(small_tmpfs, fits + 1))
    # The --min-free-mb floor is space the batches may not use: 1 MiB is the whole filesystem.
    with pytest.raises(ConfigError, match=r"plus the 1 MiB floor \(--min-free-mb\)") as info:
        check_capacity(config(small_tmpfs, 1, min_free_mb=1))
    assert f"(mount -o remount,size=... {small_tmpfs})" in str(info.value)  # its own mount, not /dev/shm
    # Told apart however close: it said "need 1 MiB but ... has 1 MiB", of batches of "0.0 MiB".
    said = re.search(r"x (.+) batches .* need (.+) but .* has (.+?);", str(info.value))
    assert said is not None and said[2] != said[3] and not said[1].startswith("0.0 "), info.value
    # Batches of the job already there (a restart) are space the mark will reuse, not space lost.
    for step in range(fits - 1):
        (small_tmpfs / batch_name(0, step)).write_bytes(b"\0" * cfg.batch_bytes)
    assert free_bytes(small_tmpfs) < 2 * cfg.batch_bytes
    check_capacity(config(small_tmpfs, fits))


def test_space_other_files_hold_now_is_warned_about_not_refused(small_tmpfs: Path) -> None:
    """A refusal is exit 2, which the systemd unit does not restart: a daemon restarted (after a crash, a
    watchdog kill) while someone else briefly filled the tmpfs stayed down, and its trainers lost it."""
    cfg = config(small_tmpfs, 1)
    fits = size_bytes(small_tmpfs) // cfg.batch_bytes - 1
    (small_tmpfs / "ballast").write_bytes(b"\1" * (free_bytes(small_tmpfs) - cfg.batch_bytes))
    short = check_capacity(config(small_tmpfs, fits))
    assert short is not None and f"high_water {fits} x" in short and "free now: other files hold the rest" in short
    assert "Production pauses whenever it would fall below the floor" in short
    assert check_capacity(config(small_tmpfs, 1)) is None


def test_a_daemon_restarted_on_a_briefly_full_tmpfs_waits_for_room(shm_dir: Path, shapes_data: Path,
                                                                  start_daemon) -> None:
    with mounted_tmpfs(shm_dir / "t4", "size=4m") as mount:
        buffer = mount / "bf"
        flags = ["--data", shapes_data / "train", "--batch-size", "4", "--image-size", "32", "--workers", "1",
                 "--high-water", "4", "--min-free-mb", "1"]
        ballast = mount / "ballast"
        ballast.write_bytes(b"\1" * (free_bytes(mount) - (256 << 10)))
        daemon = start_daemon(buffer, *flags)
        try:
            daemon.wait_until(lambda: state_of(buffer) == State.PAUSED_LOW_SPACE, 30, "a pause for space")
            assert daemon.proc.poll() is None, daemon.log
            ballast.unlink()
            daemon.wait_until(lambda: state_of(buffer) == State.FULL, 30, "a full buffer once there is room")
            with BufferLoader(buffer, normalize=False, timeout=30) as loader:
                assert next(iter(loader)).step == 0
        finally:
            daemon.terminate()  # before the tmpfs is unmounted


PAGE = 4096


def fill_leaving(mount: Path, pages: int) -> Path:
    """Fill ``mount`` to the last page, as `dd if=/dev/zero of=FILE bs=4k` does, then give ``pages`` back."""
    filler = mount / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with contextlib.suppress(OSError):  # ENOSPC: full
            while True:
                os.write(fd, b"\1" * PAGE)
        os.ftruncate(fd, os.fstat(fd).st_size - pages * PAGE)
    finally:
        os.close(fd)
    assert free_bytes(mount) == pages * PAGE, free_bytes(mount)
    return filler


def fill_then_stop(start_daemon, buffer: Path, flags: list, stop: str) -> None:
    """A first daemon fills ``buffer`` to its high-water mark and is stopped with the signal ``stop``."""
    first = start_daemon(buffer, *flags)
    try:
        first.wait_until(lambda: state_of(buffer) == State.FULL, 30, "a full buffer")
    finally:
        first.proc.send_signal(getattr(signal, stop))
        first.wait_exit()


@pytest.mark.parametrize("stop, pages", [("SIGTERM", 0), ("SIGTERM", 1), ("SIGKILL", 0)])
def test_a_daemon_restarted_on_a_full_tmpfs_comes_back_once_there_is_room(
        shm_dir: Path, shapes_data: Path, start_daemon, stop: str, pages: int) -> None:
    """README: "a daemon restarted while the tmpfs is briefly full comes back".  It crashed with a traceback:
    stopped cleanly, the daemon had emptied daemon.lock, so the next one had no page to write its pid in; killed,
    the next one had none for its manifest.  Now the lock keeps its page, and the manifest waits for room."""
    with mounted_tmpfs(shm_dir / "t4", "size=4m") as mount:
        buffer = mount / "bf"
        flags = ["--data", shapes_data / "train", "--batch-size", "4", "--image-size", "32", "--workers", "1",
                 "--high-water", "4", "--min-free-mb", "1", "--epochs", "1"]
        fill_then_stop(start_daemon, buffer, flags, stop)
        filler = fill_leaving(mount, pages)
        again = start_daemon(buffer, *flags)
        try:
            if pages:  # room for its documents, one page at a time: it starts, paused at the floor
                again.wait_until(lambda: own_status(buffer, again) is not None, 30, "its first status")
            else:  # no room even for its manifest: it waits, says so in its log and in its status
                again.wait_until(lambda: "waiting for room: " in again.log, 30, "the wait for room")
                assert f"waiting for room: no room to write {buffer / 'manifest.json'} (No space left on device; " \
                       "0 bytes free on its filesystem)" in again.log, again.log
                again.wait_until(lambda: (status := own_status(buffer, again)) is not None
                                 and status.state == State.PAUSED_LOW_SPACE, 10, "its status of the wait")
                shown = format_status(describe_status(buffer))
                assert f"running (pid {again.proc.pid}), state paused-low-space" in shown, shown
                assert f"note      waiting for room: no room to write {buffer / 'manifest.json'}" in shown, shown
                assert "status.json is the one an earlier daemon" not in shown, shown
            time.sleep(2)  # as long again: it waits, it does not exit
            assert again.proc.poll() is None and "Traceback" not in again.log, again.log
            filler.unlink()
            again.wait_until(lambda: (status := own_status(buffer, again)) is not None and status.state == State.FULL,
                             30, "a full buffer once there is room")
            with BufferLoader(buffer, normalize=False, timeout=30) as loader:
                batches = list(loader)
            assert [b.step for b in batches] == list(range(len(loader))), [b.step for b in batches]
            seen = sorted(i for b in batches for i in b.indices.tolist())
            assert seen == list(range(len(seen))) and len(seen) == 72  # every sample of the epoch, once
            assert again.wait_exit() == 0, again.log  # its one epoch read
        finally:
            again.terminate()  # before the tmpfs is unmounted


STALL = 3.0  # the waiting loader's stall_timeout: well under how long the test keeps the tmpfs full


def test_a_trainer_waiting_on_a_daemon_restarted_on_a_full_tmpfs_sees_it_wait_for_room(
        shm_dir: Path, shapes_data: Path, start_daemon) -> None:
    """A daemon restarted while the tmpfs has no page free (a crash, then systemd) waits for room, and is healthy.
    It could not replace status.json, so the earlier daemon's stayed there: its pid was not the lock's, so its
    mtime heartbeat was not the new daemon's either, and a trainer waiting for a batch raised DaemonStuck after its
    stall_timeout.  Now the status is written over the earlier one's, in its pages: the new pid, paused for space."""
    with mounted_tmpfs(shm_dir / "t8", "size=8m") as mount:
        buffer = mount / "bf"
        flags = ["--data", shapes_data / "train", "--batch-size", "4", "--image-size", "32", "--workers", "1",
                 "--high-water", "4", "--min-free-mb", "1", "--epochs", "1"]
        fill_then_stop(start_daemon, buffer, flags, "SIGKILL")
        filler = fill_leaving(mount, 0)
        again = start_daemon(buffer, *flags)
        seen: list[tuple[Status | None, DaemonOwner | None, float]] = []

        def look_then_free() -> None:
            """What a trainer's liveness check reads while it waits past its stall bound; then room is made."""
            time.sleep(3 * STALL)
            status = read_status(buffer)
            seen.append((status, daemon_owner(buffer, status), time.time()))
            filler.unlink()

        freeing = threading.Thread(target=look_then_free)
        try:
            again.wait_until(lambda: "waiting for room: " in again.log, 30, "the wait for room")
            with BufferLoader(buffer, normalize=False, timeout=60, stall_timeout=STALL) as loader:
                batches = iter(loader)
                steps = [next(batches).step for _ in range(4)]  # the earlier daemon's, still there
                freeing.start()
                began = time.monotonic()
                steps.append(next(batches).step)  # the new daemon's first: built once there is room
                waited = time.monotonic() - began
            freeing.join()
            assert steps == [0, 1, 2, 3, 4] and waited >= 3 * STALL, (steps, waited)
            [(status, owner, looked)] = seen
            assert owner is not None and owner.pid == again.proc.pid, (owner, again.proc.pid)
            assert status is not None and owner.wrote(status), status  # its own heartbeat, not the earlier daemon's
            assert status.state == State.PAUSED_LOW_SPACE, status
            assert status.message.startswith(f"waiting for room: no room to write {buffer / 'manifest.json'}"), status
            assert looked - status.heartbeat < STALL, (looked, status)  # beating, about once a second
        finally:
            if freeing.is_alive():
                freeing.join()
            filler.unlink(missing_ok=True)
            again.terminate()  # before the tmpfs is unmounted


def many_classes(root: Path, images: Path, classes: int) -> Path:
    """A class-folder dataset of ``classes`` classes of one image each, from ``images``, whose long class names
    make its manifest span several pages, as ImageNet's 1000 make one of 20 KiB."""
    files = sorted(p for p in images.rglob("*") if p.is_file())[:classes]
    for i, image in enumerate(files):
        folder = root / f"{i:03d}-{'x' * 240}"
        folder.mkdir(parents=True)
        shutil.copyfile(image, folder / image.name)
    return root


def test_a_daemon_restarted_on_a_full_tmpfs_frees_what_its_trainer_reads_and_goes_on(
        shm_dir: Path, shapes_data: Path, tmp_path: Path, start_daemon) -> None:
    """A daemon restarted on a tmpfs that something else filled, up to a page or two (room for a trainer's
    progress.json, none for the new daemon's manifest of several), deleted no batch until it had written its
    manifest: the trainer read the batches the earlier daemon left, which freed nothing, and then waited on the
    daemon, which waited for room, until the loader's timeout.  Now the daemon deletes what the trainer consumes
    while it waits, and that is the room: the trainer reads its epoch to the end, each batch once, the tmpfs
    full all along."""
    data = many_classes(tmp_path / "many-classes", shapes_data / "train", 64)
    with mounted_tmpfs(shm_dir / "t8", "size=8m") as mount:
        buffer = mount / "bf"
        flags = ["--data", data, "--batch-size", "4", "--image-size", "32", "--workers", "1",
                 "--high-water", "4", "--min-free-mb", "0", "--epochs", "1"]
        fill_then_stop(start_daemon, buffer, flags, "SIGKILL")
        pages = 2
        assert (buffer / "manifest.json").stat().st_size > 2 * pages * PAGE  # a new one cannot fit what is free
        filler = fill_leaving(mount, pages)
        again = start_daemon(buffer, *flags)
        try:
            again.wait_until(lambda: "waiting for room: " in again.log, 30, "the wait for room")
            read: list[tuple[int, list[int]]] = []
            with BufferLoader(buffer, normalize=False, timeout=20) as loader:
                for batch in loader:  # past the 4 the earlier daemon left: those the new one builds
                    read.append((batch.step, batch.indices.tolist()))
                    del batch  # unmapped: the pages of a batch the daemon deleted go back to the tmpfs
                steps = len(loader)
            assert [step for step, _ in read] == list(range(steps)) and steps == 16, read
            seen = sorted(i for _, indices in read for i in indices)
            assert seen == list(range(64)), seen  # every sample of the epoch, once
            assert f"wrote {buffer / 'manifest.json'} after waiting" in again.log, again.log
            assert filler.exists() and again.wait_exit() == 0, again.log  # its one epoch read
        finally:
            again.terminate()  # before the tmpfs is unmounted


def own_status(buffer: Path, daemon) -> Status | None:
    """``buffer``'s status where ``daemon`` wrote it, not an earlier daemon."""
    status = read_status(buffer)
    return status if status is not None and status.pid == daemon.proc.pid else None


def test_the_defaults_fit_a_64_mib_tmpfs(shm_dir: Path) -> None:
    """Docker's /dev/shm is 64 MiB: the default floor and high-water mark must fit it, at the
    default batch (128 x 224 px, 18.4 MiB)."""
    with mounted_tmpfs(shm_dir / "docker-shm", "size=64m") as mount:
        filled, notes = fill_defaults(DaemonConfig(buffer=mount / "bf"))
        (mount / "bf").mkdir()
        check_capacity(filled)
        assert filled.min_free_mb == 6 and filled.high_water == 2
        # Each note says the rule that gave the value: it said "at most half the free tmpfs" of 2 batches that
        # are more than half, and left the floor of 6 to be worked out from the whole rule.
        assert ("min_free_mb = 6 (10% of the buffer's 64.0 MiB filesystem: under 640 MiB, 64 MiB would be most of "
                "it)") in notes, notes
        assert ("high_water = 2 (batches of 18.4 MiB: the least a default is, though half the free tmpfs above the "
                "--min-free-mb floor holds 1 batch)") in notes, notes


def test_a_refusal_names_what_fits(shm_dir: Path) -> None:
    """"lower --high-water" was the first fix named for a batch of which not one fits (--batch-size 512 at 224 px
    on Docker's 64 MiB /dev/shm), where the mark was the default, which no flag had set."""
    with mounted_tmpfs(shm_dir / "docker-shm", "size=64m") as mount:
        cfg, _notes = fill_defaults(DaemonConfig(buffer=mount / "bf", batch_size=512, image_size=224))
        assert cfg.high_water == 2
        with pytest.raises(ConfigError) as info:
            check_capacity(cfg)
        message = str(info.value)
        assert ("high_water 2 x 73.5 MiB batches plus the 6 MiB floor (--min-free-mb) need 153.0 MiB but "
                f"{mount / 'bf'} has 64.0 MiB; not one batch of 73.5 MiB fits: lower --batch-size (at most 201 fits "
                "high_water 2 at 224 px), --image-size or --min-free-mb, or enlarge the tmpfs") in message, message
        assert check_capacity(dataclasses.replace(cfg, batch_size=201)) is None
        with pytest.raises(ConfigError):
            check_capacity(dataclasses.replace(cfg, batch_size=202))
        # Where a lower mark fits, the one that does is named.
        with pytest.raises(ConfigError, match=r"lower --high-water \(at most 1 fits\), --batch-size"):
            check_capacity(dataclasses.replace(cfg, batch_size=256))
        assert check_capacity(dataclasses.replace(cfg, batch_size=256, high_water=1, low_water=0)) is None
        # A cap larger than the mark's batches is what needs the room, and the one named.
        with pytest.raises(ConfigError) as info:
            check_capacity(dataclasses.replace(cfg, batch_size=4, max_buffer_bytes=100 << 20))
        assert str(info.value).startswith(f"--max-buffer-bytes {100 << 20} plus the 6 MiB floor"), info.value
        assert "lower --max-buffer-bytes or --min-free-mb" in str(info.value)
        # Another file takes the room one batch needs now: a warning, and its fix reads as one.
        (mount / "ballast").write_bytes(b"\1" * (40 << 20))
        short = check_capacity(dataclasses.replace(cfg, batch_size=128))
        assert short is not None and re.search(r"has 24\.0 MiB free now: .*; free that space, or lower --batch-size "
                                               r"\(at most \d+ fits high_water 2 at 224 px\)", short), short


@pytest.mark.parametrize("world_size, high", [(2, 3), (4, 2)])
def test_the_default_high_water_mark_is_shared_by_the_ranks(shm_dir: Path, world_size: int, high: int) -> None:
    """The mark is each rank's: sized as if one rank had the tmpfs, it was refused by the daemon that chose it
    ("4 ranks x high_water 6 x 4.6 MiB batches ... need 116.5 MiB but ... has 64.0 MiB; lower --high-water")."""
    with mounted_tmpfs(shm_dir / "docker-shm", "size=64m") as mount:
        cfg = DaemonConfig(buffer=mount / "bf", batch_size=32, image_size=224, world_size=world_size)
        filled, notes = fill_defaults(cfg)
        assert filled.high_water == high, notes
        assert f"high_water = {high} (batches of 4.6 MiB for each of {world_size} ranks: " in " ".join(notes)
        assert check_capacity(filled) is None


def test_a_restart_sizes_the_high_water_mark_its_start_did(shm_dir: Path) -> None:
    """The buffer's own batches are its room.  Counted as used, a daemon restarted on a 64 MiB tmpfs sized a
    mark of 3 where its start had sized 6, and deleted 3 of the batches it found ("beyond --high-water 3")."""
    with mounted_tmpfs(shm_dir / "docker-shm", "size=64m") as mount:
        cfg = DaemonConfig(buffer=mount / "bf", batch_size=32, image_size=224)
        first, _notes = fill_defaults(cfg)
        assert first.high_water == 6
        (mount / "bf").mkdir()
        for step in range(first.high_water):  # what the first daemon leaves
            (mount / "bf" / batch_name(0, step)).write_bytes(b"\0" * cfg.batch_bytes)
        again, notes = fill_defaults(cfg)
        assert (again.high_water, again.low_water) == (first.high_water, first.low_water), notes
        assert check_capacity(again) is None
        # Only the buffer owner's files, by their pages: a member's sparse file under a batch's name is no room.
        planted = mount / "bf" / batch_name(1, 0)
        with open(planted, "wb") as f:
            f.truncate(1 << 40)
        os.chown(planted, 65534, 65534)
        assert fill_defaults(cfg)[0].high_water == first.high_water
        os.chown(planted, os.geteuid(), os.getegid())  # the daemon's own, yet sparse: its pages count, not its size
        assert fill_defaults(cfg)[0].high_water == first.high_water


JSON_ROOM = 24 << 10  # manifest, status and progress documents (20 KiB measured), and a page to spare


def test_spares_count_as_room_on_a_tmpfs_sized_for_the_high_water_mark(
        small_tmpfs: Path, shapes_data: Path, start_daemon) -> None:
    """A consumed batch kept as a spare is space the next batch reuses: a tmpfs with room for the
    high-water mark and half a batch more must not pause production as if it were full."""
    batch = config(small_tmpfs, 1).batch_bytes
    high = 8
    (small_tmpfs / "ballast").write_bytes(b"\1" * (free_bytes(small_tmpfs) - high * batch - batch // 2 - JSON_ROOM))
    buffer = small_tmpfs / "bf"
    # --low-water one below the mark: every consumed batch is replaced at once, in its spare.
    daemon = start_daemon(buffer, "--data", shapes_data / "train", "--batch-size", "4", "--image-size", "32",
                          "--workers", "1", "--seed", "1", "--high-water", high, "--low-water", high - 1,
                          "--min-free-mb", "0", "--epochs", "2")
    loader = BufferLoader(buffer, normalize=False, timeout=30)
    steps, states = 0, set()
    try:
        for _epoch in range(2):
            for _batch in loader:
                steps += 1
                time.sleep(0.05)  # slower than the daemon: the buffer stays at the mark
                states.add(state_of(buffer))
        pauses = production_of(buffer)
    finally:
        loader.close()
        daemon.terminate()  # before the tmpfs is unmounted
    assert steps == 2 * len(loader)
    assert State.PAUSED_LOW_SPACE not in states and pauses is not None and pauses.errors.low_space_pauses == 0, \
        (states, daemon.log)


def test_a_pause_for_space_and_the_resumption_are_both_logged(shm_dir: Path, shapes_data: Path, start_daemon) -> None:
    with mounted_tmpfs(shm_dir / "t8", "size=8m") as mount:
        buffer = mount / "bf"
        daemon = start_daemon(buffer, "--data", shapes_data / "train", "--batch-size", "4", "--image-size", "32",
                              "--workers", "1", "--high-water", "4", "--low-water", "3", "--min-free-mb", "2")
        try:
            daemon.wait_until(lambda: state_of(buffer) == State.FULL, 30, "a full buffer")
            ballast = mount / "ballast"
            ballast.write_bytes(b"\1" * (free_bytes(mount) - (1 << 20)))  # 1 MiB left: below the 2 MiB floor
            loader = BufferLoader(buffer, normalize=False, timeout=30)
            batches = iter(loader)
            next(batches), next(batches)  # two consumed: below the low-water mark, a build is due
            daemon.wait_until(lambda: state_of(buffer) == State.PAUSED_LOW_SPACE, 30, "a pause for space")
            assert "paused: " in daemon.log and "resumed: " not in daemon.log
            # Under a MiB in the unit that shows it: it said "would fall to 0 MiB free".
            assert re.search(r"would fall to (\d+ bytes|[\d.]+ KiB) free, below the floor of 2 MiB", daemon.log), daemon.log
            # Something else takes the last MiB: the status cannot be rewritten, and `prefetchd status` says so.
            assert "filesystem is full" not in format_status(describe_status(buffer))
            rest = mount / "rest"
            with contextlib.suppress(OSError):
                rest.write_bytes(b"\1" * free_bytes(mount))
            assert re.search(r"the buffer's filesystem is full \((\d+ bytes?|[\d.]+ KiB) free\): the daemon (can build "
                             r"no batch|can build a batch only in the file of a consumed one it kept \(\d+ now\)), and "
                             "rewrites its status only within the pages status.json has",
                             format_status(describe_status(buffer)))
            rest.unlink()
            ballast.unlink()
            daemon.wait_until(lambda: "resumed: " in daemon.log, 30, "the resumption")
            assert f"resumed: {buffer} has room again above the floor of 2 MiB" in daemon.log
            next(batches)
            loader.close()
        finally:
            daemon.terminate()  # before the tmpfs is unmounted


def test_a_full_filesystem_is_said_with_the_consumed_batch_files_kept_to_build_in(shm_dir: Path) -> None:
    """With the tmpfs full, status said "the daemon can build no batch" while it built one in a consumed batch's
    file for each a trainer read, and its memory line left those files out (a user's walk)."""
    from prefetchd.buffer_protocol import DaemonLock
    from prefetchd.buffer_protocol.layout import spare_name

    with mounted_tmpfs(shm_dir / "t1", "size=1m") as mount:
        buffer = mount / "bf"
        buffer.mkdir()
        lock = DaemonLock(buffer)
        lock.acquire()  # this test process plays the daemon
        try:
            for spares in (0, 2):
                for n in range(spares):
                    (buffer / spare_name(n)).write_bytes(b"\1" * 65536)
                with contextlib.suppress(OSError):
                    (mount / "rest").write_bytes(b"\1" * free_bytes(mount))
                said = " ".join(format_status(describe_status(buffer)).split())
                builds = ("can build a batch only in the file of a consumed one it kept (2 now), and" if spares
                          else "can build no batch, and")
                assert f"the daemon {builds} rewrites its status" in said, said
                (mount / "rest").unlink()
        finally:
            lock.release()


@contextlib.contextmanager
def _full_then_below_the_floor(shm_dir: Path, shapes_data: Path, start_daemon: Any, high_water: int,
                               batches_short: float) -> Iterator[tuple[Path, Any, Path]]:
    """A daemon of 2 epochs on an 8 MiB tmpfs of its own, with a 2 MiB floor; once its buffer is full, a file that
    takes the tmpfs ``batches_short`` batches below the floor: (its buffer, the daemon, that file)."""
    with mounted_tmpfs(shm_dir / "t8", "size=8m") as mount:
        buffer = mount / "bf"
        batch = DaemonConfig(buffer=buffer, batch_size=4, image_size=64).batch_bytes
        daemon = start_daemon(buffer, "--data", shapes_data / "train", "--batch-size", "4", "--image-size", "64",
                              "--workers", "1", "--high-water", str(high_water), "--min-free-mb", "2", "--epochs", "2")
        try:
            daemon.wait_until(lambda: state_of(buffer) == State.FULL, 30, "a full buffer")
            ballast = mount / "ballast"
            ballast.write_bytes(b"\1" * (free_bytes(mount) - (2 << 20) + int(batch * batches_short)))
            yield buffer, daemon, ballast
        finally:
            daemon.terminate()  # before the tmpfs is unmounted


def test_one_shortage_is_one_pause_while_batches_are_built_in_spares(shm_dir: Path, shapes_data: Path,
                                                                     start_daemon) -> None:
    """Below the floor, a batch the trainer consumed leaves its file (a spare) to build the next one in, which takes
    no new space: the trainer is fed while the tmpfs stays as full.  Each such build ended the pause: the log said
    "resumed: ... has room again above the floor" then "paused" in the same millisecond for every batch read, and
    errors.low_space_pauses counted one shortage many times."""
    # 2.5 batches short of the floor, as in the report.
    with _full_then_below_the_floor(shm_dir, shapes_data, start_daemon, 8, 2.5) as (buffer, daemon, ballast):
        steps: list[tuple[int, int]] = []
        seen: list[list[int]] = []
        with BufferLoader(buffer, normalize=False, timeout=30) as loader:
            for epoch in range(2):
                seen.append([])
                for b in loader:
                    steps.append((b.epoch, b.step))
                    seen[-1] += b.indices.tolist()
                    time.sleep(0.05)
                if epoch == 0:  # a whole epoch read below the floor: built in spares, one pause
                    # As the status says it at its next rewrite (once a second): the epoch may take less.
                    daemon.wait_until(lambda: (p := production_of(buffer)) is not None
                                      and p.progress.epoch == 1, 10, "a status of the epoch read")
                    production = production_of(buffer)
                    assert production is not None and production.errors.low_space_pauses == 1, daemon.log
                    assert daemon.log.count("paused: ") == 1 and "resumed: " not in daemon.log, daemon.log
                    ballast.unlink()
                    daemon.wait_until(lambda: "resumed: " in daemon.log, 30, "the resumption")
                    assert re.search(rf"resumed: {re.escape(str(buffer))} has room again above the floor of "
                                     r"2 MiB \([\d.]+ MiB free\)", daemon.log), daemon.log
        assert steps == [(e, s) for e in range(2) for s in range(len(loader))], steps  # every batch, once
        assert all(sorted(indices) == list(range(72)) for indices in seen)
        production = production_of(buffer)
        assert production is not None and production.errors.low_space_pauses == 1, daemon.log
        assert daemon.log.count("paused: ") == 1 and daemon.log.count("resumed: ") == 1, daemon.log


def test_below_the_floor_by_more_than_the_spares_a_trainer_is_still_fed_from_them(shm_dir: Path, shapes_data: Path,
                                                                                  start_daemon) -> None:
    """Another file took the tmpfs 10 batches below the floor, and the cap (high-water 2) keeps 2 spares: counted
    only as room, they never made up the shortfall, and the trainer got no batch until its timeout (or, nearer the
    floor, one per second, a walk).  A batch built in a spare takes no new page, so each one read is built again."""
    with _full_then_below_the_floor(shm_dir, shapes_data, start_daemon, 2, 10) as (buffer, daemon, _):
        batch = DaemonConfig(buffer=buffer, batch_size=4, image_size=64).batch_bytes
        steps: list[tuple[int, int]] = []
        with BufferLoader(buffer, normalize=False, timeout=30) as loader:
            for epoch in range(2):
                steps += [(b.epoch, b.step) for b in loader]
        assert steps == [(e, s) for e in range(2) for s in range(len(loader))], steps  # every batch, once
        assert free_bytes(buffer.parent) < (2 << 20) - 9 * batch, "the daemon took pages below the floor"
        production = production_of(buffer)
        assert production is not None and production.errors.low_space_pauses == 1, daemon.log
        assert daemon.log.count("paused: ") == 1 and "resumed: " not in daemon.log, daemon.log


@pytest.mark.parametrize(("ballast_mib", "advice"), [
    (5, r"other files hold 5\.\d MiB of the filesystem's 8\.0 MiB, this daemon's batches only [\d.]+ (KiB|MiB): "
        r"free those files \(`df -h \S+` names the filesystem\), and production resumes by itself$"),
    (2, r"this daemon's batches would hold [34]\.\d MiB of the filesystem's 8\.0 MiB, other files 2\.\d MiB: free "
        r"space there or lower --high-water$"),
    # All but 40 pages: less than a batch free, which the message clamped to 0 and gave the daemon the batch it had
    # not built ("this daemon's batches only 196.0 KiB" with none in the buffer), the other files less than theirs.
    (None, r"other files hold 7\.[89] MiB of the filesystem's 8\.0 MiB, this daemon's batches none yet: free those "
           r"files"),
])
def test_a_pause_for_space_advises_what_took_it(shm_dir: Path, shapes_data: Path, start_daemon,
                                                ballast_mib: int | None, advice: str) -> None:
    """The pause said "free space there or lower --high-water" also where another process's file took most of the
    tmpfs beside a few batches: lowering the mark frees little there.  It says whose the space is, and advises
    lowering the mark only where the daemon's batches hold most of it."""
    with mounted_tmpfs(shm_dir / "t8", "size=8m") as mount:
        (mount / "ballast").write_bytes(b"\1" * (free_bytes(mount) - 40 * 4096 if ballast_mib is None else
                                                 ballast_mib << 20))
        buffer = mount / "bf"
        # 24 batches of 204 KiB (4.8 MiB) and the 2 MiB floor fit 8 MiB: the start warns of the ballast, not refuses.
        daemon = start_daemon(buffer, "--data", shapes_data / "train", "--batch-size", "4", "--image-size", "128",
                              "--workers", "1", "--high-water", "24", "--min-free-mb", "2")
        try:
            daemon.wait_until(lambda: state_of(buffer) == State.PAUSED_LOW_SPACE, 60, "a pause for space")
            paused = re.search(r"paused: .*", daemon.log)
            assert paused is not None and re.search(advice, paused[0]), daemon.log
            status = read_status(buffer)
            assert status is not None and status.message.startswith("paused: "), status
            assert re.search(advice, status.message), status.message
        finally:
            daemon.terminate()  # before the tmpfs is unmounted


def test_a_pause_for_space_another_daemon_took_names_its_buffer(shm_dir: Path, shapes_data: Path, start_daemon) -> None:
    """"free those files" sent users to delete the batches of the other daemons sharing the tmpfs (a walk)."""
    with mounted_tmpfs(shm_dir / "t8", "size=8m") as mount:
        flags = ["--data", str(shapes_data / "train"), "--batch-size", "4", "--image-size", "128", "--workers", "1",
                 "--min-free-mb", "2"]
        first = start_daemon(mount / "first", *flags, "--high-water", "24")
        second = None
        try:
            first.wait_until(lambda: state_of(mount / "first") == State.FULL, 60, "a full buffer")
            second = start_daemon(mount / "team" / "second", *flags, "--high-water", "8")
            second.wait_until(lambda: "paused: " in second.log, 60, "a pause for space")
            paused = re.search(r"paused: .*", second.log)
            assert paused is not None and (
                f"free those files (among them the buffers of other prefetchd daemons: {mount / 'first'}: lower their "
                "--high-water or --max-buffer-bytes) (`df -h" in paused[0]), paused[0]
        finally:
            for daemon in (second, first):  # before the tmpfs is unmounted
                if daemon is not None:
                    daemon.terminate()


def test_the_status_counts_the_bytes_of_each_batch_file(shm_buffer: Path, shapes_data: Path, start_daemon) -> None:
    """`prefetchd status`'s "in the buffer" counted every waiting batch as a full one: an epoch's short last batch
    made the buffer and the free space together more than a 64 MiB tmpfs holds (36.8 MiB in it, 35.2 MiB free)."""
    # 72 samples in batches of 32: 32, 32 and 8 images, all three waiting.
    daemon = start_daemon(shm_buffer, "--data", shapes_data / "train", "--batch-size", "32", "--image-size", "32",
                          "--workers", "1", "--high-water", "3", "--low-water", "1")
    daemon.wait_until(lambda: state_of(shm_buffer) == State.FULL, 30, "a full buffer")
    production = production_of(shm_buffer)
    assert production is not None and production.waiting == 3 and production.building == 0
    files = sorted(p.stat().st_size for p in shm_buffer.glob("*.batch"))
    assert len(files) == 3 and files[0] < files[1] == production.batch_bytes, files
    assert production.buffer_bytes == sum(files), (production.buffer_bytes, files)


def test_a_batch_of_another_size_on_a_full_tmpfs_frees_a_spare_to_be_built_in_fresh_pages(
        shm_dir: Path, shapes_data: Path, start_daemon) -> None:
    """The room check counts every consumed batch kept (a spare) as room, but a batch of another size (an epoch's
    short last one) cannot be built in one: it was begun in fresh pages with the spares kept, and on a tmpfs whose
    free space others had taken (several daemons sharing one) its workers met ENOSPC, about once an epoch, and its
    trainer waited a second for the retry (a user's walk).  Now a spare nobody maps is deleted first for the room
    it was counted as, and where the trainer still maps them the batch waits for it to let go."""
    with mounted_tmpfs(shm_dir / "t8", "size=8m") as mount:
        buffer = mount / "bf"
        daemon = start_daemon(buffer, "--data", shapes_data / "train", "--batch-size", "5", "--image-size", "64",
                              "--workers", "1", "--high-water", "8", "--low-water", "7", "--min-free-mb", "0",
                              "--epochs", "3")
        try:
            daemon.wait_until(lambda: state_of(buffer) == State.FULL, 30, "a full buffer")
            # Another daemon's batches, say: a third of a batch free, less than the short last batch (2 of 5 images).
            batch = DaemonConfig(buffer=buffer, batch_size=5, image_size=64).batch_bytes
            (mount / "ballast").write_bytes(b"\1" * (free_bytes(mount) - batch // 3))
            steps: list[tuple[int, int]] = []
            held: list[Any] = []
            with BufferLoader(buffer, normalize=False, timeout=30) as loader:
                for _epoch in range(3):
                    for b in loader:
                        steps.append((b.epoch, b.step))
                        # As a training loop may: the batch before is still mapped once the loader reported it
                        # consumed, so its file, kept to build in, is no room yet.
                        held = [*held[-1:], b]
                        time.sleep(0.02)
            assert steps == [(e, s) for e in range(3) for s in range(len(loader))], steps  # every batch, once
            production = production_of(buffer)
            assert production is not None and production.errors.write_failures == 0, daemon.log
            assert "No space left" not in daemon.log, daemon.log
        finally:
            daemon.terminate()  # before the tmpfs is unmounted
