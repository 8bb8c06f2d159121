"""One command that proves the GPU path on a GPU machine and writes docs/GPU.md + docs/gpu.json.

    python tools/gpu_check.py [--out docs/gpu.json] [--commit HASH] [--steps 200] [--rounds 3]
                              [--data IMAGEFOLDER] [--workers 15,12] [--skip-tests] [--skip-scaling]
                              [--time-limit SECONDS] [--dry-run]

Steps, each recorded in the JSON (rewritten after every step, so a run cut short
still leaves what it measured) and in GPU.md beside it.  Step 1 runs while the
dataset is generated and ends before step 2 times the copies; step 5, short, runs
before 3 and 4, the longest:

1. ``pytest -m gpu``: the GPU tests, their counts;
2. host-to-device copies of batch files (``tools/h2d_bench.py`` used as a module) at
   batch 128 and 256, 224 px: pageable, staging (pinned ring) and registered mapping,
   the transfer alone and ``BufferLoader`` end to end, against torch's own copy from
   pinned memory of the same size (the ceiling of a host-to-device copy);
3. ResNet-50 (channels_last, bf16 autocast, batch 256, SGD) for a fixed number of
   steps, fed three ways: by a prefetchd daemon with all cores but one, by
   ImageFolder + DataLoader with as many workers, and by synthetic tensors already on
   the GPU (the ceiling).  Per feed: images/s, data-wait share (time blocked in
   ``next()`` over wall time, as prefetchd-train defines it), GPU busy share (CUDA
   events around each step), GPU utilisation (NVML, when ``pynvml`` imports), host
   memory (PSS of this process tree, the system's used memory above the start).  The
   dataset is written back and read once first, and each feed trains three times in
   rotated order; its row is the median round;
4. the same model fed by DALI's GPU pipeline when ``nvidia.dali`` imports;
5. the producer alone on more cores than the 2 of the development machine:
   ``prefetchd bench``'s prefetchd row (no GPU, a null consumer) at 1, 2, 4, ... workers
   up to every core, with the floor (the daemon's ``augment()`` alone on one core) and
   each count's share of k times it; and at each count, k independent ``augment()`` loops
   on the same cores (the bench's independent loops): what the machine allows, so the
   producer's share of it is what the producer loses on its own.

``--dry-run`` runs every step on the CPU at toy sizes (a small model, 16 images, a
few steps) and writes into a temporary folder unless ``--out`` is given: it keeps
this script working in CI, and its numbers mean nothing.

On the GPU machine the checkout is a copy without ``.git``: pass ``--commit`` with
the hash of the checkout that was sent (README, "On a GPU").

Beside it in tools/: ``host_use.py`` samples the host while a feed trains (memory, NVML,
where the CPU went) and ``gpu_report.py`` writes GPU.md from the results.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import h2d_bench  # tools/ is sys.path[0] when this file runs as a script
from gpu_report import write_outputs
from host_use import CpuUse, HostSampler
from prefetchd.bench import describe_machine, run_benchmark
from prefetchd.buffer_protocol import batch_name, map_batch
from prefetchd.launch import buffer_root, stops_cleanly
from prefetchd.synthetic import make_imagenet_like
from prefetchd.trainer import BufferLoader
from prefetchd.trainer.config import TrainConfig
from prefetchd.trainer.model import build_model
from prefetchd.trainer.spawn import spawn_daemon
from prefetchd.trainer.tensors import IMAGENET_MEAN, IMAGENET_STD

log = logging.getLogger("gpu_check")

REPO = Path(__file__).resolve().parent.parent
RESULTS_FORMAT = "prefetchd.gpu_check"
# 2: training rows are medians over rounds (rounds_images_per_s, failed_rounds); sizes.workers is a list.
RESULTS_VERSION = 2
# Every wait on another process is bounded; a stuck step fails with this in its message.
WAIT_SECONDS = 180.0
TESTS_SECONDS = 300.0


@dataclass(frozen=True)
class Sizes:
    device: str
    model: str
    batch_size: int
    image_size: int
    steps: int  # measured training steps per feed
    warmup_steps: int  # before them, not measured (cudnn autotuning, worker start, daemon fill)
    rounds: int  # each feed trains this many times, the order rotated; its row is the median round
    classes: int
    per_class: int
    high_water: int  # the daemon's buffer, in batches
    h2d_batch_sizes: tuple[int, ...]
    h2d_image_size: int
    h2d_batches: int
    pytest_args: tuple[str, ...]
    scaling_batch_size: int  # step 5, as `prefetchd bench` measures on the 2-core machine
    scaling_seconds: float  # per worker count


# 20,000 files: 78 steps an epoch at batch 256, so the 230 steps of a feed span three
# epochs, and ~2 GB of JPEGs that the page cache holds (the check measures decoding,
# not the disk).  Generating them takes ~40-60 s on 16 cores.  Three rounds: on the first
# H200 run (2026-11-26) one configuration gave 1689 and 4344 images/s in two runs a
# minute apart (the first paid cuDNN's tuning for the short last batch: ``prefetchd_feed``),
# and later rounds still differ by up to ~18 % (the H100's DataLoader).
FULL = Sizes(device="cuda", model="resnet50", batch_size=256, image_size=224, steps=200, warmup_steps=30, rounds=3,
             classes=100, per_class=200, high_water=16, h2d_batch_sizes=(128, 256), h2d_image_size=224,
             h2d_batches=16, pytest_args=(), scaling_batch_size=128, scaling_seconds=5.0)
DRY = Sizes(device="cpu", model="squeezenet1_1", batch_size=8, image_size=32, steps=3, warmup_steps=1, rounds=2,
            classes=2, per_class=8, high_water=4, h2d_batch_sizes=(4, 8), h2d_image_size=32,
            # The GPU tests' folder alone: collecting the whole suite to select 13 took ~15 s of CI's CPU.
            h2d_batches=3, pytest_args=("-n", "0", "tests/trainer"), scaling_batch_size=8, scaling_seconds=0.5)


# -- 1. the GPU tests ------------------------------------------------------------------------


def run_gpu_tests(sizes: Sizes) -> dict[str, Any]:
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *sizes.pytest_args]
    started = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=TESTS_SECONDS)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace")
        return {"command": " ".join(command[1:]), "returncode": None, "counts": {},
                "summary": f"timed out after {TESTS_SECONDS:.0f} s", "tail": out.splitlines()[-30:]}
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    summary = lines[-1].strip("= ") if lines else ""
    counts = {word: int(n) for n, word in
              re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?)", summary)}
    doc: dict[str, Any] = {"command": " ".join(command[1:]), "returncode": proc.returncode, "counts": counts,
                           "summary": summary, "seconds": round(time.perf_counter() - started, 1)}
    if proc.returncode not in (0, 5):  # 5: no test collected (the marker matched nothing)
        doc["tail"] = (proc.stdout + proc.stderr).splitlines()[-40:]
    return doc


# -- 2. host-to-device copies -----------------------------------------------------------------


def h2d_rows(sizes: Sizes, device: torch.device, root: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for batch_size in sizes.h2d_batch_sizes:
        nbytes = batch_size * sizes.h2d_image_size ** 2 * 3
        buffer = h2d_bench.make_buffer(root, sizes.h2d_batches, batch_size, sizes.h2d_image_size)
        try:
            if device.type == "cuda":
                measured = _h2d_cuda(buffer, sizes.h2d_batches, batch_size, nbytes, device)
            else:
                measured = _h2d_host(buffer, sizes.h2d_batches)
        finally:
            shutil.rmtree(buffer, ignore_errors=True)
        reference = next((ms for name, ms, _ in measured if name == "torch pinned"), None)
        for name, ms, parts in measured:
            row: dict[str, Any] = {"batch_size": batch_size, "image_size": sizes.h2d_image_size, "bytes": nbytes,
                                   "mode": name}
            if ms is None:
                row["note"] = str(parts.get("error", "failed"))
            else:
                row.update(us_per_batch=round(ms * 1e3, 1), gb_per_s=round(nbytes / ms / 1e6, 2),
                           parts_ms={k: round(float(v), 3) for k, v in parts.items()})
                if reference:
                    row["vs_torch_pinned"] = round(reference / ms, 3)
            rows.append(row)
    return rows


def _h2d_cuda(buffer: Path, batches: int, batch_size: int, nbytes: int,
              device: torch.device) -> list[tuple[str, float | None, dict[str, Any]]]:
    """h2d_bench's transfer alone and BufferLoader end to end, and torch's pinned copy of the same size."""
    out: list[tuple[str, float | None, dict[str, Any]]] = []
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    clock = h2d_bench.Clock(device)
    for _ in range(batches):
        with clock.part("total"):
            pinned.to(device, non_blocking=True)
    out.append(("torch pinned", clock.median("total"), {}))
    names = {"plain": "pageable", "staging": "staging (pinned copy)", "register": "registered mapping"}
    done = set()
    for name, ms, parts in h2d_bench.transfer_parts(buffer, batches, device):
        out.append((names.get(name, name), ms, parts))
        done.add(name)
    out += [(names[name], None, {"error": "failed; its message is in the log"}) for name in names if name not in done]
    for pin in ("none", "staging", "register"):
        try:
            ms = h2d_bench.loader_per_batch(buffer, batches, device, pin, 0)
        except Exception as exc:  # e.g. registration unsupported: say so, keep the table
            out.append((f"BufferLoader pin={pin}", None, {"error": f"{type(exc).__name__}: {exc}"}))
        else:
            out.append((f"BufferLoader pin={pin}", ms, {}))
    return out


def _h2d_host(buffer: Path, batches: int) -> list[tuple[str, float | None, dict[str, Any]]]:
    """--dry-run without CUDA: map each batch file and copy it into a tensor, to exercise the plumbing."""
    times = []
    for step in range(batches):
        start = time.perf_counter()
        torch.from_numpy(map_batch(buffer / batch_name(0, step)).images).clone()
        times.append((time.perf_counter() - start) * 1e3)
    return [("host copy (no CUDA)", statistics.median(times), {})]


# -- 3./4. training fed four ways ---------------------------------------------------------------

Batches = Iterator[tuple[torch.Tensor, torch.Tensor, bool]]  # images, labels, whether the batch opens an epoch
Feed = Callable[[], AbstractContextManager[Batches]]


def worker_counts(text: str) -> list[int]:
    """``--workers 15,12`` as [15, 12]."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give worker counts of 1 or more, separated by commas (15,12)")
    return counts


