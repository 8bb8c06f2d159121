"""Write the synthetic shapes dataset (ImageFolder layout) used by tests and benchmarks.

    python tools/make_dataset.py OUT [--classes 4] [--train-per-class 200]
                                     [--val-per-class 50] [--seed 0]
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from prefetchd.synthetic import SHAPES, make_shapes_dataset, progress_lines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--classes", default=4, show_default=True, type=click.IntRange(1, len(SHAPES)), help="Number of shape classes.")
@click.option("--train-per-class", default=200, show_default=True, type=click.IntRange(min=1), help="Training images per class.")
@click.option("--val-per-class", default=50, show_default=True, type=click.IntRange(min=0), help="Validation images per class (0: no val split).")
@click.option("--size-range", nargs=2, default=(72, 128), show_default=True, type=click.IntRange(min=16), help="Smallest and largest width/height in pixels.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0), help="Same seed, same bytes.")
@click.option("--overwrite", is_flag=True, help="Replace existing train/val folders under OUT.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the summary line.")
def main(
    out: Path,
    classes: int,
    train_per_class: int,
    val_per_class: int,
    size_range: tuple[int, int],
    seed: int,
    overwrite: bool,
    quiet: bool,
) -> None:
    """Write a learnable shapes dataset to OUT/train/<class>/ and OUT/val/<class>/."""
    start = time.perf_counter()
    try:
        summary = make_shapes_dataset(
            out,
            classes=classes,
            train_per_class=train_per_class,
            val_per_class=val_per_class,
            size_range=(min(size_range), max(size_range)),
            seed=seed,
            progress=progress_lines(quiet=quiet),
            overwrite=overwrite,
        )
    except (ValueError, OSError) as exc:  # OSError: OUT cannot be written (synthetic.OutputError), or the disk is full
        raise click.ClickException(str(exc)) from None
    elapsed = time.perf_counter() - start
    click.echo(f"{summary.line()}; {summary.total} images in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
