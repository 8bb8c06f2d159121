"""Sample reads per second from each dataset layout, on the same generated JPEGs.

    python tools/bench_sources.py [--images 4000] [--dir /dev/shm] [--seconds 5] [--shard-size 64MB]
                                  [--kind imagenet|small] [--cold] [--work DIR]
                                  [--location NAME=URL_OR_PATH ...] [--keep]

Generates ImageNet-like JPEGs (~100 KB; ``--kind small``: 72-128 px images of
a few KB, where the per-file cost shows most) in class folders, writes a file list of them and
packs them into shards, then reads samples in a random order (as a shuffled
epoch does) through ``open_dataset`` + ``SampleReader`` -- the daemon's own read
path, without decoding -- for --seconds per layout.  Every file is in the page
cache (just written), so this measures what each layout costs per read beyond
the storage itself: open, fstat, read and close of a small file per sample vs
an open and one positioned read in a shard.  ``--location NAME=LOCATION`` adds
a row for another copy of the data (an s3:// prefix, say), read the same way
by ``reads_per_second``.  Results: docs/SOURCES.md.
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from prefetchd.daemon.cli import shard_size_option
from prefetchd.daemon.errors import DatasetError
from prefetchd.daemon.sources import SampleReader, open_dataset
from prefetchd.daemon.sources.shards import pack
from prefetchd.launch import buffer_root, stops_cleanly
from prefetchd.options import FiniteFloat
from prefetchd.synthetic import make_imagenet_like, make_shapes_dataset


def reads_per_second(location: str, seconds: float, seed: int = 0, one_pass: bool = False) -> tuple[float, float, int]:
    """(reads/s, MB/s, samples) reading ``location``'s samples in a seeded random order for ``seconds``
    (and no more than once each with ``one_pass``: a second read would come from the page cache)."""
    index = open_dataset(location)
    reader = SampleReader(index)
    order = np.random.default_rng(seed).permutation(len(index))
    done = nbytes = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds and not (one_pass and done >= len(order)):
        for i in order[done % len(order):][:256].tolist():
            nbytes += len(reader.read(i))
            done += 1
    elapsed = time.perf_counter() - start
    return done / elapsed, nbytes / elapsed / 1e6, len(index)


def evict(work: Path) -> None:
    """Drop ``work``'s files (only those) from the page cache, so the next reads go to the disk."""
    for path in work.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def local_layouts(work: Path, images: int, shard_size: int, kind: str = "imagenet") -> dict[str, str]:
    """The same images as class folders, as a file list and as shards; name -> location.
    What ``work`` already holds from an earlier run is reused."""
    folders = work / "folders"
    classes = 8 if kind == "small" else 10  # the shapes generator draws 8 kinds of shape
    if not folders.is_dir():
        if kind == "small":
            make_shapes_dataset(work / "shapes", classes=classes, train_per_class=max(1, images // classes),
                                val_per_class=0, seed=0)
            (work / "shapes" / "train").rename(folders)
        else:
            make_imagenet_like(folders, classes=classes, per_class=max(1, images // classes), seed=0,
                               workers=len(os.sched_getaffinity(0)))
    index = open_dataset(folders)
    listing = work / "list.csv"
    listing.write_text("".join(f"folders/{index.file(i)},{index.classes[index.labels[i]]}\n"
                               for i in range(len(index))))
    pack(index, work / "shards", shard_size, force=True)
    return {"class folders (small files)": str(folders), "file list (small files)": str(listing),
            "shards": str(work / "shards")}


def _location(_ctx: click.Context, _param: click.Parameter, value: tuple[str, ...]) -> dict[str, str]:
    named = {}
    for item in value:
        name, sep, location = item.partition("=")
        if not sep or not name or not location:
            raise click.BadParameter(f"{item!r}: expected NAME=LOCATION")
        named[name] = location
    return named


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--images", type=click.IntRange(10), default=4000, show_default=True)
@click.option("--dir", "base", type=click.Path(exists=True, file_okay=False, writable=True, path_type=Path),
              default=buffer_root(),
              show_default=True, help="Where the data is generated (removed afterwards unless --keep).")
@click.option("--seconds", type=FiniteFloat(0.01), default=5.0, show_default=True, help="Reading time per layout.")
@click.option("--shard-size", default="64MB", show_default=True, callback=shard_size_option, help="Shard size, e.g. 64MB or 1GiB.")
@click.option("--location", "extra", multiple=True, metavar="NAME=LOCATION", callback=_location,
              help="Also read this copy of the data (any --data the daemon takes, e.g. s3://bucket/shards).")
@click.option("--kind", type=click.Choice(["imagenet", "small"]), default="imagenet", show_default=True,
              help="ImageNet-like JPEGs (~100 KB) or small images (72-128 px, a few KB).")
@click.option("--cold", is_flag=True, help="Evict the generated files from the page cache before each layout.")
@click.option("--work", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Generate into this folder, keep it, and reuse what it holds [default: a temp folder in --dir].")
@click.option("--keep", is_flag=True)
@stops_cleanly
def main(images: int, base: Path, seconds: float, shard_size: int, kind: str, cold: bool, work: Path | None,
         extra: dict[str, str], keep: bool) -> None:
    if work is not None:
        work.mkdir(parents=True, exist_ok=True)
        keep = True
    else:
        work = Path(tempfile.mkdtemp(prefix="prefetchd-bench-sources-", dir=base))
    try:
        layouts = {**local_layouts(work, images, shard_size, kind), **extra}
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
        click.echo(f"machine: {len(os.sched_getaffinity(0))} CPUs ({cpu}), Python {platform.python_version()}; "
                   f"data in {work}, random order, 1 reader thread, {seconds:g} s per layout, "
                   f"{'cold' if cold else 'warm'} page cache")
        click.echo("| layout | samples | reads/s | MB/s |")
        click.echo("|---|---:|---:|---:|")
        for name, location in layouts.items():
            if cold:
                evict(work)
            try:
                rate, mbps, n = reads_per_second(location, seconds, one_pass=cold)
            except DatasetError as exc:  # a --location that is not there, or not a dataset
                raise click.ClickException(f"--location {name}={location}: {exc}") from None
            click.echo(f"| {name} | {n} | {rate:,.0f} | {mbps:,.0f} |")
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
