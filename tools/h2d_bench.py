"""Host-to-device benchmark: mapped batch files -> GPU memory, three ways.

    python tools/h2d_bench.py [--batches 16] [--batch-size 256] [--image-size 224]
                              [--step-ms 0,30] [--device cuda] [--root /dev/shm]

Writes ``--batches`` batch files of ``batch-size x image-size x image-size x 3`` uint8
(37.6 MB each at the defaults) into a fake buffer on the RAM disk, then measures,
per batch, with a fresh mapping of a different file each time as in training:

1. the transfer alone, its parts timed separately:
   - plain     ``torch.from_numpy(mapped).to(device)`` from pageable memory;
   - staging   memcpy into a pinned buffer, then an asynchronous copy;
   - register  ``cudaHostRegister`` (read-only) of the mapping, copy, ``cudaHostUnregister``;
2. ``BufferLoader(device, pin=...)`` end to end for pin = none, staging, register,
   with a consumer whose GPU "step" takes ``--step-ms`` (``torch.cuda._sleep``):
   at 0 the per-batch time is the transfer's latency; with a step as long as a
   real one, a strategy that overlaps the copy with the step costs close to
   nothing beyond the step (``overhead``).

Prints one table per part. GB/s is the batch's uint8 bytes over the per-batch time.
Needs a CUDA device; the numbers belong in docs/BENCHMARKS.md with the machine named.
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from prefetchd.buffer_protocol import BatchLayout, Manifest, batch_name, map_batch, write_batch
from prefetchd.launch import stops_cleanly
from prefetchd.trainer import BufferLoader
from prefetchd.trainer.gpu import HOST_REGISTER_READ_ONLY


def image_bytes(batch_size: int, image_size: int) -> int:
    """The bytes of a batch's uint8 images, what each transfer moves."""
    return BatchLayout.plan(batch_size, image_size, image_size).tensors["images"].length


def make_buffer(root: Path, batches: int, batch_size: int, image_size: int) -> Path:
    free = shutil.disk_usage(root).free
    need = batches * BatchLayout.plan(batch_size, image_size, image_size).file_len
    if need > free // 2:
        sys.exit(f"{root}: {batches} batches need {need / 2**30:.1f} GiB, more than half of the "
                 f"{free / 2**30:.1f} GiB free; pass fewer --batches or another --root")
    buffer = Path(tempfile.mkdtemp(prefix="prefetchd-h2d-", dir=root))
    try:  # a failure part way leaves no prefetchd-h2d-* folder behind
        samples = batches * batch_size
        Manifest(
            dataset_root="h2d-bench", fingerprint="h2d-bench", classes=["a", "b"], num_samples=samples, split="train",
            seed=0, batch_size=batch_size, image_size=image_size, samples_per_epoch=samples,
            steps_per_epoch=batches, epochs=None, producer="h2d-bench",
        ).write(buffer)
        rng = np.random.default_rng(0)
        images = rng.integers(0, 256, (batch_size, image_size, image_size, 3), dtype=np.uint8)
        for step in range(batches):
            images[0, 0, 0, 0] = step % 256  # distinct files, equal cost
            indices = np.arange(step * batch_size, (step + 1) * batch_size, dtype=np.int64)
            write_batch(buffer / batch_name(0, step), images, indices % 2, indices, epoch=0, step=step, seed=0,
                        producer="h2d-bench")
    except BaseException:
        shutil.rmtree(buffer, ignore_errors=True)
        raise
    return buffer


