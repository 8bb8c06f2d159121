"""``prefetchd-train``'s command line: its options, derived from ``TrainConfig``.  The run itself
(``train.run``) is imported once they have parsed, so that ``--help`` and a mistyped flag answer at once
instead of after torch and torchvision have loaded (~4 s of CPU)."""

from __future__ import annotations

from typing import Any

import click

from prefetchd.options import BufferOptionCommand, OutputChecked, click_options, version_option
from prefetchd.trainer.config import TrainConfig


class TrainCommand(OutputChecked, BufferOptionCommand):
    program = "prefetchd-train"


@click.command("prefetchd-train", cls=TrainCommand,
               context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click_options(TrainConfig)
@click.option("--verbose", "-v", is_flag=True, help="Log the loader's waits (INFO).")
@version_option()  # it was "No such option" (a walk)
def main(verbose: bool, **options: Any) -> None:
    """Train a torchvision model on the batches a prefetchd daemon writes into --buffer.

    Under torchrun (`torchrun --nproc-per-node N -m prefetchd.trainer.train ...`) each rank reads its own
    stream of the buffers, which the daemons produce with --world-size.

    Exit code 0: trained; 1: a problem found before training or an error in it; 2: a bad option; 3: the buffer
    could not deliver (no daemon, the job ended or was replaced); 4: this user may not read the buffer; 130:
    Ctrl-C; 143 (129): SIGTERM (SIGHUP), stopped at a step with a checkpoint.
    """
    from prefetchd.trainer.train import run

    run(verbose, options)
