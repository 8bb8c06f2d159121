"""The synthetic shapes dataset: deterministic, ImageFolder-shaped, mixed formats, learnable."""

from __future__ import annotations

import contextlib
import hashlib
import re
import threading
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from prefetchd.synthetic import SHAPES, DatasetSummary, make_imagenet_like, make_shapes_dataset

SIZE_RANGE = (72, 128)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetSummary:
    return make_shapes_dataset(tmp_path_factory.mktemp("shapes"), classes=4, train_per_class=30, val_per_class=6,
                               size_range=SIZE_RANGE, seed=0)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in _files(root)}


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a = make_shapes_dataset(tmp_path / "a", classes=3, train_per_class=12, val_per_class=3, seed=5)
    b = make_shapes_dataset(tmp_path / "b", classes=3, train_per_class=12, val_per_class=3, seed=5)
    c = make_shapes_dataset(tmp_path / "c", classes=3, train_per_class=12, val_per_class=3, seed=6)
    assert (a.classes, a.counts, a.formats) == (b.classes, b.counts, b.formats)
    da, db, dc = _digest(a.root), _digest(b.root), _digest(c.root)
    assert len(da) == 45 and da == db
    # Names may coincide across seeds (same formats), but contents must not.
    assert not set(da.values()) & set(dc.values())


def test_layout_matches_imagefolder(dataset: DatasetSummary) -> None:
    from torchvision.datasets import ImageFolder

    assert dataset.classes == tuple(sorted(SHAPES[:4]))
    assert dict(dataset.counts) == {"train": 120, "val": 24}
    assert dataset.total == 144
    for split, per_class in (("train", 30), ("val", 6)):
        folder = ImageFolder(str(dataset.root / split))
        assert folder.classes == list(dataset.classes)
        assert len(folder) == dataset.counts[split]
        assert Counter(folder.targets) == {i: per_class for i in range(len(dataset.classes))}
        # ImageFolder found every file we wrote, so no extension was unknown to it.
        assert sorted(Path(p) for p, _ in folder.samples) == _files(dataset.root / split)


def test_every_file_decodes_within_the_size_range(dataset: DatasetSummary) -> None:
    modes: Counter[str] = Counter()
    sizes = []
    for path in _files(dataset.root):
        with Image.open(path) as im:
            im.load()
            modes[im.mode] += 1
            sizes.append(im.size)
            assert im.convert("RGB").size == im.size
    assert all(SIZE_RANGE[0] <= s <= SIZE_RANGE[1] for size in sizes for s in size)
    assert sum(w != h for w, h in sizes) > 0.8 * len(sizes), "images should mostly be non-square"
    # One grayscale, one palette and one RGBA image per split exercise decoders' mode handling.
    assert modes["L"] == modes["P"] == modes["RGBA"] == 2
    assert modes["RGB"] == dataset.total - 6


def test_formats_are_mixed(dataset: DatasetSummary) -> None:
    names = [p.name for p in _files(dataset.root)]
    suffixes = Counter(Path(n).suffix for n in names)
    lowered = Counter(Path(n).suffix.lower() for n in names)
    assert dict(lowered) == dict(dataset.formats)
    assert lowered[".jpg"] + lowered[".jpeg"] > 0.5 * len(names)
    assert lowered[".png"] >= 3 and lowered[".webp"] >= 3
    assert any(s.isupper() for s in {s.lstrip(".") for s in suffixes}), "some extensions should be uppercase"
    jpeg_formats = set()
    for path in _files(dataset.root):
        with Image.open(path) as im:
            jpeg_formats.add(im.format)
    assert jpeg_formats == {"JPEG", "PNG", "WEBP"}


def test_names_sort_in_generation_order(dataset: DatasetSummary) -> None:
    for folder in (dataset.root / "train").iterdir():
        names = sorted(p.name for p in folder.iterdir())
        assert all(re.fullmatch(r"\d{5}\.(jpg|JPG|JPEG|png|webp)", n) for n in names), names
        assert [int(n[:5]) for n in names] == list(range(30))


