"""prefetchd.daemon.fill and prefetchd.daemon.workers: tasks written into batch slots, deterministic whatever
the chunking or the process, with per-slot stage timings; a broken hook stops the job."""

from __future__ import annotations

import multiprocessing
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch
from PIL import Image

from prefetchd.buffer_protocol import SlotFiller
from prefetchd.daemon.config import DaemonConfig
from prefetchd.daemon.errors import ConfigError, DaemonError
from prefetchd.daemon import jpeg_crop, workers
from prefetchd.daemon.dataset import SampleIndex, scan_class_folders
from prefetchd.daemon.jpeg_crop import CleanFiles
from prefetchd.daemon.sampler import sample_rng
from prefetchd.daemon.plan import AugmentOptions
from prefetchd.daemon.transforms import augment
from prefetchd.daemon.fill import run_task
from prefetchd.daemon.tasks import Filled, SampleUnrecoverable, Task, WorkerJob, WriteFailed, failure_of
from prefetchd.daemon.workers import forkserver_preload, limit_threads, worker_main

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")

SIZE = 24
SLOT = SIZE * SIZE * 3
OFFSET = 4096  # the images payload does not start at 0 in a real batch file


def _dataset(root: Path, broken: tuple[int, ...] = ()) -> SampleIndex:
    """8 JPEGs and 2 PNGs in two classes; the files at positions ``broken`` are not images."""
    rng = np.random.default_rng(0)
    for i in range(10):
        folder = root / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{i:02d}.{'png' if i in (3, 6) else 'jpg'}"
        if i in broken:
            path.write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
            continue
        w, h = int(rng.integers(40, 120)), int(rng.integers(40, 120))
        base = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
        Image.fromarray(base).resize((w, h), Image.Resampling.BICUBIC).save(path, quality=90)
    return scan_class_folders(root)


@pytest.fixture
def index(tmp_path: Path) -> SampleIndex:
    return _dataset(tmp_path / "data")


def _batch_file(path: Path, slots: int) -> Path:
    with open(path, "wb") as fh:
        fh.truncate(OFFSET + slots * SLOT)
    return path


def _task(path: Path, items: list[tuple[int, int]], task_id: int = 0, epoch: int = 0) -> Task:
    return Task(task_id, str(path), OFFSET, SLOT, epoch, tuple(items))


def _images(path: Path, slots: int) -> np.ndarray:
    data = np.fromfile(path, dtype=np.uint8)[OFFSET:OFFSET + slots * SLOT]
    return data.reshape(slots, SIZE, SIZE, 3)


def _job(index: SampleIndex, **kw: object) -> WorkerJob:
    return WorkerJob(index, np.arange(len(index), dtype=np.int64), SIZE, True, 7, **kw)  # type: ignore[arg-type]


def test_filled_has_non_negative_timings_per_slot(index: SampleIndex, tmp_path: Path) -> None:
    path = _batch_file(tmp_path / "b.tmp", 4)
    items = [(2, 5), (0, 1), (3, 6), (1, 0)]
    result = run_task(_job(index), _task(path, items))
    assert isinstance(result, Filled)
    assert [s[:2] for s in result.slots] == items
    assert len(result.timings) == len(items)
    for read, decode, aug, write in result.timings:
        assert min(read, decode, aug, write) >= 0
        assert decode > 0 and aug > 0  # every sample was decoded and resized
    assert sum(map(sum, result.timings)) <= result.seconds


def test_slots_hold_what_augment_makes(index: SampleIndex, tmp_path: Path) -> None:
    path = _batch_file(tmp_path / "b.tmp", 3)
    run_task(_job(index), _task(path, [(0, 4), (1, 3), (2, 9)], epoch=2))
    images = _images(path, 3)
    for slot, sample in enumerate([4, 3, 9]):
        expected = augment(index.path(sample), SIZE, True, sample_rng(7, 2, sample))
        assert np.array_equal(images[slot], expected)


