"""How many CPUs' worth of time this process's cgroup allows: a container's `docker run --cpus`, a Kubernetes
pod's CPU limit, a systemd unit's CPUQuota=.

Such a limit leaves the process every core of the host to run on (its affinity), so counting cores alone
sized the default --workers to the host: 63 workers in a pod limited to 4 CPUs, throttled in turn and each
holding its memory.  Read from cgroup v2's ``cpu.max`` and cgroup v1's ``cpu.cfs_quota_us`` /
``cpu.cfs_period_us``, in the process's own cgroup and every one above it (a limit may sit on a parent, as a
slice's), the tightest winning.
"""

from __future__ import annotations

import math
from pathlib import Path

PROC_CGROUP = "/proc/self/cgroup"
PROC_MOUNTINFO = "/proc/self/mountinfo"


def cpu_quota(proc_cgroup: str = PROC_CGROUP, mountinfo: str = PROC_MOUNTINFO) -> float | None:
    """CPUs' worth of time per second the cgroups of this process allow (1.5: one and a half CPUs); None when
    none sets a limit, or they cannot be read (not Linux, /proc or /sys/fs/cgroup not there)."""
    try:
        memberships = _memberships(Path(proc_cgroup).read_text())
        mounts = Path(mountinfo).read_text().splitlines()
    except OSError:
        return None
    limits = []
    for mount_point, mount_root, v2 in _cpu_mounts(mounts):
        path = memberships.get("" if v2 else "cpu")
        if path is None:
            continue
        # In a cgroup namespace (a container) the mount's root is the namespace's: the path is below it.
        below = path[len(mount_root):] if path.startswith(mount_root) else path
        folder = Path(mount_point, below.lstrip("/"))
        top = Path(mount_point)
        while True:
            quota = _read_v2(folder) if v2 else _read_v1(folder)
            if quota is not None:
                limits.append(quota)
            if folder == top or top not in folder.parents:
                break
            folder = folder.parent
    return min(limits) if limits else None


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


def _cpu_mounts(lines: list[str]) -> list[tuple[str, str, bool]]:
    """(mount point, root, is v2) of each cgroup mount that can hold a CPU limit: every cgroup2 mount, and the
    cgroup v1 mount of the cpu controller."""
    mounts = []
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if dash < 5 or len(fields) < dash + 4:
            continue
        root, point, fstype, options = fields[3], _unescape(fields[4]), fields[dash + 1], fields[dash + 3]
        if fstype == "cgroup2" or (fstype == "cgroup" and "cpu" in options.split(",")):
            mounts.append((point, root, fstype == "cgroup2"))
    return mounts


def _unescape(field: str) -> str:
    """A mountinfo path, whose spaces, tabs, newlines and backslashes are written in octal (\\040)."""
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _read_v2(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else _ratio(quota, period)


def _read_v1(folder: Path) -> float | None:
    try:
        quota = (folder / "cpu.cfs_quota_us").read_text().strip()
        period = (folder / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return None if quota.startswith("-") else _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


__all__ = ["cpu_quota", "quota_cpus"]
