"""run_benchmark: every contender at every worker count on one dataset, then the outputs."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prefetchd.bench.contenders import Run, failure
from prefetchd.bench.measure import MIN_BATCHES, WHY_MIN_BATCHES, Window, data_wait_doc, eval_every
from prefetchd.bench.report import (
    core_list,
    describe_cpu,
    describe_dataset,
    describe_machine,
    why_not_runnable,
    worker_count,
    write_outputs,
)
from prefetchd.bench.results import (ALL_CONTENDERS, BASELINE, CONTENDERS, BenchmarkResults, Throughput,
                                     add_round, fill_ratios, median_floor, take_medians)
from prefetchd.daemon.config import usable_cores, usable_cpus
from prefetchd.launch import buffer_root
from prefetchd.words import binary_size, counted

log = logging.getLogger(__name__)

DEFAULT_HIGH_WATER = 16
LOOPS_SECONDS = 5.0  # the independent loops' window when the contenders are measured by batch count


def buffers_in(root: Path | None, flag: str = "--buffer-root") -> Path:
    """The folder the bench's daemons put their buffers in: ``root`` (given as ``flag``), which must be a folder
    this user can write, else ``launch.buffer_root``'s."""
    if root is None:
        return buffer_root()
    root = Path(root).resolve()
    if not root.is_dir():
        raise ValueError(f"{flag} {root} is not a folder; make it (a tmpfs to measure, as root: mount -t tmpfs "
                         "-o size=SIZE,huge=within_size tmpfs DIR), or leave it out for /dev/shm")
    if os.statvfs(root).f_blocks == 0:  # /proc, /sys, a cgroup tree: root may "write" there, but holds no files
        from prefetchd.daemon.mounts import filesystem_of

        raise ValueError(f"{flag} {root} is on {filesystem_of(root).fstype}, a filesystem that holds no files; "
                         "pick a folder on a tmpfs (/dev/shm, or one you mount: mount -t tmpfs -o "
                         "size=SIZE,huge=within_size tmpfs DIR)")
    if not os.access(root, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {root}: this user cannot create a daemon's buffer there; pick a folder you "
                         "can write")
    return root


