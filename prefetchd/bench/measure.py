"""How one contender is measured: the time (or batch) window after a warm-up, and the
data-wait scenario, a simulated trainer that pauses for evaluation."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefetchd.bench.monitor import CpuSplit

# Every wait on another process is bounded; a stuck contender fails the run
# with this many seconds in the message instead of hanging it.
WAIT_SECONDS = 180.0
# A time window still spans this many batches, so that a slow contender's rate
# is not one batch's time.
MIN_WINDOW_BATCHES = 4
# A batch-count window is at least this long.  Its warm-up (a fifth of it) drains what the
# producer banked while the bench took its first-batch readings, but batches finished just
# before the window still count in it: over 3 batches they made prefetchd 181 % of the floor
# at 1 worker, with its workers' CPU per image 40 % below the floor's.
MIN_BATCHES = 20
WHY_MIN_BATCHES = ("a shorter window counts batches the producer built before it, and gives rates above "
                   "what its workers can make")

# The data-wait trainer: a step takes STEP_SHARE of the producer's time per
# batch, every eval_every(k) steps it pauses, and the pause is sized so that the
# producer's average rate is AVERAGE_HEADROOM times the trainer's.  Between two
# pauses the trainer runs (1 - STEP_SHARE) * eval_every batches ahead of the
# producer: 3k batches, more than a DataLoader's 2k-batch queue can bank, and
# within the default high-water mark (max(16, eval_every)).
STEP_SHARE = 0.5
AVERAGE_HEADROOM = 1.3
MIN_EVAL_EVERY = 12


def eval_every(workers: int) -> int:
    """Trainer steps between two evaluation pauses in the data-wait scenario."""
    return max(MIN_EVAL_EVERY, 6 * workers)


@dataclass(frozen=True)
class Window:
    seconds: float | None
    batches: int | None

    def consume(
        self, batches: Iterator[int], started: float, on_first: Callable[[], None] | None = None,
        cpu: CpuSplit | None = None,
    ) -> tuple[float, float, int, float]:
        """(first_batch_s, images_per_s, images, window_s) from an iterator of batch sizes;
        ``cpu``: where the cores went over the same window."""
        next(batches)
        first = time.perf_counter()
        if on_first is not None:
            on_first()
        if self.batches is None:
            assert self.seconds is not None
            warmup = min(1.0, 0.15 * self.seconds)
            while time.perf_counter() - first < warmup:
                next(batches)
        else:
            for _ in range(max(1, self.batches // 5)):
                next(batches)
        if cpu is not None:
            cpu.begin()
        start = now = time.perf_counter()
        images = count = 0
        while True:
            images += next(batches)
            count += 1
            now = time.perf_counter()
            if self.batches is not None and count >= self.batches:
                break
            if self.seconds is not None and now - start >= self.seconds and count >= MIN_WINDOW_BATCHES:
                break
        span = now - start
        if cpu is not None:
            cpu.end(images)
        return first - started, images / span, images, span

    @property
    def length_s(self) -> float:
        return self.seconds if self.seconds is not None else 2.0


# -- the data-wait scenario ----------------------------------------------------------


def data_wait_doc(workers: int) -> dict[str, Any]:
    n = eval_every(workers)
    return {
        "eval_every_steps": n,
        "step_share": STEP_SHARE,
        "average_headroom": AVERAGE_HEADROOM,
        "definition": (
            f"trainer step = {STEP_SHARE} x (batch / producer img/s); every {n} steps an evaluation pause "
            f"sized so the producer's average rate is {AVERAGE_HEADROOM} x the trainer's; wait share = time blocked "
            "in next(batch) / wall time of the measured cycles (the first cycle is a warm-up)"
        ),
    }


def trainer_with_pauses(
    batches: Iterator[int], rate: float, batch_size: int, length_s: float, workers: int
) -> dict[str, Any]:
    """Run the simulated trainer on ``batches``; ``rate`` is the producer's measured img/s."""
    every = eval_every(workers)
    per_batch = batch_size / rate
    step_s = STEP_SHARE * per_batch
    pause_s = (AVERAGE_HEADROOM - STEP_SHARE) * every * per_batch
    cycle_s = every * step_s + pause_s
    cycles = max(2, math.ceil(length_s / cycle_s))
    wait = 0.0
    waits_after_pause = 0.0
    start = time.perf_counter()
    for cycle in range(cycles + 1):
        if cycle == 1:
            wait, waits_after_pause, start = 0.0, 0.0, time.perf_counter()
        for _step in range(every):
            t0 = time.perf_counter()
            next(batches)
            waited = time.perf_counter() - t0
            wait += waited
            if _step == 0:
                waits_after_pause += waited
            time.sleep(step_s)
        time.sleep(pause_s)
    wall = time.perf_counter() - start
    return {
        "producer_images_per_s": round(rate, 1),
        "eval_every_steps": every,
        "step_s": round(step_s, 4),
        "pause_s": round(pause_s, 3),
        "cycles": cycles,
        "wall_s": round(wall, 2),
        "wait_s": round(wait, 3),
        "wait_share": round(wait / wall, 4),
        "first_step_wait_s": round(waits_after_pause, 3),
    }
