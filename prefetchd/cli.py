"""The `prefetchd` command: the daemon's commands (prefetchd/daemon/cli.py) with the
tools that use a daemon, `bench` and `demo`.  It lives above both rooms so that the
daemon never imports its consumers."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from prefetchd.bench import bench_command
from prefetchd.buffer_protocol.manifest import BATCH_SIZES, IMAGE_SIZES
from prefetchd.daemon.cli import COMMANDS, setup_logging
from prefetchd.options import LocalPath, OutputChecked, version_option


class _Commands(OutputChecked, click.Group):
    """The command group, saying so where its output cannot be written (``OutputChecked``)."""


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@version_option()
def main() -> None:
    """Decode and augment images ahead of the trainer into a RAM-disk buffer."""


@main.command()
@click.option("--workdir", type=LocalPath(file_okay=False), default=None, help="Where the generated dataset and logs go, and stay; a second demo there uses its dataset again [default: a temp dir, removed after].")
@click.option("--epochs", type=click.IntRange(1), default=3, show_default=True)
# The daemon's ranges (its refusal was a trainer's 120 s wait, a walk); a batch of one image trains no BatchNorm.
@click.option("--image-size", type=click.IntRange(16, IMAGE_SIZES[1]), default=64, show_default=True)
@click.option("--batch-size", type=click.IntRange(2, BATCH_SIZES[1]), default=32, show_default=True)
@click.option("--train-per-class", type=click.IntRange(1), default=150, show_default=True)
@click.option("--keep", is_flag=True, help="Keep the temp dir with the dataset and logs (a --workdir is always kept).")
def demo(workdir: Path | None, epochs: int, image_size: int, batch_size: int, train_per_class: int, keep: bool) -> None:
    """Generate a small dataset, start daemons for it and train ResNet-18 alongside them."""
    from prefetchd.demo import run_demo

    setup_logging("warning")
    sys.exit(run_demo(workdir=workdir, epochs=epochs, image_size=image_size, batch_size=batch_size,
                      train_per_class=train_per_class, keep=keep))


for _command in COMMANDS:
    main.add_command(_command)
main.add_command(bench_command)  # torch is imported inside it only when it runs

__all__ = ["main"]

if __name__ == "__main__":  # `python -m prefetchd.cli`, as well as `python -m prefetchd` and the entry point
    main()
