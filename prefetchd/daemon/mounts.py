"""What the file system under the buffer is: a RAM disk or not, and whether its pages are huge.

A batch file on a tmpfs mounted with ``huge=within_size`` (or ``always``) lives in 2 MiB pages.
A worker maps each task's slots and the resize writes every image straight into them
(``buffer_protocol.writer.SlotFiller``), so on 4 KiB pages every 4 KiB of a batch is a page
fault.  What 2 MiB pages saved (docs/BENCHMARKS.md, "Huge pages" and "Huge pages at 16
workers"): on this project's 2-core machine 2.5 % of the workers' CPU per image on one host
and nothing measurable on another; at 16 workers on a 16-core GPU host 7 % of it and 5 % of the
images a second.  /dev/shm is mounted without them on most systems, and only root can mount a
tmpfs, so the daemon says once how to get them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple

import psutil

RAM_FILESYSTEMS = ("tmpfs", "ramfs")
HUGE_OPTIONS = ("huge=always", "huge=within_size")  # a tmpfs's options under which files get 2 MiB pages
# The system's setting for every tmpfs: "force" and "deny" override each mount's huge= option.
SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
HUGE_PAGE_BYTES = 2 << 20
BASE_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


class Mount(NamedTuple):
    point: str
    fstype: str
    options: tuple[str, ...]


def filesystem_of(path: Path) -> Mount:
    """The mount holding ``path``."""
    path = path.resolve()
    best = Mount("/", "unknown", ())
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint
        if (path == Path(mount) or Path(mount) in path.parents) and len(mount) >= len(best.point):
            best = Mount(mount, part.fstype, tuple(part.opts.split(",")))
    return best


def huge_pages(mount: Mount, shmem_enabled: Path = SHMEM_ENABLED) -> bool | None:
    """Whether files written on the tmpfs ``mount`` get 2 MiB pages; None for another file system."""
    if mount.fstype != "tmpfs":
        return None
    chosen = _shmem_enabled(shmem_enabled)
    if chosen is None:  # no transparent huge pages in this kernel
        return False
    if chosen in ("force", "deny"):
        return chosen == "force"
    return any(option in HUGE_OPTIONS for option in mount.options)


def allocation_unit(mount: Mount, shmem_enabled: Path = SHMEM_ENABLED) -> int:
    """The bytes by which a file's space on ``mount`` grows: 2 MiB on a tmpfs that gives a file huge pages past its
    end too (huge=always, or the system's "force"), where a batch file of 2.4 MB takes 4 MiB (measured); else a base
    page (huge=within_size gives a file's tail base pages).  Counted in bytes, the daemon's space on a huge=always
    tmpfs fell short of what its batches took, and pauses for space blamed "other files" that were not there (a
    walk: 6 pauses in 14 s)."""
    chosen = _shmem_enabled(shmem_enabled) if mount.fstype == "tmpfs" else None
    if chosen == "force" or (chosen not in (None, "deny") and "huge=always" in mount.options):
        return HUGE_PAGE_BYTES
    return BASE_PAGE_BYTES


def taken_bytes(file_len: int, unit: int) -> int:
    """The space a file of ``file_len`` bytes takes where space grows by ``unit`` bytes (``allocation_unit``)."""
    return -(-file_len // unit) * unit


def _shmem_enabled(path: Path) -> str | None:
    """The system's huge-page setting for every tmpfs ("always", "within_size", "advise", "never", "deny", "force");
    None where the kernel has no transparent huge pages."""
    try:
        chosen = re.search(r"\[(\w+)\]", path.read_text())
    except OSError:
        return None
    return chosen.group(1) if chosen is not None else None


def pages_of(huge: bool | None) -> str:
    """``huge_pages``'s answer in words, for reports."""
    return "not a tmpfs" if huge is None else "2 MiB pages" if huge else "4 KiB pages"


def huge_pages_hint(buffer: Path, mount: Mount) -> str:
    """What the daemon logs once for a buffer on a tmpfs without huge pages."""
    return (f"buffer {buffer} is on a tmpfs ({mount.point}) without huge pages; one mounted with "
            "huge=within_size may save the workers some CPU per image (5 % more images/s at 16 workers on "
            "a 16-core host; 0-2.5 % at 2 workers: measure with `prefetchd bench --buffer-root DIR`; as root: "
            "mount -t tmpfs -o size=SIZE,huge=within_size tmpfs DIR, and a buffer under DIR; docs/BENCHMARKS.md, "
            "\"Huge pages\")")