def cores_but_one() -> int:
    return max(1, len(os.sched_getaffinity(0)) - 1)


@contextlib.contextmanager
def prefetchd_feed(data: Path, sizes: Sizes, workers: int, device: torch.device, root: Path) -> Iterator[Batches]:
    buffer = root / f"prefetchd-gpu-check-{os.getpid()}"
    shutil.rmtree(buffer, ignore_errors=True)
    # Full batches only, as the DataLoader feed's drop_last=True: a short last batch made
    # cudnn.benchmark tune itself again inside the first daemon-fed round (H100 lease, e14658c:
    # one fifth of that round at 1389 images/s, the GPU busy, no step waiting for data).
    config = TrainConfig(buffer=buffer, batch_size=sizes.batch_size, image_size=sizes.image_size, workers=workers,
                         high_water=sizes.high_water, seed=0, quiet=True, drop_last=True)
    daemon = spawn_daemon(buffer, data, "train", config, echo=log.info)
    if daemon is None:
        raise RuntimeError(f"{buffer} is already served by another daemon; stop it first")
    try:
        daemon.wait_ready(WAIT_SECONDS)
        loader = BufferLoader(buffer, device=device, normalize=True, timeout=WAIT_SECONDS)
        try:
            yield _epochs(lambda: ((b.images, b.labels) for b in loader), f"the daemon's buffer {buffer}")
        finally:
            loader.close()
    finally:
        daemon.stop()
        shutil.rmtree(buffer, ignore_errors=True)