@pytest.mark.parametrize("options", [AugmentOptions(), AugmentOptions(color_jitter=0.4)], ids=["plain", "jitter"])
def test_a_spares_slots_are_made_in_place_with_the_bytes_of_a_fresh_files(
        index: SampleIndex, tmp_path: Path, options: AugmentOptions, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file whose pages all exist (a spare) is mapped and each image is made in its slot (by the
    resize itself; with colour jitter, copied there at the end); a fresh file is written with
    pwrite.  The same bytes."""
    items = [(0, 4), (1, 3), (2, 9)]
    copied: list[int] = []
    fill = SlotFiller.fill
    monkeypatch.setattr(SlotFiller, "fill", lambda self, slot, image: (copied.append(slot), fill(self, slot, image)))
    fresh = _batch_file(tmp_path / "fresh.tmp", 3)
    run_task(_job(index, augment=options), _task(fresh, items, epoch=2))
    assert copied == [0, 1, 2]
    copied.clear()
    spare = tmp_path / "spare.tmp"
    spare.write_bytes(b"\xab" * (OFFSET + 3 * SLOT))  # every page there, holding an earlier batch
    run_task(_job(index, augment=options), _task(spare, items, epoch=2))
    assert copied == []
    assert spare.read_bytes() == fresh.read_bytes().replace(b"\0" * OFFSET, b"\xab" * OFFSET, 1)


def test_same_bytes_whatever_the_chunking(index: SampleIndex, tmp_path: Path) -> None:
    order = [7, 2, 9, 0, 5, 3, 8, 1]
    whole = _batch_file(tmp_path / "whole.tmp", 8)
    run_task(_job(index), _task(whole, list(enumerate(order))))
    chunked = _batch_file(tmp_path / "chunked.tmp", 8)
    # as three workers would get it, in another order
    for task_id, chunk in enumerate([[(5, 3), (6, 8), (7, 1)], [(0, 7)], [(1, 2), (2, 9), (3, 0), (4, 5)]]):
        run_task(_job(index), _task(chunked, chunk, task_id))
    assert whole.read_bytes() == chunked.read_bytes()
    other_epoch = _batch_file(tmp_path / "epoch1.tmp", 8)
    run_task(_job(index), _task(other_epoch, list(enumerate(order)), epoch=1))
    assert whole.read_bytes() != other_epoch.read_bytes()


def test_slots_of_another_size_than_the_jobs_images_stop_the_job_in_fresh_and_spare_files(
        index: SampleIndex, tmp_path: Path) -> None:
    for name, allocated in (("fresh.tmp", False), ("spare.tmp", True)):
        path = tmp_path / name
        path.write_bytes(b"\0" * (OFFSET + 2 * SLOT)) if allocated else _batch_file(path, 2)
        task = Task(0, str(path), OFFSET, SLOT - 3, 0, ((0, 1),))  # one pixel short per slot
        with pytest.raises(SampleUnrecoverable, match=f"slots of {SLOT - 3} bytes for {SIZE} x {SIZE} x 3 images"):
            run_task(_job(index), task)


def test_replaced_samples_keep_their_timings(tmp_path: Path) -> None:
    index = _dataset(tmp_path / "data", broken=(4,))
    broken = next(i for i in range(len(index)) if index.path(i).name == "04.jpg")
    path = _batch_file(tmp_path / "b.tmp", 2)
    result = run_task(_job(index), _task(path, [(0, 0), (1, broken)]))
    assert isinstance(result, Filled)
    assert result.slots[1][1] == broken + 1  # the next member replaced the broken file
    assert len(result.failures) == 1 and result.failures[0][0] == broken
    assert len(result.timings) == 2 and all(min(t) >= 0 for t in result.timings)


def test_a_replacement_from_the_next_class_carries_its_own_label(tmp_path: Path) -> None:
    # 08.jpg is the last file of class c0: the next member of the split, its replacement, is c1's first.
    index = _dataset(tmp_path / "data", broken=(8,))
    broken = next(i for i in range(len(index)) if index.path(i).name == "08.jpg")
    assert int(index.labels[broken]) != int(index.labels[broken + 1])
    result = run_task(_job(index), _task(_batch_file(tmp_path / "b.tmp", 2), [(0, 0), (1, broken)]))
    assert isinstance(result, Filled)
    assert result.slots[1] == (1, broken + 1, int(index.labels[broken + 1])), "the label is the replacement's"


def test_a_bug_in_a_task_stops_the_job_with_its_traceback_instead_of_being_retried(
        index: SampleIndex, tmp_path: Path) -> None:
    # A sample the index does not have: no file's fault and no outage, so retrying fails the same way for
    # ever (a daemon that says "retrying" while nothing is built); the job stops, saying where it happened.
    caught: list[Exception] = []
    try:
        run_task(_job(index), _task(_batch_file(tmp_path / "b.tmp", 1), [(0, len(index) + 100)]))
    except IndexError as exc:
        caught.append(exc)
    assert caught, "a sample past the index's end was built"
    result = failure_of(0, caught[0])  # the exception given, outside its except clause too
    assert isinstance(result, WriteFailed) and result.fatal is DaemonError, result
    assert "IndexError" in result.reason and "Traceback" in result.reason and "_fill" in result.reason, result.reason


def test_unwritable_batch_is_a_write_failure(index: SampleIndex, tmp_path: Path) -> None:
    result = run_task(_job(index), _task(tmp_path / "gone.tmp", [(0, 0)]))
    assert isinstance(result, WriteFailed) and not result.fatal and "gone.tmp" in result.reason


def test_augmentation_options_reach_the_samples(index: SampleIndex, tmp_path: Path) -> None:
    plain = _batch_file(tmp_path / "plain.tmp", 2)
    run_task(_job(index), _task(plain, [(0, 1), (1, 2)]))
    options = AugmentOptions(color_jitter=0.4, scale_jitter=(SIZE, 2 * SIZE))
    jittered = _batch_file(tmp_path / "jitter.tmp", 2)
    run_task(_job(index, augment=options), _task(jittered, [(0, 1), (1, 2)]))
    images = _images(jittered, 2)
    assert not np.array_equal(images, _images(plain, 2))
    for slot, sample in enumerate([1, 2]):
        assert np.array_equal(images[slot], augment(index.path(sample), SIZE, True, sample_rng(7, 0, sample), options))


def test_from_config_carries_the_augmentation(index: SampleIndex, tmp_path: Path) -> None:
    cfg = DaemonConfig(buffer=tmp_path, image_size=32, seed=3, color_jitter=0.3, scale_jitter="40,64",
                       transform="pkg.mod:fn")
    members = np.arange(4, dtype=np.int64)
    job = WorkerJob.from_config(index, members, cfg)
    assert (job.image_size, job.train, job.seed) == (32, True, 3)
    assert job.augment == AugmentOptions(color_jitter=0.3, scale_jitter=(40, 64), transform="pkg.mod:fn")
    val = WorkerJob.from_config(index, members, DaemonConfig(buffer=tmp_path, split="val"))
    assert not val.train and val.augment == AugmentOptions()
    # the controller's positional call still works and means "no extra augmentation"
    assert WorkerJob(index, members, 32, True, 3).augment == AugmentOptions()


def test_limit_threads_leaves_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # restored afterwards, as limit_threads sets it
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # as torch starts on 2 cores; the suite's processes run with one (conftest)
    try:
        limit_threads()
        assert torch.get_num_threads() == 1
        assert os.environ["OMP_NUM_THREADS"] == "1", "for a torch the worker imports later"
    finally:
        torch.set_num_threads(before)


HOOKS = """
import torch

def single_thread_or_invert(image, rng):
    # Leaves the image alone only where torch runs on one thread.
    return image if torch.get_num_threads() == 1 else 255 - image

def broken(image, rng):
    raise ValueError("bad hook")
"""


@pytest.fixture
def hooks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    module = f"prefetchd_worker_hooks_{os.getpid()}"
    (tmp_path / f"{module}.py").write_text(HOOKS)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned children inherit sys.path
    return module


def _in_worker(job: WorkerJob, task: Task, clean: CleanFiles | None,
               method: Literal["forkserver", "spawn"] = "forkserver") -> Filled | WriteFailed:
    """``task`` run by a worker process started as the pool starts them (forkserver, unless ``method``), with
    ``clean``."""
    ctx = multiprocessing.get_context(method)
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=worker_main, args=(child, job, clean), daemon=True)
    proc.start()
    child.close()
    try:
        parent.send(task)
        assert parent.poll(120), "the worker did not answer within 120 s"
        result: Filled | WriteFailed = parent.recv()
        parent.send(None)
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        parent.close()
    return result


def test_spawned_worker_matches_in_process_with_one_thread(index: SampleIndex, tmp_path: Path, hooks: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    items = [(0, 3), (1, 8), (2, 0)]
    local = _batch_file(tmp_path / "local.tmp", 3)
    run_task(_job(index), _task(local, items))
    remote = _batch_file(tmp_path / "remote.tmp", 3)
    job = _job(index, augment=AugmentOptions(transform=f"{hooks}:single_thread_or_invert"))
    # A fresh interpreter whose torch starts on 2 threads (the suite's own processes run on one, conftest), so
    # that only the worker's limit gives the hook one; a forkserver started earlier would hand down one.
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    result = _in_worker(job, _task(remote, items), None, method="spawn")
    assert isinstance(result, Filled) and len(result.timings) == 3
    assert remote.read_bytes() == local.read_bytes()


@pytest.mark.skipif(not jpeg_crop.available(), reason="the crop-aware JPEG extension is not built here")
def test_what_one_worker_learns_another_uses_for_the_same_bytes(index: SampleIndex, tmp_path: Path) -> None:
    items = [(slot, i) for slot, i in enumerate(range(len(index)))]
    clean = CleanFiles(len(index))
    sizes = [index.path(i).stat().st_size for i in range(len(index))]
    for epoch in (0, 1):  # epoch 1 in a second worker, which finds every JPEG known clean
        got = _batch_file(tmp_path / f"worker-{epoch}.tmp", len(items))
        assert isinstance(_in_worker(_job(index), _task(got, items, epoch=epoch), clean), Filled)
        if epoch == 0:
            known = [i for i in range(len(index)) if clean.known_clean(i, sizes[i])]
            assert known == [i for i in range(len(index)) if index.path(i).suffix == ".jpg"]  # PNGs: not JPEGs
        want = _batch_file(tmp_path / f"alone-{epoch}.tmp", len(items))
        run_task(_job(index), _task(want, items, epoch=epoch))  # no table: every decode reads to the end
        assert got.read_bytes() == want.read_bytes()
    clean.close()


def test_a_broken_hook_is_fatal_not_a_replacement(index: SampleIndex, tmp_path: Path, hooks: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # worker_main in this (main) thread: its SIGINT and thread settings are put back after.
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(torch, "set_num_interop_threads", lambda n: None)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # worker_main lifts Pillow's limit
    monkeypatch.setattr(workers, "volunteer_for_oom_killer", lambda: None)  # see tests/conftest.py
    path = _batch_file(tmp_path / "b.tmp", 2)
    ours, theirs = multiprocessing.Pipe()
    ours.send(_task(path, [(0, 1), (1, 2)], task_id=5))
    ours.send(None)
    worker_main(theirs, _job(index, augment=AugmentOptions(transform=f"{hooks}:broken")))
    result = ours.recv()
    assert isinstance(result, WriteFailed) and result.fatal is ConfigError and result.task_id == 5
    assert f"{hooks}:broken" in result.reason and "ValueError: bad hook" in result.reason
    assert str(index.path(1)) in result.reason
    assert "could not be decoded" not in result.reason  # not mistaken for bad images and replaced


def test_a_worker_whose_controller_died_exits_quietly(index: SampleIndex, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # A SIGKILLed controller leaves its workers with queued tasks and a dead pipe; they used to
    # die with a BrokenPipeError traceback in the log the next daemon shares.
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(torch, "set_num_interop_threads", lambda n: None)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)
    monkeypatch.setattr(workers, "volunteer_for_oom_killer", lambda: None)
    path = _batch_file(tmp_path / "b.tmp", 2)
    ours, theirs = multiprocessing.Pipe()
    ours.send(_task(path, [(0, 1), (1, 2)], task_id=5))
    ours.close()
    worker_main(theirs, _job(index))  # returns: no BrokenPipeError, no ConnectionResetError
    assert _images(path, 2).any(), "the task it had already received is still done"


KEEP_HEAP = """
import resource, sys
if sys.argv[1] == "keep":
    from prefetchd.daemon.workers import keep_heap
    keep_heap()
kept = None
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
# A worker's pattern: a box of a few hundred KB to MB per image, the previous output alive meanwhile.
for n in [150_000, 600_000, 300_000, 1_200_000, 150_000, 2_400_000, 500_000] * 30:
    image = bytearray(n)  # zero-filled: every page touched
    kept, image = image, None
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="keep_heap sets glibc's malloc")
def test_keep_heap_spares_a_worker_most_page_faults() -> None:
    faults = {mode: int(subprocess.run([sys.executable, "-c", KEEP_HEAP, mode], capture_output=True, text=True,
                                       check=True, timeout=60).stdout)
              for mode in ("default", "keep")}
    assert faults["keep"] < faults["default"] / 2, faults


