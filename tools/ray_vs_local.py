"""Remote path against local workers on the same cores: ``--workers K`` against ``--ray local --workers 0``.

    unshare -n sh -c 'ip link set lo up && python tools/ray_vs_local.py DATA [--rounds 3] [--workers 2]'

Ray 2.60 binds the machine's own address, so run it in a loopback-only network namespace
as above (root).  ``--ray local`` gives Ray the CPUs this process may use: on a machine
with more than K, run it under ``taskset -c 0-(K-1)`` so both daemons have the same cores.  Each round runs two daemons one after the other on DATA (a class-folder
dataset): one with K local workers, one with none and a private Ray cluster of K CPUs on
the same machine (``--ray local``; its head, raylet and workers are children of the
daemon).  A trainer reads as fast as it can; after ``--warmup`` batches (and, with Ray,
once a node builds slices) it times ``--batches`` batches and sums the CPU seconds of the
daemon's whole process tree (psutil) over them.  Prints each run, then the medians and
the ratio of remote to local img/s: issue 14's target is 0.80 at equal cores.
A benchmark, not a test: the figures depend on the machine and its load.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import click
import psutil

from prefetchd.buffer_protocol import read_status
from prefetchd.launch import daemon_for_a_run, stops_cleanly
from prefetchd.trainer import BufferLoader


def tree_cpu(root: psutil.Process, seen: dict[int, tuple[str, float]]) -> None:
    """Record in ``seen`` the name and CPU seconds (user + system) of ``root`` and its descendants now."""
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            seen[proc.pid] = (proc.name(), t.user + t.system)
        except psutil.Error:
            pass


def remote_building(buffer: Path) -> bool:
    try:
        status = read_status(buffer)
    except (OSError, ValueError):
        return False
    remote = status.remote if status is not None else None
    return remote is not None and remote.connected and remote.images > 0


def one_run(data: Path, work: Path, name: str, args: list[str], batch_size: int, image_size: int, warmup: int,
            batches: int, by_process: bool = False) -> tuple[float, float, int]:
    """(img/s, CPU seconds per image, images built remotely) of one daemon."""
    buffer, log = work / name, work / f"{name}.log"
    args = ["--data", str(data), "--batch-size", str(batch_size), "--image-size", str(image_size), "--epochs", "1000",
            *args]
    with daemon_for_a_run(buffer, args, log, stop_seconds=60) as daemon:
        loader = BufferLoader(buffer, normalize=False, timeout=300)
        it = (batch for _epoch in iter(int, 1) for batch in loader)  # epoch after epoch
        for _ in range(warmup):
            next(it)
        while "--ray" in args and not remote_building(buffer):
            next(it)
        root = psutil.Process(daemon.pid)
        before: dict[int, tuple[str, float]] = {}
        after: dict[int, tuple[str, float]] = {}
        tree_cpu(root, before)
        started = time.perf_counter()
        images = sum(len(next(it)[1]) for _ in range(batches))
        seconds = time.perf_counter() - started
        tree_cpu(root, after)
        by_name: dict[str, float] = {}
        for pid, (proc_name, t) in after.items():
            by_name[proc_name] = by_name.get(proc_name, 0.0) + t - before.get(pid, ("", 0.0))[1]
        cpu = sum(by_name.values())
        if by_process:
            click.echo(f"  {name}: CPU ms per image by process: " + ", ".join(
                f"{n} {t / images * 1e3:.3f}" for n, t in sorted(by_name.items(), key=lambda kv: -kv[1])))
        status = read_status(buffer)
        remote = status.remote if status is not None else None
        loader.close()
    return images / seconds, cpu / images, remote.images if remote is not None else 0


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("data", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1))
@click.option("--workers", default=2, show_default=True, type=click.IntRange(1), help="K: local workers, and Ray CPUs")
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(1))
@click.option("--image-size", default=224, show_default=True, type=click.IntRange(8))
@click.option("--warmup", default=8, show_default=True, type=click.IntRange(0), help="Batches read before timing.")
@click.option("--batches", default=80, show_default=True, type=click.IntRange(1), help="Batches timed.")
@click.option("--by-process", is_flag=True, help="Also print each run's CPU per image by process name.")
@stops_cleanly
def main(data: Path, rounds: int, workers: int, batch_size: int, image_size: int, warmup: int, batches: int,
         by_process: bool) -> None:
    modes = {"local": ["--workers", str(workers)],
             "ray": ["--workers", "0", "--ray", "local"]}
    rates: dict[str, list[float]] = {m: [] for m in modes}
    cpus: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="prefetchd-ray-vs-local-", dir="/dev/shm") as tmp:
        for r in range(rounds):
            for mode, args in modes.items():
                rate, cpu, remote = one_run(data, Path(tmp), f"{mode}-{r}", args, batch_size, image_size, warmup,
                                            batches, by_process)
                rates[mode].append(rate)
                cpus[mode].append(cpu)
                where = f", {remote} images built on the cluster" if mode == "ray" else ""
                click.echo(f"round {r + 1} {mode:5}: {rate:7.1f} img/s, {cpu * 1e3:.2f} CPU ms per image{where}")
    local, ray = statistics.median(rates["local"]), statistics.median(rates["ray"])
    click.echo(f"median: local {local:.1f} img/s ({statistics.median(cpus['local']) * 1e3:.2f} CPU ms/img), "
               f"ray {ray:.1f} img/s ({statistics.median(cpus['ray']) * 1e3:.2f} CPU ms/img); ray/local {ray / local:.2f} "
               f"(target 0.80); {workers} workers/CPUs, batch {batch_size} at {image_size} px, {batches} batches "
               f"after {warmup}, data {data}")


if __name__ == "__main__":
    main()
