"""The sources seam: locations, index locations and the reader that fetches sample bytes."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from prefetchd.daemon.dataset import SampleIndex
from prefetchd.daemon.errors import DatasetError
from prefetchd.daemon.sources import SampleReader, is_url, open_dataset
from prefetchd.daemon.sources.storage import ImageRefused


@pytest.mark.parametrize(("location", "url"), [
    ("s3://bucket/prefix", True), ("gs://b", True), ("file:///data/x", True),
    ("/data/imagenet", False), ("data/with:colon", False), ("relative", False), ("c://odd", False),
])
def test_urls_are_told_from_local_paths(location: str, url: bool) -> None:
    assert is_url(location) is url


def packed_index(root: Path, files: list[str], members: list[tuple[int, int, int]]) -> SampleIndex:
    names = [os.fsencode(f) for f in files]
    offsets = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum([len(n) for n in names], out=offsets[1:])
    return SampleIndex(
        root=str(root), classes=("a",), path_blob=np.frombuffer(b"".join(names), dtype=np.uint8),
        path_offsets=offsets, labels=np.zeros(len(members), dtype=np.int64), fingerprint="x",
        member_files=np.array([m[0] for m in members], dtype=np.int32),
        member_offsets=np.array([m[1] for m in members], dtype=np.int64),
        member_sizes=np.array([m[2] for m in members], dtype=np.int64),
    )


def test_packed_samples_are_read_by_byte_range(tmp_path: Path) -> None:
    (tmp_path / "s0.tar").write_bytes(b"0123456789")
    (tmp_path / "s1.tar").write_bytes(b"abcdefghij")
    index = packed_index(tmp_path, ["s0.tar", "s1.tar"], [(0, 2, 3), (1, 0, 10), (0, 9, 1)])
    reader = SampleReader(index)
    assert [bytes(reader.read(i)) for i in range(3)] == [b"234", b"abcdefghij", b"9"]
    assert index.name(0) == f"{tmp_path}/s0.tar (bytes 2-5)"


def test_a_member_past_the_end_of_its_shard_names_the_shard(tmp_path: Path) -> None:
    (tmp_path / "s0.tar").write_bytes(b"0123")
    reader = SampleReader(packed_index(tmp_path, ["s0.tar"], [(0, 2, 5)]))
    with pytest.raises(OSError, match=r"s0\.tar ends at byte 4.*truncated or rewritten"):
        reader.read(0)


def test_unpacked_samples_are_whole_files_and_special_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.jpg").write_bytes(b"jpeg bytes")
    os.mkfifo(tmp_path / "a" / "y.jpg")
    names = [b"a/x.jpg", b"a/y.jpg"]
    index = SampleIndex(str(tmp_path), ("a",), np.frombuffer(b"".join(names), dtype=np.uint8),
                        np.array([0, 7, 14], dtype=np.int64), np.zeros(2, dtype=np.int64), "x")
    reader = SampleReader(index)
    assert bytes(reader.read(0)) == b"jpeg bytes"
    assert index.name(0) == f"{tmp_path}/a/x.jpg"
    with pytest.raises(ImageRefused, match="y.jpg is a FIFO"):
        reader.read(1)


# -- file lists -------------------------------------------------------------------


def image_files(root: Path, make_image: Callable[..., Path], names: list[str]) -> list[Path]:
    return [make_image(root / name, seed=k) for k, name in enumerate(names)]


def test_file_list_with_class_names_header_and_relative_paths(tmp_path: Path, make_image: Callable[..., Path]) -> None:
    image_files(tmp_path, make_image, ["imgs/b1.jpg", "imgs/a1.png", "imgs/with, comma.jpg"])
    listing = tmp_path / "train.csv"
    listing.write_text('path,label\nimgs/b1.jpg,dog\nimgs/a1.png,cat\n\n"imgs/with, comma.jpg",dog\n')
    index = open_dataset(listing)
    assert index.classes == ("cat", "dog")  # sorted, as ImageFolder sorts folder names
    assert index.labels.tolist() == [1, 0, 1]
    assert [index.path(i) for i in range(3)] == [tmp_path / "imgs/b1.jpg", tmp_path / "imgs/a1.png",
                                                 tmp_path / "imgs/with, comma.jpg"]
    reader = SampleReader(index)
    assert bytes(reader.read(1)) == (tmp_path / "imgs/a1.png").read_bytes()


def test_tsv_file_list_with_integer_labels_and_absolute_paths(tmp_path: Path, make_image: Callable[..., Path]) -> None:
    outside = make_image(tmp_path / "elsewhere" / "x.jpg")
    inside = make_image(tmp_path / "lists" / "y.jpg")
    listing = tmp_path / "lists" / "val.tsv"
    listing.write_text(f"{outside}\t3\n{inside}\t0\n")
    index = open_dataset(listing)
    assert index.classes == ("0", "1", "2", "3")
    assert index.labels.tolist() == [3, 0]
    assert index.file(1) == "y.jpg"  # inside the list's folder: stored relative to it
    reader = SampleReader(index)
    assert bytes(reader.read(0)) == outside.read_bytes()
    assert bytes(reader.read(1)) == inside.read_bytes()


@pytest.mark.parametrize(("text", "message"), [
    ("a.jpg,cat\nb.jpg\n", r"list\.csv:2: expected 'path,label'"),
    ("a.jpg,cat\n,dog\n", r"list\.csv:2: the path is empty"),
    ("a.jpg,cat\nb.jpg, \n", r"list\.csv:2: the label of b\.jpg is empty"),
    ("a.jpg,1\nb.jpg,2\nc.jpg,dog\n", r"list\.csv:3: label 'dog' is a class name but the list's labels start as integers"),
    ("a.jpg,cat\nb.jpg,7\n", r"list\.csv:2: label '7' is an integer but the list's labels start as class names"),
    ("a.jpg,-1\n", r"list\.csv:1: label -1 is negative"),
    ("path,label\n\n", r"names no samples"),
    ("path,label\na.jpg,1\npath,label\n", r"list\.csv:3: label 'label' is a class name"),  # a second header
])
def test_bad_file_lists_name_the_line(tmp_path: Path, text: str, message: str) -> None:
    listing = tmp_path / "list.csv"
    listing.write_text(text)
    with pytest.raises(DatasetError, match=message):
        open_dataset(listing)


def test_missing_or_undecodable_file_lists_are_clear(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"nope\.csv does not exist"):
        open_dataset(tmp_path / "nope.csv")
    (tmp_path / "latin.csv").write_bytes(b"a.jpg,cat\n\xe9t\xe9.jpg,dog\n")
    with pytest.raises(DatasetError, match=r"latin\.csv:2: not valid UTF-8"):
        open_dataset(tmp_path / "latin.csv")


def test_file_list_fingerprint_follows_the_list(tmp_path: Path) -> None:
    listing = tmp_path / "l.csv"
    listing.write_text("a.jpg,cat\nb.jpg,dog\n")
    first = open_dataset(listing).fingerprint
    assert open_dataset(listing).fingerprint == first
    listing.write_text("a.jpg,cat\nb.jpg,cat\n")
    assert open_dataset(listing).fingerprint != first
