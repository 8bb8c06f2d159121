"""The buffer's file system: a tmpfs with or without huge pages, on real mounts (root), and the
daemon's hint where a buffer's batches would live in 4 KiB pages."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefetchd.daemon.buffer_dir import note_buffer_filesystem
from prefetchd.daemon.mounts import (SHMEM_ENABLED, Mount, allocation_unit, filesystem_of, huge_pages, pages_of,
                                     taken_bytes)
from tests.conftest import mounted_tmpfs


def _system_setting() -> str | None:
    """'force' or 'deny' where the system overrides every tmpfs's huge= option, else None."""
    try:
        text = SHMEM_ENABLED.read_text()
    except OSError:
        return "deny"  # no transparent huge pages at all
    for setting in ("force", "deny"):
        if f"[{setting}]" in text:
            return setting
    return None


def test_a_tmpfs_mounted_with_huge_pages_has_them_and_one_without_has_not(shm_dir: Path) -> None:
    overridden = _system_setting()
    with mounted_tmpfs(shm_dir / "huge", "size=64m,huge=within_size") as huge, \
            mounted_tmpfs(shm_dir / "plain", "size=64m") as plain:
        on_huge, on_plain = filesystem_of(huge / "bf"), filesystem_of(plain / "bf")
        assert (on_huge.point, on_huge.fstype) == (str(huge), "tmpfs")
        assert "huge=within_size" in on_huge.options
        assert (on_plain.point, on_plain.fstype) == (str(plain), "tmpfs")
        if overridden is None:
            assert huge_pages(on_huge) is True
            assert huge_pages(on_plain) is False
        else:
            assert huge_pages(on_huge) is huge_pages(on_plain) is (overridden == "force")


def test_the_systems_setting_overrides_a_mounts_option(tmp_path: Path) -> None:
    setting = tmp_path / "shmem_enabled"
    plain = Mount("/dev/shm", "tmpfs", ("rw", "relatime"))
    huge = Mount("/mnt/bf", "tmpfs", ("rw", "huge=always"))
    setting.write_text("always within_size advise [never] deny force\n")
    assert (huge_pages(plain, setting), huge_pages(huge, setting)) == (False, True)
    setting.write_text("always within_size advise never deny [force]\n")
    assert (huge_pages(plain, setting), huge_pages(huge, setting)) == (True, True)
    setting.write_text("always within_size advise never [deny] force\n")
    assert (huge_pages(plain, setting), huge_pages(huge, setting)) == (False, False)
    assert huge_pages(huge, tmp_path / "missing") is False  # a kernel without transparent huge pages
    assert huge_pages(Mount("/", "ext4", ("rw",)), setting) is None
    # As reports name them (the bench's machine line, GPU.md).
    assert [pages_of(v) for v in (True, False, None)] == ["2 MiB pages", "4 KiB pages", "not a tmpfs"]


def test_the_daemon_says_once_how_to_get_huge_pages(shm_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    if _system_setting() is not None:
        pytest.skip("this system forces or denies huge pages on every tmpfs")
    caplog.set_level(logging.INFO, logger="prefetchd.daemon.buffer_dir")
    with mounted_tmpfs(shm_dir / "huge", "size=64m,huge=within_size") as huge, \
            mounted_tmpfs(shm_dir / "plain", "size=64m") as plain:
        note_buffer_filesystem(plain)
        hints = [r.getMessage() for r in caplog.records if "without huge pages" in r.getMessage()]
        assert len(hints) == 1
        assert str(plain) in hints[0] and "huge=within_size" in hints[0] and "prefetchd bench --buffer-root" in hints[0]
        caplog.clear()
        note_buffer_filesystem(huge)
        assert not [r for r in caplog.records if "huge pages" in r.getMessage()]


BATCH_LEN = 2_400_000  # about a batch of 16 images at 224 px


@pytest.mark.parametrize("options", ["size=16m,huge=always", "size=16m,huge=within_size", "size=16m"])
def test_the_space_a_file_takes_is_as_the_mount_says(shm_dir: Path, options: str) -> None:
    """On huge=always a 2.4 MB file takes 4 MiB: files take whole huge pages past their end there."""
    if _system_setting() is not None:
        pytest.skip("this system forces or denies huge pages on every tmpfs")
    with mounted_tmpfs(shm_dir / "fs", options) as mount:
        path = mount / "batch"
        path.write_bytes(b"x" * BATCH_LEN)
        taken = taken_bytes(BATCH_LEN, allocation_unit(filesystem_of(path)))
        assert path.stat().st_blocks * 512 == taken, options
        assert (taken == 4 << 20) is ("always" in options)


def test_the_settings_huge_page_choice_sets_the_unit(tmp_path: Path) -> None:
    setting = tmp_path / "shmem_enabled"
    always, within = Mount("/b", "tmpfs", ("rw", "huge=always")), Mount("/b", "tmpfs", ("rw", "huge=within_size"))
    for chosen, units in (("never", (2 << 20, 4096)), ("force", (2 << 20, 2 << 20)), ("deny", (4096, 4096))):
        setting.write_text(" ".join(f"[{c}]" if c == chosen else c for c in
                                    "always within_size advise never deny force".split()) + "\n")
        assert (allocation_unit(always, setting), allocation_unit(within, setting)) == units, chosen
    assert allocation_unit(Mount("/", "ext4", ("rw",)), setting) == os.sysconf("SC_PAGE_SIZE")


def test_a_high_water_mark_is_checked_in_the_huge_pages_its_batches_take(shm_dir: Path, shapes_data: Path,
                                                                        start_daemon) -> None:
    """Counted in bytes, 10 batches of 2.4 MB and a 2 MiB floor fit a 40 MiB huge=always tmpfs, and the daemon
    paused for space again and again blaming "other files" that were not there (a walk): they take 4 MiB each."""
    if _system_setting() is not None:
        pytest.skip("this system forces or denies huge pages on every tmpfs")
    with mounted_tmpfs(shm_dir / "fs", "size=40m,huge=always") as mount:
        flags = ["--data", str(shapes_data / "train"), "--batch-size", "16", "--image-size", "224", "--workers", "1",
                 "--min-free-mb", "2"]
        refused = subprocess.run([sys.executable, "-m", "prefetchd", "start", "--buffer", str(mount / "bf"), *flags,
                                  "--high-water", "10"], capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2, refused.stderr
        assert "high_water 10 x 4.0 MiB batches" in refused.stderr and "at most 9 fits" in refused.stderr, \
            refused.stderr
        # 7, not the 8 that fit: the daemon's own small files take a huge page each (manifest, lock, status: 6 MiB),
        # and status.json's rewrite a seventh page for a moment, which at 8 left exactly the floor and paused it once
        # in a loaded run of the README's test command (the room check counts that moment as other files).
        daemon = start_daemon(mount / "bf", *flags, "--high-water", "7")
        daemon.wait_until(lambda: len(list((mount / "bf").glob("*.batch"))) == 7, 120, "7 batches waiting")
        assert "paused" not in daemon.log, daemon.log