def _hue_histogram(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        hsv = np.asarray(im.convert("RGB").convert("HSV")).reshape(-1, 3).astype(int)
    vivid = hsv[(hsv[:, 1] > 120) & (hsv[:, 2] > 100)]
    hist = np.bincount(vivid[:, 0] // 16, minlength=16).astype(float)
    normalized: np.ndarray = hist / max(hist.sum(), 1.0)
    return normalized


def test_classes_are_learnable(dataset: DatasetSummary) -> None:
    """A nearest-centroid classifier on hue histograms already separates the classes."""
    centroids = np.stack([
        np.mean([_hue_histogram(p) for p in _files(dataset.root / "train" / name)], axis=0)
        for name in dataset.classes
    ])
    correct = total = 0
    for label, name in enumerate(dataset.classes):
        for path in _files(dataset.root / "val" / name):
            guess = int(np.argmin(np.linalg.norm(centroids - _hue_histogram(path), axis=1)))
            correct += guess == label
            total += 1
    assert correct / total >= 0.9, f"{correct}/{total}"


def test_progress_is_reported(tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    make_shapes_dataset(tmp_path, classes=2, train_per_class=3, val_per_class=1,
                        progress=lambda done, total: calls.append((done, total)))
    assert calls == [(i, 8) for i in range(1, 9)]


def test_no_val_split(tmp_path: Path) -> None:
    summary = make_shapes_dataset(tmp_path, classes=2, train_per_class=3, val_per_class=0)
    assert dict(summary.counts) == {"train": 6}
    assert not (tmp_path / "val").exists()


def test_refuses_to_mix_into_an_existing_dataset(tmp_path: Path) -> None:
    make_shapes_dataset(tmp_path, classes=2, train_per_class=3, val_per_class=1)
    stray = tmp_path / "train" / SHAPES[0] / "99999.jpg"
    stray.write_bytes(b"left over")
    with pytest.raises(FileExistsError, match="overwrite"):
        make_shapes_dataset(tmp_path, classes=2, train_per_class=3, val_per_class=1)
    summary = make_shapes_dataset(tmp_path, classes=2, train_per_class=3, val_per_class=1, overwrite=True)
    assert not stray.exists()
    assert len(_files(tmp_path)) == summary.total == 8


@pytest.mark.parametrize("kwargs", [
    {"classes": 0}, {"classes": len(SHAPES) + 1}, {"train_per_class": 0}, {"val_per_class": -1},
    {"size_range": (8, 32)}, {"size_range": (64, 32)}, {"seed": -1},
], ids=repr)
def test_refuses_bad_arguments(tmp_path: Path, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        make_shapes_dataset(tmp_path, **kwargs)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_imagenet_like_workers_are_not_forks_of_a_caller_that_may_run_threads(tmp_path: Path) -> None:
    """gpu_check generates its dataset while a thread of its runs `pytest -m gpu`: a pool child forked while
    another thread holds a lock (logging's, say) would wait for it for good, and Python 3.12 warns of such forks.
    The pool's workers come from multiprocessing's fork server instead: no child of the caller runs its code."""
    import psutil

    children: list[list[str]] = []
    # Of earlier tests in this process: its fork server too, if one started it (multiprocessing keeps one).
    earlier = {child.pid for child in psutil.Process().children()}
    done_counts: list[int] = []

    def progress(done: int, total: int) -> None:  # called in the caller while the pool's workers are alive
        done_counts.append(done)
        for child in psutil.Process().children():
            if child.pid not in earlier:
                with contextlib.suppress(psutil.NoSuchProcess):  # a zombie's, an exited one's
                    children.append(child.cmdline())

    busy = threading.Event()
    thread = threading.Thread(target=busy.wait)
    thread.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)  # 3.12+: a fork of a threaded process
            make_imagenet_like(tmp_path / "a", classes=1, per_class=4, seed=0, workers=2, progress=progress)
    finally:
        busy.set()
        thread.join()
    assert done_counts == [1, 2, 3, 4], done_counts
    # Forked, the pool's workers are the caller's children, running pytest's command line; from the fork server,
    # they are its children, and the caller's own new ones (if any) are the fork server and resource tracker.
    assert all("multiprocessing" in " ".join(argv) for argv in children), children
