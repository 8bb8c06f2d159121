"""The floor the daemon's workers approach: its own ``augment()`` alone on one core.

k workers cannot beat k times this rate: it is the same code with nothing around it (no
tasks, no writes into the buffer, no controller, no consumer).  The bench measures it on
the benchmark's own files, in the same minutes as the contenders, so that "prefetchd at
k workers is X % of k x the floor" needs no second tool on another day.  The files are
decoded once first, as a worker's first epoch does: the floor is a worker's steady state,
every file known clean (``jpeg_crop.CleanFiles``).  ``tools/decode_floor.py`` breaks the
same per-image time down by kernel.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from prefetchd.daemon.dataset import scan_class_folders
from prefetchd.daemon.jpeg_crop import CleanFiles, TrackedFile
from prefetchd.daemon.sampler import sample_rng
from prefetchd.daemon.transforms import augment, preload

# Enough files that they do not all stay in the CPU's caches (a dataset does not), few
# enough that the first pass stays a few seconds.
FLOOR_FILES = 1500


def measure_floor(data: Path, image_size: int, core: int, *, seconds: float | None = None,
                  images: int | None = None) -> dict[str, Any]:
    """CPU time per image of ``augment()`` (train) on one thread pinned to ``core``, over up to
    ``FLOOR_FILES`` files of the class-folder dataset ``data`` spread evenly, for ``seconds``
    of CPU time or ``images`` images after a first pass over the files."""
    if (seconds is None) == (images is None):
        raise ValueError("pass seconds= or images=, not both")
    cpu_limit = seconds if seconds is not None else math.inf
    image_limit = images if images is not None else math.inf
    index = scan_class_folders(data)
    step = max(1, len(index) // FLOOR_FILES)
    paths = [index.path(i) for i in range(0, len(index), step)][:FLOOR_FILES]
    clean = CleanFiles(len(paths), shared=False)
    torch = sys.modules.get("torch")  # the bench's own; put back as it was
    threads = torch.get_num_threads() if torch is not None else None
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        if torch is not None:
            torch.set_num_threads(1)  # as in a worker (workers.limit_threads)
        preload()

        def one(epoch: int, i: int) -> None:
            augment(paths[i], image_size, True, sample_rng(0, epoch, i), tracked=TrackedFile(clean, i))

        for i in range(len(paths)):  # the first epoch: page cache, and which files decode cleanly
            one(0, i)
        done, epoch, start = 0, 1, time.process_time()
        while True:
            for i in range(len(paths)):
                one(epoch, i)
                done += 1
                cpu = time.process_time() - start
                if cpu >= cpu_limit or done >= image_limit:
                    return {"images_per_s": done / cpu, "ms_per_image": cpu / done * 1e3, "images": done,
                            "files": len(paths), "core": core}
            epoch += 1
    finally:
        os.sched_setaffinity(0, affinity)
        if torch is not None and threads is not None:
            torch.set_num_threads(threads)
