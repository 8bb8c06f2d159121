"""The contenders: prefetchd (a daemon read by BufferLoader), torchvision's DataLoader
(float32 and uint8), SPDL and DALI's CPU pipeline, each run pinned to the cores of its
worker count."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefetchd.bench.dali import DALI_CONTENDERS, dali_batches
from prefetchd.bench.measure import WAIT_SECONDS, Window, trainer_with_pauses
from prefetchd.bench.monitor import MONITOR_SECONDS, BenchDaemon, CpuSplit
from prefetchd.bench.results import Throughput
from prefetchd.words import binary_size

log = logging.getLogger(__name__)

WARM_START_TARGET_MS = 20.0
WARM_START_REPEATS = 5


def failure(exc: BaseException) -> str:
    """One line for a contender that failed, for its row of the table: the DataLoader hands a worker's error on
    with the worker's whole traceback in its message, which filled the table with it (and widened every row to
    its longest line).  Its first line and its last, the error itself; --log-level debug logs the rest."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " ".join(lines[:1] + lines[-1:] if len(lines) > 1 else lines)
    if "shared memory" in text and "No space left" in text and os.path.isdir("/dev/shm"):
        size = os.statvfs("/dev/shm")
        text += (f" (/dev/shm holds {binary_size(size.f_blocks * size.f_frsize)}: DataLoader workers pass each batch "
                 "through it; a container's is enlarged with docker run --shm-size=...)")
    return f"{type(exc).__name__}: {text}"