def check_buffer_room(batch_size: int, image_size: int, high_water: int, root: Path) -> None:
    """Refuse at once settings whose daemon would refuse its buffer: on Docker's 64 MiB /dev/shm the default
    --high-water of 16 batches of 18.4 MiB failed each prefetchd row in turn, after the floor and the other
    contenders had been measured, and the table held the daemon's message in every one of them.  The advice
    names the bench's own flags: the daemon's (--min-free-mb, a mark of 1) are not the bench's to take."""
    from prefetchd.daemon.buffer_dir import check_capacity, enlarge, largest_batch_size
    from prefetchd.daemon.config import DaemonConfig, fill_defaults
    from prefetchd.daemon.errors import ConfigError
    from prefetchd.daemon.mounts import filesystem_of

    cfg, _notes = fill_defaults(DaemonConfig(buffer=root / "prefetchd-bench", batch_size=batch_size,
                                             image_size=image_size, high_water=high_water, workers=1))
    fs = os.statvfs(root)
    size, floor = fs.f_blocks * fs.f_frsize, (cfg.min_free_mb or 0) << 20
    need = high_water * cfg.batch_bytes + floor
    if need > size:
        room = max(0, size - floor)
        fits = room // cfg.batch_bytes
        if fits >= 2:
            lower = f"pass --high-water {fits} (at most {fits} fits)"
        elif (smaller := largest_batch_size(image_size, room // 2, below=batch_size)) >= 1:
            lower = (f"pass --high-water 2 --batch-size {smaller} (not 2 batches of {batch_size} fit; "
                     f"{smaller} at {image_size} px do)")
        else:
            lower = "pass a smaller --image-size"
        raise ValueError(
            f"the daemon's buffer goes in {root}, a filesystem of {binary_size(size)}: --high-water {high_water} x "
            f"{binary_size(cfg.batch_bytes)} batches plus the daemon's {cfg.min_free_mb} MiB floor of free space "
            f"need {binary_size(need)}; {lower}, put the buffers on a larger tmpfs with --buffer-root, or enlarge "
            f"this one ({enlarge(filesystem_of(root).point)})")
    try:
        check_capacity(cfg)  # what else the daemon refuses: batches beyond its memory cgroup's limit
    except ConfigError as exc:
        raise ValueError(f"the daemon's buffer goes in {root}: {exc}") from None


def run_benchmark(
    data: Path,
    *,
    workers_list: Sequence[int] | None = None,
    batch_size: int = 128,
    image_size: int = 224,
    seconds: float | None = 8.0,
    batches: int | None = None,
    out_dir: Path,
    high_water: int | None = None,
    contenders: Sequence[str] = tuple(CONTENDERS),
    warm_start: bool = True,
    data_wait: bool = True,
    floor: bool = True,
    rounds: int = 1,
    report: Callable[[str], None] | None = None,
    buffer_root: Path | None = None,
) -> BenchmarkResults:
    """Measure every contender at every worker count on ``data``; write results into ``out_dir``.

    ``data`` is a class-folder dataset (ImageFolder layout).  ``workers_list``
    defaults to 1 .. the usable cores.  Each measurement lasts ``seconds`` after
    its first batch and a warm-up of 15 % of that (at most 1 s), or, when
    ``batches`` is given, that many batches (at least MIN_BATCHES) after a warm-up of a fifth as many.
    ``high_water`` (the daemon's, in batches) defaults to enough for the
    data-wait scenario: max(16, eval_every(max workers)).  ``floor``: also time the
    daemon's ``augment()`` alone on one core, once a round (``prefetchd.bench.floor``), and
    give each prefetchd row's share of k times it.  ``rounds`` > 1 measures
    every contender that many times, the contenders taking turns, and reports the median
    of each one's rounds (a machine whose speed drifts then slows every contender alike,
    where one round apiece can catch one contender in a slow minute).  ``buffer_root``: the folder the
    daemons' buffers go in (default /dev/shm, or the temp folder without one: ``launch.buffer_root``), say a
    tmpfs mounted with huge pages, to measure where a daemon's buffer will live.  Writes
    ``bench.json``, ``bench.txt`` (the table), ``bench.png`` (if matplotlib is
    importable) and ``logs/`` (daemon logs) into ``out_dir`` and returns the results.
    """
    say = report or log.info
    data = Path(data).resolve()
    if not data.is_dir():
        raise ValueError(f"--data {data} is not a directory; pass a class-folder dataset, or leave out --data "
                         "and `prefetchd bench` generates an ImageNet-like one (--generate N images)")
    usable = sorted(usable_cores())
    workers_list = worker_counts(workers_list)
    if batches is not None:
        seconds = None  # a batch count replaces the time window
    elif seconds is None:
        raise ValueError("pass seconds= (a time window per measurement) or batches= (a batch count)")
    if batches is not None and batches < MIN_BATCHES:
        raise ValueError(f"batches={batches} (--batches): measure at least {MIN_BATCHES}; {WHY_MIN_BATCHES}")
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: measure each contender at least once")
    if seconds is not None and seconds <= 0:
        raise ValueError(f"seconds={seconds}: the measurement needs a positive length")
    unknown = [c for c in contenders if c not in ALL_CONTENDERS]
    if unknown:
        raise ValueError(f"unknown contenders {unknown}; choose from {', '.join(ALL_CONTENDERS)}")
    if high_water is None:
        high_water = max(DEFAULT_HIGH_WATER, eval_every(workers_list[-1]))
    if high_water < 2:
        raise ValueError(f"high_water={high_water}: the daemon needs at least 2 batches of buffer")
    buffers = buffers_in(buffer_root)
    if any(name.startswith("prefetchd") for name in contenders):
        check_buffer_room(batch_size, image_size, high_water, buffers)

    out_dir = Path(out_dir)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    window = Window(seconds=seconds, batches=batches)
    dataset = describe_dataset(data)
    results = BenchmarkResults(
        machine=describe_machine(buffers),
        dataset=dataset,
        config={
            "batch_size": batch_size, "image_size": image_size, "seconds": seconds, "batches": batches,
            "workers": list(workers_list), "high_water": high_water, "contenders": list(contenders), "rounds": rounds,
            "floor": floor,
            "pinning": "each contender (consumer + workers) pinned to the first k usable cores",
        },
    )
    say(f"dataset: {dataset['images']} images in {dataset['classes']} classes, mean {dataset['mean_kb']:.0f} KB; "
        f"{describe_cpu(results.machine)}")
    missing = {name: why_not_runnable(name) for name in contenders}
    run = Run(data=data, batch_size=batch_size, image_size=image_size, window=window, out_dir=out_dir,
               high_water=high_water, say=say, buffers=buffers)
    k_max = workers_list[-1]
    waits: dict[str, Any] = {}
    floors: list[dict[str, Any]] = []
    original = os.sched_getaffinity(0)
    try:
        for k in workers_list:
            cores = usable[:k]
            first_rounds: dict[str, Throughput] = {}
            loops: list[float] = []
            for turn, name in itertools.product(range(rounds), contenders):
                if floor and "prefetchd" in contenders and k == workers_list[0] and name == contenders[0]:
                    floors.append(_measure_floor(data, image_size, usable[0], window, batch_size, say))
                if floor and "prefetchd" in contenders and not missing["prefetchd"] and name == contenders[0]:
                    loops.append(_measure_loops(data, image_size, cores, window, say))
                wait = data_wait and turn == 0 and k == k_max and name in ("prefetchd", BASELINE)
                if missing[name]:
                    if turn == 0:
                        results.throughput.append(Throughput(name, k, cores, note=missing[name]))
                    continue
                say(f"measuring {name} with {worker_count(k)} on cores {core_list(cores)}"
                    + (f", round {turn + 1} of {rounds}" if rounds > 1 else ""))
                row, scenario = run.measure(name, k, cores, data_wait=wait)
                if turn == 0:
                    first_rounds[name] = row
                    results.throughput.append(row)
                else:
                    add_round(first_rounds[name], row)
                if scenario is not None:
                    waits[name] = scenario
                    if name == "prefetchd" and high_water < scenario["eval_every_steps"]:
                        results.notes.append(
                            f"the daemon's high-water mark ({high_water}) is below the {scenario['eval_every_steps']} "
                            "steps between evaluations, so its buffer cannot bank a whole pause's production"
                        )
                if row.images_per_s is not None:
                    say(f"  {row.images_per_s:.0f} img/s" + (f"; {row.note}" if row.note else ""))
                mem = row.extra.pop("memory", None)
                if mem and turn == 0:
                    phase = {} if name == "prefetchd" else {"phase": f"{name} throughput run"}
                    results.memory.append({"workers": k, **phase, **mem})
            if rounds > 1:
                for row in first_rounds.values():
                    take_medians(row)
            if loops and "prefetchd" in first_rounds:  # once a round, like the floor: the median
                first_rounds["prefetchd"].loops = sorted(loops)[(len(loops) - 1) // 2]
                first_rounds["prefetchd"].extra["loops_rounds"] = [round(rate, 1) for rate in loops]
        if warm_start and "prefetchd" in contenders:
            say(f"measuring prefetchd's warm start ({worker_count(k_max)}, buffer filled to {high_water} batches)")
            try:
                results.warm_start = run.warm_start(k_max, usable[:k_max])
            except Exception as exc:  # keep the throughput numbers
                log.debug("warm start failed", exc_info=True)
                results.warm_start = {"workers": k_max, "error": failure(exc)}
                say(f"  failed: {results.warm_start['error']}")
            mem = results.warm_start.pop("memory", None)
            if mem:
                results.memory.append({"workers": k_max, "phase": "warm start (filled to high water)", **mem})
    finally:
        os.sched_setaffinity(0, original)
    if floors:
        results.floor = median_floor(floors)
    if waits:
        results.data_wait = {"workers": k_max, **data_wait_doc(k_max), "contenders": waits}
    fill_ratios(results)
    results.notes.append(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}")
    results.machine["load_average_end"] = round(os.getloadavg()[0], 2)
    write_outputs(results, out_dir)
    return results


def worker_counts(workers_list: Sequence[int] | None) -> list[int]:
    """The worker counts to measure, sorted (default: 1 .. the usable cores); ValueError for a count
    below 1 or above the usable cores.  `prefetchd bench` asks before it generates a dataset."""
    usable = usable_cpus()
    counts = sorted(set(int(k) for k in (workers_list if workers_list is not None else range(1, usable + 1))))
    if not counts or counts[0] < 1:
        raise ValueError(f"workers {counts}: pass worker counts of 1 or more")
    if counts[-1] > usable:
        raise ValueError(
            f"workers {counts[-1]} is more than the {usable} usable cores; every contender is pinned "
            "to as many cores as it has workers, so pick counts up to the core count"
        )
    return counts


def _measure_loops(data: Path, image_size: int, cores: list[int], window: Window,
                   say: Callable[[str], None]) -> float:
    from prefetchd.bench.floor import measure_parallel_floor

    seconds = window.seconds if window.seconds is not None else LOOPS_SECONDS
    say(f"measuring {counted(len(cores), 'independent augment() loop')} on cores {core_list(cores)} ({seconds:g} s)")
    loops = measure_parallel_floor(data, image_size, cores, seconds)
    rate: float = loops["images_per_s"]
    say(f"  {rate:.0f} img/s (the processes were ready after {loops['start_s']:.1f} s)")
    return rate


def _measure_floor(data: Path, image_size: int, core: int, window: Window, batch_size: int,
                   say: Callable[[str], None]) -> dict[str, Any]:
    from prefetchd.bench.floor import measure_floor  # PIL and the decoder: not for `prefetchd --help`

    say(f"measuring the floor: the daemon's augment() alone on core {core}")
    measured = measure_floor(data, image_size, core, seconds=window.seconds,
                             images=None if window.batches is None else window.batches * batch_size)
    say(f"  {measured['ms_per_image']:.2f} ms per image ({measured['images_per_s']:.0f} img/s)")
    return measured