@contextlib.contextmanager
def dataloader_feed(data: Path, sizes: Sizes, workers: int, device: torch.device) -> Iterator[Batches]:
    from torch.utils.data import DataLoader
    from torchvision import datasets, transforms

    # What users run today: PIL decode, RandomResizedCrop, flip, float32 normalised in the workers.
    transform = transforms.Compose([
        transforms.RandomResizedCrop(sizes.image_size), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])
    loader = DataLoader(datasets.ImageFolder(str(data), transform=transform), batch_size=sizes.batch_size,
                        shuffle=True, drop_last=True, num_workers=workers, persistent_workers=True,
                        prefetch_factor=2, pin_memory=device.type == "cuda", timeout=WAIT_SECONDS,
                        generator=torch.Generator().manual_seed(0))
    it = _epochs(lambda: iter(loader), f"the DataLoader over {data}")
    try:
        yield it
    finally:
        it.close()
        workers_iter = getattr(loader, "_iterator", None)  # persistent workers outlive an epoch: end them now
        if workers_iter is not None:
            workers_iter._shutdown_workers()


@contextlib.contextmanager
def synthetic_feed(sizes: Sizes, classes: int, device: torch.device) -> Iterator[Batches]:
    images = torch.randn(sizes.batch_size, 3, sizes.image_size, sizes.image_size, device=device)
    images = images.contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, classes, (sizes.batch_size,), device=device)

    def forever() -> Batches:
        while True:
            yield images, labels, False

    yield forever()