def classic_transform(image_size: int, *, uint8: bool) -> Any:
    """What users run today on each PIL-decoded image: RandomResizedCrop and a flip, then uint8 CHW
    (PILToTensor), or float32 normalised (ToTensor, Normalize).  The DataLoader and SPDL contenders
    take it, and so does tools/gpu_check.py's DataLoader feed."""
    from torchvision import transforms

    from prefetchd.trainer.tensors import IMAGENET_MEAN, IMAGENET_STD

    steps: list[Any] = [transforms.RandomResizedCrop(image_size), transforms.RandomHorizontalFlip()]
    if uint8:
        steps.append(transforms.PILToTensor())
    else:
        # The classic recipe's float32 normalised batches, with the statistics BufferLoader
        # would use.
        steps += [transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    return transforms.Compose(steps)


@dataclass
class Run:
    """One benchmark's settings; measure() runs one contender at one worker count."""

    data: Path
    batch_size: int
    image_size: int
    window: Window
    out_dir: Path
    high_water: int
    say: Callable[[str], None]
    buffers: Path  # where each daemon's buffer goes (``run_benchmark``'s ``buffer_root``)

    def measure(self, name: str, k: int, cores: list[int], *, data_wait: bool) -> tuple[Throughput, dict[str, Any] | None]:
        import torch

        row = Throughput(name, k, cores)
        scenario: dict[str, Any] | None = None
        os.sched_setaffinity(0, cores)
        # torch sizes its intra-op pool from the machine at import, not from a mask
        # set later; size it as `taskset` at start would have.  Measured: SPDL's
        # torch.stack with 2 spinning OpenMP threads on 1 pinned core ran at 0.4x.
        threads = torch.get_num_threads()
        torch.set_num_threads(len(cores))
        try:
            if name in ("prefetchd", "prefetchd-ray"):
                scenario = self._prefetchd(row, data_wait, ray=name == "prefetchd-ray")
            elif name == "spdl":
                self._spdl(row)
            elif name in DALI_CONTENDERS:
                self._dali(row, crop_aware=DALI_CONTENDERS[name])
            else:
                scenario = self._dataloader(row, uint8=name == "dataloader-uint8", data_wait=data_wait)
        except Exception as exc:  # one failing contender must not lose the others' numbers
            log.debug("%s with %d workers failed", name, k, exc_info=True)
            row.images_per_s = None
            row.note = f"failed: {failure(exc)}"
            self.say(f"  {row.note}")
        finally:
            torch.set_num_threads(threads)
        return row, scenario

    # -- prefetchd ---------------------------------------------------------------

    def _prefetchd(self, row: Throughput, data_wait: bool, ray: bool = False) -> dict[str, Any] | None:
        """The daemon with ``row.workers`` workers; ``ray``: with none, and a private Ray cluster on the same cores."""
        from prefetchd.buffer_protocol import read_status
        from prefetchd.trainer import BufferLoader

        with BenchDaemon(self, row.workers, f"{'ray-' if ray else ''}k{row.workers}", ray=ray) as daemon:
            started = daemon.started
            daemon.wait_for_manifest()
            loader = BufferLoader(daemon.buffer, normalize=False, timeout=WAIT_SECONDS)
            try:
                batches = _loader_batches(loader)
                monitor = daemon.monitor
                cpu = CpuSplit(monitor.pid, monitor.thread_id)
                first_batch, rate, images, span = self.window.consume(batches, started, monitor.mark_start, cpu)
                row.extra["cpu"] = cpu.result
                row.first_batch_s, row.images_per_s, row.images, row.window_s = first_batch, rate, images, span
                row.extra["affinity"] = daemon.affinity_check(row.cores)
                if not row.extra["affinity"]["pinned"]:
                    row.note = "daemon processes were not all pinned (see extra.affinity)"
                scenario = None
                if data_wait:
                    scenario = trainer_with_pauses(batches, rate, self.batch_size, self.window.length_s, row.workers)
                monitor.mark_end()
                if ray:  # where its batches were built, and the object-store-to-tmpfs copy rate
                    status = read_status(daemon.buffer)
                    remote = status.remote if status is not None else None
                    if remote is not None:
                        row.extra["remote_images"] = remote.images
                        row.extra["remote_cpus"] = remote.cluster_cpus
                        if remote.copy_seconds > 0:
                            row.extra["copy_mib_per_s"] = round(remote.copied_bytes / remote.copy_seconds / 2**20, 1)
                        row.note = (f"{remote.images} images built on the Ray cluster ({remote.cluster_cpus} CPUs), "
                                    f"copied in at {row.extra.get('copy_mib_per_s', '?')} MiB/s")
            finally:
                loader.close()
            row.extra["memory"] = daemon.monitor.summary()
        return scenario

    def warm_start(self, k: int, cores: list[int]) -> dict[str, Any]:
        from prefetchd.buffer_protocol import State, read_status
        from prefetchd.trainer import BufferLoader

        os.sched_setaffinity(0, cores)
        with BenchDaemon(self, k, "warm") as daemon:
            daemon.wait_for_manifest()
            fill_started = time.perf_counter()
            daemon.wait_for(lambda: (st := read_status(daemon.buffer)) is not None and st.state == State.FULL,
                            f"the daemon to fill {daemon.buffer} to {self.high_water} batches (status state 'full')")
            filled_s = time.perf_counter() - fill_started
            times_ms = []
            loaders = []
            for i in range(WARM_START_REPEATS):
                # The first is a trainer's plain loader (the default consumer); each later one a
                # consumer of its own, left open: closing one would move progress past batch
                # (0, 0), and two open on one consumer take turns at its progress file (a WARNING,
                # and the daemon builds again the batches each moves back to).
                t0 = time.perf_counter()
                loader = BufferLoader(daemon.buffer, normalize=False, timeout=WAIT_SECONDS,
                                      consumer=None if i == 0 else f"warm-start-{i}")
                next(iter(loader))
                times_ms.append((time.perf_counter() - t0) * 1e3)
                loaders.append(loader)
            daemon.monitor.mark_start()
            time.sleep(2 * MONITOR_SECONDS)
            daemon.monitor.mark_end()
            memory = daemon.monitor.summary()
            for loader in loaders:
                loader.close()
        median = statistics.median(times_ms)
        return {
            "workers": k,
            "fill_s": round(filled_s, 2),
            "first_batch_ms": [round(t, 2) for t in times_ms],
            "first_ms": round(times_ms[0], 2),
            "median_ms": round(median, 2),
            "target_ms": WARM_START_TARGET_MS,
            "ok": times_ms[0] <= WARM_START_TARGET_MS,
            "memory": memory,
        }

    # -- torchvision DataLoader ------------------------------------------------------

    def _dataloader(self, row: Throughput, *, uint8: bool, data_wait: bool) -> dict[str, Any] | None:
        import torch
        from torch.utils.data import DataLoader, RandomSampler
        from torchvision import datasets

        # The float32 row does more work than the prefetchd contender, which reads uint8
        # (normalize=False): dataloader-uint8 is the like-for-like one.
        dataset = datasets.ImageFolder(str(self.data), transform=classic_transform(self.image_size, uint8=uint8))
        # shuffle=True, as one long epoch of fresh permutations (see the module docstring).
        sampler = RandomSampler(dataset, num_samples=len(dataset) * 100_000, generator=torch.Generator().manual_seed(0))
        loader = DataLoader(
            dataset, batch_size=self.batch_size, sampler=sampler, num_workers=row.workers,
            persistent_workers=False, prefetch_factor=2, timeout=WAIT_SECONDS,
            worker_init_fn=functools.partial(_pin_worker, tuple(row.cores)),
        )
        started = time.perf_counter()
        it = iter(loader)
        try:
            batches = (int(labels.shape[0]) for _images, labels in it)
            row.first_batch_s, row.images_per_s, row.images, row.window_s = self.window.consume(batches, started)
            scenario = None
            if data_wait:
                scenario = trainer_with_pauses(
                    batches, row.images_per_s, self.batch_size, self.window.length_s, row.workers
                )
                scenario["queue_batches"] = 2 * row.workers
        finally:
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            del it
        return scenario

    # -- SPDL ------------------------------------------------------------------------

    def _spdl(self, row: Throughput) -> None:
        import random

        import torch
        from spdl.pipeline import PipelineBuilder
        from torchvision import datasets

        samples = self._samples()
        tf = classic_transform(self.image_size, uint8=True)
        loader = datasets.folder.pil_loader

        def source() -> Iterator[tuple[str, int]]:
            rng = random.Random(0)
            order = list(samples)
            while True:
                rng.shuffle(order)
                yield from order

        def load(item: tuple[str, int]) -> tuple[Any, int]:
            path, label = item
            return tf(loader(path)), label

        def collate(items: list[tuple[Any, int]]) -> tuple[Any, Any]:
            return torch.stack([i for i, _ in items]), torch.tensor([label for _, label in items])

        pipeline = (
            PipelineBuilder()
            .add_source(source())
            .pipe(load, concurrency=row.workers)
            .aggregate(self.batch_size)
            .pipe(collate)
            .add_sink(2)
            .build(num_threads=row.workers)
        )
        started = time.perf_counter()
        with pipeline.auto_stop(timeout=WAIT_SECONDS):
            batches = (int(labels.shape[0]) for _images, labels in pipeline.get_iterator(timeout=WAIT_SECONDS))
            row.first_batch_s, row.images_per_s, row.images, row.window_s = self.window.consume(batches, started)
        row.note = "threads in the consumer process"

    # -- DALI ------------------------------------------------------------------------

    def _dali(self, row: Throughput, *, crop_aware: bool) -> None:
        import nvidia.dali  # noqa: F401  (imported before the clock starts, as the others' libraries are)

        samples = self._samples()
        started = time.perf_counter()  # building the pipeline is in "first batch", as iter() is for DataLoader
        with contextlib.closing(dali_batches(
            samples, batch_size=self.batch_size, image_size=self.image_size, threads=row.workers,
            crop_aware=crop_aware,
        )) as it:
            batches = (int(labels.shape[0]) for _images, labels in it)
            row.first_batch_s, row.images_per_s, row.images, row.window_s = self.window.consume(batches, started)
        row.note = "CPU pipeline, threads in the consumer process"

    def _samples(self) -> list[tuple[str, int]]:
        """(path, label) as ImageFolder lists them, so every contender reads the same files and labels."""
        from torchvision import datasets

        return list(datasets.ImageFolder(str(self.data)).samples)


def _loader_batches(loader: Any) -> Iterator[int]:
    while True:
        got = False
        for batch in loader:
            got = True
            yield int(batch.images.shape[0])
        if not got:
            raise RuntimeError(f"{loader.buffer}: an epoch without batches; is the daemon's --epochs limit reached?")


def _pin_worker(cores: tuple[int, ...], _worker_id: int) -> None:
    # Forked workers inherit the pinning already; forkserver/spawn ones start
    # from the server's mask, so set it explicitly.
    os.sched_setaffinity(0, cores)
