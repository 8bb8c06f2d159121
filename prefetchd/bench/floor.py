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

import json
import math
import os
import pickle
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from prefetchd.daemon.dataset import scan_class_folders
from prefetchd.daemon.jpeg_crop import CleanFiles, TrackedFile
from prefetchd.daemon.sampler import sample_rng
from prefetchd.daemon.transforms import augment, preload
from prefetchd.daemon.workers import limit_threads

# Enough files that they do not all stay in the CPU's caches (a dataset does not), few
# enough that the first pass stays a few seconds.
FLOOR_FILES = 1500
PARALLEL_START_SECONDS = 300.0  # k interpreters starting and sharing one pass over the files, on a busy machine


def _floor_paths(data: Path) -> list[Path]:
    index = scan_class_folders(data)
    step = max(1, len(index) // FLOOR_FILES)
    return [index.path(i) for i in range(0, len(index), step)][:FLOOR_FILES]


SHOWN_BAD_FILES = 3  # files that did not decode, named with why in a measurement's record


class AugmentLoop:
    """``augment()`` of file ``i`` in ``epoch`` (``one``: whether it made an image), after a first pass over ``paths``
    (or the part ``first_pass`` of it, where processes sharing ``clean`` split the pass): the page cache, and which
    files decode cleanly (a worker's first epoch).  A file that does not decode (a truncated JPEG, a text file
    named .JPEG) is left out from then on, as a worker replaces it: one such file stopped the bench with a
    traceback that did not name it.  ``bad``: those files, with why."""

    def __init__(self, paths: list[Path], image_size: int, clean: CleanFiles | None = None,
                 first_pass: range | None = None) -> None:
        self.paths, self.image_size = paths, image_size
        self.clean = clean if clean is not None else CleanFiles(len(paths), shared=False)
        self.bad: dict[int, str] = {}
        preload()
        tried = first_pass if first_pass is not None else range(len(paths))
        for i in tried:
            self.one(0, i)
        if len(tried) == len(paths) and paths and len(self.bad) == len(paths):  # (a share of the pass may be all bad)
            raise ValueError(f"none of the {len(paths)} files the floor reads decodes (last: "
                             f"{self.bad[len(paths) - 1]}); are these files images?")

    def one(self, epoch: int, i: int) -> bool:
        if i in self.bad:
            return False
        try:
            augment(self.paths[i], self.image_size, True, sample_rng(0, epoch, i), tracked=TrackedFile(self.clean, i))
        except Exception as exc:  # any decode failure, as a worker's: that file is left out, and named
            self.bad[i] = f"{self.paths[i]}: {type(exc).__name__}: {exc}"
            return False
        return True

    def left_out(self) -> dict[str, Any]:
        """The files left out, for a measurement's record: how many, and the first few with why."""
        return {"undecodable": len(self.bad), "undecodable_files": list(self.bad.values())[:SHOWN_BAD_FILES]}


def measure_floor(data: Path, image_size: int, core: int, *, seconds: float | None = None,
                  images: int | None = None) -> dict[str, Any]:
    """CPU time per image of ``augment()`` (train) on the calling thread pinned to ``core``, over up
    to ``FLOOR_FILES`` files of the class-folder dataset ``data`` spread evenly, for ``seconds``
    of that thread's CPU time or ``images`` images after a first pass over the files.  The
    thread's own CPU time (``time.thread_time``), not the process's: the caller's other threads
    (gpu_check's CUDA and executor threads, a monitor) would count as the floor's (one busy
    thread beside it was seen to double it, 1.42 to 2.81 ms per image)."""
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
        loop = AugmentLoop(paths, image_size)
        done, epoch, start = 0, 1, time.thread_time()
        while True:
            for i in range(len(paths)):
                done += loop.one(epoch, i)
                cpu = time.thread_time() - start
                if cpu >= cpu_limit or done >= image_limit:
                    return {"images_per_s": done / cpu, "ms_per_image": cpu / done * 1e3, "images": done,
                            "files": len(paths) - len(loop.bad), "core": core, **loop.left_out()}
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
    paths = [str(path) for path in _floor_paths(data)]
    clean = CleanFiles(len(paths))
    procs: list[tuple[int, subprocess.Popen[bytes]]] = []
    per_core: list[Any] | None = None
    started = time.perf_counter()
    affinity = os.sched_getaffinity(0)
    # A process inherits this mask and keeps it until it pins itself after its imports: set it to
    # the measured cores, or k interpreters import on whatever the caller was last pinned to
    # (the bench pins itself to the previous count's cores: seen as 20-40 s to start 16 loops).
    os.sched_setaffinity(0, cores)
    try:
        # Plain interpreters running this module, not multiprocessing's spawn: that imports the
        # caller's main script again in every process (gpu_check's torch and torchvision: ~3 s
        # here, ~10 s on a GPU host's core, for loops that need neither).
        for core in cores:
            procs.append((core, subprocess.Popen([sys.executable, "-c", _LOOP_MAIN], stdin=subprocess.PIPE,
                                                 stdout=subprocess.PIPE, pass_fds=[clean.fd])))
        for j, (core, proc) in enumerate(procs):  # all started first: a job outgrows the pipe, and waits for a reader
            assert proc.stdin is not None
            pickle.dump(_LoopJob(paths, image_size, core, j, len(cores), clean.fd, seconds), proc.stdin)
            proc.stdin.flush()
        os.sched_setaffinity(0, affinity)
        _collect(procs, PARALLEL_START_SECONDS)  # every process ready
        start_s = time.perf_counter() - started
        for _, proc in procs:
            assert proc.stdin is not None
            proc.stdin.close()  # go
        per_core = sorted(_collect(procs, seconds + PARALLEL_START_SECONDS))
    finally:
        os.sched_setaffinity(0, affinity)
        for _, proc in procs:
            if per_core is None:  # failed or timed out: the others would wait for their go, or loop on
                proc.kill()
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        clean.close()
    return {"images_per_s": sum(rate for _, rate in per_core), "seconds": seconds, "start_s": start_s,
            "per_core": [{"core": core, "images_per_s": rate} for core, rate in per_core]}


def _collect(procs: list[tuple[int, subprocess.Popen[bytes]]], timeout: float) -> list[Any]:
    """One message from each of ``procs``; an error naming the first that died, or the wait."""
    got: list[Any] = []
    waiting = {proc.stdout.fileno(): (core, proc) for core, proc in procs if proc.stdout is not None}
    deadline = time.monotonic() + timeout
    while waiting:
        readable, _, _ = select.select(list(waiting), [], [], max(0.0, deadline - time.monotonic()))
        if not readable:
            raise TimeoutError(f"{len(waiting)} of the floor's {len(procs)} processes did not answer "
                               f"within {timeout:.0f} s")
        for fd in readable:
            core, proc = waiting.pop(fd)
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the floor's process on core {core} exited with code {proc.wait()}")
            got.append(json.loads(line))
    return got


class _LoopJob(NamedTuple):
    """What one of ``measure_parallel_floor``'s processes does, sent down its stdin."""

    paths: list[str]
    image_size: int
    core: int
    first: int  # its part of the first pass: files first, first + every, ...
    every: int
    clean_fd: int  # the shared ``CleanFiles`` table, passed open
    seconds: float


def _walk(files: int, first: int, every: int) -> Iterator[tuple[int, int]]:
    """(epoch, file) for the ``first``-th of ``every`` loops, from epoch 1 on: each starts its own
    share of the way into the files, as the daemon's workers are each at a batch of their own.
    All from file 0 would read the same file with the same crop at the same moment."""
    position = first * files // every
    while True:
        epoch, i = divmod(position, files)
        yield epoch + 1, i
        position += 1


_LOOP_MAIN = "from prefetchd.bench.floor import _parallel_loop; _parallel_loop()"


def _parallel_loop() -> None:
    """One process of ``measure_parallel_floor``: its job from stdin, one JSON line on stdout
    when ready, then (after stdin closes: go) another with its rate."""
    job: _LoopJob = pickle.load(sys.stdin.buffer)
    os.sched_setaffinity(0, {job.core})
    limit_threads()
    paths = [Path(path) for path in job.paths]
    clean = CleanFiles.attach(job.clean_fd, len(paths))
    loop = AugmentLoop(paths, job.image_size, clean, range(job.first, len(paths), job.every))
    print(json.dumps("ready"), flush=True)
    sys.stdin.buffer.read()  # until the parent closes it
    done, start = 0, time.perf_counter()
    for epoch, i in _walk(len(paths), job.first, job.every):
        done += loop.one(epoch, i)
        elapsed = time.perf_counter() - start
        if elapsed >= job.seconds:
            print(json.dumps([job.core, done / elapsed]), flush=True)
            return