def dali_missing(device: torch.device) -> str | None:
    try:
        import nvidia.dali  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install failing at import
        return f"skipped: nvidia.dali not importable ({type(exc).__name__})"
    if device.type != "cuda":
        return "skipped: DALI's mixed decoder needs a GPU (dry run on the CPU)"
    return None


@contextlib.contextmanager
def dali_feed(data: Path, sizes: Sizes, workers: int, device: torch.device) -> Iterator[Batches]:
    # Untyped on purpose: DALI's stubs differ between releases (2.4's lack fn's and types'
    # names), and this is the one place that uses them.
    dali: Any = importlib.import_module("nvidia.dali")
    fn, types = dali.fn, dali.types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    @dali.pipeline_def  # type: ignore[untyped-decorator]
    def pipeline() -> Any:
        # readers.file labels class folders in sorted order, as ImageFolder does.
        jpegs, labels = fn.readers.file(file_root=str(data), random_shuffle=True, name="reader")
        images = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB)
        images = fn.resize(images, resize_x=sizes.image_size, resize_y=sizes.image_size)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="HWC",
                                          mean=[m * 255 for m in IMAGENET_MEAN], std=[s * 255 for s in IMAGENET_STD],
                                          mirror=fn.random.coin_flip())
        return images, labels.gpu()

    pipe = pipeline(batch_size=sizes.batch_size, num_threads=workers, device_id=device.index or 0, seed=0)
    pipe.build()
    it = DALIGenericIterator([pipe], ["images", "labels"], reader_name="reader", auto_reset=True)

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for out in it:
            # NHWC memory seen as NCHW is channels_last, which the model wants anyway.
            yield out[0]["images"].permute(0, 3, 1, 2), out[0]["labels"].reshape(-1).long()

    yield _epochs(batches, f"DALI over {data}")


def _epochs(epoch: Callable[[], Iterator[Any]],
            what: str) -> Generator[tuple[torch.Tensor, torch.Tensor, bool], None, None]:
    """Batches across epochs, as a training loop that runs for a number of steps sees them, each
    marked where it opens an epoch (a DataLoader waits there for its workers' first batches)."""
    while True:
        got = False
        for images, labels in epoch():
            yield images, labels, not got
            got = True
        if not got:
            raise RuntimeError(f"{what}: an epoch without batches")


