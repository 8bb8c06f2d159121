"""The sources seam: locations, index locations and the reader that fetches sample bytes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from prefetchd.daemon.dataset import SampleIndex
from prefetchd.daemon.sources import SampleReader, is_url
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
