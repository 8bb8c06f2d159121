"""What `prefetchd bench` measured: one Throughput row per contender and worker count, and
the BenchmarkResults document that bench.json holds."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from prefetchd.words import counted

RESULTS_FORMAT = "prefetchd.bench"
RESULTS_VERSION = 1

CONTENDERS: dict[str, str] = {
    "prefetchd": "prefetchd daemon -> BufferLoader(normalize=False), uint8",
    "dataloader": "ImageFolder + DataLoader, RandomResizedCrop+flip+ToTensor+Normalize, float32",
    "dataloader-uint8": "ImageFolder + DataLoader, RandomResizedCrop+flip+PILToTensor, uint8",
    "spdl": "SPDL thread pipeline, RandomResizedCrop+flip+PILToTensor, uint8",
    "dali": "DALI CPU pipeline, decoders.image_random_crop (crop-aware decode)+resize+flip, uint8 HWC",
    "dali-fulldecode": "DALI CPU pipeline, decoders.image+random_resized_crop+flip, uint8 HWC",
}
# Measured only when asked for (`prefetchd bench --ray`): Ray is an optional extra, and here its traffic
# must stay on loopback (run the bench under `unshare -n` with `ip link set lo up`, as tests/integration/test_ray.py does).
ON_REQUEST_CONTENDERS: dict[str, str] = {
    "prefetchd-ray": "prefetchd daemon --ray local --workers 0 (a private Ray cluster on the same cores) -> BufferLoader, uint8",
}
BASELINE = "dataloader"
ALL_CONTENDERS: dict[str, str] = {**CONTENDERS, **ON_REQUEST_CONTENDERS}  # the names `contenders=` accepts


@dataclass
class Throughput:
    """One contender at one worker count."""

    contender: str
    workers: int
    cores: list[int]
    images_per_s: float | None = None
    images: int = 0
    window_s: float = 0.0
    first_batch_s: float | None = None  # daemon start / iterator creation -> first batch
    vs_baseline: float | None = None  # images_per_s / the DataLoader's at the same workers
    scaling: float | None = None  # images_per_s / (workers * images_per_s at 1 worker)
    vs_floor: float | None = None  # prefetchd: images_per_s / (workers * the floor's, BenchmarkResults.floor)
    # prefetchd: the floor's loop in `workers` processes at once on the same cores, images/s summed
    # (prefetchd.bench.floor.measure_parallel_floor): what the machine allows k workers.
    loops: float | None = None
    vs_loops: float | None = None  # prefetchd: images_per_s / loops
    loops_vs_floor: float | None = None  # prefetchd: loops / (workers * the floor's)
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class BenchmarkResults:
    machine: dict[str, Any]
    dataset: dict[str, Any]
    config: dict[str, Any]
    throughput: list[Throughput] = field(default_factory=list)
    warm_start: dict[str, Any] | None = None
    data_wait: dict[str, Any] | None = None
    floor: dict[str, Any] | None = None  # prefetchd.bench.floor.measure_floor, its median over the rounds
    memory: list[dict[str, Any]] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        return {"format": RESULTS_FORMAT, "version": RESULTS_VERSION, **doc}

    def row(self, contender: str, workers: int) -> Throughput | None:
        return next((r for r in self.throughput if r.contender == contender and r.workers == workers), None)

    def rate(self, contender: str, workers: int) -> float | None:
        row = self.row(contender, workers)
        return row.images_per_s if row is not None else None

    def table(self) -> str:
        from prefetchd.bench.report import format_table  # the report imports these results

        return format_table(self)


def add_round(row: Throughput, later: Throughput) -> None:
    """Fold a later round of ``row``'s contender at its worker count into ``row`` (its first round):
    ``extra["rounds"]`` lists every round's figures; ``take_medians`` picks the row's from them."""
    rounds = row.extra.setdefault("rounds", [_round(row)])
    rounds.append(_round(later))
    if later.note and later.note not in row.note:
        row.note = "; ".join(n for n in (row.note, later.note) if n)


def _round(row: Throughput) -> dict[str, Any]:
    return {"images_per_s": row.images_per_s, "images": row.images, "window_s": row.window_s,
            "first_batch_s": row.first_batch_s, "cpu": row.extra.get("cpu")}


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median rate (the lower of two middle ones); ``rounds`` all measured one.
    One rule for every figure taken over rounds (a row's rate, images, window and CPU split, the
    floor, the independent loops): a rate and the window, floor or CPU it is set against are then
    one round's, where a mean of two middle rates beside the lower one's floor was not."""
    return sorted(rounds, key=lambda r: r["images_per_s"])[(len(rounds) - 1) // 2]


def median_floor(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The floor of the round with the median rate, and every round's rate."""
    return {**median_round(rounds), "rounds": [round(r["images_per_s"], 1) for r in rounds]}


def take_medians(row: Throughput) -> None:
    """The row's rate, images, window and CPU split become the median round's (``median_round``:
    the lower of two middle ones), of the rounds that measured a rate; its first batch the median
    of the rounds' first batches, the lower of two middle ones likewise."""
    rounds = row.extra.get("rounds", [])
    measured = [r for r in rounds if r["images_per_s"] is not None]
    firsts = [r["first_batch_s"] for r in rounds if r["first_batch_s"] is not None]
    if measured:
        middle = median_round(measured)
        row.images_per_s, row.images, row.window_s = middle["images_per_s"], middle["images"], middle["window_s"]
        if middle.get("cpu") is not None:
            row.extra["cpu"] = middle["cpu"]
    if firsts:
        row.first_batch_s = statistics.median_low(firsts)


# prefetchd above this share of k x the floor is not a rate its k workers made (see fill_ratios).
IMPOSSIBLE_VS_FLOOR = 1.1


def fill_ratios(results: BenchmarkResults) -> None:
    for row in results.throughput:
        if row.images_per_s is None:
            continue
        base_row = results.row(BASELINE, row.workers)
        if base_row is not None and base_row.images_per_s:
            row.vs_baseline = round(row.images_per_s / base_row.images_per_s, 3)
            pairs = zip(row.extra.get("rounds", []), base_row.extra.get("rounds", []))
            ratios = [a["images_per_s"] / b["images_per_s"] for a, b in pairs if a["images_per_s"] and b["images_per_s"]]
            if ratios:  # round by round: the contenders of one round ran minutes apart, not an hour
                row.extra["vs_baseline_rounds"] = [round(r, 3) for r in ratios]
        one = results.rate(row.contender, 1)
        if one:
            row.scaling = round(row.images_per_s / (row.workers * one), 3)
        if row.contender == "prefetchd" and results.floor is not None:
            row.vs_floor = round(row.images_per_s / (row.workers * results.floor["images_per_s"]), 3)
            if row.vs_floor > IMPOSSIBLE_VS_FLOOR:
                batches = results.config.get("batches")
                window = f"{batches} batches" if batches else f"{row.window_s:.2f} s"
                whose = "its median round's window" if len(row.extra.get("rounds", [])) > 1 else "its window"
                results.notes.append(
                    f"WARNING: prefetchd at {counted(row.workers, 'worker')} measured {row.vs_floor:.0%} of "
                    f"{row.workers} x the floor, more than its workers can make: {whose} ({window}) counted "
                    "batches built before it, or the floor was measured on a busy core; measure longer "
                    "(--seconds, --batches) on a quiet machine")
        if row.loops:
            row.vs_loops = round(row.images_per_s / row.loops, 3)
            if results.floor is not None:
                row.loops_vs_floor = round(row.loops / (row.workers * results.floor["images_per_s"]), 3)
            row.loops = round(row.loops, 1)
        row.images_per_s = round(row.images_per_s, 1)
        row.window_s = round(row.window_s, 2)
        if row.first_batch_s is not None:
            row.first_batch_s = round(row.first_batch_s, 3)
