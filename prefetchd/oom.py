"""The machine's count of the kernel's OOM kills, which the trainer (a daemon that vanished), the demo (its trainer)
and the daemon (its workers' deaths, where its memory cgroup keeps no count of its own) read to tell a kill for want
of memory from another; and the reader of the kernel's "key value" files it and the cgroups' counts are in."""

from __future__ import annotations

from pathlib import Path


def oom_kills(vmstat: str = "/proc/vmstat") -> int | None:
    """How many processes the kernel's out-of-memory killer has killed on this machine since it booted (any
    cgroup's limit, or the machine's memory); None where the kernel does not say."""
    return keyed_value(Path(vmstat), "oom_kill")


def keyed_value(path: Path, key: str) -> int | None:
    """The number after ``key`` in a file of "key value" lines (/proc/vmstat; a cgroup's memory.stat,
    memory.events, memory.oom_control); None where the file cannot be read, or has no such number."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        return None
    return None


__all__ = ["keyed_value", "oom_kills"]
