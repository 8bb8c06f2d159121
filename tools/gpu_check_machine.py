"""The machine and checkout a run of ``tools/gpu_check.py`` measures: the GPU beside
``prefetchd.bench.describe_machine``'s host, the commit, whether the daemon's interpreter can run
``prefetchd`` at all, where the buffers go, the cores, and the dataset read into the page cache
before anything is timed on it."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from gpu_check_plan import REPO, not_a_tool
from prefetchd.daemon.config import usable_cpus
from prefetchd.launch import buffer_root

log = logging.getLogger(__name__)


def describe_gpu(device: torch.device) -> dict[str, Any]:
    doc: dict[str, Any] = {"torch_cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}  # type: ignore[no-untyped-call]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        doc.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                   multiprocessors=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        if smi.returncode == 0:
            doc["nvidia_smi"] = smi.stdout.strip()
    return doc


def git_commit(given: str | None) -> str:
    if given:
        return given
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git here; pass --commit)"
    if head.returncode != 0:
        return "unknown (not a git checkout; pass --commit)"
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def cli_problem() -> str | None:
    """Why the daemon's interpreter cannot run ``prefetchd``, or None.  A dependency left out of the
    carried wheels (tomli-w on the first H200 run) otherwise shows only minutes later, as every
    daemon-fed row failing."""
    command = [sys.executable, "-m", "prefetchd", "--help"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if proc.returncode == 0:
        return None
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
    return (f"`{' '.join(command)}` fails: {last[0]}; install what it lacks (on a machine without a package "
            "registry, the wheels of `bash tools/fetch_gpu_wheels.sh`, README \"On a GPU\") and run again")


def cores_but_one() -> int:
    return max(1, usable_cpus() - 1)


def warm_page_cache(data: Path) -> None:
    """Write back and read once every file of ``data``: no feed then pays for the disk or for the
    writeback of a dataset just generated."""
    os.sync()
    files = nbytes = 0
    for folder, _, names in os.walk(data):
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                while chunk := f.read(1 << 20):
                    nbytes += len(chunk)
            files += 1
    log.info("read %d files (%.0f MiB) into the page cache", files, nbytes / 2**20)


def buffer_root_saying_where(need: int) -> Path:
    """``prefetchd.launch.buffer_root``, with a warning where the buffers will not be on a RAM disk."""
    root = buffer_root(need)
    if root != Path("/dev/shm"):
        log.warning("/dev/shm is missing or has less than %.1f GiB free: buffers go to %s, not a RAM disk",
                    2 * need / 2**30, root)
    return root


if __name__ == "__main__":  # imported by tools/gpu_check.py; run alone it has nothing to do
    not_a_tool(__file__)
