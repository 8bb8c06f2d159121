"""What a run of ``tools/gpu_check.py`` measures and how long it may take: the sizes of a full
run and of ``--dry-run`` (``Sizes``), ``--time-limit`` (``TimeLimit``), the checkout it runs
from, and what the check's modules say when one is run alone."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Sizes:
    device: str
    model: str
    batch_size: int
    image_size: int
    steps: int  # measured training steps per feed
    warmup_steps: int  # before them, not measured (cudnn autotuning, worker start, daemon fill)
    rounds: int  # each feed trains this many times, the order rotated; its row is the median round
    classes: int
    per_class: int
    high_water: int  # the daemon's buffer, in batches
    h2d_batch_sizes: tuple[int, ...]
    h2d_image_size: int
    h2d_batches: int
    pytest_args: tuple[str, ...]
    scaling_batch_size: int  # step 5, as `prefetchd bench` measures on the 2-core machine
    scaling_seconds: float  # per worker count
    scaling_rounds: int  # step 5 measures every count this many times (with its loops); a row is the median round


# 20,000 files: 78 steps an epoch at batch 256, so the 230 steps of a feed span three
# epochs, and ~2 GB of JPEGs that the page cache holds (the check measures decoding,
# not the disk).  Generating them takes ~40-60 s on 16 cores.  Three rounds: on the first
# H200 run (2026-11-26) one configuration gave 1689 and 4344 images/s in two runs a
# minute apart (the first paid cuDNN's tuning for the short last batch: ``prefetchd_feed``),
# and later rounds still differ by up to ~18 % (the H100's DataLoader).
FULL = Sizes(device="cuda", model="resnet50", batch_size=256, image_size=224, steps=200, warmup_steps=30, rounds=3,
             classes=100, per_class=200, high_water=16, h2d_batch_sizes=(128, 256), h2d_image_size=224,
             h2d_batches=16, pytest_args=(), scaling_batch_size=128, scaling_seconds=5.0,
             scaling_rounds=1)
DRY = Sizes(device="cpu", model="squeezenet1_1", batch_size=8, image_size=32, steps=3, warmup_steps=1, rounds=2,
            classes=2, per_class=8, high_water=4, h2d_batch_sizes=(4, 8), h2d_image_size=32,
            # The GPU tests' folder alone: collecting the whole suite to select its GPU tests took ~15 s of CI's CPU.
            h2d_batches=3, pytest_args=("-n", "0", "tests/trainer"), scaling_batch_size=8, scaling_seconds=0.5,
            scaling_rounds=2)


@dataclass(frozen=True)
class TimeLimit:
    """``--time-limit``: seconds for the whole run, counted on ``clock`` from ``start``."""

    seconds: float
    start: float
    clock: Callable[[], float] = time.monotonic

    def left(self) -> float:
        return self.start + self.seconds - self.clock()


def not_a_tool(module_file: str) -> NoReturn:
    """What a module of the check says when it is run as a script: it has nothing to do alone."""
    print(f"{Path(module_file).name} is a module of tools/gpu_check.py, not a tool: run python tools/gpu_check.py --help",
          file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":  # imported by tools/gpu_check.py; run alone it has nothing to do
    not_a_tool(__file__)
