"""Ray in a loopback-only network namespace: Ray 2.60 binds the machine's own address even when told
127.0.0.1, so the tests start it under ``unshare -n`` (root) with only ``lo`` up, where it finds no route
out and uses 127.0.0.1 (test_ray.py, test_ray_faults.py)."""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
from collections.abc import Sequence


def namespace_problem() -> str | None:
    """Why Ray cannot be tested here, or None."""
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed: pip install -e '.[ray]'"
    if os.geteuid() != 0:
        return "needs root for `unshare -n` (Ray must run in a loopback-only network namespace here)"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing: apt-get install util-linux iproute2"
    try:
        probe = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True, text=True,
                               timeout=30)
    except subprocess.TimeoutExpired:
        return "`unshare -n` did not return within 30 s"
    if probe.returncode != 0:
        return f"cannot make a network namespace here: {probe.stderr.strip()}"
    return None


def in_namespace(argv: Sequence[str]) -> list[str]:
    """``argv`` run in a network namespace of its own with only loopback up (see ``namespace_problem``)."""
    return ["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {shlex.join(argv)}"]
