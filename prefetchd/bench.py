"""`prefetchd bench` / `python tools/bench.py`: prefetchd against the loaders users have today.

One run, one dataset, the same cores for every contender:

    prefetchd          a real `prefetchd start` subprocess, consumed by BufferLoader(normalize=False)
    dataloader         ImageFolder + DataLoader, RandomResizedCrop + flip + ToTensor + Normalize (float32)
    dataloader-uint8   the same with PILToTensor (uint8, no normalisation)
    spdl               an SPDL thread pipeline with the uint8 transforms, if `import spdl` works

Each contender runs with k = 1 .. cores workers, and the whole contender (its
consumer, the daemon's controller, every worker) is pinned to the same k cores,
so "k workers" always means "k cores' worth of CPU", consumer included.  The
consumer is a null consumer: it takes each batch and drops it.

What is measured (see docs/BENCHMARKS.md for how to read it):

- throughput: images/s after the first batch and a short warm-up, so start-up is
  excluded from the rate and reported separately as "first batch";
- warm start: the time from constructing a BufferLoader to holding the first
  batch when the daemon has already filled its buffer (target <= 20 ms);
- data-wait share: a simulated trainer whose steps are twice as fast as the
  producer and which pauses for "evaluation" every few steps, sized so that the
  producer's *average* rate exceeds the trainer's by 30 %.  A producer that keeps
  working during the pause (prefetchd, up to its high-water mark) hides the
  deficit; one with a small queue (DataLoader: prefetch_factor x workers batches)
  makes the trainer wait after each pause;
- memory: the daemon's peak buffer bytes against high_water x batch bytes, and
  the RSS of the daemon's process tree at the first batch and at the end.

DataLoaders iterate one long shuffled epoch (a RandomSampler drawing fresh
permutations of the dataset), so that a small benchmark dataset behaves like a
large one; with persistent_workers=False every real epoch start costs the
"first batch" time again, which the table reports.

Heavy imports (torch, torchvision, spdl, matplotlib) happen inside the
functions, so importing this module for the CLI stays cheap.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import json
import logging
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click
import psutil

log = logging.getLogger(__name__)

RESULTS_FORMAT = "prefetchd.bench"
RESULTS_VERSION = 1

CONTENDERS: dict[str, str] = {
    "prefetchd": "prefetchd daemon -> BufferLoader(normalize=False), uint8",
    "dataloader": "ImageFolder + DataLoader, RandomResizedCrop+flip+ToTensor+Normalize, float32",
    "dataloader-uint8": "ImageFolder + DataLoader, RandomResizedCrop+flip+PILToTensor, uint8",
    "spdl": "SPDL thread pipeline, RandomResizedCrop+flip+PILToTensor, uint8",
}
BASELINE = "dataloader"

WARM_START_TARGET_MS = 20.0
WARM_START_REPEATS = 5
DEFAULT_HIGH_WATER = 16
DEFAULT_GENERATE = 1500
# Every wait on another process is bounded; a stuck contender fails the run
# with this many seconds in the message instead of hanging it.
WAIT_SECONDS = 180.0
DAEMON_STOP_SECONDS = 20.0
# A time window still spans this many batches, so that a slow contender's rate
# is not one batch's time.
MIN_WINDOW_BATCHES = 4
MONITOR_SECONDS = 0.2

# The data-wait trainer: a step takes STEP_SHARE of the producer's time per
# batch, every eval_every(k) steps it pauses, and the pause is sized so that the
# producer's average rate is AVERAGE_HEADROOM times the trainer's.  Between two
# pauses the trainer runs (1 - STEP_SHARE) * eval_every batches ahead of the
# producer: 3k batches, more than a DataLoader's 2k-batch queue can bank, and
# within the default high-water mark (max(16, eval_every)).
STEP_SHARE = 0.5
AVERAGE_HEADROOM = 1.3
MIN_EVAL_EVERY = 12


def eval_every(workers: int) -> int:
    """Trainer steps between two evaluation pauses in the data-wait scenario."""
    return max(MIN_EVAL_EVERY, 6 * workers)


# -- results -------------------------------------------------------------------


@dataclass
class Throughput:
    """One contender at one worker count."""

    contender: str
    workers: int
    cores: list[int]
    images_per_s: float | None = None
    images: int = 0
    window_s: float = 0.0
    first_batch_s: float | None = None  # daemon start / iterator creation -> first batch
    vs_baseline: float | None = None  # images_per_s / the DataLoader's at the same workers
    scaling: float | None = None  # images_per_s / (workers * images_per_s at 1 worker)
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class BenchmarkResults:
    machine: dict[str, Any]
    dataset: dict[str, Any]
    config: dict[str, Any]
    throughput: list[Throughput] = field(default_factory=list)
    warm_start: dict[str, Any] | None = None
    data_wait: dict[str, Any] | None = None
    memory: list[dict[str, Any]] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        return {"format": RESULTS_FORMAT, "version": RESULTS_VERSION, **doc}

    def rate(self, contender: str, workers: int) -> float | None:
        for row in self.throughput:
            if row.contender == contender and row.workers == workers:
                return row.images_per_s
        return None

    def table(self) -> str:
        return format_table(self)


# -- the benchmark ---------------------------------------------------------------


def run_benchmark(
    data: Path,
    *,
    workers_list: Sequence[int] | None = None,
    batch_size: int = 128,
    image_size: int = 224,
    seconds: float | None = 8.0,
    batches: int | None = None,
    out_dir: Path,
    high_water: int | None = None,
    contenders: Sequence[str] = tuple(CONTENDERS),
    warm_start: bool = True,
    data_wait: bool = True,
    report: Callable[[str], None] | None = None,
) -> BenchmarkResults:
    """Measure every contender at every worker count on ``data``; write results into ``out_dir``.

    ``data`` is a class-folder dataset (ImageFolder layout).  ``workers_list``
    defaults to 1 .. the usable cores.  Each measurement lasts ``seconds`` after
    its first batch and a warm-up of 15 % of that (at most 1 s), or, when
    ``batches`` is given, that many batches after a warm-up of a fifth as many.
    ``high_water`` (the daemon's, in batches) defaults to enough for the
    data-wait scenario: max(16, eval_every(max workers)).  Writes
    ``bench.json``, ``bench.txt`` (the table), ``bench.png`` (if matplotlib is
    importable) and ``logs/`` (daemon logs) into ``out_dir`` and returns the results.
    """
    say = report or log.info
    data = Path(data).resolve()
    if not data.is_dir():
        raise ValueError(f"--data {data} is not a directory; pass a class-folder dataset or use --generate")
    usable = sorted(_usable_cores())
    if workers_list is None:
        workers_list = range(1, len(usable) + 1)
    workers_list = sorted(set(int(k) for k in workers_list))
    if not workers_list or workers_list[0] < 1:
        raise ValueError(f"workers {workers_list}: pass worker counts of 1 or more")
    if workers_list[-1] > len(usable):
        raise ValueError(
            f"workers {workers_list[-1]} is more than the {len(usable)} usable cores; every contender is pinned "
            "to as many cores as it has workers, so pick counts up to the core count"
        )
    if batches is not None:
        seconds = None  # a batch count replaces the time window
    elif seconds is None:
        raise ValueError("pass seconds= (a time window per measurement) or batches= (a batch count)")
    if seconds is not None and seconds <= 0 or batches is not None and batches < 1:
        raise ValueError(f"seconds={seconds}, batches={batches}: the measurement needs a positive length")
    unknown = [c for c in contenders if c not in CONTENDERS]
    if unknown:
        raise ValueError(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    if high_water is None:
        high_water = max(DEFAULT_HIGH_WATER, eval_every(workers_list[-1]))
    if high_water < 2:
        raise ValueError(f"high_water={high_water}: the daemon needs at least 2 batches of buffer")

    out_dir = Path(out_dir)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    window = _Window(seconds=seconds, batches=batches)
    dataset = _describe_dataset(data)
    results = BenchmarkResults(
        machine=describe_machine(),
        dataset=dataset,
        config={
            "batch_size": batch_size, "image_size": image_size, "seconds": seconds, "batches": batches,
            "workers": list(workers_list), "high_water": high_water, "contenders": list(contenders),
            "pinning": "each contender (consumer + workers) pinned to the first k usable cores",
        },
    )
    say(f"dataset: {dataset['images']} images in {dataset['classes']} classes, mean {dataset['mean_kb']:.0f} KB; "
        f"{_describe_cpu(results.machine)}")
    spdl_missing = _spdl_missing()
    run = _Run(data=data, batch_size=batch_size, image_size=image_size, window=window, out_dir=out_dir,
               high_water=high_water, say=say)
    k_max = workers_list[-1]
    waits: dict[str, Any] = {}
    original = os.sched_getaffinity(0)
    try:
        for k in workers_list:
            cores = usable[:k]
            for name in contenders:
                wait = data_wait and k == k_max and name in ("prefetchd", BASELINE)
                if name == "spdl" and spdl_missing:
                    results.throughput.append(Throughput(name, k, cores, note=spdl_missing))
                    continue
                say(f"measuring {name} with {_workers(k)} on cores {_cores(cores)}")
                row, scenario = run.measure(name, k, cores, data_wait=wait)
                results.throughput.append(row)
                if scenario is not None:
                    waits[name] = scenario
                    if name == "prefetchd" and high_water < scenario["eval_every_steps"]:
                        results.notes.append(
                            f"the daemon's high-water mark ({high_water}) is below the {scenario['eval_every_steps']} "
                            "steps between evaluations, so its buffer cannot bank a whole pause's production"
                        )
                if row.images_per_s is not None:
                    say(f"  {row.images_per_s:.0f} img/s" + (f"; {row.note}" if row.note else ""))
                mem = row.extra.pop("memory", None)
                if mem:
                    results.memory.append({"workers": k, **mem})
        if warm_start and "prefetchd" in contenders:
            say(f"measuring prefetchd's warm start ({_workers(k_max)}, buffer filled to {high_water} batches)")
            try:
                results.warm_start = run.warm_start(k_max, usable[:k_max])
            except Exception as exc:  # keep the throughput numbers
                log.debug("warm start failed", exc_info=True)
                results.warm_start = {"workers": k_max, "error": f"{type(exc).__name__}: {exc}"}
                say(f"  failed: {results.warm_start['error']}")
            mem = results.warm_start.pop("memory", None)
            if mem:
                results.memory.append({"workers": k_max, "phase": "warm start (filled to high water)", **mem})
    finally:
        os.sched_setaffinity(0, original)
    if waits:
        results.data_wait = {"workers": k_max, **_data_wait_doc(k_max), "contenders": waits}
    _fill_ratios(results)
    results.notes.append(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}")
    results.machine["load_average_end"] = round(os.getloadavg()[0], 2)
    _write_outputs(results, out_dir, say)
    return results


@dataclass(frozen=True)
class _Window:
    seconds: float | None
    batches: int | None

    def consume(
        self, batches: Iterator[int], started: float, on_first: Callable[[], None] | None = None
    ) -> tuple[float, float, int, float]:
        """(first_batch_s, images_per_s, images, window_s) from an iterator of batch sizes."""
        next(batches)
        first = time.perf_counter()
        if on_first is not None:
            on_first()
        if self.batches is None:
            assert self.seconds is not None
            warmup = min(1.0, 0.15 * self.seconds)
            while time.perf_counter() - first < warmup:
                next(batches)
        else:
            for _ in range(max(1, self.batches // 5)):
                next(batches)
        start = now = time.perf_counter()
        images = count = 0
        while True:
            images += next(batches)
            count += 1
            now = time.perf_counter()
            if self.batches is not None and count >= self.batches:
                break
            if self.seconds is not None and now - start >= self.seconds and count >= MIN_WINDOW_BATCHES:
                break
        span = now - start
        return first - started, images / span, images, span

    @property
    def length_s(self) -> float:
        return self.seconds if self.seconds is not None else 2.0


@dataclass
class _Run:
    data: Path
    batch_size: int
    image_size: int
    window: _Window
    out_dir: Path
    high_water: int
    say: Callable[[str], None]

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
            if name == "prefetchd":
                scenario = self._prefetchd(row, data_wait)
            elif name == "spdl":
                self._spdl(row)
            else:
                scenario = self._dataloader(row, uint8=name == "dataloader-uint8", data_wait=data_wait)
        except Exception as exc:  # one failing contender must not lose the others' numbers
            log.debug("%s with %d workers failed", name, k, exc_info=True)
            row.images_per_s = None
            row.note = f"failed: {type(exc).__name__}: {exc}"
            self.say(f"  {row.note}")
        finally:
            torch.set_num_threads(threads)
        return row, scenario

    # -- prefetchd ---------------------------------------------------------------

    def _prefetchd(self, row: Throughput, data_wait: bool) -> dict[str, Any] | None:
        from prefetchd.trainer import BufferLoader

        with _Daemon(self, row.workers, f"k{row.workers}") as daemon:
            started = daemon.started
            daemon.wait_for_manifest()
            loader = BufferLoader(daemon.buffer, normalize=False, timeout=WAIT_SECONDS)
            try:
                batches = _loader_batches(loader)
                monitor = daemon.monitor
                first_batch, rate, images, span = self.window.consume(batches, started, monitor.mark_start)
                row.first_batch_s, row.images_per_s, row.images, row.window_s = first_batch, rate, images, span
                row.extra["affinity"] = daemon.affinity_check(row.cores)
                if not row.extra["affinity"]["pinned"]:
                    row.note = "daemon processes were not all pinned (see extra.affinity)"
                scenario = None
                if data_wait:
                    scenario = _trainer_with_pauses(batches, rate, self.batch_size, self.window.length_s, row.workers)
                monitor.mark_end()
            finally:
                loader.close()
            row.extra["memory"] = daemon.monitor.summary()
        return scenario

    def warm_start(self, k: int, cores: list[int]) -> dict[str, Any]:
        from prefetchd.buffer_protocol import State, read_status
        from prefetchd.trainer import BufferLoader

        os.sched_setaffinity(0, cores)
        with _Daemon(self, k, "warm") as daemon:
            daemon.wait_for_manifest()
            fill_started = time.perf_counter()
            daemon.wait_for(lambda: (st := read_status(daemon.buffer)) is not None and st.state == State.FULL,
                            f"the daemon to fill {daemon.buffer} to {self.high_water} batches (status state 'full')")
            filled_s = time.perf_counter() - fill_started
            times_ms = []
            for _ in range(WARM_START_REPEATS):
                # Loaders are left open: closing one would move progress past batch
                # (0, 0) and the next loader would have to wait for it to be rebuilt.
                t0 = time.perf_counter()
                loader = BufferLoader(daemon.buffer, normalize=False, timeout=WAIT_SECONDS)
                next(iter(loader))
                times_ms.append((time.perf_counter() - t0) * 1e3)
            daemon.monitor.mark_start()
            time.sleep(2 * MONITOR_SECONDS)
            daemon.monitor.mark_end()
            memory = daemon.monitor.summary()
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
        from torchvision import datasets, transforms

        steps: list[Any] = [transforms.RandomResizedCrop(self.image_size), transforms.RandomHorizontalFlip()]
        if uint8:
            steps.append(transforms.PILToTensor())
        else:
            steps += [transforms.ToTensor(), transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]
        dataset = datasets.ImageFolder(str(self.data), transform=transforms.Compose(steps))
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
                scenario = _trainer_with_pauses(
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
        from torchvision import datasets, transforms

        samples = datasets.ImageFolder(str(self.data)).samples
        tf = transforms.Compose([
            transforms.RandomResizedCrop(self.image_size), transforms.RandomHorizontalFlip(), transforms.PILToTensor(),
        ])
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


# -- the data-wait scenario ----------------------------------------------------------


def _data_wait_doc(workers: int) -> dict[str, Any]:
    n = eval_every(workers)
    return {
        "eval_every_steps": n,
        "step_share": STEP_SHARE,
        "average_headroom": AVERAGE_HEADROOM,
        "definition": (
            f"trainer step = {STEP_SHARE} x (batch / producer img/s); every {n} steps an evaluation pause "
            f"sized so the producer's average rate is {AVERAGE_HEADROOM} x the trainer's; wait share = time blocked "
            "in next(batch) / wall time of the measured cycles (the first cycle is a warm-up)"
        ),
    }


def _trainer_with_pauses(
    batches: Iterator[int], rate: float, batch_size: int, length_s: float, workers: int
) -> dict[str, Any]:
    """Run the simulated trainer on ``batches``; ``rate`` is the producer's measured img/s."""
    every = eval_every(workers)
    per_batch = batch_size / rate
    step_s = STEP_SHARE * per_batch
    pause_s = (AVERAGE_HEADROOM - STEP_SHARE) * every * per_batch
    cycle_s = every * step_s + pause_s
    cycles = max(2, math.ceil(length_s / cycle_s))
    wait = 0.0
    waits_after_pause = 0.0
    start = time.perf_counter()
    for cycle in range(cycles + 1):
        if cycle == 1:
            wait, waits_after_pause, start = 0.0, 0.0, time.perf_counter()
        for _step in range(every):
            t0 = time.perf_counter()
            next(batches)
            waited = time.perf_counter() - t0
            wait += waited
            if _step == 0:
                waits_after_pause += waited
            time.sleep(step_s)
        time.sleep(pause_s)
    wall = time.perf_counter() - start
    return {
        "producer_images_per_s": round(rate, 1),
        "eval_every_steps": every,
        "step_s": round(step_s, 4),
        "pause_s": round(pause_s, 3),
        "cycles": cycles,
        "wall_s": round(wall, 2),
        "wait_s": round(wait, 3),
        "wait_share": round(wait / wall, 4),
        "first_step_wait_s": round(waits_after_pause, 3),
    }


# -- the daemon --------------------------------------------------------------------


def _buffer_root() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


class _Daemon:
    """A `prefetchd start` subprocess on a fresh buffer, stopped and cleaned up on exit."""

    def __init__(self, run: _Run, workers: int, tag: str) -> None:
        self.buffer = _buffer_root() / f"prefetchd-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.log_path = run.out_dir / "logs" / f"daemon-{tag}.log"
        self.cmd = [
            sys.executable, "-m", "prefetchd", "start", "--buffer", str(self.buffer), "--data", str(run.data),
            "--workers", str(workers), "--batch-size", str(run.batch_size), "--image-size", str(run.image_size),
            "--high-water", str(run.high_water), "--seed", "0", "--reset",
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.monitor: _BufferMonitor

    def __enter__(self) -> _Daemon:
        with open(self.log_path, "wb") as fh:
            self.started = time.perf_counter()
            # Inherits this process's CPU mask, and its spawned workers inherit the daemon's.
            self.proc = subprocess.Popen(self.cmd, stdout=fh, stderr=subprocess.STDOUT)
        self.monitor = _BufferMonitor(self.buffer, self.proc.pid)
        self.monitor.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.monitor.stop()
        from prefetchd.buffer_protocol import stop_daemon_process

        if self.proc is not None and stop_daemon_process(self.proc, DAEMON_STOP_SECONDS):
            log.warning("the daemon (pid %d) did not stop within %.0f s; killed it", self.proc.pid, DAEMON_STOP_SECONDS)
        shutil.rmtree(self.buffer, ignore_errors=True)

    def wait_for(self, predicate: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_SECONDS
        while not _safe(predicate):
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with code {self.proc.returncode} while waiting for {what}; "
                                   f"see {self.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {WAIT_SECONDS:.0f} s for {what}; see {self.log_path}")
            time.sleep(0.02)

    def wait_for_manifest(self) -> None:
        # BufferLoader would wait out its whole timeout for a daemon that died at
        # start; this wait notices the exit.
        from prefetchd.buffer_protocol.layout import MANIFEST_NAME

        self.wait_for(lambda: (self.buffer / MANIFEST_NAME).exists(), f"the daemon's {MANIFEST_NAME}")

    def affinity_check(self, cores: list[int]) -> dict[str, Any]:
        assert self.proc is not None
        masks: dict[str, list[int]] = {}
        try:
            root = psutil.Process(self.proc.pid)
            for p in (root, *root.children(recursive=True)):
                with contextlib.suppress(psutil.Error):
                    masks[str(p.pid)] = sorted(p.cpu_affinity() or [])
        except psutil.Error:
            pass
        return {"pinned": bool(masks) and all(set(m) <= set(cores) for m in masks.values()), "processes": len(masks)}


def _safe(predicate: Callable[[], bool]) -> bool:
    try:
        return predicate()
    except (OSError, ValueError):  # a status file between writes, or not there yet
        return False


def _tree_memory(pid: int, kind: str) -> int | None:
    """``kind`` ("rss" or "pss") summed over ``pid`` and its descendants.

    RSS counts shared library pages once per process; PSS splits shared pages between
    their users, so its sum is the tree's real share.
    """
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error, AttributeError):
            info = p.memory_info() if kind == "rss" else p.memory_full_info()
            total += getattr(info, kind, 0)
    return total or None


def _disk_bytes(buffer: Path) -> int:
    """Bytes the buffer's batch files (finished and being written) really occupy on the tmpfs."""
    total = 0
    with contextlib.suppress(OSError), os.scandir(buffer) as entries:
        for entry in entries:
            if not (entry.name.endswith(".batch") or ".tmp" in entry.name):
                continue  # manifest, status, progress, lock: a few KiB, not the buffer
            with contextlib.suppress(OSError):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


class _BufferMonitor:
    """Samples the daemon's status, the buffer's real size and the daemon tree's RSS in a thread."""

    def __init__(self, buffer: Path, pid: int) -> None:
        self.buffer, self.pid = buffer, pid
        self.peak_status_bytes = 0
        self.peak_disk_bytes = 0
        self.peak_waiting = 0
        self.high_water: int | None = None
        self.batch_bytes: int | None = None
        self.rss_start: int | None = None
        self.rss_end: int | None = None
        self.rss_peak = 0
        self.pss_start: int | None = None
        self.pss_end: int | None = None
        self._stop = threading.Event()
        self._measuring = False
        self._thread = threading.Thread(target=self._loop, name="bench-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def mark_start(self) -> None:
        self.rss_start = _tree_memory(self.pid, "rss")
        self.pss_start = _tree_memory(self.pid, "pss")
        self._measuring = True

    def mark_end(self) -> None:
        self.rss_end = _tree_memory(self.pid, "rss")
        self.pss_end = _tree_memory(self.pid, "pss")

    def _loop(self) -> None:
        from prefetchd.buffer_protocol import ProtocolError, read_status

        while not self._stop.wait(MONITOR_SECONDS):
            try:
                status = read_status(self.buffer)
            except (OSError, ProtocolError, ValueError):
                status = None
            production = status.production if status is not None else None
            if production is not None:
                self.peak_status_bytes = max(self.peak_status_bytes, production.buffer_bytes)
                self.peak_waiting = max(self.peak_waiting, production.waiting)
                self.high_water = production.high_water
                self.batch_bytes = production.batch_bytes
            self.peak_disk_bytes = max(self.peak_disk_bytes, _disk_bytes(self.buffer))
            if self._measuring:
                rss = _tree_memory(self.pid, "rss")
                if rss is not None:
                    self.rss_peak = max(self.rss_peak, rss)

    def summary(self) -> dict[str, Any]:
        planned = self.high_water * self.batch_bytes if self.high_water and self.batch_bytes else None
        return {
            "high_water": self.high_water,
            "batch_bytes": self.batch_bytes,
            "planned_bytes": planned,
            "peak_status_bytes": self.peak_status_bytes,
            "peak_disk_bytes": self.peak_disk_bytes,
            "peak_waiting_batches": self.peak_waiting,
            "within_plan": planned is not None and max(self.peak_status_bytes, self.peak_disk_bytes) <= planned,
            "rss_start_bytes": self.rss_start,
            "rss_end_bytes": self.rss_end,
            "rss_peak_bytes": self.rss_peak or None,
            "pss_start_bytes": self.pss_start,
            "pss_end_bytes": self.pss_end,
        }


# -- machine, dataset, outputs -------------------------------------------------------


def _usable_cores() -> set[int]:
    return set(os.sched_getaffinity(0))


def _cores(cores: Sequence[int]) -> str:
    return ",".join(str(c) for c in cores)


def _spdl_missing() -> str:
    try:
        import spdl.pipeline  # noqa: F401
    except ImportError:
        return "not installed (pip install spdl-core)"
    return ""


def describe_machine() -> dict[str, Any]:
    import numpy
    import PIL
    import torch
    import torchvision

    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    shm = _buffer_root()
    du = shutil.disk_usage(shm)
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu_model": model or platform.processor() or "unknown",
        "cpus": os.cpu_count(),
        "usable_cpus": len(_usable_cores()),
        "ram_bytes": psutil.virtual_memory().total,
        "buffer_fs": str(shm),
        "buffer_fs_bytes": du.total,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "pillow": PIL.__version__,
        "numpy": numpy.__version__,
        "load_average_start": round(os.getloadavg()[0], 2),
    }


def _describe_cpu(machine: dict[str, Any]) -> str:
    return (f"{machine['usable_cpus']} usable cores ({machine['cpu_model']}), "
            f"{machine['ram_bytes'] / 2**30:.0f} GiB RAM, load average {machine['load_average_start']}")


def _describe_dataset(root: Path) -> dict[str, Any]:
    from torchvision.datasets.folder import IMG_EXTENSIONS

    classes = [d for d in sorted(os.scandir(root), key=lambda e: e.name) if d.is_dir()]
    sizes = []
    for d in classes:
        for dirpath, _dirs, files in os.walk(d.path):
            for f in files:
                if f.lower().endswith(IMG_EXTENSIONS):
                    sizes.append(os.path.getsize(os.path.join(dirpath, f)))
    if not sizes:
        raise ValueError(f"{root} holds no images in class folders; pass an ImageFolder-style dataset or use --generate")
    return {
        "root": str(root),
        "classes": len(classes),
        "images": len(sizes),
        "total_bytes": sum(sizes),
        "mean_kb": round(sum(sizes) / len(sizes) / 1024, 1),
    }


def _fill_ratios(results: BenchmarkResults) -> None:
    for row in results.throughput:
        if row.images_per_s is None:
            continue
        base = results.rate(BASELINE, row.workers)
        if base:
            row.vs_baseline = round(row.images_per_s / base, 3)
        one = results.rate(row.contender, 1)
        if one:
            row.scaling = round(row.images_per_s / (row.workers * one), 3)
        row.images_per_s = round(row.images_per_s, 1)
        row.window_s = round(row.window_s, 2)
        if row.first_batch_s is not None:
            row.first_batch_s = round(row.first_batch_s, 3)


def _mib(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 2**20:.0f} MiB" if n >= 10 * 2**20 else f"{n / 2**20:.2g} MiB"


def _workers(k: int) -> str:
    return f"{k} worker{'s' * (k != 1)}"


def format_table(results: BenchmarkResults) -> str:
    m, d, c = results.machine, results.dataset, results.config
    window = f"{c['seconds']:g} s" if c.get("seconds") is not None else f"{c['batches']} batches"
    lines = [
        f"prefetchd bench, {m['date']}",
        f"machine: {_describe_cpu(m)}; {m['platform']}; python {m['python']}, torch {m['torch']}, "
        f"torchvision {m['torchvision']}, pillow {m['pillow']}",
        f"dataset: {d['images']} images, {d['classes']} classes, mean {d['mean_kb']:.0f} KB ({d['root']})",
        f"batch {c['batch_size']}, image {c['image_size']}px, {window} per measurement; every contender pinned to "
        "as many cores as it has workers (consumer included)",
        "",
    ]
    header = ("contender", "workers", "img/s", "vs dataloader", "scaling", "first batch")
    rows = []
    for r in results.throughput:
        if r.images_per_s is None:
            rows.append((r.contender, str(r.workers), "-", "-", "-", r.note or "-"))
            continue
        rows.append((
            r.contender, str(r.workers), f"{r.images_per_s:.0f}",
            f"{r.vs_baseline:.2f}x" if r.vs_baseline is not None else "-",
            f"{r.scaling:.0%}" if r.scaling is not None else "-",
            f"{r.first_batch_s:.2f} s" if r.first_batch_s is not None else "-",
        ))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines.append(fmt.format(*header))
    lines.append("  ".join("-" * w for w in widths))
    lines += [fmt.format(*row) for row in rows]
    lines.append("first batch: prefetchd = daemon start -> first batch (cold); DataLoader = iter() -> first batch, "
                 "paid again at every epoch start with persistent_workers=False")
    ws = results.warm_start
    if ws and "error" in ws:
        lines += ["", f"warm start ({_workers(ws['workers'])}): failed: {ws['error']}"]
    elif ws:
        verdict = "ok" if ws["ok"] else "above target"
        lines += ["", f"warm start ({_workers(ws['workers'])}, buffer filled in {ws['fill_s']:.1f} s): "
                      f"BufferLoader() -> first batch {ws['first_ms']:.1f} ms (median of {len(ws['first_batch_ms'])}: "
                      f"{ws['median_ms']:.1f} ms; target <= {ws['target_ms']:.0f} ms: {verdict})"]
    dw = results.data_wait
    if dw:
        lines += ["", f"data-wait share ({_workers(dw['workers'])}; step = {dw['step_share']} x producer batch time, "
                      f"evaluation pause every {dw['eval_every_steps']} steps, producer average "
                      f"{dw['average_headroom']} x the trainer's):"]
        for name, s in dw["contenders"].items():
            queue = f", queue {s['queue_batches']} batches" if "queue_batches" in s else ""
            lines.append(f"  {name:<12} {s['wait_share']:6.1%} of {s['wall_s']:.1f} s waiting for data "
                         f"(step {s['step_s'] * 1e3:.0f} ms, pause {s['pause_s']:.2f} s, {s['cycles']} cycles{queue})")
    if results.memory:
        lines += ["", "prefetchd memory (RSS and PSS summed over the daemon's process tree; buffer bytes vs "
                      "high_water x batch bytes):"]
        for mem in results.memory:
            phase = mem.get("phase", "throughput run")
            lines.append(
                f"  {_workers(mem['workers'])}, {phase}: RSS {_mib(mem['rss_start_bytes'])} at first batch -> "
                f"{_mib(mem['rss_end_bytes'])} at end (peak {_mib(mem['rss_peak_bytes'])}; PSS "
                f"{_mib(mem['pss_start_bytes'])} -> {_mib(mem['pss_end_bytes'])}); buffer peak "
                f"{_mib(mem['peak_status_bytes'])} by status, {_mib(mem['peak_disk_bytes'])} on tmpfs, plan "
                f"{mem['high_water']} x {_mib(mem['batch_bytes'])} = {_mib(mem['planned_bytes'])}"
                f"{'' if mem['within_plan'] else ' (ABOVE PLAN)'}"
            )
    for note in results.notes:
        lines.append(note)
    return "\n".join(lines)


def _plot(results: BenchmarkResults, path: Path) -> str | None:
    """Write the img/s vs workers plot; return why not, or None when written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'prefetchd[bench]'); skipped the plot"
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    workers = results.config["workers"]
    for name in CONTENDERS:
        points = [(r.workers, r.images_per_s) for r in results.throughput
                  if r.contender == name and r.images_per_s is not None]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("workers (= pinned cores)")
    ax.set_ylabel("images / s")
    ax.set_xticks(workers)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    m, c = results.machine, results.config
    ax.set_title(f"{c['batch_size']} x {c['image_size']}px batches from {results.dataset['images']} images "
                 f"({Path(results.dataset['root']).name}, mean {results.dataset['mean_kb']:.0f} KB)\n"
                 f"{m['usable_cpus']} cores, {m['cpu_model']}, {m['date'][:10]}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def _write_outputs(results: BenchmarkResults, out_dir: Path, say: Callable[[str], None]) -> None:
    png = out_dir / "bench.png"
    why = _plot(results, png)
    if why is None:
        results.files["plot"] = str(png)
    else:
        results.notes.append(why)
        say(why)
    results.files["json"] = str(out_dir / "bench.json")
    results.files["table"] = str(out_dir / "bench.txt")
    results.files["logs"] = str(out_dir / "logs")
    (out_dir / "bench.txt").write_text(results.table() + "\n")
    (out_dir / "bench.json").write_text(json.dumps(results.to_dict(), indent=2) + "\n")


# -- the command -------------------------------------------------------------------------


def _parse_workers(_ctx: click.Context, _param: click.Parameter, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        counts = sorted({int(v) for v in value.split(",") if v.strip()})
    except ValueError:
        raise click.BadParameter(f"{value!r}: give worker counts separated by commas, e.g. 1,2,4") from None
    if not counts or counts[0] < 1:
        raise click.BadParameter(f"{value!r}: worker counts must be 1 or more")
    return counts


@click.command("bench", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--data", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Class-folder dataset to read. Without it an ImageNet-like set is generated in a temp dir.")
@click.option("--generate", "generate", type=click.IntRange(min=1), default=DEFAULT_GENERATE, show_default=True,
              help="Images to generate when --data is not given.")
@click.option("--source", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Folder of real photos to cut the generated images from (instead of synthetic pictures).")
@click.option("--keep-data", is_flag=True, help="Keep the generated dataset (its path is printed).")
@click.option("--workers", "workers", callback=_parse_workers, metavar="K1,K2,...",
              help="Worker counts to measure  [default: 1..usable cores]")
@click.option("--batch-size", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--image-size", type=click.IntRange(min=8), default=224, show_default=True)
@click.option("--seconds", type=click.FloatRange(min=0, min_open=True), default=8.0, show_default=True,
              help="Length of each measurement after its first batch and warm-up.")
@click.option("--batches", type=click.IntRange(min=1), help="Measure this many batches instead of --seconds.")
@click.option("--high-water", type=click.IntRange(min=2), default=None,
              help="The daemon's --high-water in batches  [default: max(16, 6 x max workers)]")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("bench-out"),
              show_default=True, help="Where bench.json, bench.txt, bench.png and logs/ go.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="warning",
              show_default=True, help="Log level of the benchmark's own diagnostics.")
def bench_command(
    data: Path | None,
    generate: int,
    source: Path | None,
    keep_data: bool,
    workers: list[int] | None,
    batch_size: int,
    image_size: int,
    seconds: float,
    batches: int | None,
    high_water: int | None,
    out_dir: Path,
    log_level: str,
) -> None:
    """Measure images/s of prefetchd against ImageFolder + DataLoader (and SPDL, if installed).

    Every contender runs on the same dataset with 1..cores workers, pinned to as
    many cores as it has workers. Prints a table and writes bench.json,
    bench.txt and bench.png into --out.
    """
    if not logging.getLogger().handlers:
        logging.basicConfig(level=getattr(logging, log_level.upper()),
                            format="%(asctime)s %(levelname)-7s %(name)s: %(message)s", stream=sys.stderr)

    def say(msg: str) -> None:
        click.echo(msg, err=True)

    generated: Path | None = None
    try:
        if data is None:
            generated = Path(tempfile.mkdtemp(prefix="prefetchd-bench-data-"))
            data = generated / "train"
            data_classes = min(10, generate)
            per_class = math.ceil(generate / data_classes)
            say(f"generating {data_classes * per_class} ImageNet-like JPEGs in {data}")
            from prefetchd.synthetic import make_imagenet_like

            with click.progressbar(length=data_classes * per_class, label="images", file=sys.stderr) as bar:
                summary = make_imagenet_like(
                    data, classes=data_classes, per_class=per_class, seed=0, source=source,
                    workers=len(_usable_cores()), progress=lambda done, _total: bar.update(done - bar.pos),
                )
            say(summary.line())
        elif source is not None:
            raise click.UsageError("--source only applies when generating; drop it or drop --data")
        results = run_benchmark(
            data, workers_list=workers, batch_size=batch_size, image_size=image_size,
            seconds=seconds, batches=batches, out_dir=out_dir, high_water=high_water,
            report=say,
        )
    except (ValueError, FileExistsError) as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        if generated is not None:
            if keep_data:
                say(f"kept the generated dataset in {generated}")
            else:
                shutil.rmtree(generated, ignore_errors=True)
    click.echo(results.table())
    click.echo(f"\nwrote {', '.join(results.files[k] for k in ('table', 'json', 'plot') if k in results.files)}")


__all__ = ["CONTENDERS", "BenchmarkResults", "Throughput", "bench_command", "describe_machine", "format_table",
           "run_benchmark"]