class Clock:
    """Milliseconds of named parts, per batch; the device is synchronised at each mark."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.parts: dict[str, list[float]] = {}

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        yield
        torch.cuda.synchronize(self.device)
        self.parts.setdefault(name, []).append((time.perf_counter() - start) * 1e3)

    def median(self, name: str) -> float:
        return statistics.median(self.parts[name][1:] or self.parts[name])  # the first call warms up


def transfer_parts(buffer: Path, batches: int, device: torch.device) -> list[tuple[str, float, dict[str, float]]]:
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    rows = []
    staging: torch.Tensor | None = None

    def each(body: Callable[[np.ndarray, Clock], None]) -> Clock:
        clock = Clock(device)
        for step in range(batches):
            mapped = map_batch(buffer / batch_name(0, step))
            with clock.part("total"):
                body(mapped.images, clock)
        return clock

    def plain(images: np.ndarray, clock: Clock) -> None:
        torch.from_numpy(images).to(device)

    def staged(images: np.ndarray, clock: Clock) -> None:
        nonlocal staging
        if staging is None or staging.numel() < images.size:
            staging = torch.empty(images.size, dtype=torch.uint8, pin_memory=True)
        host = staging[: images.size].view(images.shape)
        with clock.part("memcpy"):
            host.copy_(torch.from_numpy(images))
        with clock.part("copy"):
            host.to(device, non_blocking=True)

    def registered(images: np.ndarray, clock: Clock) -> None:
        address = int(images.ctypes.data)
        with clock.part("register"):
            err = cudart.cudaHostRegister(address, images.nbytes, HOST_REGISTER_READ_ONLY)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister: {cudart.cudaGetErrorString(err)}")
        with clock.part("copy"):
            torch.from_numpy(images).to(device, non_blocking=True)
        with clock.part("unregister"):
            cudart.cudaHostUnregister(address)

    for name, body in (("plain", plain), ("staging", staged), ("register", registered)):
        try:
            clock = each(body)
        except RuntimeError as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            continue
        rows.append((name, clock.median("total"), {k: clock.median(k) for k in clock.parts if k != "total"}))
    return rows


def cycles_per_ms(device: torch.device) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    cycles = 50_000_000
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]  # warm-up
    start.record()
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
    end.record()
    torch.cuda.synchronize(device)
    return float(cycles / start.elapsed_time(end))


def loader_per_batch(buffer: Path, batches: int, device: torch.device, pin: str, step_cycles: int) -> float:
    loader = BufferLoader(buffer, device=device, pin=pin, normalize=True, timeout=30, daemon_grace=0)  # type: ignore[arg-type]
    times = []
    torch.cuda.synchronize(device)
    last = time.perf_counter()
    for batch in loader:
        if step_cycles:
            torch.cuda._sleep(step_cycles)  # type: ignore[no-untyped-call]  # the model's step, on the consumer's stream
        batch.images.add_(0)  # touch the batch on the consumer's stream after the step
        torch.cuda.synchronize(device)
        now = time.perf_counter()
        times.append((now - last) * 1e3)
        last = now
        if len(times) == batches:
            break
    loader.close()
    return statistics.median(times[1:] or times)


def whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def batch_count(text: str) -> int:
    """``--batches``: 2 or more, for the first of each pass (page faults, cuDNN and allocator warm-up) is not
    counted, and the median of none is no figure."""
    count = whole_number(text)
    if count < 2:
        raise argparse.ArgumentTypeError(f"{count}: pass 2 or more; the first batch of each pass is left out of "
                                         "the median, so fewer leave nothing to measure")
    return count


def at_least_one(text: str) -> int:
    """``--batch-size`` and ``--image-size``: a whole number of 1 or more."""
    value = whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: pass 1 or more")
    return value


def step_times(text: str) -> list[float]:
    """``--step-ms 0,30``: simulated GPU step times of 0 ms or more, read before anything is measured."""
    try:
        steps = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        steps = []
    if not steps or min(steps) < 0 or not all(math.isfinite(s) for s in steps):
        raise argparse.ArgumentTypeError(f"{text!r}: pass step times in ms of 0 or more, separated by commas (0,30)")
    return steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, all checked before CUDA starts: a bad one met after part 1 was measured lost that part."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=batch_count, default=16,
                        help="batch files to write and read (at least 2: the first of each pass is left out) "
                        "[default: 16]")
    parser.add_argument("--batch-size", type=at_least_one, default=256, help="images per batch [default: 256]")
    parser.add_argument("--image-size", type=at_least_one, default=224, help="pixels a side [default: 224]")
    parser.add_argument("--step-ms", type=step_times, default=[0.0, 30.0],
                        help="comma-separated simulated GPU step times [default: 0,30]")
    parser.add_argument("--device", default="cuda", help="a CUDA device, e.g. cuda:1 [default: cuda]")
    parser.add_argument("--root", type=Path, default=Path("/dev/shm"),
                        help="where the fake buffer goes (a tmpfs) [default: /dev/shm]")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        parser.error(f"--root {args.root} is not a folder; pass a tmpfs folder such as /dev/shm")
    try:
        if torch.device(args.device).type != "cuda":
            parser.error(f"--device {args.device}: this measures copies to a GPU; pass a CUDA device (cuda, cuda:1)")
    except RuntimeError as exc:
        parser.error(f"--device {args.device}: {exc}")
    return args


@stops_cleanly
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("h2d_bench: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    torch.cuda.init()  # type: ignore[no-untyped-call]
    nbytes = image_bytes(args.batch_size, args.image_size)
    buffer = make_buffer(args.root, args.batches, args.batch_size, args.image_size)
    try:
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, batch {args.batch_size}x"
              f"{args.image_size}x{args.image_size}x3 uint8 = {nbytes / 1e6:.1f} MB, median of {args.batches - 1} batches")
        print("\n1. the transfer alone (ms per batch)")
        print(f"{'mode':<10} {'total':>8} {'GB/s':>7}  parts")
        for name, total, parts in transfer_parts(buffer, args.batches, device):
            detail = ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
            print(f"{name:<10} {total:8.2f} {nbytes / total / 1e6:7.2f}  {detail}")

        per_ms = cycles_per_ms(device)
        steps = args.step_ms
        print("\n2. BufferLoader end to end, normalised float32 on the device (ms per batch)")
        print(f"{'pin':<10} " + " ".join(f"{f'step {s:g} ms':>12} {'GB/s':>6} {'overhead':>8}" for s in steps))
        for pin in ("none", "staging", "register"):
            cells = []
            for step in steps:
                try:
                    ms = loader_per_batch(buffer, args.batches, device, pin, int(step * per_ms))
                except Exception as exc:  # e.g. register unsupported: say so, keep the table
                    cells.append(f"{'failed':>12} {'':>6} {'':>8}")
                    print(f"pin={pin}: {exc}", file=sys.stderr)
                    continue
                cells.append(f"{ms:12.2f} {nbytes / ms / 1e6:6.2f} {ms - step:8.2f}")
            print(f"{pin:<10} " + " ".join(cells))
    finally:
        shutil.rmtree(buffer, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
