"""Every layout through a real daemon and BufferLoader: each sample exactly once per
epoch, and with the same seed the same batches as the class folders they came from."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from torchvision.datasets import ImageFolder

from prefetchd.buffer_protocol.manifest import Manifest
from prefetchd.daemon.sources import open_dataset
from prefetchd.daemon.sources.shards import pack
from prefetchd.trainer import BufferLoader

ARGS = ["--batch-size", "8", "--image-size", "32", "--workers", "2", "--seed", "5", "--epochs", "2", "--high-water", "4"]
EPOCHS = 2


def run_epochs(start_daemon, buffer: Path, data: Path, labels: np.ndarray) -> list[tuple[int, int, str, list[int]]]:
    """(epoch, step, image digest, indices) of every batch of two epochs, checking each epoch covers every sample once
    and that the daemon's log names the dataset as given (a file list, not its folder)."""
    daemon = start_daemon(buffer, "--data", data, *ARGS)
    loader = BufferLoader(buffer, normalize=False, timeout=60)
    batches = []
    for epoch in range(EPOCHS):
        seen: list[int] = []
        for batch in loader:
            images, got = batch
            indices = batch.indices.numpy()
            np.testing.assert_array_equal(got.numpy(), labels[indices])
            seen.extend(indices.tolist())
            batches.append((batch.epoch, batch.step, hashlib.sha256(images.numpy().tobytes()).hexdigest(),
                            indices.tolist()))
        assert sorted(seen) == list(range(len(labels))), f"{data}: epoch {epoch} does not hold every sample once"
    loader.close()
    assert daemon.wait_exit(30) == 0, daemon.log
    assert f"producing train split of {data} into {buffer}" in daemon.log, daemon.log
    return batches


@pytest.fixture(scope="module")
def reference() -> dict[str, object]:
    """The class folders' batches, produced once by whichever test needs them first."""
    return {}


@pytest.mark.parametrize("layout", ["file-list", "shards"])
def test_each_layout_gives_every_sample_once_and_the_class_folders_batches(
    layout: str, shapes_data: Path, shm_dir: Path, tmp_path: Path, start_daemon, reference: dict[str, object]
) -> None:
    folders = shapes_data / "train"
    ref = ImageFolder(str(folders))
    targets = np.asarray(ref.targets)
    if "batches" not in reference:
        reference["batches"] = run_epochs(start_daemon, shm_dir / "folders", folders, targets)
    if layout == "file-list":
        data = tmp_path / "train.csv"
        # Class names and absolute paths, in ImageFolder's order, so sample i is the same image.
        data.write_text("path,label\n" + "".join(f"{p},{ref.classes[t]}\n" for p, t in ref.samples))
    else:
        data = tmp_path / "shards"
        summary = pack(open_dataset(folders), data, shard_size=64 * 1024)
        assert summary["shards"] > 2
    batches = run_epochs(start_daemon, shm_dir / layout, data, targets)
    assert batches == reference["batches"]


def test_a_class_folder_named_in_latin1_is_produced_and_named_in_the_manifest(
    shapes_data: Path, shm_dir: Path, tmp_path: Path, start_daemon
) -> None:
    """ImageFolder takes a folder name that is not UTF-8 (caf\\xe9 in Latin-1) as a class; so does the daemon."""
    data = tmp_path / "train"
    shutil.copytree(shapes_data / "train", data)
    first = sorted(p.name for p in data.iterdir())[0]
    os.rename(os.path.join(os.fsencode(data), os.fsencode(first)), os.path.join(os.fsencode(data), b"caf\xe9"))
    ref = ImageFolder(str(data))
    assert "caf\udce9" in ref.classes
    run_epochs(start_daemon, shm_dir / "bf", data, np.asarray(ref.targets))
    assert Manifest.read(shm_dir / "bf").classes == ref.classes


