"""The machine's count of the kernel's OOM kills, which the trainer (a daemon that vanished), the demo (its trainer)
and the daemon (its workers' deaths, where its memory cgroup keeps no count of its own) read to tell a kill for want
of memory from another."""

from __future__ import annotations

from pathlib import Path


def oom_kills(vmstat: str = "/proc/vmstat") -> int | None:
    """How many processes the kernel's out-of-memory killer has killed on this machine since it booted (any
    cgroup's limit, or the machine's memory); None where the kernel does not say."""
    try:
        for line in Path(vmstat).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


__all__ = ["oom_kills"]