PRELOADED_WORKER = """
import importlib, multiprocessing, sys
for module in sys.argv[1].split(","):
    importlib.import_module(module)
preloaded = set(sys.modules)
# What a forked worker does next: unpickle its job and its tasks (importing their classes' modules) and run worker_main.
import numpy as np
from prefetchd.daemon.dataset import scan_class_folders
from prefetchd.daemon.tasks import Filled, Task, WorkerJob
from prefetchd.daemon.workers import worker_main
root, path, size, offset = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
index = scan_class_folders(root)
ours, theirs = multiprocessing.Pipe()
ours.send(Task(0, path, offset, size * size * 3, 0, ((0, 1), (1, 2))))
ours.send(None)
worker_main(theirs, WorkerJob(index, np.arange(len(index), dtype=np.int64), size, True, 7))
assert isinstance(ours.recv(), Filled)
print(" ".join(sorted(m for m in set(sys.modules) - preloaded if m.startswith("prefetchd"))))
"""


def test_a_worker_runs_only_code_its_server_preloaded(index: SampleIndex, tmp_path: Path) -> None:
    """Workers are forked from a server that imported ``forkserver_preload()``'s modules, so that they share
    those pages and start at once; a module of the worker's code that the list misses (moved out of the
    modules it names) would be imported again by every worker, at its first task."""
    path = _batch_file(tmp_path / "b.tmp", 2)
    run = subprocess.run([sys.executable, "-c", PRELOADED_WORKER, ",".join(forkserver_preload()), str(index.root),
                          str(path), str(SIZE), str(OFFSET)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == [], f"imported by the worker, not by its server: {run.stdout}"