def test_a_dataset_of_a_hundred_thousand_classes_is_served(shapes_data: Path, shm_dir: Path, tmp_path: Path,
                                                           start_daemon) -> None:
    """Integer labels up to 99,500 (a file list may have a million classes) made a manifest of 1.08 MB, past the
    1 MiB its readers took: the trainer could not open the buffer and a restart of the job failed (a walk)."""
    files = sorted(p for p in (shapes_data / "train").rglob("*") if p.is_file())
    step = 100_000 // len(files)
    listed = tmp_path / "list.csv"
    listed.write_text("".join(f"{path},{k * step}\n" for k, path in enumerate(files)))
    labels = np.arange(len(files)) * step
    run_epochs(start_daemon, shm_dir / "bf", listed, labels)
    manifest = Manifest.read(shm_dir / "bf")
    assert len(manifest.classes) == labels[-1] + 1 > 95_000
    assert (shm_dir / "bf" / "manifest.json").stat().st_size > 1 << 20


def test_a_restarted_daemon_takes_the_index_from_its_cache(shapes_data: Path, shm_dir: Path, tmp_path: Path,
                                                            start_daemon) -> None:
    data = tmp_path / "train"
    shutil.copytree(shapes_data / "train", data)
    past = time.time() - 60  # a dataset nobody is writing to: its folder mtimes can vouch for it
    for folder in [data, *(p for p in data.iterdir() if p.is_dir())]:
        os.utime(folder, (past, past))
    cache = tmp_path / "cache"
    args = ["--data", data, *ARGS[:-4], "--high-water", "2", "--index-cache", cache]
    first = start_daemon(shm_dir / "bf", *args)
    first.wait_until(lambda: list(cache.glob("classfolders-*.npz")) != [], 60, "the index cache entry")
    first.terminate()
    assert "from the cache" not in first.log_path.read_text()
    second = start_daemon(shm_dir / "bf", *args)
    second.wait_until(lambda: "from the cache" in second.log, 60, "the index to come from the cache")
    second.terminate()
    third = start_daemon(shm_dir / "bf", *args, "--refresh-index")
    third.wait_until(lambda: "indexed" in third.log, 60, "the index")
    third.terminate()
    assert "from the cache" not in third.log_path.read_text()


def test_a_shuffled_packs_val_split_serves_the_class_folders_val_images(shapes_data: Path, shm_dir: Path,
                                                                         tmp_path: Path, start_daemon) -> None:
    """--split val --val-fraction of a pack shuffled when written holds out the images the class folders
    hold out (the batches differ: a sample's place and augmentation follow its index in the pack)."""
    folders = shapes_data / "train"
    shards = tmp_path / "shards"
    pack(open_dataset(folders), shards, shard_size=64 * 1024, shuffle_seed=3)
    served = {}
    for name, data in (("folders", folders), ("shards", shards)):
        buffer = shm_dir / name
        daemon = start_daemon(buffer, "--data", data, "--split", "val", "--val-fraction", "0.25", "--batch-size", "8",
                              "--image-size", "32", "--workers", "1", "--epochs", "1", "--high-water", "4")
        loader = BufferLoader(buffer, normalize=False, timeout=60)
        served[name] = sorted(hashlib.sha256(image.numpy().tobytes()).hexdigest() + f":{int(label)}"
                              for images, labels in loader for image, label in zip(images, labels))
        loader.close()
        assert daemon.wait_exit(30) == 0, daemon.log
    assert len(served["folders"]) == 18 and len(set(served["folders"])) == 18
    assert served["shards"] == served["folders"]


def test_a_cut_shard_refuses_the_start_saying_how_to_pack_again(shapes_data: Path, shm_dir: Path, tmp_path: Path,
                                                                 start_daemon) -> None:
    """The advice said `prefetchd pack SRC OUT --force`, OUT the pack the user had just named and SRC a word the
    pack cannot fill in (it records no source, which was class folders or a file list): the command names the
    pack and says in words what goes first."""
    import subprocess
    import sys

    out = tmp_path / "packed"
    packed = subprocess.run([sys.executable, "-m", "prefetchd", "pack", str(shapes_data / "train"), str(out)],
                            capture_output=True, text=True, timeout=120)
    assert packed.returncode == 0, packed.stdout + packed.stderr
    os.truncate(out / "shard-000000.tar", 600)  # inside its first member (from byte 512)
    daemon = start_daemon(shm_dir / "bf", "--data", out, *ARGS)
    assert daemon.wait_exit(60) != 0, daemon.log
    said = (f"restore it, or pack it again from the class folders or file list it was made from: "
            f"`prefetchd pack <that folder or list> {out} --force`")
    assert said in daemon.log and "SRC" not in daemon.log, daemon.log

