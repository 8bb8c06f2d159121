"""Which batches a stream keeps: each holding consumer's window, and the next batch to build.

The trainer's progress ``p`` (the next batch it needs) is the truth: the stream keeps exactly the window
``[p, p + high_water)``; of several consumers, the union of the holding ones' windows, each planned by
``consumers.plan_windows`` within the cap.  Flow control has hysteresis: production stops when the window is
full and resumes only when the waiting batches fall to the low-water mark (``next_missing``).

A part of :class:`~prefetchd.daemon.stream.Stream`, which sets what is declared here in its ``__init__``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from prefetchd.buffer_protocol import DEFAULT_CONSUMER
from prefetchd.daemon.consumers import Consumer, plan_windows

log = logging.getLogger("prefetchd.daemon.stream")  # the stream's messages, as before this module was split off

STARVED_SAID_SECONDS = 60.0  # a consumer is said to wait for room under the cap at most this often


class StreamWindows:
    """The windows of a :class:`~prefetchd.daemon.stream.Stream` and the hysteresis that fills them."""

    # Set by Stream.__init__.
    high: int
    low: int
    cap: int
    consumer_timeout: float
    end: int | None
    limit: int
    published: dict[int, Path]
    building: Mapping[int, object]  # of Builds, by position
    consumers: dict[str, Consumer]
    holders: list[Consumer]
    held: set[int]
    _starved: set[str]
    _starved_said: dict[str, float]
    filling: bool

    if TYPE_CHECKING:  # the stream's
        @property
        def rank(self) -> int: ...
        @property
        def active(self) -> int: ...

    @property
    def produced_all(self) -> bool:
        """Every batch up to the end of the last epoch that a window holds is published: the status says
        "done" only then, not while a trainer may still wait for the last one being built."""
        if self.end is None:
            return False
        if any(c.position + c.window < self.end for c in self.holders):
            return False
        return all(g in self.published for g in self.held)

    def plan(self) -> None:
        """Decide which consumers hold batches and how many each: see ``consumers.plan_windows``.

        Live consumers hold; a gone, silent or closed one does not while another is live.  When
        none is live, all that may come back hold, so a single trainer that went away keeps its
        window (SPEC rule 8); when every one left (closed) before the job's end, they hold, so the
        next trainer finds the buffer filled; before any consumer wrote, the default one holds
        from 0.
        """
        now = time.time()
        known = [c for c in self.consumers.values() if c.seen]
        unfinished = [c for c in known if self.end is None or c.position < self.end]
        waiting = [c for c in known if c.waits(self.end)]
        live = [c for c in waiting if c.live(now, self.consumer_timeout)]
        left = [] if len(unfinished) < len(known) else unfinished  # one at the end: the job is done (finished)
        holders = live or waiting or left or ([] if known else [self.consumers[DEFAULT_CONSUMER]])
        holders.sort(key=lambda c: (c.position, c.name))
        widths = plan_windows([c.position for c in holders], self.high, self.cap, self.limit)
        for c in self.consumers.values():
            c.window = 0
        self.held = set()
        for c, w in zip(holders, widths):
            c.window = w
            hi = min(c.position + w, self.limit)
            self.held.update(range(c.position, hi))
        # Only a cap below one batch per consumer leaves one without its next batch (plan_windows).
        # One that left (closed) holds for whoever comes next, and waits for nothing.
        starved = {c.name for c in holders if c.position not in self.held and not c.closed
                   and (self.end is None or c.position < self.end)}
        said_before = time.monotonic() - STARVED_SAID_SECONDS
        for c in holders:
            # Consumers taking turns at a cap of a batch or two starve by turns, at every poll.
            if c.name in starved - self._starved and self._starved_said.get(c.name, said_before) <= said_before:
                self._starved_said[c.name] = time.monotonic()
                log.info("rank %d's %s waits: the other consumers' windows fill the cap of %d batches "
                         "(raise --max-buffer-bytes to let it run)", self.rank, c.label.removeprefix("the "), self.cap)
        self._starved = starved
        self.holders = holders

    def next_missing(self) -> int | None:
        """The most urgent position of a window that is neither published nor being built, if the
        hysteresis lets production run; None when there is nothing to build now."""
        kept = len(self.published) + self.active
        if self.filling and (kept >= min(self.cap, self.high * len(self.holders)) or not self._gap()):
            self.filling = False
        if not self.filling and (self._running_low() or self._trainer_blocked() or self._unattended() and self._gap()):
            self.filling = True
        if not self.filling:
            return None
        if len(self.published) + len(self.building) >= self.cap:
            # A rewind's cancelled builds keep their temp files until the tasks at workers end (tens of
            # ms; the cluster answers its slices at once, unbuilt): counted too, or the tmpfs would hold
            # more than --max-buffer-bytes meanwhile.
            return None
        best: tuple[int, int, int] | None = None  # (batches ready in its window, its position, g)
        for c in self.holders:
            ready, first = 0, None
            for g in range(c.position, c.position + c.window):
                if g not in self.held:
                    break  # past the end
                if g in self.published:
                    ready += 1
                elif g not in self.building and first is None:
                    first = g
            if first is not None and (best is None or (ready, c.position) < best[:2]):
                best = (ready, c.position, first)
        return best[2] if best is not None else None

    def _running_low(self) -> bool:
        """A holding consumer's window has fallen to the low-water mark (scaled to its window)."""
        for c in self.holders:
            if c.window == 0:
                continue
            ready = sum(1 for g in range(c.position, c.position + c.window) if g in self.published)
            if ready <= self.low * c.window // self.high:
                return True
        return False

    def _gap(self) -> bool:
        """A held position is neither published nor being built."""
        return any(g not in self.published and g not in self.building for g in self.held)

    def _unattended(self) -> bool:
        """No holding consumer reads (each is gone, silent or closed, or none has written yet).

        Then the windows are topped up to the high-water mark at once rather than from the low-water
        mark: no consumption is left for the hysteresis to batch up, and a trainer that comes back
        finds its window full."""
        now = time.time()
        return not any(c.live(now, self.consumer_timeout) for c in self.holders)

    def _trainer_blocked(self) -> bool:
        """The batch a consumer needs next is held but neither published nor being built: after a
        rewind, or a waiting batch lost, the batches further on do not help it, however many there are."""
        return any(c.position in self.held and c.position not in self.published and c.position not in self.building
                   for c in self.holders)
