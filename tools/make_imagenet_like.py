"""Write ImageNet-like JPEGs (ImageFolder layout) for decode and loader benchmarks.

    python tools/make_imagenet_like.py OUT [--classes 10] [--per-class 100] [--seed 0]
                                           [--source PHOTOS] [--workers N] [--overwrite]

Short side 333-500 px, ImageNet's aspect-ratio mix, JPEG quality mostly ~90,
natural-image statistics (1/f noise, soft-edged textured shapes, grain), ~100 KB
per file on average.  With --source, images are random crops of your own photos.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from prefetchd.synthetic import make_imagenet_like, progress_lines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--classes", default=10, show_default=True, type=click.IntRange(min=1), help="Number of class folders.")
@click.option("--per-class", default=100, show_default=True, type=click.IntRange(min=1), help="Images per class.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0), help="Same seed, same bytes.")
@click.option("--source", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Folder of photos (searched recursively) to cut random crops from instead of generating pictures.")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Processes  [default: usable CPUs]")
@click.option("--overwrite", is_flag=True, help="Delete OUT first if it is not empty.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the summary line.")
def main(out: Path, classes: int, per_class: int, seed: int, source: Path | None, workers: int | None,
         overwrite: bool, quiet: bool) -> None:
    """Write OUT/class_NNN/NNN_NNNNN.JPEG, shaped like ImageNet's training images."""
    workers = workers or len(os.sched_getaffinity(0))
    start = time.perf_counter()
    try:
        summary = make_imagenet_like(out, classes=classes, per_class=per_class, seed=seed, source=source,
                                     workers=workers, overwrite=overwrite, progress=progress_lines(quiet=quiet))
    except (ValueError, OSError) as exc:  # OSError: OUT cannot be written (synthetic.OutputError), or the disk is full
        raise click.ClickException(str(exc)) from None
    click.echo(f"{summary.line()}; {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
