"""What this process's cgroups allow it: CPUs' worth of time (`docker run --cpus`, a Kubernetes pod's CPU
limit, a systemd unit's CPUQuota=) and memory (`docker run --memory`, a pod's memory limit, MemoryMax=).

Neither shows where the defaults looked before.  A CPU limit leaves the process every core of the host to
run on (its affinity), so counting cores sized --workers to the host: 63 workers in a pod limited to 4 CPUs,
throttled in turn and each holding its memory.  A memory limit leaves the host's free memory in
/proc/meminfo, and the batches' tmpfs pages count against the cgroup of the daemon that writes them: a
high-water mark sized from the host's memory got the daemon killed by the cgroup's OOM killer.

Read from cgroup v2 (``cpu.max``; ``memory.max`` and ``memory.current``) and cgroup v1 (``cpu.cfs_quota_us``
and ``cpu.cfs_period_us``; ``memory.limit_in_bytes`` and ``memory.usage_in_bytes``), in the process's own
cgroup and every one above it (a limit may sit on a parent, as a slice's), the tightest winning.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from prefetchd.oom import keyed_value
from prefetchd.words import binary_size

PROC_CGROUP = "/proc/self/cgroup"
PROC_MOUNTINFO = "/proc/self/mountinfo"


def cpu_quota(proc_cgroup: str = PROC_CGROUP, mountinfo: str = PROC_MOUNTINFO) -> float | None:
    """CPUs' worth of time per second the cgroups of this process allow (1.5: one and a half CPUs); None when
    none sets a limit, or they cannot be read (not Linux, /proc or /sys/fs/cgroup not there)."""
    return _tightest("cpu", _read_cpu, proc_cgroup, mountinfo)


def memory_room(proc_cgroup: str = PROC_CGROUP, mountinfo: str = PROC_MOUNTINFO) -> int | None:
    """Bytes the cgroups of this process may still take before their memory limit: the limit less what they
    use, not counting the page cache they could drop (inactive files); None when none sets a limit."""
    return _tightest("memory", _read_memory_room, proc_cgroup, mountinfo)


def memory_limit(proc_cgroup: str = PROC_CGROUP, mountinfo: str = PROC_MOUNTINFO) -> int | None:
    """The tightest memory limit, in bytes, of the cgroups of this process; None when none sets one."""
    return _tightest("memory", _read_memory_limit, proc_cgroup, mountinfo)


def out_of_memory_where(who: str = "the daemon") -> str:
    """Where memory ran short, for a message about an OOM kill: the limit of ``who``'s cgroup (this process's), or
    the machine's memory."""
    limit = memory_limit()
    return (f"{who}'s memory cgroup is limited to {binary_size(limit)}" if limit is not None else
            "the machine's memory ran short")


T = TypeVar("T", int, float)


def _tightest(controller: str, read: Callable[[Path, bool], T | None], proc_cgroup: str,
              mountinfo: str) -> T | None:
    """The least ``read`` finds in the folders of ``controller``'s cgroups of this process, up to the root."""
    found = []
    for folder, top, v2 in _own_folders(controller, proc_cgroup, mountinfo):
        while True:
            value = read(folder, v2)
            if value is not None:
                found.append(value)
            if folder == top or top not in folder.parents:
                break
            folder = folder.parent
    return min(found) if found else None


def _own_folders(controller: str, proc_cgroup: str, mountinfo: str) -> list[tuple[Path, Path, bool]]:
    """(folder, its hierarchy's mount point, is v2) of this process's cgroup in each hierarchy that can hold
    ``controller``'s files; none where /proc cannot say."""
    try:
        memberships = _memberships(Path(proc_cgroup).read_text())
        mounts = Path(mountinfo).read_text().splitlines()
    except OSError:
        return []
    folders = []
    for mount_point, mount_root, v2 in _mounts(mounts, controller):
        path = memberships.get("" if v2 else controller)
        if path is None:
            continue
        # In a cgroup namespace (a container) the mount's root is the namespace's: the path is below it.
        below = path[len(mount_root):] if path.startswith(mount_root) else path
        folders.append((Path(mount_point, below.lstrip("/")), Path(mount_point), v2))
    return folders


