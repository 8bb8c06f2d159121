"""The buffer's file system: a tmpfs with or without huge pages, on real mounts (root), and the
daemon's hint where a buffer's batches would live in 4 KiB pages."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from prefetchd.daemon.buffer_dir import note_buffer_filesystem
from prefetchd.daemon.mounts import SHMEM_ENABLED, Mount, filesystem_of, huge_pages, pages_of
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