def train_with(name: str, feed: Feed, sizes: Sizes, classes: int, device: torch.device) -> dict[str, Any]:
    """Train a fresh model for warmup + steps batches from ``feed``; what it took."""
    torch.manual_seed(0)
    model = build_model(sizes.model, classes, pretrained=False, echo=log.info)
    model = model.to(device, memory_format=torch.channels_last)  # type: ignore[call-overload]
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5)
    criterion = nn.CrossEntropyLoss()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    sampler = HostSampler(device)
    events: list[tuple[Any, Any]] = []
    marks: list[float] = []  # each measured step's start, then the end: where in the round time went
    waits: list[float] = []  # each measured step's time in next()
    counts: list[int] = []  # each measured step's images: an epoch's last batch can be short
    opens: list[bool] = []  # whether each measured step's batch opened an epoch
    first_batch_s = wall = 0.0
    loss = torch.zeros(())
    cpu: CpuUse | None = None  # from the first measured step
    cpu_use: dict[str, float] = {}
    try:
        started = time.perf_counter()
        with feed() as batches:
            measured_from = started
            for step in range(sizes.warmup_steps + sizes.steps):
                if step == sizes.warmup_steps:
                    if cuda:
                        torch.cuda.synchronize(device)
                    measured_from = time.perf_counter()
                    sampler.measure()
                    cpu = CpuUse()
                t0 = time.perf_counter()
                images, labels, opens_epoch = next(batches)
                waited = time.perf_counter() - t0
                if step >= sizes.warmup_steps:
                    marks.append(t0)
                    waits.append(waited)
                    counts.append(len(labels))
                    opens.append(opens_epoch)
                if step == 0:
                    first_batch_s = time.perf_counter() - started
                # Copy first, change the layout on the device: a layout change in the copy
                # itself would go through a pageable host buffer and make the copy synchronous.
                images = images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
                labels = labels.to(device, non_blocking=True)
                timed = cuda and step >= sizes.warmup_steps
                if timed:
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                    begin.record()
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = criterion(model(images), labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if timed:
                    end.record()
                    events.append((begin, end))
            if cuda:
                torch.cuda.synchronize(device)
            marks.append(time.perf_counter())
            wall = marks[-1] - measured_from
            if cpu is not None:
                cpu_use = cpu.stop()
    finally:
        if cpu is not None:
            cpu.close()
        host = sampler.stop()
    row: dict[str, Any] = {
        "feed": name, "steps": sizes.steps, "warmup_steps": sizes.warmup_steps, "batch_size": sizes.batch_size,
        "images_per_s": round(sum(counts) / wall, 1), "wall_s": round(wall, 2),
        "data_wait_share": round(sum(waits) / wall, 4), "first_batch_s": round(first_batch_s, 2),
        "final_loss": round(float(loss.item()), 4), **host, **cpu_use, **timeline(marks, waits, counts, opens),
    }
    if events:
        busy_ms = sum(begin.elapsed_time(end) for begin, end in events)
        row["gpu_busy_share"] = round(busy_ms / 1e3 / wall, 4)
        row["gpu_memory_peak_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
    return row


FIFTHS = 5
# What each round keeps beside its images/s, for the "By round" table: the median row alone
# hid that the first daemon-fed round was the slow one in every lease.
ROUND_KEYS = ("between_epochs_images_per_s", "epoch_starts", "fifths_images_per_s", "data_wait_share", "longest_wait_s",
              "longest_wait_step", "gpu_busy_share", "cpu_tree_cores", "cpu_other_cores", "cpu_steal_share")


def timeline(marks: list[float], waits: list[float], counts: list[int], opens: list[bool]) -> dict[str, Any]:
    """Where in a round its time went: images/s over each fifth of the measured steps (``marks``:
    every step's start, then the end; ``counts``: every step's images; fewer parts when there
    are fewer steps), the longest time one step waited in ``next()``, and the images/s of the
    steps whose batch did not open an epoch (``opens``).  A round slowed by a one-off stall
    shows one slow fifth; one slow throughout shows every fifth slow; a long wait says the step
    waited for its batch, where a slow fifth without one says the GPU (or the trainer's own
    thread) was slower.  The rate between epoch starts is what a long run sees: a DataLoader
    waits ~2 s at every epoch's start, which weighs on gpu_check's 78-step epochs as it does
    not on ImageNet's 5000.  (The median step's rate, reported before, hid the DataLoader's
    waits between epoch starts: most of its steps find a batch ready and some wait.)"""
    steps = len(waits)
    if not steps or len(marks) != steps + 1 or len(counts) != steps or len(opens) != steps:
        return {}
    parts = min(FIFTHS, steps)
    bounds = [round(i * steps / parts) for i in range(parts + 1)]
    rates = [round(sum(counts[a:b]) / max(marks[b] - marks[a], 1e-9), 1) for a, b in zip(bounds, bounds[1:])]
    longest = max(range(steps), key=waits.__getitem__)
    inside = [i for i in range(steps) if not opens[i]]
    between = (round(sum(counts[i] for i in inside) / max(sum(marks[i + 1] - marks[i] for i in inside), 1e-9), 1)
               if inside else None)
    return {"fifths_images_per_s": rates, "longest_wait_s": round(waits[longest], 3), "longest_wait_step": longest,
            "between_epochs_images_per_s": between, "epoch_starts": steps - len(inside)}


@dataclass(frozen=True)
class TimeLimit:
    """``--time-limit``: seconds for the whole run, counted on ``clock`` from ``start``."""

    seconds: float
    start: float
    clock: Callable[[], float] = time.monotonic

    def left(self) -> float:
        return self.start + self.seconds - self.clock()


def training_rows(data: Path, sizes: Sizes, classes: int, device: torch.device, workers: list[int], root: Path,
                  done: Callable[[list[dict[str, Any]]], None],
                  deadline: TimeLimit | None = None) -> tuple[list[dict[str, Any]], str | None]:
    """Each feed trained ``sizes.rounds`` times.  The synthetic ceiling opens every round and
    the others rotate, so each runs first once; a feed's row is its median round, with every
    round's images/s.  The daemon trains with each count in ``workers``, DataLoader and DALI
    with the first.  After the first round, a feed whose last round would end past
    ``deadline`` is not started, nor anything after it; the second value then says where
    the training stopped."""
    feeds: list[tuple[str, Feed | str]] = [
        ("synthetic (on the GPU)" if device.type == "cuda" else "synthetic", lambda: synthetic_feed(sizes, classes, device)),
        *((f"prefetchd ({k} workers)", lambda k=k: prefetchd_feed(data, sizes, k, device, root)) for k in workers),
    ]
    workers_first = workers[0]
    feeds.append((f"DataLoader ({workers_first} workers)", lambda: dataloader_feed(data, sizes, workers_first, device)))
    missing = dali_missing(device)
    feeds.append((f"DALI mixed ({workers_first} threads)",
                  missing or (lambda: dali_feed(data, sizes, workers_first, device))))
    runnable = [(name, feed) for name, feed in feeds if not isinstance(feed, str)]
    ceiling, rotating = runnable[0], runnable[1:]
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in runnable}
    took: dict[str, float] = {}  # each feed's last round, in seconds, start and stop included
    clock = deadline.clock if deadline is not None else time.monotonic
    for r in range(sizes.rounds):
        k = r % len(rotating)
        for name, feed in [ceiling, *rotating[k:], *rotating[:k]]:
            if deadline is not None and name in took and (left := deadline.left()) < took[name]:
                ran = sum(map(len, rounds.values()))
                stopped = (f"stopped before round {r + 1}'s {name}, whose last round took {took[name]:.0f} s, with "
                           f"{max(left, 0):.0f} s of --time-limit {deadline.seconds:.0f} left: "
                           f"{ran} of {sizes.rounds * len(runnable)} feed rounds ran")
                log.info("%s", stopped)
                return median_rows(feeds, rounds), stopped
            began = clock()
            log.info("round %d/%d: training %s on %s, fed by %s: %d + %d steps", r + 1, sizes.rounds, sizes.model,
                     device, name, sizes.warmup_steps, sizes.steps)
            try:
                row = train_with(name, feed, sizes, classes, device)
            except Exception as exc:  # one failing feed must not lose the others' numbers
                log.exception("%s failed", name)
                row = {"feed": name, "note": f"failed: {type(exc).__name__}: {exc}"}
            else:
                log.info("  %.0f images/s, data wait %.1f%%", row["images_per_s"], 100 * row["data_wait_share"])
            took[name] = clock() - began
            rounds[name].append(row)
            done(median_rows(feeds, rounds))
    return median_rows(feeds, rounds), None


def median_rows(feeds: list[tuple[str, Feed | str]], rounds: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per feed: its median measured round (the lower of the middle two for an even
    count), every round's images/s beside it (None for a failed one), and images/s against
    the synthetic ceiling's median."""
    rows: list[dict[str, Any]] = []
    for name, feed in feeds:
        if isinstance(feed, str):
            rows.append({"feed": name, "note": feed})
            continue
        runs = rounds.get(name, [])
        measured = sorted((run for run in runs if "note" not in run), key=lambda run: run["images_per_s"])
        failed = [run["note"] for run in runs if "note" in run]
        if not measured:
            if runs:
                rows.append({"feed": name, "note": failed[0]})
            continue
        row = {**measured[(len(measured) - 1) // 2], "rounds_images_per_s": [run.get("images_per_s") for run in runs],
               "rounds_detail": [{key: run[key] for key in ROUND_KEYS if key in run} for run in runs]}
        if failed:
            row["failed_rounds"] = failed
        rows.append(row)
    ceiling = rows[0].get("images_per_s") if rows else None
    for row in rows:
        if ceiling and row.get("images_per_s"):
            row["vs_synthetic"] = round(row["images_per_s"] / ceiling, 3)
    return rows


# -- the machine, the outputs ------------------------------------------------------------------


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


# -- 5. the producer on more cores ------------------------------------------------------------


def scaling_counts(cores: int) -> list[int]:
    """1, 2, 4, ... up to ``cores``, and ``cores`` itself."""
    return sorted({1 << i for i in range(cores.bit_length()) if 1 << i <= cores} | {cores})


def scaling_rows(data: Path, sizes: Sizes, out_dir: Path, counts: list[int]) -> dict[str, Any]:
    cpu = CpuUse()  # follows each daemon's worker server and workers after the daemon stops
    try:
        results = run_benchmark(data, workers_list=counts, batch_size=sizes.scaling_batch_size,
                                image_size=sizes.image_size, seconds=sizes.scaling_seconds, out_dir=out_dir,
                                contenders=("prefetchd",), warm_start=False, data_wait=False,
                                report=lambda line: log.info("  %s", line))
    except BaseException:
        cpu.close()
        raise
    rows = [{"workers": r.workers, "images_per_s": r.images_per_s, "scaling": r.scaling, "vs_floor": r.vs_floor,
             "first_batch_s": r.first_batch_s, "note": r.note, "independent_loops_per_s": r.loops,
             "loops_vs_floor": r.loops_vs_floor, "vs_loops": r.vs_loops, "cpu": r.extra.get("cpu")}
            for r in results.throughput]
    return {"floor": results.floor, "batch_size": sizes.scaling_batch_size, "seconds": sizes.scaling_seconds,
            "rows": rows, **cpu.stop()}


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


def _buffer_root(need: int) -> Path:
    root = buffer_root(need)
    if root != Path("/dev/shm"):
        log.warning("/dev/shm is missing or has less than %.1f GiB free: buffers go to %s, not a RAM disk",
                    2 * need / 2**30, root)
    return root


@stops_cleanly
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="the JSON; GPU.md goes beside it [default: docs/gpu.json, "
                        "or a temporary folder with --dry-run]")
    parser.add_argument("--dry-run", action="store_true", help="every step on the CPU at toy sizes")
    parser.add_argument("--commit", help="the commit measured, where the checkout has no .git")
    parser.add_argument("--steps", type=int, help="measured training steps per feed")
    parser.add_argument("--data", type=Path, help="an ImageFolder tree to train on instead of generating one")
    parser.add_argument("--skip-tests", action="store_true", help="leave out `pytest -m gpu`")
    parser.add_argument("--skip-scaling", action="store_true", help="leave out step 5, the producer alone "
                        "(~3 min on 16 cores): for a short lease that looks only at the training")
    parser.add_argument("--rounds", type=int, help="times each feed trains; its row is the median round")
    parser.add_argument("--time-limit", type=float, metavar="SECONDS",
                        help="seconds for the whole run: after the first training round, a feed whose last round "
                        "would end past it is not started, so a lease's call ends with complete rows and says so "
                        "[default: none]")
    parser.add_argument("--workers", type=worker_counts, help="the daemon's worker counts to train with, e.g. "
                        "15,12 (DataLoader and DALI get the first) [default: all cores but one]")
    args = parser.parse_args(argv)
    if args.time_limit is not None and args.time_limit <= 0:
        parser.error(f"--time-limit {args.time_limit:g}: give a number of seconds above 0")
    deadline = None if args.time_limit is None else TimeLimit(args.time_limit, time.monotonic())
    # The clock in every line: a lease's one call must hold the whole run, so show where its time goes.
    logging.basicConfig(level=logging.INFO, format="gpu_check %(asctime)s: %(message)s", datefmt="%H:%M:%S")
    sizes = DRY if args.dry_run else FULL
    if args.steps is not None:
        sizes = dataclasses.replace(sizes, steps=args.steps)
    if args.rounds is not None:
        if args.rounds < 1:
            parser.error(f"--rounds {args.rounds}: give 1 or more")
        sizes = dataclasses.replace(sizes, rounds=args.rounds)
    device = torch.device(sizes.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a GPU machine, or pass --dry-run", file=sys.stderr)
        return 2
    problem = cli_problem()
    if problem:
        print(f"gpu_check: {problem}", file=sys.stderr)
        return 2
    out = args.out or (Path(tempfile.mkdtemp(prefix="gpu-check-")) / "gpu.json" if args.dry_run
                       else REPO / "docs" / "gpu.json")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    else:
        # Toy sizes on a shared CPU: more intra-op threads than free cores spin against
        # each other (seen here: 30x slower steps with 2 threads on a busy 2-core box).
        torch.set_num_threads(1)
    workers = args.workers or [cores_but_one()]
    doc: dict[str, Any] = {
        "format": RESULTS_FORMAT, "version": RESULTS_VERSION, "dry_run": args.dry_run, "json_name": out.name,
        "commit": git_commit(args.commit), "machine": describe_machine(), "gpu": describe_gpu(device),
        "sizes": {**dataclasses.asdict(sizes), "workers": workers}, "tests": None, "h2d": None, "training": None,
        "scaling": None, "training_stopped": None,
    }
    write_outputs(doc, out)
    log.info("writing %s and %s", out, out.parent / "GPU.md")
    # The tests run beside the data's generation (the sixth lease ran them one after the other:
    # 28 s, then 94 s) and end before the copies are timed, which want a quiet machine.
    background = ThreadPoolExecutor(max_workers=1)
    tests = None if args.skip_tests else background.submit(run_gpu_tests, sizes)
    if tests is not None:
        log.info("1. pytest -m gpu, beside step 3")
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-data-"))
    try:
        data = args.data
        if data is None:
            data = scratch / "imagenet-like"
            log.info("3. generating %d images in %s", sizes.classes * sizes.per_class, data)
            summary = make_imagenet_like(data, classes=sizes.classes, per_class=sizes.per_class, seed=0,
                                         workers=len(os.sched_getaffinity(0)))
            doc["dataset"] = summary.line()
        else:
            doc["dataset"] = str(data)
        if tests is not None:
            doc["tests"] = tests.result()
            log.info("1. %s", doc["tests"]["summary"])
            write_outputs(doc, out)
        batch_bytes = max(sizes.h2d_batch_sizes) * sizes.h2d_image_size ** 2 * 3
        root = _buffer_root(max(sizes.h2d_batches * batch_bytes, (sizes.high_water + 4) * batch_bytes))
        log.info("2. host-to-device copies, batches %s", sizes.h2d_batch_sizes)
        doc["h2d"] = h2d_rows(sizes, device, root)
        write_outputs(doc, out)
        warm_page_cache(data)
        classes = sum(1 for entry in os.scandir(data) if entry.is_dir())
        # Step 5 runs before the training: it takes about three minutes where the training takes
        # four to six, and a run cut short by the device's time limit then still has it.
        if not args.skip_scaling:
            counts = scaling_counts(len(os.sched_getaffinity(0))) if not args.dry_run else [1]
            log.info("5. the producer alone at %s workers", ", ".join(map(str, counts)))
            doc["scaling"] = scaling_rows(data, sizes, scratch / "bench", counts)
            write_outputs(doc, out)

        def save(rows: list[dict[str, Any]]) -> None:
            doc["training"] = rows
            write_outputs(doc, out)

        doc["training"], doc["training_stopped"] = training_rows(data, sizes, classes, device, workers, root,
                                                                 done=save, deadline=deadline)
    finally:
        background.shutdown(wait=True)  # a step that failed leaves the tests to end first
        shutil.rmtree(scratch, ignore_errors=True)
    write_outputs(doc, out)
    log.info("done: %s", out.parent / "GPU.md")
    failed = [row["feed"] for row in doc["training"]
              if str(row.get("note", "")).startswith("failed") or row.get("failed_rounds")]
    failed += [f"producer at {row['workers']} workers" for row in (doc["scaling"] or {}).get("rows", [])
               if row["images_per_s"] is None]
    tests_failed = doc["tests"] is not None and doc["tests"]["returncode"] not in (0, 5)
    return 1 if failed or tests_failed else 0


if __name__ == "__main__":
    sys.exit(main())
