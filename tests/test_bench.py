"""The benchmark tool at toy scale (structure only, no speed assertions) and the ImageNet-like generator."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from prefetchd.bench import CONTENDERS, BenchmarkResults, bench_command, run_benchmark
from prefetchd.bench.dali import DALI_CONTENDERS, dali_batches
from prefetchd.bench.measure import MIN_BATCHES
from prefetchd.bench.report import LIBRARY_CONTENDERS, why_not_runnable
from prefetchd.bench.results import Throughput, fill_ratios
from prefetchd.daemon.mounts import pages_of
from prefetchd.synthetic import IMAGENET_LIKE_SHORT_SIDE, make_imagenet_like

REPO = Path(__file__).resolve().parents[1]


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


SMOKE_WARNINGS = _Warnings()  # what the smoke run logged at WARNING and above, from prefetchd's loggers


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory, shapes_data: Path) -> Iterator[tuple[BenchmarkResults, Path]]:
    out = tmp_path_factory.mktemp("bench-out")
    logger = logging.getLogger("prefetchd")
    logger.addHandler(SMOKE_WARNINGS)
    buffers = Path(tempfile.mkdtemp(prefix="prefetchd-test-buffers-", dir="/dev/shm"))  # --buffer-root
    try:
        results = run_benchmark(
            shapes_data / "train", workers_list=(1,), batch_size=8, image_size=32, seconds=1.0, out_dir=out,
            high_water=6, buffer_root=buffers,
        )
        assert not any(buffers.iterdir()), "each daemon's buffer removed after it"
        yield results, out
    finally:
        logger.removeHandler(SMOKE_WARNINGS)
        shutil.rmtree(buffers, ignore_errors=True)


def test_every_contender_is_measured(smoke: tuple[BenchmarkResults, Path]) -> None:
    results, _ = smoke
    assert [(r.contender, r.workers) for r in results.throughput] == [(name, 1) for name in CONTENDERS]
    for row in results.throughput:
        assert row.cores and len(row.cores) == 1
        if why_not_runnable(row.contender):
            assert row.images_per_s is None and row.note == why_not_runnable(row.contender)
            continue
        assert row.images_per_s is not None and row.images_per_s > 0, row.note
        assert row.images > 0 and row.window_s > 0 and row.first_batch_s is not None and row.first_batch_s > 0
        assert row.scaling == 1.0
        assert row.vs_baseline is not None and row.vs_baseline > 0
    prefetchd = results.throughput[0]
    assert prefetchd.extra["affinity"]["pinned"] and prefetchd.extra["affinity"]["processes"] >= 2
    # The floor: augment() alone on the first core, over every file of the dataset (72 < FLOOR_FILES).
    floor = results.floor
    assert floor is not None and floor["files"] == 72 and floor["core"] == prefetchd.cores[0] and len(floor["rounds"]) == 1
    assert floor["images"] > 0 and floor["ms_per_image"] == pytest.approx(1e3 / floor["images_per_s"])
    assert prefetchd.vs_floor == pytest.approx(prefetchd.images_per_s / floor["images_per_s"], abs=2e-3)
    assert all(r.vs_floor is None for r in results.throughput[1:])
    assert f"prefetchd {prefetchd.vs_floor:.0%} of 1 x that at 1 worker" in results.table()
    # The machine's own ceiling at k: the floor's loop in k processes at once (here k = 1).
    assert prefetchd.loops is not None and prefetchd.loops > 0
    assert prefetchd.vs_loops == pytest.approx(prefetchd.images_per_s / prefetchd.loops, abs=2e-3)
    assert prefetchd.loops_vs_floor == pytest.approx(prefetchd.loops / floor["images_per_s"], abs=2e-3)
    assert all(r.loops is None for r in results.throughput[1:])
    assert f"prefetchd {prefetchd.vs_loops:.0%} of that at 1 worker" in results.table()
    # Where the one core went over prefetchd's window: every process is pinned to it, so the
    # parts cannot add up to more than it; the worker's CPU per image is at least most of the floor's.
    cpu = prefetchd.extra["cpu"]
    parts = [cpu[f"{part}_cores"] for part in ("workers", "controller", "consumer", "monitor")]
    assert all(part >= 0 for part in parts) and cpu["workers_cores"] > 0 and cpu["consumer_cores"] > 0
    assert sum(parts) <= 1.1, cpu
    assert cpu["worker_ms_per_image"] > 0.5 * floor["ms_per_image"], (cpu, floor)
    assert abs(cpu["window_s"] - prefetchd.window_s) < 0.1
    assert "cores over prefetchd's window at 1 worker: workers" in results.table()
    assert all("cpu" not in r.extra for r in results.throughput[1:])


def test_warm_start_data_wait_and_memory(smoke: tuple[BenchmarkResults, Path]) -> None:
    results, _ = smoke
    ws = results.warm_start
    assert ws is not None and "error" not in ws, ws
    assert len(ws["first_batch_ms"]) == 5 and all(t > 0 for t in ws["first_batch_ms"])
    assert ws["target_ms"] == 20.0 and isinstance(ws["ok"], bool)
    # Five loaders open at once on one consumer took turns at its progress file (a WARNING each
    # after the first, and batches built again): each has a consumer of its own.
    assert not [m for m in SMOKE_WARNINGS.messages if "progress file" in m or "consumer" in m], SMOKE_WARNINGS.messages

    dw = results.data_wait
    assert dw is not None and set(dw["contenders"]) == {"prefetchd", "dataloader"}
    for scenario in dw["contenders"].values():
        assert 0.0 <= scenario["wait_share"] <= 1.0
        assert scenario["cycles"] >= 2 and scenario["step_s"] > 0 and scenario["pause_s"] > 0

    phases = [m.get("phase", "throughput run") for m in results.memory]
    assert phases == ["throughput run", "warm start (filled to high water)"]
    for mem in results.memory:
        assert mem["high_water"] == 6 and mem["planned_bytes"] == 6 * mem["batch_bytes"]
        assert mem["within_plan"], mem
        assert mem["rss_start_bytes"] > 0 and mem["rss_end_bytes"] > 0
    # The warm-start daemon filled its buffer to the high-water mark.
    assert results.memory[1]["peak_waiting_batches"] == 6


def test_outputs_are_written(smoke: tuple[BenchmarkResults, Path]) -> None:
    results, out = smoke
    doc = json.loads((out / "bench.json").read_text())
    assert doc["format"] == "prefetchd.bench" and doc["version"] == 1
    assert len(doc["throughput"]) == len(CONTENDERS) and doc["config"]["batch_size"] == 8
    assert doc["machine"]["usable_cpus"] >= 1 and doc["dataset"]["images"] == 72
    table = (out / "bench.txt").read_text()
    assert table.strip() == results.table().strip()
    for needle in ("img/s", "vs dataloader", "scaling", "warm start", "data-wait share", "prefetchd memory"):
        assert needle in table
    huge = doc["machine"]["buffer_huge_pages"]  # whether the buffer's tmpfs gives batches 2 MiB pages
    assert huge is None or f"buffer in {doc['machine']['buffer_fs']} ({pages_of(huge)})" in table
    # --buffer-root: the daemons' buffers went there, and the machine line says where they were.
    assert doc["machine"]["buffer_fs"].startswith("/dev/shm/prefetchd-test-buffers-")
    assert f" into {doc['machine']['buffer_fs']}/prefetchd-bench-" in (out / "logs" / "daemon-k1.log").read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert any("matplotlib is not installed" in n for n in results.notes)


def test_bad_arguments_are_refused(tmp_path: Path, shapes_data: Path) -> None:
    with pytest.raises(ValueError, match="more than the"):
        run_benchmark(shapes_data / "train", workers_list=(10_000,), out_dir=tmp_path)
    with pytest.raises(ValueError, match="or batches="):
        run_benchmark(shapes_data / "train", seconds=None, out_dir=tmp_path)
    # --generate applies only without --data: the way out is to leave --data out.
    with pytest.raises(ValueError, match="not a directory.*leave out --data"):
        run_benchmark(tmp_path / "missing", out_dir=tmp_path)
    (tmp_path / "empty" / "a").mkdir(parents=True)
    with pytest.raises(ValueError, match="no images in class folders.*leave out --data"):
        run_benchmark(tmp_path / "empty", out_dir=tmp_path / "out")
    result = CliRunner().invoke(bench_command, ["--workers", "0", "--data", str(shapes_data / "train")])
    assert result.exit_code == 2 and "worker counts must be 1 or more" in result.output
    # Refused before the dataset is generated (1500 images by default: a minute), not after.
    result = CliRunner().invoke(bench_command, ["--workers", "10000", "--generate", "40", "--out", str(tmp_path)])
    assert result.exit_code == 1 and "workers 10000 is more than the" in result.output
    assert "generating" not in result.output
    # A batch window so short that it counts batches built before it.
    with pytest.raises(ValueError, match=f"batches=3 .*at least {MIN_BATCHES}"):
        run_benchmark(shapes_data / "train", batches=3, out_dir=tmp_path)
    result = CliRunner().invoke(bench_command, ["--batches", "3", "--data", str(shapes_data / "train")])
    assert result.exit_code == 2 and f"x>={MIN_BATCHES}" in result.output
    # A --buffer-root that is no folder, refused before the dataset is generated.
    result = CliRunner().invoke(bench_command, ["--buffer-root", str(tmp_path / "none"), "--generate", "40",
                                                "--out", str(tmp_path)])
    assert result.exit_code == 1 and f"--buffer-root {tmp_path / 'none'} is not a folder" in result.output
    assert "generating" not in result.output
    # One on a filesystem that holds no files: root may write there, so only its size told (a review advised
    # "mount -o remount,size=... /proc").
    result = CliRunner().invoke(bench_command, ["--buffer-root", "/proc", "--generate", "40", "--out", str(tmp_path)])
    assert result.exit_code == 1 and "--buffer-root /proc is on proc, a filesystem that holds no files; pick a " \
        "folder on a tmpfs" in result.output, result.output
    assert "generating" not in result.output and "remount" not in result.output
    # An --out it cannot write in was a traceback once the run began (a user's walk, on a read-only mount).
    (tmp_path / "afile").write_text("")
    result = CliRunner().invoke(bench_command, ["--generate", "40", "--out", str(tmp_path / "afile" / "out")])
    assert result.exit_code == 2 and f"Invalid value for --out: {tmp_path / 'afile' / 'out'}: cannot write in " \
        f"{tmp_path / 'afile'} (Not a directory); pass a folder you can write" in result.output, result.output
    assert "generating" not in result.output
    # --generate beside --data was ignored without a word.
    result = CliRunner().invoke(bench_command, ["--data", str(shapes_data / "train"), "--generate", "40",
                                                "--out", str(tmp_path)])
    assert result.exit_code == 2 and "--generate sizes the dataset generated without --data; drop one of them" \
        in result.output, result.output


def test_data_under_a_folder_this_user_may_not_enter_is_said_so(shm_dir: Path, tmp_path: Path) -> None:
    """click's exists=True said "does not exist" of --data /root/ds to a user who may not enter /root (a walk as a
    non-root user): it is said as the other commands say a path this user may not use, exit code 4."""
    from tests.as_nobody import as_nobody

    shm_dir.chmod(0o755)
    shut = shm_dir / "shut"
    (shut / "ds" / "a").mkdir(parents=True)
    shut.chmod(0o700)  # root's: nobody may not enter it
    for flag in ("--data", "--source"):

        def run(flag: str = flag) -> str:
            result = CliRunner().invoke(bench_command, [flag, str(shut / "ds"), "--out", str(shm_dir / "out")])
            return f"{result.exit_code} {result.output}"

        said = as_nobody(run)
        assert said.startswith(f"4 prefetchd: {flag} {shut / 'ds'}: {shut}: permission denied: it belongs to root"), said
        assert "does not exist" not in said, said
    result = CliRunner().invoke(bench_command, ["--data", str(tmp_path / "none")])  # as root: not there is not there
    assert result.exit_code == 2 and "does not exist" in result.output, result.output


def test_a_rate_above_the_floor_is_flagged_in_the_report() -> None:
    results = BenchmarkResults(machine={}, dataset={}, config={"batches": 20},
                               floor={"images_per_s": 1000.0, "ms_per_image": 1.0, "files": 20, "rounds": [1000.0]})
    results.throughput = [Throughput("prefetchd", 1, [0], images_per_s=1800.0, window_s=0.1),
                          Throughput("prefetchd", 2, [0, 1], images_per_s=1900.0, window_s=0.2)]
    fill_ratios(results)
    warnings = [n for n in results.notes if n.startswith("WARNING")]
    assert warnings == ["WARNING: prefetchd at 1 worker measured 180% of 1 x the floor, more than its workers can "
                        "make: its window (20 batches) counted batches built before it, or the floor was measured on "
                        "a busy core; measure longer (--seconds, --batches) on a quiet machine"]


def test_two_rounds_give_the_lower_rounds_figures_for_everything() -> None:
    # The floor and the CPU split are the lower middle round's: a mean of two rates set against
    # them overstated vs_floor, and the warning named the rounds' summed window as the row's.
    from prefetchd.bench.results import add_round, take_medians

    results = BenchmarkResults(machine={}, dataset={}, config={"batches": None, "rounds": 2},
                               floor={"images_per_s": 1000.0, "ms_per_image": 1.0, "files": 20, "rounds": [1000.0]})
    slow = Throughput("prefetchd", 1, [0], images_per_s=1150.0, images=1150, window_s=1.0, first_batch_s=2.0,
                      extra={"cpu": {"workers_cores": 0.9}})
    fast = Throughput("prefetchd", 1, [0], images_per_s=1500.0, images=2250, window_s=1.5, first_batch_s=1.0,
                      extra={"cpu": {"workers_cores": 1.0}})
    add_round(slow, fast)
    take_medians(slow)
    results.throughput = [slow]
    fill_ratios(results)
    assert (slow.images_per_s, slow.images, slow.window_s, slow.first_batch_s) == (1150.0, 1150, 1.0, 1.0)
    assert slow.extra["cpu"] == {"workers_cores": 0.9} and slow.vs_floor == 1.15
    [warning] = [note for note in results.notes if note.startswith("WARNING")]
    assert "its median round's window (1.00 s)" in warning


def test_contenders_picks_who_is_measured(tmp_path: Path, shapes_data: Path) -> None:
    result = CliRunner().invoke(bench_command, ["--data", str(shapes_data / "train"), "--workers", "1",
                                                "--batch-size", "8", "--image-size", "32", "--seconds", "0.5",
                                                "--contenders", "dataloader-uint8,dataloader", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert [row["contender"] for row in doc["throughput"]] == ["dataloader-uint8", "dataloader"]
    assert doc["floor"] is None and doc["warm_start"] is None  # both are prefetchd's
    assert doc["throughput"][0]["vs_baseline"] > 0
    result = CliRunner().invoke(bench_command, ["--data", str(shapes_data / "train"), "--contenders", "prefetchd,torch"])
    assert result.exit_code == 2 and "torch: name contenders from prefetchd, dataloader" in result.output


def test_command_help_and_script() -> None:
    result = CliRunner().invoke(bench_command, ["--help"])
    assert result.exit_code == 0 and "--generate" in result.output and "--seconds" in result.output
    script = subprocess.run([sys.executable, str(REPO / "tools" / "bench.py"), "--help"], capture_output=True, text=True)
    assert script.returncode == 0 and "tools/bench.py" in script.stdout


def test_importing_the_command_stays_light() -> None:
    # `prefetchd` adds bench_command to its CLI: importing it must not pull in torch.
    code = ("import sys, prefetchd.bench; "
            "print(sorted({'torch', 'torchvision', 'matplotlib', 'nvidia.dali', 'spdl'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("contender", sorted(LIBRARY_CONTENDERS))
def test_a_missing_library_gives_a_not_installed_row(
    contender: str, shapes_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # None in sys.modules makes `import` raise ImportError, as on a machine without the package.
    module, package = LIBRARY_CONTENDERS[contender]
    monkeypatch.setitem(sys.modules, module, None)
    results = run_benchmark(shapes_data / "train", workers_list=(1,), batch_size=8, image_size=32, seconds=1.0,
                            out_dir=tmp_path, contenders=(contender,))
    [row] = results.throughput
    assert row.contender == contender and row.images_per_s is None and row.first_batch_s is None
    assert row.note == f"not installed (pip install {package})"
    assert row.note in (tmp_path / "bench.txt").read_text()


# -- the DALI contenders ----------------------------------------------------------------

# Source images whose pixels say where they came from: red is the class, green rises
# left to right, blue top to bottom.  A crop of one shows a flat red, a green ramp (falling
# when flipped) and a blue ramp as tall as the crop.
CLASS_RED = (50, 200)


@pytest.fixture(scope="module")
def ramp_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ramps")
    sizes = [(320, 240), (240, 320), (400, 300), (300, 300)]
    for label, red in enumerate(CLASS_RED):
        (root / f"class_{label}").mkdir()
        for i, (w, h) in enumerate(sizes):
            pixels = np.empty((h, w, 3), np.uint8)
            pixels[..., 0] = red
            pixels[..., 1] = np.linspace(0, 255, w).round().astype(np.uint8)[None, :]
            pixels[..., 2] = np.linspace(0, 255, h).round().astype(np.uint8)[:, None]
            Image.fromarray(pixels).save(root / f"class_{label}" / f"{i:03d}.JPEG", quality=95, subsampling=0)
    return root


@pytest.mark.parametrize("contender", sorted(DALI_CONTENDERS))
def test_dali_batches_are_flipped_crops_of_the_source(contender: str, ramp_data: Path) -> None:
    why = why_not_runnable(contender)
    if why:
        pytest.skip(f"nvidia.dali does not import: {why}")
    from torchvision.datasets import ImageFolder

    size, batch = 32, 8
    batches = dali_batches(ImageFolder(str(ramp_data)).samples, batch_size=batch, image_size=size, threads=1,
                           crop_aware=DALI_CONTENDERS[contender])
    images_list, labels_list = [], []
    for _ in range(6):
        images, labels = next(batches)
        assert images.shape == (batch, size, size, 3) and images.dtype == np.uint8
        assert labels.shape == (batch,) and np.issubdtype(labels.dtype, np.integer)
        images_list.append(images)
        labels_list.append(labels)
    batches.close()
    images = np.concatenate(images_list).astype(np.int32)
    labels = np.concatenate(labels_list)
    assert set(labels.tolist()) == {0, 1}

    red = images[..., 0].mean(axis=(1, 2))
    assert np.all(np.abs(red - np.take(CLASS_RED, labels)) < 12), "an image is not from its label's class"
    edge = size // 8
    left, right = images[:, :, :edge, 1].mean(axis=(1, 2)), images[:, :, -edge:, 1].mean(axis=(1, 2))
    top, bottom = images[:, :edge, :, 2].mean(axis=(1, 2)), images[:, -edge:, :, 2].mean(axis=(1, 2))
    assert np.all(bottom - top > 20), "every crop keeps a piece of the vertical ramp, upright"
    assert np.all(np.abs(right - left) > 20), "every crop keeps a piece of the horizontal ramp"
    flipped = right < left
    assert 0 < flipped.sum() < len(flipped), "some crops are flipped and some are not"
    # Crops, not the whole image resized: scale 0.08-1 leaves many crops well short of the full height.
    assert np.sum(bottom - top < 150) >= len(labels) // 4


# -- make_imagenet_like -------------------------------------------------------------


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*.JPEG"))}


def test_imagenet_like_shape_and_determinism(tmp_path: Path) -> None:
    a = make_imagenet_like(tmp_path / "a", classes=2, per_class=4, seed=3)
    b = make_imagenet_like(tmp_path / "b", classes=2, per_class=4, seed=3, workers=2)
    c = make_imagenet_like(tmp_path / "c", classes=2, per_class=4, seed=4)
    assert a.classes == ("class_000", "class_001") and a.images == 8
    da, db, dc = _digest(a.root), _digest(b.root), _digest(c.root)
    assert len(da) == 8 and da == db and set(da.values()).isdisjoint(dc.values())
    lo, hi = IMAGENET_LIKE_SHORT_SIDE
    for path in sorted(a.root.rglob("*.JPEG")):
        with Image.open(path) as im:
            assert im.format == "JPEG" and im.mode == "RGB"
            assert lo <= min(im.size) <= hi and max(im.size) / min(im.size) <= 16 / 9 + 0.01
    # Realistic entropy: tens of KB per file, not a few (flat) or hundreds (white noise).
    assert 30 < a.mean_kb < 300
    done: list[tuple[int, int]] = []
    make_imagenet_like(tmp_path / "d", classes=1, per_class=2, progress=lambda n, t: done.append((n, t)))
    assert done == [(1, 2), (2, 2)]


def test_imagenet_like_from_photos_and_refusals(tmp_path: Path) -> None:
    photos = tmp_path / "photos"
    photos.mkdir()
    Image.new("RGB", (800, 300), (200, 30, 40)).save(photos / "wide.png")
    Image.new("RGB", (200, 900), (20, 130, 40)).save(photos / "tall.jpg")
    s = make_imagenet_like(tmp_path / "out", classes=2, per_class=3, source=photos)
    for path in sorted(s.root.rglob("*.JPEG")):
        with Image.open(path) as im:
            assert IMAGENET_LIKE_SHORT_SIDE[0] <= min(im.size) <= IMAGENET_LIKE_SHORT_SIDE[1]
    with pytest.raises(FileExistsError, match="not empty"):
        make_imagenet_like(tmp_path / "out", classes=1, per_class=1)
    make_imagenet_like(tmp_path / "out", classes=1, per_class=1, overwrite=True)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["class_000"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no photos"):
        make_imagenet_like(tmp_path / "x", source=tmp_path / "empty", classes=1, per_class=1)


def test_rounds_take_turns_and_report_medians(tmp_path: Path, shapes_data: Path) -> None:
    said: list[str] = []
    results = run_benchmark(shapes_data / "train", workers_list=(1,), batch_size=8, image_size=32, seconds=0.5,
                            out_dir=tmp_path, high_water=6, contenders=("prefetchd", "dataloader"), rounds=3,
                            warm_start=False, data_wait=False, report=said.append)
    measuring = [line for line in said if line.startswith("measuring")]
    # turns, not blocks; the floor ("measuring the floor") and the independent loops first in each round
    assert [line.split()[1] for line in measuring] == ["the", "1", "prefetchd", "dataloader"] * 3
    assert measuring[1].startswith("measuring 1 independent augment() loop on cores")
    assert measuring[-1].endswith("round 3 of 3")
    for row in results.throughput:
        rates = [r["images_per_s"] for r in row.extra["rounds"]]
        assert len(rates) == 3 and all(rate > 0 for rate in rates)
        middle = sorted(row.extra["rounds"], key=lambda r: r["images_per_s"])[1]
        assert row.images_per_s == round(middle["images_per_s"], 1)
        assert (row.images, row.window_s) == (middle["images"], round(middle["window_s"], 2))  # not summed
        assert row.first_batch_s == round(sorted(r["first_batch_s"] for r in row.extra["rounds"])[1], 3)
    prefetchd, dataloader = results.throughput
    # (the ratio is taken before the rates are rounded for the table)
    assert prefetchd.vs_baseline == pytest.approx(prefetchd.images_per_s / dataloader.images_per_s, rel=3e-3, abs=1e-3)
    assert len(prefetchd.extra["vs_baseline_rounds"]) == 3
    assert results.floor is not None and len(results.floor["rounds"]) == 3  # once a round
    loops = prefetchd.extra["loops_rounds"]  # once a round too, the row's the median
    assert len(loops) == 3 and prefetchd.loops == round(sorted(loops)[1], 1) and dataloader.loops is None
    middle = sorted(prefetchd.extra["rounds"], key=lambda r: r["images_per_s"])[1]  # its CPU split too
    assert prefetchd.extra["cpu"] == middle["cpu"] and middle["cpu"]["workers_cores"] > 0
    assert round(results.floor["images_per_s"], 1) == sorted(results.floor["rounds"])[1]
    table = results.table()
    low, high = min(r["images_per_s"] for r in prefetchd.extra["rounds"]), max(
        r["images_per_s"] for r in prefetchd.extra["rounds"])
    assert f"{prefetchd.images_per_s:.0f} ({low:.0f}-{high:.0f})" in table and "median round's of 3" in table
    with pytest.raises(ValueError, match="rounds=0"):
        run_benchmark(shapes_data / "train", rounds=0, out_dir=tmp_path)


def test_the_floor_counts_what_it_is_asked_and_leaves_the_process_as_it_was(shapes_data: Path) -> None:
    import torch

    from prefetchd.bench.floor import measure_floor

    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    core = max(affinity)
    floor = measure_floor(shapes_data / "train", 32, core, images=100)
    assert floor["images"] == 100 and floor["files"] == 72 and floor["core"] == core
    assert floor["images_per_s"] > 0
    assert os.sched_getaffinity(0) == affinity and torch.get_num_threads() == threads
    with pytest.raises(ValueError, match="not both"):
        measure_floor(shapes_data / "train", 32, core, seconds=1.0, images=10)
    with pytest.raises(ValueError, match="not both"):
        measure_floor(shapes_data / "train", 32, core)


def test_the_floor_and_its_parallel_loops_leave_out_files_that_do_not_decode_and_name_them(
    shapes_data: Path, tmp_path: Path
) -> None:
    """A truncated JPEG and a text file named .JPEG stopped `prefetchd bench` at its floor with a traceback that did
    not name the file (a review); the daemon replaces such files, and the floor leaves them out."""
    from prefetchd.bench.floor import measure_floor, measure_parallel_floor

    data = tmp_path / "data"
    shutil.copytree(shapes_data / "train", data)
    first = sorted(data.glob("*/*.jp*g"))[0]
    (first.parent / "truncated.jpg").write_bytes(first.read_bytes()[:300])
    (first.parent / "text.JPEG").write_text("not an image\n")
    core = max(os.sched_getaffinity(0))
    floor = measure_floor(data, 32, core, images=100)
    assert floor["images"] == 100 and floor["files"] == 72 and floor["undecodable"] == 2, floor
    named = " ".join(floor["undecodable_files"])
    assert "truncated.jpg: " in named and "text.JPEG: ImageRefused: " in named, named
    loops = measure_parallel_floor(data, 32, [core], 0.5)
    assert loops["images_per_s"] > 0
    for other in [p for p in data.glob("*/*") if p != first]:
        other.unlink()
    for empty in [d for d in data.iterdir() if d != first.parent]:
        empty.rmdir()
    first.write_text("nor this")
    with pytest.raises(ValueError, match=r"^none of the 1 files the floor reads decodes \(last: .*\); are these files "):
        measure_floor(data, 32, core, images=10)


def test_the_floor_counts_its_own_threads_cpu_not_the_processes(shapes_data: Path) -> None:
    # gpu_check measures the floor in a process with CUDA's and an executor's threads: their CPU
    # is not the floor's.  hashlib lets go of the GIL on large inputs, so these threads burn CPU
    # beside the floor's; the floor's own thread cannot have used more CPU than the wall-clock
    # time the whole call took, whatever the load, where the process's CPU can (and did).
    import threading

    from prefetchd.bench.floor import measure_floor

    stop = threading.Event()
    block = bytes(1 << 22)

    def burn() -> None:
        while not stop.is_set():
            hashlib.sha256(block).digest()

    burners = [threading.Thread(target=burn, daemon=True) for _ in range(2)]
    for thread in burners:
        thread.start()
    try:
        started = time.perf_counter()
        floor = measure_floor(shapes_data / "train", 32, max(os.sched_getaffinity(0)), images=400)
        wall = time.perf_counter() - started
    finally:
        stop.set()
        for thread in burners:
            thread.join(10.0)
    cpu = floor["ms_per_image"] * floor["images"] / 1e3
    assert cpu <= wall, f"the floor reported {cpu:.2f} s of CPU in {wall:.2f} s of wall-clock time"


def test_the_parallel_floor_runs_one_pinned_loop_per_core_and_names_one_that_dies(
    shapes_data: Path, tmp_path: Path
) -> None:
    from prefetchd.bench.floor import measure_parallel_floor

    cores = sorted(os.sched_getaffinity(0))[:2]
    mask = os.sched_getaffinity(0)
    loops = measure_parallel_floor(shapes_data / "train", 32, cores, 0.5)
    assert [row["core"] for row in loops["per_core"]] == cores
    assert all(row["images_per_s"] > 0 for row in loops["per_core"])
    assert loops["images_per_s"] == pytest.approx(sum(row["images_per_s"] for row in loops["per_core"]))
    assert 0 < loops["start_s"] < 60
    assert os.sched_getaffinity(0) == mask  # the processes start on the measured cores; the caller's mask is back
    broken = tmp_path / "broken" / "class_a"
    broken.mkdir(parents=True)
    (broken / "0.jpg").write_bytes(b"not a JPEG")  # the one process's first pass fails on it
    with pytest.raises(RuntimeError, match=f"on core {cores[0]} exited with code 1"):
        measure_parallel_floor(broken.parent, 32, cores[:1], 0.5)
    assert os.sched_getaffinity(0) == mask


def test_the_independent_loops_start_at_different_files() -> None:
    # From file 0 each, k loops read the same file with the same crop at the same moment.
    import itertools

    from prefetchd.bench.floor import _walk

    walks = [list(itertools.islice(_walk(10, first, 4), 12)) for first in range(4)]
    assert [walk[0] for walk in walks] == [(1, 0), (1, 2), (1, 5), (1, 7)]
    for walk in walks:  # each goes on over every file, into the next epoch
        assert sorted(i for _, i in walk[:10]) == list(range(10))
    assert walks[0][10:] == [(2, 0), (2, 1)] and walks[3][3] == (2, 0)


def test_the_parallel_floor_does_not_import_the_callers_script_again(shapes_data: Path, tmp_path: Path) -> None:
    # multiprocessing's spawn would import it in every process (gpu_check: torch and torchvision).
    marker = tmp_path / "imported-again"
    script = tmp_path / "caller.py"
    script.write_text(
        "import sys\n"
        "from pathlib import Path\n"
        "if __name__ != '__main__':\n"
        f"    Path({str(marker)!r}).write_text(__name__)\n"
        "if __name__ == '__main__':\n"
        "    from prefetchd.bench.floor import measure_parallel_floor\n"
        f"    loops = measure_parallel_floor(Path(sys.argv[1]), 32, {sorted(os.sched_getaffinity(0))[:2]!r}, 0.2)\n"
        "    print(len(loops['per_core']))\n")
    proc = subprocess.run([sys.executable, str(script), str(shapes_data / "train")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == str(min(2, len(os.sched_getaffinity(0))))
    assert not marker.exists()


def test_disk_bytes_counts_batch_files_once_and_not_the_documents(tmp_path: Path) -> None:
    from prefetchd.bench.monitor import _disk_bytes

    (tmp_path / "e000000-s00000000.batch").write_bytes(b"\1" * 8192)
    (tmp_path / "e000000-s00000001.tmp").write_bytes(b"\1" * 4096)  # being built
    (tmp_path / "spare-00000000.tmp").write_bytes(b"\1" * 4096)
    # The same file under a second name, as a listing meets one the daemon renames meanwhile.
    os.link(tmp_path / "spare-00000000.tmp", tmp_path / "e000000-s00000002.tmp")
    (tmp_path / "status.json.tmp-12-ab12cd34").write_bytes(b"{}" * 1000)  # a document being replaced
    (tmp_path / "manifest.json").write_bytes(b"{}" * 1000)
    assert _disk_bytes(tmp_path) == sum(
        (tmp_path / n).stat().st_blocks * 512 for n in ("e000000-s00000000.batch", "e000000-s00000001.tmp",
                                                          "spare-00000000.tmp"))



def _bench_on_docker_shm(*args: str) -> subprocess.CompletedProcess[str]:
    """`prefetchd bench` in a mount namespace of its own whose /dev/shm is a 64 MiB tmpfs, as Docker makes it."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a /dev/shm of its own")
    mount_then_run = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"'
    return subprocess.run(["unshare", "-m", "sh", "-c", mount_then_run, "sh", sys.executable, "-m", "prefetchd",
                           "bench", *args], capture_output=True, text=True, timeout=240)


