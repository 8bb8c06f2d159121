"""prefetchd.daemon.dataset: the index must be torchvision's ImageFolder, in numpy."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import tempfile
import time
from typing import Any
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS as TV_IMG_EXTENSIONS

from prefetchd.daemon.dataset import (IMG_EXTENSIONS, SampleIndex, hidden_classes, loose_images, scan_class_folders,
                                     split_folders_as_classes, split_members)
from prefetchd.daemon.errors import ConfigError, DatasetError
from prefetchd.daemon.sources.index_cache import cached_class_folders, default_cache_dir
from prefetchd.daemon.sources.shards import pack, read_shard_index

NON_UTF8_NAME = b"latin1-\xe9t\xe9.jpg"  # not valid UTF-8: lives as surrogate escapes in str


def build_messy_tree(base: Path, write_image: Callable[..., Path]) -> Path:
    """A class-folder tree with every case ImageFolder has an opinion about."""
    root = base / "data"
    outside = base / "outside"
    # class "cat": every extension, upper case, hidden, non-image, nested, unicode
    for i, ext in enumerate(IMG_EXTENSIONS):
        write_image(root / "cat" / f"img{i}{ext}", seed=i)
    write_image(root / "cat" / "UPPER.JPG")
    write_image(root / "cat" / "Mixed.PnG")
    write_image(root / "cat" / "Shout.JPEG")
    write_image(root / "cat" / ".hidden.jpg")
    (root / "cat" / "notes.txt").write_text("not an image\n")
    (root / "cat" / "archive.jpg.bak").write_bytes(b"nope")
    (root / "cat" / "noext").write_bytes(b"nope")
    write_image(root / "cat" / "sub" / "nested.jpg")
    write_image(root / "cat" / "sub" / "deeper" / "deepest.png")
    write_image(root / "cat" / "sub-x" / "dash.jpg")  # '-' sorts before '/', a walk-order trap
    write_image(root / "cat" / "dir.jpg" / "inside.jpg")  # a folder with an image name is not a sample
    write_image(root / "cat" / "ünïcødé_名前.jpg")
    write_image(root / "cat" / "Émile.png")
    write_image(root / "cat" / "emoji_🐈.webp")
    # class "dog": a symlinked subfolder and a dangling symlink
    write_image(root / "dog" / "z.jpg")
    write_image(outside / "linked" / "x.jpg")
    write_image(outside / "linked" / "y.png")
    write_image(outside / "linked" / "more" / "w.bmp")
    os.symlink(outside / "linked", root / "dog" / "linked")
    os.symlink(base / "does-not-exist.jpg", root / "dog" / "broken.jpg")
    # a symlinked class folder and a hidden class folder
    write_image(outside / "zebra_src" / "stripes.jpg")
    os.symlink(outside / "zebra_src", root / "zebra")
    write_image(root / ".cache" / "thumb.png")
    # files at the top level are not classes
    (root / "README.txt").write_text("top-level file\n")
    write_image(root / "stray.jpg")
    # a file name that is not valid UTF-8
    bad = os.path.join(os.fsencode(root / "dog"), NON_UTF8_NAME)
    with open(bad, "wb") as fh:
        fh.write((root / "dog" / "z.jpg").read_bytes())
    return root


def assert_same_as_imagefolder(root: Path) -> None:
    index = scan_class_folders(root)
    ref = ImageFolder(str(root))
    assert list(index.classes) == ref.classes
    assert len(index) == len(ref.samples)
    for i, (path, label) in enumerate(ref.samples):
        assert index.path(i).resolve() == Path(path).resolve(), i
        assert int(index.labels[i]) == label, i


def test_extensions_are_torchvisions() -> None:
    assert tuple(IMG_EXTENSIONS) == tuple(TV_IMG_EXTENSIONS)


def test_messy_tree_matches_imagefolder(tmp_path: Path, make_image: Callable[..., Path]) -> None:
    root = build_messy_tree(tmp_path, make_image)
    assert_same_as_imagefolder(root)
    # the traps are really in the index, so the comparison above covers them
    index = scan_class_folders(root)
    names = {index.path(i).name for i in range(len(index))}
    for expected in ["UPPER.JPG", "Mixed.PnG", ".hidden.jpg", "deepest.png", "x.jpg", "w.bmp",
                     "ünïcødé_名前.jpg", "broken.jpg", "stripes.jpg", "thumb.png", "inside.jpg",
                     os.fsdecode(NON_UTF8_NAME)]:
        assert expected in names
    assert not names & {"notes.txt", "archive.jpg.bak", "noext", "stray.jpg", "README.txt", "dir.jpg"}
    assert index.classes == (".cache", "cat", "dog", "zebra")
    for i, ext in enumerate(IMG_EXTENSIONS):
        assert f"img{i}{ext}" in names


def test_relative_root_matches_imagefolder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_image: Callable[..., Path]
) -> None:
    for cls in ("b", "a", "C"):
        for j in range(3):
            make_image(tmp_path / "ds" / cls / f"{j}.png")
    monkeypatch.chdir(tmp_path)
    assert_same_as_imagefolder(Path("ds"))
    index = scan_class_folders(Path("ds"))
    assert Path(index.root).is_absolute()
    assert index.classes == ("C", "a", "b")  # byte order, as sorted() gives ImageFolder
    assert index.path(0) == (tmp_path / "ds" / "C" / "0.png").resolve()


@settings(max_examples=15, deadline=None)
@given(
    layout=st.dictionaries(
        keys=st.text(alphabet="abcXYZ_-.0é", min_size=1, max_size=4).filter(lambda s: s not in (".", "..")),
        values=st.lists(
            st.tuples(
                st.sampled_from(["", "s/", "s-t/", "S/", "s/t/"]),
                st.text(alphabet="abAB_-.1", min_size=1, max_size=4),
                st.sampled_from(IMG_EXTENSIONS + (".JPG", ".Png", ".txt", ".jpgx")),
            ),
            min_size=1, max_size=5,
        ),
        min_size=1, max_size=4,
    )
)
def test_random_trees_match_imagefolder(tmp_path_factory: pytest.TempPathFactory, layout: dict) -> None:
    root = tmp_path_factory.mktemp("rand")
    for cls, files in layout.items():
        (root / cls).mkdir()
        for sub, stem, ext in files:
            path = root / cls / f"{sub}{stem}{ext}"
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.is_dir():
                path.write_bytes(b"x")  # the scan never opens files; contents do not matter
    try:
        ref = ImageFolder(str(root))
    except FileNotFoundError:
        with pytest.raises(DatasetError):
            scan_class_folders(root)
        return
    index = scan_class_folders(root)
    assert list(index.classes) == ref.classes
    assert [str(index.path(i)) for i in range(len(index))] == [str(Path(p).resolve()) for p, _ in ref.samples]
    assert index.labels.tolist() == [label for _, label in ref.samples]


# -- errors -------------------------------------------------------------------


def test_missing_root(tmp_path: Path) -> None:
    root = tmp_path / "nope"
    with pytest.raises(DatasetError, match="does not exist") as exc:
        scan_class_folders(root)
    assert str(root) in str(exc.value)


def test_root_is_a_file(tmp_path: Path, make_image: Callable[..., Path]) -> None:
    root = make_image(tmp_path / "file.jpg")
    with pytest.raises(DatasetError, match="not a directory") as exc:
        scan_class_folders(root)
    assert str(root) in str(exc.value)


def test_root_without_class_folders(tmp_path: Path, make_image: Callable[..., Path]) -> None:
    root = tmp_path / "flat"
    make_image(root / "a.jpg")
    make_image(root / "b.jpg")
    with pytest.raises(DatasetError, match="no class folders") as exc:
        scan_class_folders(root)
    assert str(root) in str(exc.value)


@pytest.mark.parametrize("link, target", [("cat/up", ".."), ("cat/sub/again", "../../cat"), ("dog", ".")])
def test_a_link_back_into_a_folder_it_is_inside_is_refused_naming_it(
        tmp_path: Path, make_image: Callable[..., Path], link: str, target: str) -> None:
    """os.walk, like ImageFolder, went round such a loop until the path was too long: `cat/up -> ..` made
    the 2 images of the dataset 246 samples, without a word."""
    root = tmp_path / "ds"
    make_image(root / "cat" / "a.jpg")
    make_image(root / "cat" / "sub" / "b.jpg")
    make_image(root / "fox" / "c.jpg")
    os.symlink(target, root / link)
    with pytest.raises(DatasetError) as exc:
        scan_class_folders(root, threads=3)
    assert str(exc.value).startswith(f"{root / link} links to "), exc.value
    assert "a folder it is inside: a loop" in str(exc.value) and "remove that link" in str(exc.value)


def test_a_link_to_another_folder_of_the_dataset_is_followed_as_imagefolder_does(
        tmp_path: Path, make_image: Callable[..., Path]) -> None:
    root = tmp_path / "ds"
    make_image(root / "cat" / "a.jpg")
    make_image(root / "fox" / "c.jpg")
    os.symlink("../fox", root / "cat" / "foxes")  # a sibling, not a folder above it: its images twice, no loop
    index = scan_class_folders(root)
    assert [index.name(i) for i in range(len(index))] == [p for p, _ in ImageFolder(str(root)).samples]
    assert len(index) == 3


def test_class_folder_without_images(tmp_path: Path, make_image: Callable[..., Path]) -> None:
    root = tmp_path / "ds"
    make_image(root / "good" / "a.jpg")
    (root / "empty" / "sub").mkdir(parents=True)
    (root / "empty" / "notes.txt").write_text("x")
    with pytest.raises(DatasetError) as exc:
        scan_class_folders(root)
    assert str(root / "empty") in str(exc.value)
    assert "no images" in str(exc.value)


# -- fingerprint and memory -----------------------------------------------------


def small_tree(base: Path, write_image: Callable[..., Path]) -> Path:
    root = base / "ds"
    for cls in ("a", "b"):
        for j in range(4):
            write_image(root / cls / f"img_{j}.jpg", seed=j)
    return root


def test_fingerprint_is_stable(tmp_path: Path, make_image: Callable[..., Path]) -> None:
    root = small_tree(tmp_path, make_image)
    first, second = scan_class_folders(root), scan_class_folders(root)
    assert first.fingerprint == second.fingerprint
    assert isinstance(first.fingerprint, str) and len(first.fingerprint) >= 16


@pytest.mark.parametrize("change", ["add", "remove", "rename", "resize", "add_class"])
def test_fingerprint_changes(tmp_path: Path, make_image: Callable[..., Path], change: str) -> None:
    root = small_tree(tmp_path, make_image)
    before = scan_class_folders(root).fingerprint
    target = root / "a" / "img_1.jpg"
    if change == "add":
        make_image(root / "b" / "img_9.jpg")
    elif change == "remove":
        target.unlink()
    elif change == "rename":
        target.rename(root / "a" / "img_1_renamed.jpg")
    elif change == "resize":
        stat = target.stat()
        target.write_bytes(target.read_bytes() + b"\0" * 17)
        os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # only the size tells
    elif change == "add_class":
        make_image(root / "c" / "img_0.jpg")
    assert scan_class_folders(root).fingerprint != before


def test_index_arrays_are_compact_numpy(tmp_path: Path, make_image: Callable[..., Path]) -> None:
    root = small_tree(tmp_path, make_image)
    index = scan_class_folders(root)
    n = len(index)
    assert n == 8
    assert isinstance(index.path_blob, np.ndarray) and index.path_blob.dtype == np.uint8
    assert isinstance(index.path_offsets, np.ndarray) and index.path_offsets.dtype == np.int64
    assert isinstance(index.labels, np.ndarray) and index.labels.dtype == np.int64
    assert index.path_offsets.shape == (n + 1,)
    assert index.labels.tolist() == [0] * 4 + [1] * 4
    assert index.nbytes == index.path_blob.nbytes + index.path_offsets.nbytes + index.labels.nbytes
    assert index.nbytes / n < 100
    assert index.path_blob.nbytes == sum(len(b"a/img_0.jpg") for _ in range(n))


# -- split_members ----------------------------------------------------------------


def test_split_none_is_everything() -> None:
    got = split_members(7, "train", None)
    assert got.dtype == np.int64
    assert got.tolist() == list(range(7))
    assert split_members(7, "val", None).tolist() == list(range(7))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 3000), fraction=st.floats(0.001, 0.999))
def test_split_partitions(n: int, fraction: float) -> None:
    n_val = round(n * fraction)
    if n_val in (0, n):
        # What to do, not "strictly between 0 and 1", which the fraction already was.
        more = "more" if n_val == 0 else "fewer"
        # ConfigError: exit 2, a bad setting, which systemd does not restart into the same refusal (it was exit 1).
        with pytest.raises(ConfigError, match=f"choose a fraction that holds out {more}"):
            split_members(n, "val" if n_val == 0 else "train", fraction)
        return
    train = split_members(n, "train", fraction)
    val = split_members(n, "val", fraction)
    assert train.dtype == val.dtype == np.int64
    assert len(val) == n_val
    assert np.all(np.diff(train) > 0) and np.all(np.diff(val) > 0)
    assert not set(train.tolist()) & set(val.tolist())
    assert sorted(train.tolist() + val.tolist()) == list(range(n))


def test_split_depends_only_on_n_and_fraction() -> None:
    val = split_members(1000, "val", 0.1)
    np.random.seed(123)
    np.random.random(10)
    split_members(50, "val", 0.5)  # unrelated calls in between
    assert np.array_equal(split_members(1000, "val", 0.1), val)
    assert np.array_equal(split_members(1000, "train", 0.1), np.setdiff1d(np.arange(1000), val))
    # a real shuffle, not the first or last indices
    assert val.tolist() != list(range(100)) and val.tolist() != list(range(900, 1000))
    assert np.diff(val).max() > 1


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 500), fraction=st.floats(0.05, 0.95), seed=st.integers(0, 2**32 - 1))
def test_a_reordered_datasets_split_holds_the_same_samples(n: int, fraction: float, seed: int) -> None:
    """A shuffled pack: its sample i is sample source[i] of the data it was packed from.  Its val side
    is the positions of the source's val samples, in the pack's order (sorted, as the workers' bisection
    for replacements needs), whatever the shuffle; and with no reordering it is the plain split."""
    if round(n * fraction) in (0, n):
        return
    source = np.random.default_rng(seed).permutation(n)
    for split in ("train", "val"):
        plain = split_members(n, split, fraction)
        got = split_members(n, split, fraction, source)
        assert got.dtype == np.int64 and np.all(np.diff(got) > 0)
        assert sorted(source[got].tolist()) == plain.tolist()
        assert np.array_equal(split_members(n, split, fraction, np.arange(n)), plain)
    assert split_members(n, "val", None, source).tolist() == list(range(n))


@pytest.mark.parametrize(
    ("n", "split", "fraction"),
    [(10, "val", 0.0), (10, "val", 0.01), (10, "train", 1.0), (10, "train", 0.99), (0, "train", 0.5)],
)
def test_split_refuses_an_empty_side(n: int, split: str, fraction: float) -> None:
    with pytest.raises(ConfigError, match=split):
        split_members(n, split, fraction)


# -- parallel walk and index cache ------------------------------------------------


def test_thread_count_does_not_change_the_index(tmp_path: Path, make_image: Callable[..., Path]) -> None:
    root = build_messy_tree(tmp_path, make_image)
    one, many = scan_class_folders(root, threads=1), scan_class_folders(root, threads=7)
    assert one.fingerprint == many.fingerprint
    assert np.array_equal(one.path_blob, many.path_blob) and np.array_equal(one.labels, many.labels)


def cache_entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("classfolders-*.npz"))


def same_index(a: SampleIndex, b: SampleIndex) -> bool:
    return (a.root, a.classes, a.fingerprint) == (b.root, b.classes, b.fingerprint) and \
        np.array_equal(a.path_blob, b.path_blob) and np.array_equal(a.path_offsets, b.path_offsets) and \
        np.array_equal(a.labels, b.labels)


def settle(root: Path) -> None:
    """Date every folder a minute back, as a dataset that is not being written to."""
    past = time.time() - 60
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        os.utime(folder, (past, past))


def test_cached_index_is_reused_until_a_folder_changes(tmp_path: Path, make_image: Callable[..., Path]) -> None:
    root, cache = small_tree(tmp_path, make_image), tmp_path / "cache"
    cached_class_folders(root, cache)
    assert cache_entries(cache) == []  # folders modified just now: their mtimes cannot vouch for the next change
    settle(root)
    first = cached_class_folders(root, cache)
    assert same_index(first, scan_class_folders(root)) and len(cache_entries(cache)) == 1
    # A file rewritten in place (its folder untouched) is what the cache cannot see:
    # the cached fingerprint proves the index came from the cache, --refresh-index rescans.
    target = root / "a" / "img_1.jpg"
    with open(target, "r+b") as fh:
        fh.seek(0, os.SEEK_END)
        fh.write(b"\0" * 5)
    assert cached_class_folders(root, cache).fingerprint == first.fingerprint
    refreshed = cached_class_folders(root, cache, refresh=True)
    assert refreshed.fingerprint != first.fingerprint
    assert cached_class_folders(root, cache).fingerprint == refreshed.fingerprint  # the refresh was cached
    # Adding a file, a nested folder's file or a class changes a folder's mtime: rescanned.
    for added, n in [("b/img_9.jpg", 9), ("b/sub/x.jpg", 10), ("b/sub/y.jpg", 11), ("c/z.jpg", 12)]:
        cached_class_folders(root, cache)  # cached as it is now
        make_image(root / added)  # b/sub/y.jpg: only b/sub's mtime changes
        index = cached_class_folders(root, cache)
        assert len(index) == n and same_index(index, scan_class_folders(root)), added
        settle(root)
    assert index.classes == ("a", "b", "c")
    assert len(cache_entries(cache)) == 1  # one entry per root, replaced


def test_a_file_renamed_into_place_with_the_folders_mtime_restored_is_seen(
        tmp_path: Path, make_image: Callable[..., Path]) -> None:
    """What ``rsync -a`` does to an updated file: write a temporary file, rename it over the old one,
    then set the folder's mtime back (here with ``touch -r``, as a script would).  The folder's ctime
    cannot be set back, so the cache sees the change and the new fingerprint is used."""
    root, cache = small_tree(tmp_path, make_image), tmp_path / "cache"
    settle(root)
    first = cached_class_folders(root, cache)
    assert len(cache_entries(cache)) == 1
    reference = tmp_path / "a-times"
    subprocess.run(["touch", "-r", str(root / "a"), str(reference)], check=True)
    target = root / "a" / "img_1.jpg"
    temporary = root / "a" / ".img_1.jpg.Xa81f"
    temporary.write_bytes(target.read_bytes() + b"\0" * 5)
    os.rename(temporary, target)
    subprocess.run(["touch", "-r", str(reference), str(root / "a")], check=True)
    assert (root / "a").stat().st_mtime_ns == reference.stat().st_mtime_ns  # the mtime is as cached
    again = cached_class_folders(root, cache)
    assert again.fingerprint != first.fingerprint, "the cached index of the old files was used"
    assert same_index(again, scan_class_folders(root))



@pytest.mark.parametrize("where", ["a class folder", "a folder in a class"])
def test_a_link_that_led_nowhere_and_leads_to_a_folder_now_is_seen(
        tmp_path: Path, make_image: Callable[..., Path], where: str) -> None:
    """A link to a folder on a disk not mounted at the first start led nowhere, and ImageFolder skipped it; once
    the disk is there, it is a class (or a class's subfolder) with images, and no folder the cache stamped has
    changed: the cached index left them out (a walk: 2 of 4 samples, a class missing)."""
    root, cache = small_tree(tmp_path, make_image), tmp_path / "cache"
    target = tmp_path / "later"  # not there yet
    link = root / "linked" if where == "a class folder" else root / "a" / "linked"
    link.symlink_to(target, target_is_directory=True)
    settle(root)
    first = cached_class_folders(root, cache)
    assert same_index(first, scan_class_folders(root)) and len(cache_entries(cache)) == 1
    assert cached_class_folders(root, cache).fingerprint == first.fingerprint  # from the cache while it leads nowhere
    make_image(target / "x.jpg")
    make_image(target / "y.jpg")
    now = cached_class_folders(root, cache)
    assert len(now) == len(first) + 2 and same_index(now, scan_class_folders(root))
    if where == "a class folder":
        assert "linked" in now.classes and "linked" not in first.classes

def test_a_tree_written_just_now_is_not_cached_and_the_log_names_its_folder(
    tmp_path: Path, make_image: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    root = small_tree(tmp_path, make_image)  # the root itself was modified just now
    with caplog.at_level("INFO"):
        cached_class_folders(root, tmp_path / "cache")
    assert f"not caching the index of {root}: {root} changed less than 2 s before the scan" in caplog.text
    assert f"{root}/ changed" not in caplog.text


def test_a_tree_whose_folders_have_mtimes_in_the_future_is_cached_and_a_later_change_seen(
    tmp_path: Path, make_image: Callable[..., Path]
) -> None:
    """An archive unpacked from a box whose clock ran ahead: each start walked the whole tree again, saying it
    "changed less than 2 s before the scan"; a later change sets a folder's mtime to now, which differs."""
    root = small_tree(tmp_path, make_image)
    ahead = time.time() + 3600 * 24 * 180
    for folder in [root, *(p for p in root.iterdir() if p.is_dir())]:
        os.utime(folder, (ahead, ahead))
    cache = tmp_path / "cache"
    first = cached_class_folders(root, cache)
    assert len(cache_entries(cache)) == 1, "not cached"
    folder = next(p for p in sorted(root.iterdir()) if p.is_dir())
    make_image(folder / "new.jpg")
    assert len(cached_class_folders(root, cache)) == len(first) + 1


def test_a_damaged_cache_is_rebuilt_with_a_warning(
    tmp_path: Path, make_image: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    root, cache = small_tree(tmp_path, make_image), tmp_path / "cache"
    settle(root)
    cached_class_folders(root, cache)
    (entry,) = cache_entries(cache)
    entry.write_bytes(entry.read_bytes()[:100])
    with caplog.at_level("WARNING"):
        index = cached_class_folders(root, cache)
    assert same_index(index, scan_class_folders(root))
    assert f"index cache {entry} is damaged" in caplog.text and "rewriting it" in caplog.text
    assert same_index(cached_class_folders(root, cache), index)  # rewritten whole
    assert not list(cache.glob(".*.tmp"))
    entry.write_bytes(b"\x80\x04 not an index")  # what numpy takes for a pickle
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert same_index(cached_class_folders(root, cache), index)
    assert f"index cache {entry} is damaged (not a numpy .npz archive" in caplog.text
    assert "unsafely" not in caplog.text
    np.savez(entry, labels=np.zeros(3))  # an archive, of other arrays: "damaged ('format')" (a walk)
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert same_index(cached_class_folders(root, cache), index)
    assert f"index cache {entry} is damaged (it has no 'format' array)" in caplog.text, caplog.text


def test_an_unwritable_cache_only_warns(tmp_path: Path, make_image: Callable[..., Path],
                                        caplog: pytest.LogCaptureFixture) -> None:
    root = small_tree(tmp_path, make_image)
    settle(root)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    for cache in (blocker, blocker / "cache"):  # --index-cache a file, or a folder below one
        caplog.clear()
        with caplog.at_level("WARNING"):
            index = cached_class_folders(root, cache)
        assert len(index) == 8 and "cannot write the index cache" in caplog.text
        assert f"({blocker} is a file, not a folder)" in caplog.text, caplog.text
        assert "cannot read" not in caplog.text  # one warning, the one that says what is wrong


def test_an_index_cache_folder_named_through_a_link_and_dotdot_is_written(tmp_path: Path,
                                                                         make_image: Callable[..., Path],
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """--index-cache links/parent/../cache, with parent a link elsewhere: tempfile.mkstemp gave back the temp file's
    path made lexically (links/cache), and the rename failed, "cannot write the index cache" (a walk with odd
    paths: the same for probe_folder)."""
    root = small_tree(tmp_path, make_image)
    settle(root)
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "parent").symlink_to(tmp_path / "real" / "sub")
    with caplog.at_level("WARNING"):
        cached_class_folders(root, tmp_path / "links" / "parent" / ".." / "cache")
    assert "cannot write" not in caplog.text, caplog.text
    assert len(cache_entries(tmp_path / "real" / "cache")) == 1 and not list((tmp_path / "real" / "cache").glob(".*"))


def test_an_unreadable_cache_does_not_promise_a_rewrite_it_cannot_make(shm_dir: Path,
                                                                       make_image: Callable[..., Path]) -> None:
    """A cache folder this user may neither read nor write (another user's) said "cannot read index cache ...;
    rescanning ... and rewriting it", then at once "cannot write the index cache" (a walk as a non-root user)."""
    import logging

    from tests.as_nobody import as_nobody

    shm_dir.chmod(0o755)
    root, cache = small_tree(shm_dir, make_image), shm_dir / "cache"
    settle(root)
    cached_class_folders(root, cache)
    (entry,) = cache_entries(cache)
    entry.chmod(0o600)
    cache.chmod(0o711)  # nobody may reach the entry but neither read it nor write beside it

    def walk() -> str:
        lines: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("prefetchd").addHandler(handler)
        cached_class_folders(root, cache)
        return "\n".join(lines)

    said = as_nobody(walk)
    assert f"cannot read index cache {entry} (Permission denied); rescanning {root.resolve()}" in said, said
    assert "rewriting it" not in said and "cannot write the index cache" in said, said


def test_default_cache_dir_follows_systemd_then_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CACHE_DIRECTORY", "/var/cache/prefetchd")
    assert default_cache_dir() == Path("/var/cache/prefetchd")
    monkeypatch.delenv("CACHE_DIRECTORY")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "prefetchd"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "prefetchd"


@pytest.mark.parametrize("xdg", [None, "", "rel/cache"])
@pytest.mark.parametrize("home", [None, "", "."])
def test_default_cache_dir_ignores_empty_or_relative_homes(monkeypatch: pytest.MonkeyPatch, xdg: str | None,
                                                         home: str | None) -> None:
    """An empty HOME (cron, a container's HOME="") made the cache `.cache/prefetchd` in whatever folder the
    daemon was started from: the account's home folder instead, as the XDG spec asks."""
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    for name, value in (("XDG_CACHE_HOME", xdg), ("HOME", home)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert default_cache_dir() == Path(pwd.getpwuid(os.getuid()).pw_dir) / ".cache" / "prefetchd"


def test_a_user_without_a_home_gets_a_private_index_cache(homeless: None) -> None:
    """A uid with no account and HOME="": the cache was /tmp/prefetchd-UID/..., a name another user may take first."""
    cache = default_cache_dir()
    st = cache.stat()
    assert cache.parent == Path(tempfile.gettempdir()) and cache.name.startswith("prefetchd-index-cache-")
    assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700 and default_cache_dir() == cache
    cache.rmdir()


def test_a_private_index_cache_is_removed_when_its_process_exits(tmp_path: Path) -> None:
    """README says such a cache's indexes last one run, but every run (a daemon, `config --show`) left its folder
    and the index in it (a walk as a uid with no account: 5 of 5 runs).  A real process, which exits normally."""
    code = ("import os, pwd\n"
            "import prefetchd.daemon.sources.index_cache as ic\n"
            "def no_account(uid): raise KeyError(uid)\n"
            "pwd.getpwuid = no_account\n"
            "os.environ['HOME'] = ''\n"
            "cache = ic.default_cache_dir()\n"
            "(cache / 'classfolders-x.npz').write_bytes(b'index')\n"
            "if os.fork() == 0:\n"  # a forked child's exit leaves its parent's folder alone
            "    raise SystemExit(0)\n"
            "os.wait()\n"
            "print(cache, os.path.exists(cache / 'classfolders-x.npz'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CACHE_DIRECTORY", "XDG_CACHE_HOME")}
    env["TMPDIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    cache, kept = done.stdout.split()
    assert kept == "True", "the forked child's exit removed it"
    assert Path(cache).parent == tmp_path and not Path(cache).exists(), cache


def test_a_stop_during_the_walk_does_not_wait_for_the_folders_queued(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """A stop (the start's heartbeat raises it) left the pool's block, which waited for every folder queued: on a
    slow filesystem `prefetchd stop` ran into its timeout, 45 s for a 200,000-file tree (a walk)."""
    import threading

    import prefetchd.daemon.dataset as dataset

    for k in range(200):
        (tmp_path / f"c{k:03d}").mkdir()
    listed: list[str] = []
    real = dataset.list_folder
    class_folders_queued = threading.Event()

    def slow_listing(path: str) -> Any:
        listed.append(path)
        if path != str(tmp_path):
            class_folders_queued.set()  # the root was listed and its 200 folders submitted
        time.sleep(0.02)
        return real(path)

    class Stopped(Exception):
        pass

    def tick(_found: str) -> None:
        if class_folders_queued.is_set():
            raise Stopped

    monkeypatch.setattr(dataset, "list_folder", slow_listing)
    with pytest.raises(Stopped):
        dataset.walk_classes([str(tmp_path)], 2, tick)
    time.sleep(0.2)  # a listing queued but not cancelled would start meanwhile
    assert len(listed) < 20, f"{len(listed)} of 201 folders listed after the stop"


def test_a_long_walk_says_how_many_images_and_folders_it_has_listed(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path, caplog: Any) -> None:
    """A walk of a million files on a network filesystem takes minutes, and the status said only "indexing DATA"
    until it ended (a walk of 200,000 files): now each tick tells what was found so far, and the log says it
    every PROGRESS_LOG_SECONDS."""
    import threading

    import prefetchd.daemon.dataset as dataset

    for cls in ("a", "b", "c"):
        (tmp_path / cls).mkdir()
        for k in range(3 if cls != "c" else 1):
            (tmp_path / cls / f"{k}.jpg").write_bytes(b"x")
    (tmp_path / "a" / "notes.txt").write_text("not an image")
    real = dataset.list_folder
    said: list[str] = []
    two_listed = threading.Event()

    def listing(path: str) -> Any:
        if path.endswith("/c"):  # the last one waits until the walk has said the other two
            assert two_listed.wait(10), said
        return real(path)

    def tick(found: str) -> None:
        said.append(found)
        if found == "6 images in 2 folders listed so far":
            two_listed.set()

    monkeypatch.setattr(dataset, "list_folder", listing)
    walked = dataset.walk_classes([str(tmp_path / cls) for cls in ("a", "b", "c")], 2, tick)
    assert [len(f[0].files) for f in walked] == [3, 3, 1]
    assert said[0] == "0 images in 0 folders listed so far" and two_listed.is_set(), said

    clock = [100.0]
    monkeypatch.setattr(dataset.time, "monotonic", lambda: clock[0])
    statuses: list[str] = []
    progress = dataset.logged_progress("indexing /data", statuses.append)
    with caplog.at_level("INFO", logger="prefetchd.daemon.dataset"):
        for seconds, found in ((1, "1 image"), (dataset.PROGRESS_LOG_SECONDS, "2 images"), (1, "3 images"),
                               (dataset.PROGRESS_LOG_SECONDS, "4 images")):
            clock[0] += seconds
            progress(found)
    assert statuses == ["1 image", "2 images", "3 images", "4 images"], "the status is told each time"
    assert [r.getMessage() for r in caplog.records] == ["indexing /data: 2 images", "indexing /data: 4 images"]


def test_split_folders_taken_for_classes_are_warned_about() -> None:
    """--data /imagenet (holding train/ and val/) is a valid ImageFolder of two classes, but a slip."""
    warning = split_folders_as_classes(("train", "val"), "/data/imagenet/")
    assert warning is not None and "split folders, not classes?" in warning
    assert "pass --data /data/imagenet/train" in warning
    assert split_folders_as_classes(("Test", "Training"), "s3://b/x") is not None
    assert split_folders_as_classes(("cat", "dog"), "/d") is None
    one = split_folders_as_classes(("train",), "/data/imagenet")
    assert one is not None and "only class of /data/imagenet is train" in one and "--data /data/imagenet/train" in one
    assert split_folders_as_classes(("cat",), "/d") is None
    assert split_folders_as_classes(("train", "val", "zebra"), "/d") is None



def test_hidden_class_folders_are_warned_about() -> None:
    """A notebook's .ipynb_checkpoints beside the class folders is a class for ImageFolder, and so here: said."""
    warning = hidden_classes((".ipynb_checkpoints", "cat", "dog"), "/data/pets")
    assert warning == ("1 class folder of /data/pets is hidden: '.ipynb_checkpoints' (label 0). ImageFolder counts "
                       "such folders as classes too, so they are classes here; if they are not, move them out of the "
                       "dataset and start the daemon again")
    many = hidden_classes((".a", ".b", ".c", ".d", "cat"), "/d")
    assert many is not None and many.startswith("4 class folders of /d are hidden: '.a' (label 0), '.b' (label 1), "
                                                "'.c' (label 2), ...")
    assert hidden_classes(("cat", "dog.v2"), "/d") is None

def test_images_directly_in_the_root_are_warned_about(tmp_path: Path, make_image: Callable[..., Path]) -> None:
    """ImageFolder leaves them out, and so does prefetchd: said, as most of a dataset could be there."""
    make_image(tmp_path / "cat" / "a.jpg")
    assert loose_images(str(tmp_path)) is None
    for name in ("b.JPG", "c.png", "d.webp", "e.jpeg"):
        make_image(tmp_path / name)
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "link.jpg").symlink_to(tmp_path / "cat")  # a folder's link: no image
    warning = loose_images(str(tmp_path))
    assert warning == (f"4 images directly in {tmp_path} (b.JPG, c.png, d.webp, ...) are in no class folder, so left "
                       "out, as ImageFolder leaves them out; to train on them, move them into the class folder of "
                       "their label")
    assert loose_images(str(tmp_path / "cat" / "a.jpg")) is None, "a file list or any file: not a folder"
    assert loose_images("s3://bucket/train") is None and loose_images(str(tmp_path / "missing")) is None


def test_a_class_folder_named_in_latin1_is_indexed_cached_and_packed(
    tmp_path: Path, make_image: Callable[..., Path]
) -> None:
    """ImageFolder takes any folder name as a class; a non-UTF-8 one lives in str as surrogate escapes."""
    root = tmp_path / "data"
    make_image(root / "dog" / "a.jpg")
    latin = os.path.join(os.fsencode(root), b"caf\xe9")
    os.makedirs(latin)
    with open(os.path.join(latin, b"b.jpg"), "wb") as fh:
        fh.write((root / "dog" / "a.jpg").read_bytes())
    assert_same_as_imagefolder(root)
    settle(root)
    cache = tmp_path / "cache"
    scanned = cached_class_folders(root, cache)
    assert scanned.classes == ("caf\udce9", "dog") and len(cache_entries(cache)) == 1
    assert same_index(cached_class_folders(root, cache), scanned)  # read back from the entry
    pack(scanned, tmp_path / "shards", shard_size=10**6)
    assert read_shard_index(str(tmp_path / "shards")).classes == scanned.classes


def test_macos_metadata_files_are_indexed_as_imagefolder_does_and_named_in_a_warning(
        tmp_path: Path, make_image: Callable[..., Path], caplog: pytest.LogCaptureFixture) -> None:
    """Folders copied from macOS hold a '._NAME.jpg' beside each image: not images, and a run of them
    ended the job later as 'undecodable samples'. Said at once, with the command that removes them."""
    for cls in ("cat", "dog"):
        for j in range(2):
            make_image(tmp_path / "ds" / cls / f"{j}.jpg")
            (tmp_path / "ds" / cls / f"._{j}.jpg").write_bytes(b"\x00\x05\x16\x07" + bytes(60))
    with caplog.at_level("WARNING", logger="prefetchd.daemon.dataset"):
        index = scan_class_folders(tmp_path / "ds")
    assert len(index) == len(ImageFolder(str(tmp_path / "ds")).samples) == 8
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "4 files named '._*' (macOS AppleDouble metadata" in warning, warning
    assert f"`find {tmp_path / 'ds'} -name '._*' -delete`" in warning, warning


def test_one_macos_metadata_file_is_said_in_the_singular(
        tmp_path: Path, make_image: Callable[..., Path], caplog: pytest.LogCaptureFixture) -> None:
    """It read "1 file named '._*' ..., e.g. X, are samples here"."""
    make_image(tmp_path / "ds" / "cat" / "0.jpg")
    (tmp_path / "ds" / "cat" / "._0.jpg").write_bytes(b"\x00\x05\x16\x07" + bytes(60))
    with caplog.at_level("WARNING", logger="prefetchd.daemon.dataset"):
        scan_class_folders(tmp_path / "ds")
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert (f"1 file named '._*' (macOS AppleDouble metadata, not an image), namely {tmp_path / 'ds' / 'cat' / '._0.jpg'}, "
            "is a sample here, as ImageFolder counts it too: it is replaced by the next sample that decodes: delete it "
            "(`find") in warning, warning
