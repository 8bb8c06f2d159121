"""Several trainers on one buffer vs one daemon each: CPU seconds per consumed image, and each
trainer's share of time spent waiting for data.

    python tools/bench_consumers.py [--data DIR | --generate N] [--consumers 4] [--epochs 2]
                                    [--batch-size 32] [--image-size 112] [--workers 1]
                                    [--step-ms 20] [--high-water 8] [--cap-factor 1] [--out FILE.json]

Two scenarios on the same cores (everything inherits this process's CPU affinity):

  shared    one `prefetchd start` with --workers W; the N consumers read it as named consumers
  separate  N `prefetchd start`, each with --workers W; one consumer each (the default consumer)

Each consumer is its own process: a BufferLoader reading --epochs epochs, "training" for
--step-ms per batch (a sleep, so it costs no CPU).  The daemons' CPU is read from psutil
cpu_times of each daemon's process tree (the daemon and its workers) after the consumers are done,
before the daemons are stopped; a consumer's CPU is its process time inside the reading loop.
See docs/BENCHMARKS.md ("Several trainers on one buffer").
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import psutil

from prefetchd.buffer_protocol import BatchLayout
from prefetchd.launch import DaemonExited, launch, start_argv, stop_daemon_process, stops_cleanly, wait_ready
from prefetchd.options import FiniteFloat
from prefetchd.synthetic import make_imagenet_like
from prefetchd.words import counted

CONSUMER = r'''
import json, sys, time
from prefetchd.trainer import BufferLoader
buffer, name, epochs, step = sys.argv[1], sys.argv[2] or None, int(sys.argv[3]), float(sys.argv[4]) / 1000
loader = BufferLoader(buffer, normalize=False, timeout=300, consumer=name, start=(0, 0))
cpu0, wall0, waited, images = time.process_time(), time.monotonic(), 0.0, 0
while loader.position[0] < epochs:
    it = iter(loader)
    while True:
        asked = time.monotonic()
        batch = next(it, None)
        waited += time.monotonic() - asked
        if batch is None:
            break
        images += len(batch.labels)
        time.sleep(step)
loader.close()
wall = time.monotonic() - wall0
print(json.dumps({"consumer": name or "", "images": images, "cpu_s": time.process_time() - cpu0,
                  "wall_s": wall, "wait_share": waited / wall}))
'''


def tree_cpu(proc: psutil.Process) -> float:
    """User + system CPU seconds of ``proc`` and its live descendants."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


@dataclass(frozen=True)
class Options:
    """The command line's values (see main)."""

    data: Path | None
    generate: int
    consumers: int
    epochs: int
    batch_size: int
    image_size: int
    workers: int
    step_ms: float
    high_water: int
    cap_factor: float
    out: Path | None


def run_scenario(name: str, data: Path, args: Options, work: Path) -> dict[str, Any]:
    separate = name == "separate"
    buffers = [work / f"{name}-{i}" for i in range(args.consumers if separate else 1)]
    batch_bytes = BatchLayout.plan(args.batch_size, args.image_size, args.image_size).file_len
    daemon_args = ["--data", str(data), "--workers", str(args.workers), "--batch-size", str(args.batch_size),
                   "--image-size", str(args.image_size), "--high-water", str(args.high_water), "--seed", "0",
                   "--reset", "--max-buffer-bytes", str(int(args.cap_factor * args.high_water * batch_bytes))]
    since = time.time()
    daemons = [launch(start_argv(b, extra=daemon_args), log=work / f"{b.name}.log") for b in buffers]
    consumers: list[subprocess.Popen[bytes]] = []
    try:
        for proc, buffer in zip(daemons, buffers):
            wait_ready(proc, buffer, since=since, timeout=300, log=work / f"{buffer.name}.log")
        cpu_before = sum(tree_cpu(psutil.Process(d.pid)) for d in daemons)
        started = time.monotonic()
        for i in range(args.consumers):
            consumers.append(subprocess.Popen([sys.executable, "-c", CONSUMER, str(buffers[i if separate else 0]),
                                               "" if separate else f"trial-{i}", str(args.epochs), str(args.step_ms)],
                                              stdout=subprocess.PIPE))
        results = []
        for c in consumers:
            out, _ = c.communicate()
            if c.returncode != 0:
                raise SystemExit(f"a consumer of the {name} scenario failed (exit {c.returncode})")
            results.append(json.loads(out))
        wall = time.monotonic() - started
        daemon_cpu = sum(tree_cpu(psutil.Process(d.pid)) for d in daemons) - cpu_before
    finally:
        for c in consumers:  # still running only when we were stopped or one of them failed
            if c.poll() is None:
                c.kill()
                c.wait()
        for d in daemons:
            stop_daemon_process(d, 30)
    images = sum(r["images"] for r in results)
    consumer_cpu = sum(r["cpu_s"] for r in results)
    return {
        "scenario": name, "daemons": len(daemons), "consumers": results, "images_consumed": images,
        "wall_s": round(wall, 2), "daemon_cpu_s": round(daemon_cpu, 2), "consumer_cpu_s": round(consumer_cpu, 2),
        "daemon_cpu_ms_per_image": round(1000 * daemon_cpu / images, 3),
        "total_cpu_ms_per_image": round(1000 * (daemon_cpu + consumer_cpu) / images, 3),
    }