def cgroup_oom_kills(proc_cgroup: str = PROC_CGROUP, mountinfo: str = PROC_MOUNTINFO) -> int | None:
    """How many processes of this process's memory cgroup the kernel's OOM killer has killed (cgroup v2's
    ``memory.events``, which counts those of the cgroups below it too; v1's ``memory.oom_control``); None where
    neither says.  Unlike the machine's count (``prefetchd.oom``), another cgroup's OOM kills leave it as it was."""
    for folder, _top, v2 in _own_folders("memory", proc_cgroup, mountinfo):
        count = keyed_value(folder / ("memory.events" if v2 else "memory.oom_control"), "oom_kill")
        if count is not None:
            return count
    return None


def quota_cpus(cores: int, quota: float | None) -> int:
    """The CPUs of ``cores`` the quota lets the process keep busy: at least one, a part of a CPU counted whole."""
    return cores if quota is None else max(1, min(cores, math.ceil(quota - 1e-9)))


def _memberships(text: str) -> dict[str, str]:
    """/proc/self/cgroup as {controller: path}; cgroup v2's line ("0::/path") under ""."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for controller in controllers.split(",") if controllers else [""]:
            found[controller] = path
    return found


def _mounts(lines: list[str], controller: str) -> list[tuple[str, str, bool]]:
    """(mount point, root, is v2) of each cgroup mount that can hold ``controller``'s limit: every cgroup2 mount,
    and the cgroup v1 mount of that controller."""
    mounts = []
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if dash < 5 or len(fields) < dash + 4:
            continue
        root, point, fstype, options = fields[3], _unescape(fields[4]), fields[dash + 1], fields[dash + 3]
        if fstype == "cgroup2" or (fstype == "cgroup" and controller in options.split(",")):
            mounts.append((point, root, fstype == "cgroup2"))
    return mounts


def _unescape(field: str) -> str:
    """A mountinfo path, whose spaces, tabs, newlines and backslashes are written in octal (\\040)."""
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _read_cpu(folder: Path, v2: bool) -> float | None:
    try:
        if v2:
            quota, period = (folder / "cpu.max").read_text().split()[:2]
        else:
            quota = (folder / "cpu.cfs_quota_us").read_text().strip()
            period = (folder / "cpu.cfs_period_us").read_text().strip()
    except (OSError, ValueError):
        return None
    return None if quota == "max" or quota.startswith("-") else _ratio(quota, period)


# cgroup v1 writes "no limit" as the largest multiple of the page size below 2**63.
V1_NO_LIMIT = 1 << 62


def _read_memory_limit(folder: Path, v2: bool) -> int | None:
    try:
        limit = (folder / ("memory.max" if v2 else "memory.limit_in_bytes")).read_text().strip()
        return None if limit == "max" or int(limit) >= V1_NO_LIMIT else int(limit)
    except (OSError, ValueError):
        return None


def _read_memory_room(folder: Path, v2: bool) -> int | None:
    """The limit in ``folder`` less what its cgroup uses, not counting the inactive page cache."""
    limit = _read_memory_limit(folder, v2)
    if limit is None:
        return None
    try:
        usage = int((folder / ("memory.current" if v2 else "memory.usage_in_bytes")).read_text())
    except (OSError, ValueError):
        return None
    inactive = keyed_value(folder / "memory.stat", "inactive_file" if v2 else "total_inactive_file") or 0
    return max(0, limit - max(0, usage - inactive))


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


__all__ = ["cgroup_oom_kills", "cpu_quota", "memory_limit", "memory_room", "out_of_memory_where", "quota_cpus"]
