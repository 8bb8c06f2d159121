"""A cold start: seconds from ``prefetchd start`` to the first batch in a trainer's BufferLoader.

    python tools/cold_start.py DATA [--runs 5] [--workers 2] [--batch-size 128] [--image-size 224]

Each run starts a fresh daemon on a fresh buffer in /dev/shm with ``--data DATA``, opens a
BufferLoader once its manifest is there, as a trainer launched beside the daemon does, and
times its first batch: the daemon's imports, the index (cached after the first run), the
worker server's imports (torch; torchvision where the crop-aware decoder is not built), and
the first batch's decode.  Prints each run and the median; a daemon that refuses DATA ends
the tool at once with its reason.  A benchmark, not a test: the figures depend on the
machine and its load.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import click

from prefetchd.launch import DaemonExited, daemon_for_a_run, stops_cleanly, wait_ready
from prefetchd.trainer import BufferLoader
from prefetchd.words import counted

READY_SECONDS = 120.0  # to the manifest, then to the first batch


@click.command(help=__doc__.split("\n\n")[0], context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("data", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--runs", default=5, show_default=True, type=click.IntRange(1))
@click.option("--workers", default=2, show_default=True, type=click.IntRange(1))
@click.option("--batch-size", default=128, show_default=True, type=click.IntRange(1))
@click.option("--image-size", default=224, show_default=True, type=click.IntRange(8))
@stops_cleanly
def main(data: Path, runs: int, workers: int, batch_size: int, image_size: int) -> None:
    seconds = []
    with tempfile.TemporaryDirectory(prefix="prefetchd-cold-", dir="/dev/shm") as work:
        for run in range(runs):
            buffer, log = Path(work) / f"bf-{run}", Path(work) / f"daemon-{run}.log"
            started = time.perf_counter()
            args = ["--data", str(data), "--workers", str(workers), "--batch-size", str(batch_size),
                    "--image-size", str(image_size), "--epochs", "1"]
            since = time.time()
            try:
                with daemon_for_a_run(buffer, args, log) as proc:
                    # Not the loader's own wait: it would sit out its whole timeout on a daemon that
                    # died at start, then blame the buffer.
                    wait_ready(proc, buffer, since=since, timeout=READY_SECONDS, log=log,
                               more_time="index a smaller dataset")
                    loader = BufferLoader(buffer, normalize=False, timeout=READY_SECONDS)
                    next(iter(loader))
                    seconds.append(time.perf_counter() - started)
                    loader.close()
            except DaemonExited as exc:  # its log goes with the temp folder: say what it said
                raise click.ClickException(exc.brief) from None
            click.echo(f"run {run + 1}: first batch {seconds[-1]:.2f} s after prefetchd start")
    click.echo(f"cold first batch: median {statistics.median(seconds):.2f} s over {counted(runs, 'run')} "
               f"(min {min(seconds):.2f}, max {max(seconds):.2f}); {counted(workers, 'worker')}, batch {batch_size} at "
               f"{image_size} px, data {data}")


if __name__ == "__main__":
    main()
