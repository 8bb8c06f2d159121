"""How long indexing a big class-folder tree takes, and what the index costs in memory.

    python tools/bench_index.py [--files 1000000] [--classes 1000] [--dir /dev/shm] [--threads 8] [--keep]

Generates FILES empty .JPEG files in CLASSES class folders (contents do not
matter: the index never opens a file), then times a walk with one thread, a walk
with --threads threads, and a start that finds the index in the cache; and
reports the index's bytes per sample.  The folders are dated a minute back after
generation, as a dataset nobody is writing to (a just-written folder is never
cached, see prefetchd/daemon/sources/index_cache.py).  Results: docs/SOURCES.md.
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import click

from prefetchd.daemon.dataset import scan_class_folders
from prefetchd.daemon.sources.index_cache import cached_class_folders
from prefetchd.launch import buffer_root, stops_cleanly

T = TypeVar("T")


def generate(root: Path, files: int, classes: int) -> None:
    per_class, extra = divmod(files, classes)
    past = time.time() - 60
    for c in range(classes):
        folder = root / f"n{c:08d}"
        folder.mkdir(parents=True)
        for k in range(per_class + (c < extra)):
            os.close(os.open(folder / f"n{c:08d}_{k}.JPEG", os.O_CREAT | os.O_WRONLY, 0o644))
        os.utime(folder, (past, past))
    os.utime(root, (past, past))


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--files", type=click.IntRange(1), default=1_000_000, show_default=True)
@click.option("--classes", type=click.IntRange(1), default=1000, show_default=True)
@click.option("--dir", "base", type=click.Path(exists=True, file_okay=False, writable=True, path_type=Path),
              default=buffer_root(),
              show_default=True, help="Where the tree is generated (removed afterwards unless --keep).")
@click.option("--threads", type=click.IntRange(1), default=8, show_default=True, help="Threads of the parallel walk.")
@click.option("--keep", is_flag=True, help="Keep the generated tree.")
@stops_cleanly
def main(files: int, classes: int, base: Path, threads: int, keep: bool) -> None:
    if files < classes:
        raise click.BadParameter(f"{files} files cannot fill {classes} class folders (an empty class folder is "
                                 "refused); pass at least as many files as classes", param_hint="--files")
    work = Path(tempfile.mkdtemp(prefix="prefetchd-bench-index-", dir=base))
    root, cache = work / "tree", work / "cache"
    try:
        _, t_gen = timed(lambda: generate(root, files, classes))
        click.echo(f"generated {files} empty files in {classes} class folders under {root} in {t_gen:.1f} s")
        serial, t_serial = timed(lambda: scan_class_folders(root, threads=1))
        parallel, t_parallel = timed(lambda: scan_class_folders(root, threads=threads))
        assert parallel.fingerprint == serial.fingerprint and len(parallel) == files
        _, t_first = timed(lambda: cached_class_folders(root, cache))
        cached, t_cached = timed(lambda: cached_class_folders(root, cache))
        assert cached.fingerprint == serial.fingerprint
        per_sample = serial.nbytes / len(serial)
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
        click.echo(f"machine: {len(os.sched_getaffinity(0))} CPUs ({cpu}), Python {platform.python_version()}")
        click.echo("| files | walk, 1 thread | walk, %d threads | first start (walk + write cache) | "
                   "cached start | index bytes/sample |" % threads)
        click.echo("|---:|---:|---:|---:|---:|---:|")
        click.echo(f"| {files:,} | {t_serial:.1f} s | {t_parallel:.1f} s | {t_first:.1f} s | {t_cached:.2f} s | "
                   f"{per_sample:.0f} |")
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
