"""Steps 3 and 4 of ``tools/gpu_check.py``: the model trained for a fixed number of steps, fed each
way ``gpu_check_feeds.py`` offers, round after round.  ``train_with`` is one round and what it took
(images/s, data wait, GPU busy, host memory and CPU), ``timeline`` where in the round its time
went, ``training_rows`` the rounds in rotated order within ``--time-limit``, and ``median_rows``
a row per feed from its rounds."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpu_check_feeds import Feed, dali_feed, dali_missing, dataloader_feed, prefetchd_feed, synthetic_feed
from gpu_check_plan import Sizes, TimeLimit, not_a_tool
from host_use import CpuUse, HostSampler
from prefetchd.bench.results import median_round
from prefetchd.trainer.model import build_model
from prefetchd.words import counted

log = logging.getLogger(__name__)


def train_with(name: str, feed: Feed, sizes: Sizes, classes: int, device: torch.device) -> dict[str, Any]:
    """Train a fresh model for warmup + steps batches from ``feed``; what it took."""
    torch.manual_seed(0)
    model = build_model(sizes.model, classes, pretrained=False, echo=log.info)
    model = model.to(device, memory_format=torch.channels_last)  # type: ignore[call-overload]
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5)
    criterion = nn.CrossEntropyLoss()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    sampler = HostSampler(device)
    events: list[tuple[Any, Any]] = []
    marks: list[float] = []  # each measured step's start, then the end: where in the round time went
    waits: list[float] = []  # each measured step's time in next()
    counts: list[int] = []  # each measured step's images: an epoch's last batch can be short
    opens: list[bool] = []  # whether each measured step's batch opened an epoch
    first_batch_s = wall = 0.0
    loss = torch.zeros(())
    cpu: CpuUse | None = None  # from the first measured step
    cpu_use: dict[str, float] = {}
    try:
        started = time.perf_counter()
        with feed() as batches:
            measured_from = started
            for step in range(sizes.warmup_steps + sizes.steps):
                if step == sizes.warmup_steps:
                    if cuda:
                        torch.cuda.synchronize(device)
                    measured_from = time.perf_counter()
                    sampler.measure()
                    cpu = CpuUse()
                t0 = time.perf_counter()
                images, labels, opens_epoch = next(batches)
                waited = time.perf_counter() - t0
                if step >= sizes.warmup_steps:
                    marks.append(t0)
                    waits.append(waited)
                    counts.append(len(labels))
                    opens.append(opens_epoch)
                if step == 0:
                    first_batch_s = time.perf_counter() - started
                # Copy first, change the layout on the device: a layout change in the copy
                # itself would go through a pageable host buffer and make the copy synchronous.
                images = images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
                labels = labels.to(device, non_blocking=True)
                timed = cuda and step >= sizes.warmup_steps
                if timed:
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                    begin.record()
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = criterion(model(images), labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if timed:
                    end.record()
                    events.append((begin, end))
            if cuda:
                torch.cuda.synchronize(device)
            marks.append(time.perf_counter())
            wall = marks[-1] - measured_from
            if cpu is not None:
                cpu_use = cpu.stop()
    finally:
        if cpu is not None:
            cpu.close()
        host = sampler.stop()
    row: dict[str, Any] = {
        "feed": name, "steps": sizes.steps, "warmup_steps": sizes.warmup_steps, "batch_size": sizes.batch_size,
        "images_per_s": round(sum(counts) / wall, 1), "wall_s": round(wall, 2),
        "data_wait_share": round(sum(waits) / wall, 4), "first_batch_s": round(first_batch_s, 2),
        "final_loss": round(float(loss.item()), 4), **host, **cpu_use, **timeline(marks, waits, counts, opens),
    }
    if events:
        busy_ms = sum(begin.elapsed_time(end) for begin, end in events)
        row["gpu_busy_share"] = round(busy_ms / 1e3 / wall, 4)
        row["gpu_memory_peak_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
    return row


FIFTHS = 5
# What each round keeps beside its images/s, for the "By round" table: the median row alone
# hid that the first daemon-fed round was the slow one in every lease.
ROUND_KEYS = ("between_epochs_images_per_s", "epoch_starts", "fifths_images_per_s", "data_wait_share", "longest_wait_s",
              "longest_wait_step", "gpu_busy_share", "cpu_tree_cores", "cpu_other_cores", "cpu_steal_share")


def timeline(marks: list[float], waits: list[float], counts: list[int], opens: list[bool]) -> dict[str, Any]:
    """Where in a round its time went: images/s over each fifth of the measured steps (``marks``:
    every step's start, then the end; ``counts``: every step's images; fewer parts when there
    are fewer steps), the longest time one step waited in ``next()``, and the images/s of the
    steps whose batch did not open an epoch (``opens``).  A round slowed by a one-off stall
    shows one slow fifth; one slow throughout shows every fifth slow; a long wait says the step
    waited for its batch, where a slow fifth without one says the GPU (or the trainer's own
    thread) was slower.  The rate between epoch starts is what a long run sees: a DataLoader
    waits ~2 s at every epoch's start, which weighs on gpu_check's 78-step epochs as it does
    not on ImageNet's 5000.  (The median step's rate, reported before, hid the DataLoader's
    waits between epoch starts: most of its steps find a batch ready and some wait.)"""
    steps = len(waits)
    if not steps or len(marks) != steps + 1 or len(counts) != steps or len(opens) != steps:
        return {}
    parts = min(FIFTHS, steps)
    bounds = [round(i * steps / parts) for i in range(parts + 1)]
    rates = [round(sum(counts[a:b]) / max(marks[b] - marks[a], 1e-9), 1) for a, b in zip(bounds, bounds[1:])]
    longest = max(range(steps), key=waits.__getitem__)
    inside = [i for i in range(steps) if not opens[i]]
    between = (round(sum(counts[i] for i in inside) / max(sum(marks[i + 1] - marks[i] for i in inside), 1e-9), 1)
               if inside else None)
    return {"fifths_images_per_s": rates, "longest_wait_s": round(waits[longest], 3), "longest_wait_step": longest,
            "between_epochs_images_per_s": between, "epoch_starts": steps - len(inside)}


def training_rows(data: Path, sizes: Sizes, classes: int, device: torch.device, workers: list[int], root: Path,
                  done: Callable[[list[dict[str, Any]]], None],
                  deadline: TimeLimit | None = None) -> tuple[list[dict[str, Any]], str | None]:
    """Each feed trained ``sizes.rounds`` times.  The synthetic ceiling opens every round and
    the others rotate, so each runs first once; a feed's row is its median round, with every
    round's images/s.  The daemon trains with each count in ``workers``, DataLoader and DALI
    with the first.  After the first round, a round whose feeds' last rounds would together end
    past ``deadline`` is not started: every feed keeps as many rounds as the others (cut by the
    feed, the eleventh lease's daemon had one round against the DataLoader's two, and a median of
    one against the lower of two).  The second value then says where the training stopped."""
    feeds: list[tuple[str, Feed | str]] = [
        ("synthetic (on the GPU)" if device.type == "cuda" else "synthetic", lambda: synthetic_feed(sizes, classes, device)),
        *((f"prefetchd ({counted(k, 'worker')})", lambda k=k: prefetchd_feed(data, sizes, k, device, root))
          for k in workers),
    ]
    workers_first = workers[0]
    feeds.append((f"DataLoader ({counted(workers_first, 'worker')})",
                  lambda: dataloader_feed(data, sizes, workers_first, device)))
    missing = dali_missing(device)
    feeds.append((f"DALI mixed ({counted(workers_first, 'thread')})",
                  missing or (lambda: dali_feed(data, sizes, workers_first, device))))
    runnable = [(name, feed) for name, feed in feeds if not isinstance(feed, str)]
    ceiling, rotating = runnable[0], runnable[1:]
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in runnable}
    took: dict[str, float] = {}  # each feed's last round, in seconds, start and stop included
    clock = deadline.clock if deadline is not None else time.monotonic
    for r in range(sizes.rounds):
        if deadline is not None and took and (left := deadline.left()) < (needs := sum(took.values())):
            # Past it already (the steps before the training and the first round always run): by how much, not "0 s".
            where = (f"with {left:.0f} s of --time-limit {deadline.seconds:.0f} left" if left >= 0 else
                     f"{-left:.0f} s past --time-limit {deadline.seconds:.0f} already")
            stopped = (f"stopped before round {r + 1}, whose {len(runnable)} feeds took {needs:.0f} s in the last, "
                       f"{where}: {r} of {sizes.rounds} rounds ran")
            log.info("%s", stopped)
            return median_rows(feeds, rounds), stopped
        k = r % len(rotating)
        for name, feed in [ceiling, *rotating[k:], *rotating[:k]]:
            began = clock()
            log.info("round %d/%d: training %s on %s, fed by %s: %d + %d steps", r + 1, sizes.rounds, sizes.model,
                     device, name, sizes.warmup_steps, sizes.steps)
            try:
                row = train_with(name, feed, sizes, classes, device)
            except Exception as exc:  # one failing feed must not lose the others' numbers
                log.exception("%s failed", name)
                row = {"feed": name, "note": f"failed: {type(exc).__name__}: {exc}"}
            else:
                log.info("  %.0f images/s, data wait %.1f%%", row["images_per_s"], 100 * row["data_wait_share"])
            took[name] = clock() - began
            rounds[name].append(row)
            done(median_rows(feeds, rounds))
    return median_rows(feeds, rounds), None


def median_rows(feeds: list[tuple[str, Feed | str]], rounds: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per feed: its median measured round (``median_round``, as `prefetchd bench` takes
    its rows: the lower of the middle two for an even count), every round's images/s beside it
    (None for a failed one), and images/s against the synthetic ceiling's median."""
    rows: list[dict[str, Any]] = []
    for name, feed in feeds:
        if isinstance(feed, str):
            rows.append({"feed": name, "note": feed})
            continue
        runs = rounds.get(name, [])
        measured = [run for run in runs if "note" not in run]
        failed = [run["note"] for run in runs if "note" in run]
        if not measured:
            if runs:
                rows.append({"feed": name, "note": failed[0]})
            continue
        row = {**median_round(measured), "rounds_images_per_s": [run.get("images_per_s") for run in runs],
               "rounds_detail": [{key: run[key] for key in ROUND_KEYS if key in run} for run in runs]}
        if failed:
            row["failed_rounds"] = failed
        rows.append(row)
    ceiling = rows[0].get("images_per_s") if rows else None
    for row in rows:
        if ceiling and row.get("images_per_s"):
            row["vs_synthetic"] = round(row["images_per_s"] / ceiling, 3)
    return rows


if __name__ == "__main__":  # imported by tools/gpu_check.py; run alone it has nothing to do
    not_a_tool(__file__)