def test_a_buffer_the_daemon_would_refuse_is_refused_before_anything_is_measured(
        tmp_path: Path, shapes_data: Path) -> None:
    """The default --high-water (16 batches of 18.4 MiB) does not fit Docker's /dev/shm: every prefetchd row
    failed in turn, after the floor and the other contenders had been measured."""
    out = tmp_path / "out"
    proc = _bench_on_docker_shm("--data", str(shapes_data / "train"), "--workers", "1", "--out", str(out))
    assert proc.returncode == 1, proc.stderr
    assert ("the daemon's buffer goes in /dev/shm, a filesystem of 64.0 MiB: --high-water 16 x 18.4 MiB batches "
            "plus the daemon's 6 MiB floor of free space need 300.2 MiB; pass --high-water 3 (at most 3 fits), put the "
            "buffers on a larger tmpfs with --buffer-root, or enlarge this one (mount -o remount,size=... /dev/shm; in "
            "a container, docker run --shm-size=...)") in proc.stderr, proc.stderr
    assert "--min-free-mb" not in proc.stderr  # the daemon's flag, not the bench's
    # where not 2 batches fit, the batch size that does (the bench takes no mark below 2)
    small = _bench_on_docker_shm("--data", str(shapes_data / "train"), "--workers", "1", "--image-size", "400",
                                 "--out", str(out))
    assert small.returncode == 1 and "pass --high-water 2 --batch-size 63 (not 2 batches of 128 fit; 63 at 400 px " \
        "do)" in small.stderr, small.stderr
    assert "measuring" not in proc.stderr and not out.exists()


