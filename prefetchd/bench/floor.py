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
import multiprocessing
import os
import queue
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefetchd.daemon.dataset import scan_class_folders
from prefetchd.daemon.jpeg_crop import CleanFiles, TrackedFile
from prefetchd.daemon.sampler import sample_rng
from prefetchd.daemon.transforms import augment, preload
from prefetchd.daemon.workers import limit_threads

# Enough files that they do not all stay in the CPU's caches (a dataset does not), few
# enough that the first pass stays a few seconds.
FLOOR_FILES = 1500
PARALLEL_START_SECONDS = 300.0  # k processes importing torch and sharing one pass over the files, on a busy machine


def _floor_paths(data: Path) -> list[Path]:
    index = scan_class_folders(data)
    step = max(1, len(index) // FLOOR_FILES)
    return [index.path(i) for i in range(0, len(index), step)][:FLOOR_FILES]


def _augment_loop(paths: list[Path], image_size: int, clean: CleanFiles | None = None,
                  first_pass: range | None = None) -> Callable[[int, int], None]:
    """``augment()`` of file ``i`` in ``epoch``, after a first pass over ``paths`` (or the part
    ``first_pass`` of it, where processes sharing ``clean`` split the pass): the page cache,
    and which files decode cleanly (a worker's first epoch)."""
    clean = clean if clean is not None else CleanFiles(len(paths), shared=False)
    preload()

    def one(epoch: int, i: int) -> None:
        augment(paths[i], image_size, True, sample_rng(0, epoch, i), tracked=TrackedFile(clean, i))

    for i in first_pass if first_pass is not None else range(len(paths)):
        one(0, i)
    return one


def measure_floor(data: Path, image_size: int, core: int, *, seconds: float | None = None,
                  images: int | None = None) -> dict[str, Any]:
    """CPU time per image of ``augment()`` (train) on one thread pinned to ``core``, over up to
    ``FLOOR_FILES`` files of the class-folder dataset ``data`` spread evenly, for ``seconds``
    of CPU time or ``images`` images after a first pass over the files."""
    if (seconds is None) == (images is None):
        raise ValueError("pass seconds= or images=, not both")
    cpu_limit = seconds if seconds is not None else math.inf
    image_limit = images if images is not None else math.inf
    paths = _floor_paths(data)
    torch = sys.modules.get("torch")  # the bench's own; put back as it was
    threads = torch.get_num_threads() if torch is not None else None
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        if torch is not None:
            torch.set_num_threads(1)  # as in a worker (workers.limit_threads)
        one = _augment_loop(paths, image_size)
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


def measure_parallel_floor(data: Path, image_size: int, cores: list[int], seconds: float) -> dict[str, Any]:
    """The floor's loop in one process per core of ``cores``, all at once over the same
    ``seconds`` of wall-clock time: what k workers could make if nothing ran beside their own
    ``augment()``.  Against k x the floor it shows what the machine loses to running k at once
    (shared caches, memory bandwidth, a busy host); against it, what the producer loses on its
    own (tasks, writes, controller, consumer).  The processes share one first pass over the
    files (each decodes every k-th, into one shared ``CleanFiles`` table, as the daemon's
    workers share theirs), so the steady state starts sooner at large k.  ``start_s``: the
    seconds until every process was ready (interpreter, imports, its part of the first pass)."""
    paths = _floor_paths(data)
    clean = CleanFiles(len(paths))
    ctx = multiprocessing.get_context("spawn")  # the caller may hold threads (torch's): no fork
    go, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_parallel_loop, args=(paths, image_size, core, range(j, len(paths), len(cores)),
                                                      clean, seconds, go, results),
                         name=f"the floor's process on core {core}", daemon=True) for j, core in enumerate(cores)]
    started = time.perf_counter()
    affinity = os.sched_getaffinity(0)
    # A process inherits this mask and keeps it until it pins itself after its imports: set it to
    # the measured cores, or k interpreters import on whatever the caller was last pinned to
    # (the bench pins itself to the previous count's cores: seen as 20-40 s to start 16 loops).
    os.sched_setaffinity(0, cores)
    try:
        for proc in procs:
            proc.start()
        os.sched_setaffinity(0, affinity)
        _collect(results, procs, PARALLEL_START_SECONDS)  # every process ready
        start_s = time.perf_counter() - started
        go.set()
        per_core = sorted(_collect(results, procs, seconds + PARALLEL_START_SECONDS))
    finally:
        os.sched_setaffinity(0, affinity)
        for proc in procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
        clean.close()
    return {"images_per_s": sum(rate for _, rate in per_core), "seconds": seconds, "start_s": start_s,
            "per_core": [{"core": core, "images_per_s": rate} for core, rate in per_core]}


def _collect(results: Any, procs: list[Any], timeout: float) -> list[Any]:
    """One message from each of ``procs``; an error naming the first that died, or the wait."""
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < len(procs):
        try:
            got.append(results.get(timeout=0.5))
        except queue.Empty:
            dead = [proc for proc in procs if proc.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited with code {dead[0].exitcode}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(procs) - len(got)} of the floor's {len(procs)} processes did not answer "
                                   f"within {timeout:.0f} s") from None
    return got


def _parallel_loop(paths: list[Path], image_size: int, core: int, first_pass: range, clean: CleanFiles,
                   seconds: float, go: Any, results: Any) -> None:
    os.sched_setaffinity(0, {core})
    limit_threads()
    one = _augment_loop(paths, image_size, clean, first_pass)
    results.put("ready")
    go.wait()
    done, start = 0, time.perf_counter()
    while True:
        epoch, i = divmod(done, len(paths))
        one(epoch + 1, i)
        done += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            results.put((core, done / elapsed))
            return
