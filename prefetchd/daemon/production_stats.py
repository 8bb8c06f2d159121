"""What the controller counts while it produces, for the status: batches and samples, failures, the
produce and consume rates over the last seconds, and per-stage quantiles of the workers' times."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

STAGES = ("read", "decode", "augment", "write")  # the order of ``Filled.timings``
STAGE_WINDOW = 4096  # samples the stage quantiles are taken over
RATE_WINDOW_SECONDS = 10.0  # the produce and consume rates are over this long (`status` says so)


@dataclass
class Stats:
    """The controller's counts since it started."""

    started: float = field(default_factory=time.time)
    batches: int = 0
    samples: int = 0
    replaced: int = 0
    consumed: int = 0
    worker_restarts: int = 0
    worker_hangs: int = 0  # of those restarts, the workers killed for a hang (--task-timeout, --worker-start-timeout)
    write_failures: int = 0
    low_space_pauses: int = 0
    recent: deque[tuple[float, int, int]] = field(default_factory=lambda: deque(maxlen=64))  # (t, samples, consumed)
    # Per-sample (read, decode, augment, write) seconds of the most recent samples.
    stage_times: deque[tuple[float, float, float, float]] = field(default_factory=lambda: deque(maxlen=STAGE_WINDOW))
    stage_version: int = 0  # bumped when stage_times changes: the quantiles change only then
    _quantiles: tuple[int, dict[str, dict[str, float]]] = (0, {})  # (stage_version, quantiles) last worked out

    def rates(self) -> tuple[float, float]:
        """Samples produced and batches consumed per second over the last ``RATE_WINDOW_SECONDS``."""
        now = time.monotonic()
        self.recent.append((now, self.samples, self.consumed))
        old = next((r for r in self.recent if now - r[0] <= RATE_WINDOW_SECONDS), self.recent[0])
        dt = now - old[0]
        if dt <= 0:
            return 0.0, 0.0
        return (self.samples - old[1]) / dt, (self.consumed - old[2]) / dt

    def add_stage_times(self, timings: Iterable[tuple[float, float, float, float]]) -> None:
        self.stage_times.extend(timings)
        self.stage_version += 1

    def stage_quantiles(self) -> dict[str, dict[str, float]]:
        """p50/p90/p99 seconds per stage over the last ``STAGE_WINDOW`` samples; empty before the first.
        Worked out again only after new samples: an idle daemon asks every second, and the quantiles of
        4096 samples take about 1 ms each time."""
        if self._quantiles[0] != self.stage_version:
            times = np.asarray(self.stage_times)
            q = np.quantile(times, [0.5, 0.9, 0.99], axis=0)
            self._quantiles = (self.stage_version, {stage: {"p50": float(q[0, i]), "p90": float(q[1, i]),
                                                          "p99": float(q[2, i])} for i, stage in enumerate(STAGES)})
        return self._quantiles[1]


__all__ = ["STAGES", "STAGE_WINDOW", "Stats"]