def test_a_contender_that_fails_takes_one_line_of_the_table(tmp_path: Path, shapes_data: Path) -> None:
    """The DataLoader's workers pass each batch through /dev/shm (88 MiB at 72 images of 320 px): it fails on
    Docker's 64 MiB one with its worker's whole traceback in the error, which filled the table's row."""
    out = tmp_path / "out"
    proc = _bench_on_docker_shm("--data", str(shapes_data / "train"), "--workers", "1", "--image-size", "320",
                                "--contenders", "dataloader", "--batches", str(MIN_BATCHES), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    table = (out / "bench.txt").read_text()
    row = next(line for line in table.splitlines() if line.startswith("dataloader "))
    assert "failed: RuntimeError: Caught RuntimeError in DataLoader worker process 0. RuntimeError: " in row, table
    assert "No space left on device" in row and "(/dev/shm holds 64.0 MiB: DataLoader workers pass" in row, row
    assert "Traceback" not in table, table


def test_the_memory_peak_is_never_below_the_start_or_end_figures(tmp_path: Path) -> None:
    """The samples list the daemon's tree every few seconds, the end figure lists it then: with processes new since
    (a Ray node's), the report read "RSS 1190 MiB at first batch -> 1461 MiB at end (peak 1419 MiB)"."""
    from prefetchd.bench.monitor import BufferMonitor

    monitor = BufferMonitor(tmp_path, os.getpid())  # this process's tree; its loop never runs: no sample at all
    monitor.mark_start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # new since the start
    try:
        time.sleep(0.5)  # its interpreter up
        monitor.mark_end()
    finally:
        child.kill()
        child.wait()
    memory = monitor.summary()
    assert memory["rss_end_bytes"] > memory["rss_start_bytes"] > 0
    assert memory["rss_peak_bytes"] >= memory["rss_end_bytes"], memory


def test_the_machine_line_names_a_buffer_root_that_is_not_a_tmpfs() -> None:
    """`--buffer-root` on an ext4 folder: the machine line said nothing of the buffer (a review), as for results
    written before the buffer's pages were recorded."""
    from prefetchd.bench.report import _buffer_pages, describe_cpu

    disk = {"buffer_fs": "/tmp/root", "buffer_fs_type": "ext4", "buffer_huge_pages": None}
    assert _buffer_pages(disk) == "; buffer in /tmp/root (ext4, not a tmpfs)"
    assert _buffer_pages({**disk, "buffer_fs_type": "tmpfs", "buffer_huge_pages": True}) == \
        "; buffer in /tmp/root (2 MiB pages)"
    assert _buffer_pages({"buffer_fs": "/dev/shm"}) == ""  # an old bench.json
    one = {"usable_cpus": 1, "cpu_model": "x", "ram_bytes": 2**30, "load_average_start": 0.1}
    assert describe_cpu(one).startswith("1 usable core (x)")