@click.command(help=__doc__.split("\n\n")[0] + "\n\nSee this script's docstring and docs/BENCHMARKS.md "
               "(\"Several trainers on one buffer\").",
               context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--data", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A class-folder dataset  [default: generate one]")
@click.option("--generate", type=click.IntRange(min=1), default=400, show_default=True,
              help="Images to generate without --data.")
@click.option("--consumers", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--epochs", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--image-size", type=click.IntRange(min=8), default=112, show_default=True)
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True, help="--workers of every daemon.")
@click.option("--step-ms", type=FiniteFloat(min=0), default=20.0, show_default=True,
              help="Each consumer's simulated training step.")
@click.option("--high-water", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--cap-factor", type=FiniteFloat(min=0, min_open=True), default=1.0, show_default=True,
              help="--max-buffer-bytes as a multiple of high-water batches (1: the default cap).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Also write the results here as JSON.")
@stops_cleanly
def main(**options: Any) -> None:
    args = Options(**options)
    with tempfile.TemporaryDirectory(prefix="bench-consumers-", dir="/dev/shm") as tmp:
        work = Path(tmp)
        data = args.data
        if data is None:
            data = work / "data"
            classes = min(4, args.generate)
            make_imagenet_like(data, classes=classes, per_class=math.ceil(args.generate / classes), seed=0)
        try:
            results = [run_scenario(name, data, args, work) for name in ("shared", "separate")]
        except DaemonExited as exc:  # its log goes with the temp folder: say what it said
            raise click.ClickException(exc.brief) from None
    shared, separate = results
    print(f"{counted(args.consumers, 'consumer')} x {counted(args.epochs, 'epoch')}, batch {args.batch_size} at {args.image_size}px, "
          f"--workers {args.workers} per daemon, {args.step_ms:g} ms per step, high-water {args.high_water}, "
          f"cap {args.cap_factor:g} x high-water, cores: {len(psutil.Process().cpu_affinity() or [])}")
    print(f"{'scenario':<10} {'daemons':>7} {'images':>7} {'wall s':>7} {'daemon CPU s':>12} {'consumer CPU s':>14} "
          f"{'daemon ms/img':>13} {'total ms/img':>12}  data-wait share per consumer")
    for r in results:
        shares = " ".join(f"{c['wait_share']:.0%}" for c in r["consumers"])
        print(f"{r['scenario']:<10} {r['daemons']:>7} {r['images_consumed']:>7} {r['wall_s']:>7.1f} "
              f"{r['daemon_cpu_s']:>12.1f} {r['consumer_cpu_s']:>14.1f} {r['daemon_cpu_ms_per_image']:>13.2f} "
              f"{r['total_cpu_ms_per_image']:>12.2f}  {shares}")
    ratio = separate["daemon_cpu_ms_per_image"] / max(shared["daemon_cpu_ms_per_image"], 1e-9)
    total = separate["total_cpu_ms_per_image"] / max(shared["total_cpu_ms_per_image"], 1e-9)
    print(f"separate / shared: {ratio:.2f}x the daemon CPU per consumed image, {total:.2f}x counting the consumers")
    if args.out is not None:
        options = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(args).items()}
        args.out.write_text(json.dumps({"args": options, "results": results}, indent=1))


if __name__ == "__main__":
    main()
