"""The sources seam: locations, index locations and the reader that fetches sample bytes."""

from __future__ import annotations

import fcntl
import io
import os
import pickle
import re
import struct
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from prefetchd.daemon.dataset import SampleIndex, split_members
from prefetchd.cli import main as cli_main
from prefetchd.daemon.errors import DatasetError
from prefetchd.daemon.sources import SampleReader, is_url, open_dataset
from prefetchd.daemon.sources import shards as shards_module
from prefetchd.daemon.sources.filelist import MAX_INT_CLASSES
from prefetchd.daemon.sources.shards import INDEX_NAME, ShardChanged, pack, parse_size, read_packed_from
from prefetchd.daemon.sources.storage import ImageRefused
from prefetchd.daemon.fill import run_task
from prefetchd.daemon.tasks import Filled, Task, WorkerJob, failure_of
from tests.as_nobody import as_nobody
from tests.conftest import mounted_tmpfs


@pytest.mark.parametrize(("location", "url"), [
    ("s3://bucket/prefix", True), ("gs://b", True), ("file:///data/x", True),
    ("/data/imagenet", False), ("data/with:colon", False), ("relative", False), ("c://odd", False),
])
def test_urls_are_told_from_local_paths(location: str, url: bool) -> None:
    assert is_url(location) is url


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
    assert index.name(0) == str(outside) and index.name(1) == str(inside)  # as messages name them
    reader = SampleReader(index)
    assert bytes(reader.read(0)) == outside.read_bytes()
    assert bytes(reader.read(1)) == inside.read_bytes()


@pytest.mark.parametrize("header", ["path,label", "image_path,label_name", "File Path,Class", "filepath,labels",
                                    "image,class_id", "IMG\tTarget", "key,category"])
def test_a_header_row_is_skipped_whatever_its_words(tmp_path: Path, header: str) -> None:
    """A header read as a sample would add a class and shift the labels after it."""
    tab = "\t" in header
    listing = tmp_path / ("list.tsv" if tab else "list.csv")
    listing.write_text(header + "\n" + "\n".join(f"{n}.jpg{chr(9) if tab else ','}{c}" for n, c in
                                                 [("a", "cat"), ("b", "dog"), ("c", "cat")]) + "\n")
    (tmp_path / "a.jpg").touch()  # a list none of whose files are there is refused
    index = open_dataset(listing)
    assert index.classes == ("cat", "dog") and index.labels.tolist() == [0, 1, 0]



@pytest.mark.parametrize(("name", "text", "files"), [
    ("list.csv", '"t\tab.png",cat\na.png,dog\n', ["t\tab.png", "a.png"]),  # quoted: the tab is the path's
    ("list.csv", "t\tab.png,cat\na.png,dog\n", ["t\tab.png", "a.png"]),  # as csv.writer writes it: unquoted
    ("list.tsv", "a,b.png\tcat\nc.png\tdog\n", ["a,b.png", "c.png"]),  # a comma in a TSV's path
    ("list.txt", "a,b.png\tcat\nc.png\tdog\n", ["a,b.png", "c.png"]),  # both in a .txt: a tab, as before
])
def test_a_delimiter_in_the_first_path_does_not_decide_the_lists_delimiter(
        tmp_path: Path, name: str, text: str, files: list[str]) -> None:
    """A tab anywhere in the first row made the list tab-separated: a CSV whose first path held one was refused
    ("'\t' expected after '\"'", or "expected 'path<TAB>label'" at line 2), quoted or not (a walk)."""
    listing = tmp_path / name
    listing.write_text(text)
    for file in files:
        (tmp_path / file).touch()
    index = open_dataset(listing)
    assert [index.name(i) for i in range(len(index))] == [str(tmp_path / f) for f in files]
    assert index.classes == ("cat", "dog") and index.labels.tolist() == [0, 1]


def test_a_row_over_several_lines_is_named_by_its_first(tmp_path: Path) -> None:
    """A quoted path holding a newline spans two lines; the errors named its last (a walk)."""
    listing = tmp_path / "list.csv"
    listing.write_text('a.jpg,cat\n"two\nlines.jpg",\nc.jpg,dog\n')
    with pytest.raises(DatasetError, match=r"list\.csv:2: the label of two\nlines\.jpg is empty"):
        open_dataset(listing)
    listing.write_text('"two\nlines.jpg",cat\n\nb.jpg,dog\n,dog\n')  # a blank line between rows counts too
    with pytest.raises(DatasetError, match=r"list\.csv:5: the path is empty"):
        open_dataset(listing)

@pytest.mark.parametrize("first", ["images/path.jpg,label", "path.jpg,class", "img,7"])
def test_a_first_row_naming_a_file_is_a_sample(tmp_path: Path, first: str) -> None:
    listing = tmp_path / "list.csv"
    listing.write_text(first + "\nb.jpg," + ("3" if first.endswith("7") else "dog") + "\n")
    named = tmp_path / first.split(",")[0]  # there: a list none of whose files are is refused
    named.parent.mkdir(exist_ok=True)
    named.touch()
    assert len(open_dataset(listing)) == 2


@pytest.mark.parametrize(("text", "message"), [
    ("a.jpg,cat\nb.jpg\n", r"list\.csv:2: expected 'path,label'.*every row needs a path and a label"),
    ("a.jpg 0\nb.jpg 1\n", r"list\.csv:1: expected 'path,label'.*with a comma or a tab .*not spaces"),
    ("a.jpg;cat\nb.jpg;dog\n", r"list\.csv:1: expected 'path,label'.*with a comma or a tab .*not ';'"),
    ("# made by hand\na.jpg,0\n", r"list\.csv:1: expected 'path,label'.*has no comments; remove the line"),
    ("a.jpg,cat\n,dog\n", r"list\.csv:2: the path is empty"),
    ("a.jpg,cat\nb.jpg, \n", r"list\.csv:2: the label of b\.jpg is empty"),
    ("a.jpg,1\nb.jpg,2\nc.jpg,dog\n", r"list\.csv:3: label 'dog' is a class name but the list's labels start as integers"),
    ("a.jpg,cat\nb.jpg,7\n", r"list\.csv:2: label '7' is an integer but the list's labels start as class names"),
    ("a.jpg,-1\n", r"list\.csv:1: label -1 is negative"),
    ("a.jpg,3\nb.jpg,1_0\n", r"list\.csv:2: label '1_0' is a class name but the list's labels start as integers"),
    ("a.jpg,3\nb.jpg,\u0663\n", r"list\.csv:2: label '\u0663' is a class name"),  # an Arabic-Indic 3
    ("a.jpg,3\nb.jpg,+5\n", r"list\.csv:2: label '\+5' is a class name but the list's labels start as integers"),
    ("path,label\n\n", r"names no samples"),
    ("path,label\na.jpg,1\npath,label\n", r"list\.csv:3: label 'label' is a class name"),  # a second header
])
def test_bad_file_lists_name_the_line(tmp_path: Path, text: str, message: str) -> None:
    listing = tmp_path / "list.csv"
    listing.write_text(text)
    with pytest.raises(DatasetError, match=message):
        open_dataset(listing)


@pytest.mark.parametrize("label", ["10000000", "3000000000", "99999999999999999999999"])
def test_an_integer_label_far_above_the_samples_is_refused_not_made_into_millions_of_classes(
    tmp_path: Path, label: str
) -> None:
    listing = tmp_path / "list.csv"
    listing.write_text(f"a.jpg,0\nb.jpg,{label}\nc.jpg,1\n")
    with pytest.raises(DatasetError, match=rf"list\.csv:2: label {label} makes {int(label) + 1:,} classes .* "
                                           r"for 3 samples with 3 distinct labels; number the classes from 0"):
        open_dataset(listing)



def test_whole_numbers_written_as_decimals_are_integer_labels(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """pandas writes an integer column holding a missing value as floats: "10.0" was a class name, sorted as text
    before "2.0", so the labels the user numbered became others without a word (a walk)."""
    listing = tmp_path / "list.csv"
    listing.write_text("a.jpg,0.0\nb.jpg,1.0\nc.jpg,10.0\nd.jpg,2\n")
    (tmp_path / "a.jpg").touch()
    index = open_dataset(listing)
    assert list(index.labels) == [0, 1, 10, 2] and index.classes == tuple(str(k) for k in range(11))
    listing.write_text("a.jpg,0.5\nb.jpg,10.5\nc.jpg,2.5\n")  # no whole numbers: names, and said so
    with caplog.at_level("WARNING"):
        index = open_dataset(listing)
    assert index.classes == ("0.5", "10.5", "2.5") and list(index.labels) == [0, 1, 2]
    assert (f"{listing}: the labels are decimal numbers, not whole ones (e.g. '0.5' at line 1): taken as class names, "
            "sorted as text ('0.5', '10.5', '2.5')") in caplog.text

def test_integer_labels_up_to_a_million_classes_or_as_many_as_samples_are_taken(tmp_path: Path) -> None:
    """A sparse list (a few samples of a large label space) is legitimate up to MAX_INT_CLASSES."""
    listing = tmp_path / "list.csv"
    listing.write_text(f"a.jpg,0\nb.jpg,{MAX_INT_CLASSES - 1}\n")
    (tmp_path / "a.jpg").touch()
    assert len(open_dataset(listing).classes) == MAX_INT_CLASSES
    listing.write_text("".join(f"{k}.jpg,{k}\n" for k in range(MAX_INT_CLASSES + 1)))
    (tmp_path / "0.jpg").touch()
    assert len(open_dataset(listing).classes) == MAX_INT_CLASSES + 1  # more classes, but as many samples


def test_paths_are_taken_as_csv_gives_them_spaces_after_the_delimiter_skipped(
        tmp_path: Path, make_image: Callable[..., Path], caplog: pytest.LogCaptureFixture) -> None:
    """A quoted name keeps its spaces (stripping made " lead.png" the missing "lead.png"); a list aligned by
    hand ("plain.png, cat") still reads; "./" as `find .` writes it is dropped, the files the same."""
    files = image_files(tmp_path, make_image, [" lead.png", "trail.png ", "plain.png", "cat/0.png"])
    listing = tmp_path / "list.csv"
    listing.write_text('" lead.png",cat\n"trail.png ",dog\nplain.png, cat\n./cat/0.png,\tdog\n')
    with caplog.at_level("WARNING"):
        index = open_dataset(listing)
    assert [index.file(i) for i in range(4)] == [" lead.png", "trail.png ", "plain.png", "cat/0.png"]
    assert index.classes == ("cat", "dog") and index.labels.tolist() == [0, 1, 0, 1]
    reader = SampleReader(index)
    assert [bytes(reader.read(i)) for i in range(4)] == [f.read_bytes() for f in files]
    assert "2 paths with whitespace at an end, e.g. line 1: ' lead.png', taken as written" in caplog.text


def test_a_file_listed_twice_is_said_and_one_listed_with_two_labels_is_warned_of(
        tmp_path: Path, make_image: Callable[..., Path], caplog: pytest.LogCaptureFixture) -> None:
    """A file on two rows is two samples, as listed (oversampling on purpose, or a list concatenated twice): it was
    silent, and so was one file listed as a cat and as a dog, the same image then trained as both."""
    image_files(tmp_path, make_image, ["a.png", "b.png", "c.png"])
    listing = tmp_path / "list.csv"
    listing.write_text("a.png,cat\nb.png,dog\n./a.png,cat\nc.png,dog\n")
    with caplog.at_level("INFO", logger="prefetchd.daemon.sources.filelist"):
        index = open_dataset(listing)
    assert [index.file(i) for i in range(4)] == ["a.png", "b.png", "a.png", "c.png"]  # each row a sample
    assert "list.csv: 1 file listed more than once, e.g. a.png at lines 1 and 3: each row is a sample" in caplog.text
    assert "another label" not in caplog.text
    caplog.clear()
    listing.write_text("a.png,cat\nb.png,dog\nc.png,cat\nb.png,cat\na.png,dog\n")
    with caplog.at_level("INFO", logger="prefetchd.daemon.sources.filelist"):
        assert len(open_dataset(listing)) == 5
    assert ("list.csv: 2 files listed again with another label, e.g. b.png at line 2 (dog) and line 4 (cat): each row "
            "is a sample with its label, so the same image trains as both; remove the wrong rows") in caplog.text
    caplog.clear()
    listing.write_text("a.png,cat\nb.png,dog\nc.png,cat\n")
    with caplog.at_level("INFO", logger="prefetchd.daemon.sources.filelist"):
        open_dataset(listing)
    assert "more than once" not in caplog.text and "another label" not in caplog.text


@pytest.mark.parametrize("header", ["Image,Id", "filename\tspecies", "img,whale"])
def test_a_first_row_of_unknown_header_words_is_refused_when_its_file_is_missing_and_the_next_is_not(
        tmp_path: Path, make_image: Callable[..., Path], header: str) -> None:
    """Kaggle's "Image,Id": read as a sample it adds a class "Id" and shifts every label after it."""
    make_image(tmp_path / "a.png")
    sep = "\t" if "\t" in header else ","
    listing = tmp_path / ("list.tsv" if sep == "\t" else "list.csv")
    listing.write_text(f"{header}\na.png{sep}w1\nb.png{sep}w2\n")
    first, second = header.split(sep)
    with pytest.raises(DatasetError, match=rf"list\.(csv|tsv):1: '{first}','{second}' looks like a header, not a "
                                           r"sample: no file .* and line 2's is; remove the line, or name the columns"):
        open_dataset(listing)
    make_image(tmp_path / first)  # a file of that name: a sample after all
    assert len(open_dataset(listing)) == 3


def test_a_list_whose_first_and_last_files_are_not_there_is_refused_naming_where_its_paths_start(
        tmp_path: Path) -> None:
    """Paths written relative to where the list was made, not to its folder, or on another machine: every sample
    was replaced and the job stopped at its first batch, saying no sample decoded (a missing file, no more)."""
    lists = tmp_path / "lists"
    lists.mkdir()
    (tmp_path / "cat").mkdir()
    for name in ("a.jpg", "b.jpg", "c.jpg"):
        (tmp_path / "cat" / name).touch()
    listing = lists / "train.csv"
    for text, said in [
        ("cat/a.jpg,cat\ncat/b.jpg,cat\ncat/c.jpg,dog\n",  # relative to tmp_path, not to lists/
         rf"train\.csv: neither line 1's file, cat/a\.jpg, nor line 3's, cat/c\.jpg, is in {lists}, the folder holding "
         r"the list, from which its relative paths start: write them relative to it, or absolute"),
        ("cat/a.jpg,cat\n", r"line 1's file, cat/a\.jpg, is not in .*lists, the folder holding"),
        ("/elsewhere/cat/a.jpg,cat\n/elsewhere/cat/c.jpg,dog\n",
         r"neither line 1's file, /elsewhere/cat/a\.jpg, nor line 2's, /elsewhere/cat/c\.jpg, is there: was the list "
         "written on another machine"),
        # A list written on Windows, and one with its columns the other way round, say so.
        ("cat\\a.jpg,cat\ncat\\c.jpg,dog\n", r"its paths are separated by '\\', as on Windows; write them with '/'"),
        ("cat,../cat/a.jpg\ndog,../cat/c.jpg\n", r"and its labels look like image files \('\.\./cat/a\.jpg'\): are the "
                                                r"columns the other way round\? A row is path, then label"),
    ]:
        listing.write_text(text)
        with pytest.raises(DatasetError, match=said):
            open_dataset(listing)
    # One of the two there: the list starts, and its missing files are replaced as any missing file is.
    for first, last in [("../cat/a.jpg", "../cat/gone.jpg"), ("gone.jpg", str(tmp_path / "cat/c.jpg"))]:
        listing.write_text(f"{first},cat\n../cat/b.jpg,cat\n{last},dog\n")
        assert len(open_dataset(listing)) == 3


def test_missing_or_undecodable_file_lists_are_clear(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"nope\.csv does not exist"):
        open_dataset(tmp_path / "nope.csv")
    (tmp_path / "latin.csv").write_bytes(b"a.jpg,cat\n\xe9t\xe9.jpg,dog\n")
    with pytest.raises(DatasetError, match=r"latin\.csv:2: not valid UTF-8"):
        open_dataset(tmp_path / "latin.csv")


def test_file_list_fingerprint_follows_the_list(tmp_path: Path) -> None:
    listing = tmp_path / "l.csv"
    listing.write_text("a.jpg,cat\nb.jpg,dog\n")
    (tmp_path / "a.jpg").touch()
    first = open_dataset(listing).fingerprint
    assert open_dataset(listing).fingerprint == first
    listing.write_text("a.jpg,cat\nb.jpg,cat\n")
    assert open_dataset(listing).fingerprint != first
    elsewhere = tmp_path / "other" / "l.csv"  # the same bytes, naming the images of another folder
    elsewhere.parent.mkdir()
    (elsewhere.parent / "a.jpg").touch()
    elsewhere.write_bytes(listing.read_bytes())
    assert open_dataset(elsewhere).fingerprint != open_dataset(listing).fingerprint


# -- packed shards ----------------------------------------------------------------


def class_tree(root: Path, make_image: Callable[..., Path]) -> Path:
    for k, name in enumerate(["cat/a.jpg", "cat/b.png", "dog/c.jpg", "dog/sub/d.jpeg", "emu/e.webp"]):
        make_image(root / name, size=(8 + k, 6), seed=k)
    return root


@pytest.mark.parametrize("text", ["1GB", "500MB", "1GiB", "64kib", "4096", "1.5GB"])
def test_shard_sizes_parse(text: str) -> None:
    expected = {"1GB": 10**9, "500MB": 5 * 10**8, "1GiB": 2**30, "64kib": 65536, "4096": 4096, "1.5GB": 15 * 10**8}
    assert parse_size(text) == expected[text]


@pytest.mark.parametrize("text", ["", "1XB", "GB", "-1GB", "0"])
def test_bad_shard_sizes_say_what_is_expected(text: str) -> None:
    with pytest.raises(ValueError, match="1GB, 500MB or 1GiB|less than one byte"):
        parse_size(text)


def test_packed_shards_hold_the_source_samples_in_order(tmp_path: Path, make_image: Callable[..., Path]) -> None:
    source = open_dataset(class_tree(tmp_path / "src", make_image))
    summary = pack(source, tmp_path / "out", shard_size=2000)
    assert summary["shards"] > 1  # the tiny size forces several shards
    shards = open_dataset(tmp_path / "out")
    assert shards.classes == source.classes
    assert shards.labels.tolist() == source.labels.tolist()
    src_reader, shard_reader = SampleReader(source), SampleReader(shards)
    for i in range(len(source)):
        assert bytes(shard_reader.read(i)) == bytes(src_reader.read(i)), i
    per_shard = shards.path_blob.nbytes + shards.path_offsets.nbytes  # shard names, not per sample
    assert (shards.nbytes - per_shard) / len(shards) == 28  # int32 shard + int64 offset, size, label
    # Another tool reads the same bytes: WebDataset's <key>.<ext> and <key>.cls members.
    members: dict[str, bytes] = {}
    for tar_path in sorted((tmp_path / "out").glob("shard-*.tar")):
        with tarfile.open(tar_path) as tar:
            for m in tar.getmembers():
                members[m.name] = tar.extractfile(m).read()  # type: ignore[union-attr]
    assert sorted(members) == sorted([f"{i:09d}.{ext}" for i, ext in enumerate(["jpg", "png", "jpg", "jpeg", "webp"])]
                                     + [f"{i:09d}.cls" for i in range(5)])
    for i in range(len(source)):
        ext = source.file(i).rsplit(".", 1)[1]
        assert members[f"{i:09d}.{ext}"] == bytes(src_reader.read(i))
        assert members[f"{i:09d}.cls"] == str(int(source.labels[i])).encode()


def test_shuffled_pack_records_the_source_of_each_sample(tmp_path: Path, make_image: Callable[..., Path]) -> None:
    source = open_dataset(class_tree(tmp_path / "src", make_image))
    pack(source, tmp_path / "a", shard_size=10**6, shuffle_seed=3)
    pack(source, tmp_path / "b", shard_size=10**6, shuffle_seed=3)
    assert (tmp_path / "a" / "shard-000000.tar").read_bytes() == (tmp_path / "b" / "shard-000000.tar").read_bytes()
    with np.load(tmp_path / "a" / INDEX_NAME) as npz:
        order = npz["source_index"]
    assert sorted(order.tolist()) == list(range(5)) and order.tolist() != list(range(5))
    shards, reader = open_dataset(tmp_path / "a"), SampleReader(source)
    for i, src in enumerate(order.tolist()):
        assert bytes(SampleReader(shards).read(i)) == bytes(reader.read(src))
        assert shards.labels[i] == source.labels[src]


def _as_packed_before_source_paths(out: Path) -> None:
    """Rewrite the index of the pack at ``out`` as packs wrote it before they recorded the files packed."""
    with np.load(out / INDEX_NAME) as npz:
        arrays = {k: npz[k] for k in npz.files if not k.startswith("source_path") and k != "source_root"}
    np.savez(out / INDEX_NAME, **arrays)


def test_a_packed_sample_is_shown_with_the_file_it_was_packed_from(tmp_path: Path,
                                                                   make_image: Callable[..., Path]) -> None:
    """Reviewer's case: a broken image in a pack was logged and listed in the status by shard and byte
    range alone, so the file to mend could not be found.  The pack records each sample's file, through
    a shuffle and a pack of that pack, for the names a failure is shown with; the sample's identity (its
    name without them) stays the shard and bytes.  An index packed before it records none, as it did."""
    source = open_dataset(class_tree(tmp_path / "src", make_image))
    pack(source, tmp_path / "shuffled", shard_size=2000, shuffle_seed=3)
    pack(open_dataset(tmp_path / "shuffled"), tmp_path / "again", shard_size=10**6, shuffle_seed=5)
    for layout in ("shuffled", "again"):
        shards = open_dataset(tmp_path / layout)
        packed_from = read_packed_from(shards)
        assert shards.source_index is not None and packed_from is not None
        for i, src in enumerate(shards.source_index.tolist()):
            shard, offset, size = shards.location(i)
            assert shards.name(i) == f"{tmp_path / layout / shard} (bytes {offset}-{offset + size})", (layout, i)
            assert shards.name(i, packed_from) == (f"{tmp_path / layout / shard} (bytes {offset}-{offset + size}, "
                                                   f"packed from {source.name(src)})"), (layout, i)

    # A file list's absolute paths stay as listed.
    make_image(tmp_path / "listed" / "x.jpg", size=(8, 6))
    (tmp_path / "list.csv").write_text(f"{tmp_path / 'listed' / 'x.jpg'},0\n")
    pack(open_dataset(tmp_path / "list.csv"), tmp_path / "from-list", shard_size=10**6)
    from_list = open_dataset(tmp_path / "from-list")
    assert from_list.name(0, read_packed_from(from_list)).endswith(f", packed from {tmp_path / 'listed' / 'x.jpg'})")

    _as_packed_before_source_paths(tmp_path / "shuffled")
    old = open_dataset(tmp_path / "shuffled")
    assert read_packed_from(old) is None
    pack(old, tmp_path / "of-old", shard_size=10**6)  # nothing to pass on: named as the old pack's samples are
    assert read_packed_from(open_dataset(tmp_path / "of-old")) is None


def test_the_files_packed_are_not_held_by_the_daemon_or_its_workers(tmp_path: Path) -> None:
    """The index every worker is sent (and the controller holds) is the one of a pack that recorded no
    files: those are read from the pack's index only to show a failure.  Some 36 bytes per sample held
    by each of 16 workers would be 0.8 GB at ImageNet's size, for a name seldom shown."""
    pack(open_dataset(coloured_ppms(tmp_path / "src", per_class=2)), tmp_path / "out", shard_size=10**6)
    recorded = open_dataset(tmp_path / "out")
    assert read_packed_from(recorded) is not None
    _as_packed_before_source_paths(tmp_path / "out")
    old = open_dataset(tmp_path / "out")
    assert recorded.nbytes == old.nbytes
    assert len(pickle.dumps(recorded)) == len(pickle.dumps(old))


def _damage_member(npz: Path, name: str) -> None:
    """Flip the last byte of member ``name``'s data in the zip ``npz``: what reads it fails its CRC-32."""
    with zipfile.ZipFile(npz) as archive:
        info = archive.getinfo(name)
    data = bytearray(npz.read_bytes())
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)  # the member's local header
    data[info.header_offset + 30 + name_len + extra_len + info.compress_size - 1] ^= 0xFF
    npz.write_bytes(data)


def test_the_files_packed_are_not_even_read_at_start(tmp_path: Path) -> None:
    """Reading them at every start and dropping them cost half the index's bytes (0.2-0.4 s and 140 MiB
    of peak memory more at ImageNet's size).  Damaged in the index, they leave the start as it was; the
    first failure shown reads them, and finds the damage."""
    pack(open_dataset(coloured_ppms(tmp_path / "src", per_class=2)), tmp_path / "out", shard_size=10**6)
    before = open_dataset(tmp_path / "out")
    for member in ("source_path_blob.npy", "source_path_offsets.npy", "source_root.npy"):
        _damage_member(tmp_path / "out" / INDEX_NAME, member)
    shards = open_dataset(tmp_path / "out")
    assert pickle.dumps(shards) == pickle.dumps(before)
    with pytest.raises(DatasetError, match=rf"shard index {tmp_path / 'out' / INDEX_NAME} is damaged "
                                           r"\(a broken zip archive \(Bad CRC-32 for file 'source_root\.npy'\)\)"):
        read_packed_from(shards)


def test_files_packed_that_do_not_fit_the_pack_are_refused(tmp_path: Path) -> None:
    """Shown beside another pack's samples, the files would send the user to mend the wrong ones."""
    out = tmp_path / "out"
    pack(open_dataset(coloured_ppms(tmp_path / "src", per_class=2)), out, shard_size=10**6)
    shards = open_dataset(out)
    with np.load(out / INDEX_NAME) as npz:
        arrays = {k: npz[k] for k in npz.files}
    np.savez(out / INDEX_NAME, **{**arrays, "source_path_offsets": arrays["source_path_offsets"][:-1]})
    with pytest.raises(DatasetError, match="source_path_offsets do not delimit a source path for each of its 4 "
                                           "samples; pack again"):
        read_packed_from(shards)
    with pytest.raises(DatasetError, match="source_path_offsets do not delimit"):  # nor packed again from
        pack(shards, tmp_path / "again", shard_size=10**6)
    np.savez(out / INDEX_NAME, **{**arrays, "stamp": np.array("pack-another")})
    with pytest.raises(DatasetError, match=f"{out / INDEX_NAME} is no longer the index of the pack read before"):
        read_packed_from(shards)


def test_pack_refuses_a_non_empty_folder_and_an_unfinished_pack_is_no_dataset(
    tmp_path: Path, make_image: Callable[..., Path]
) -> None:
    source = open_dataset(class_tree(tmp_path / "src", make_image))
    out = tmp_path / "out"
    pack(source, out, shard_size=10**6)
    with pytest.raises(DatasetError, match=r"out is not empty.*--force"):
        pack(source, out, shard_size=10**6)
    pack(source, out, shard_size=3000, force=True)
    assert len(open_dataset(out)) == 5
    (out / INDEX_NAME).unlink()  # as if the pack had been killed before its last step
    with pytest.raises(DatasetError, match=r"holds shards but no prefetchd-index\.npz.*did not finish.*--force"):
        open_dataset(out)
    with pytest.raises(DatasetError, match=r"out holds an unfinished pack \(5 shards without prefetchd-index\.npz: "
                                           r"a pack that was killed\); pass --force to replace it"):
        pack(source, out, shard_size=10**6)


def test_a_second_pack_into_a_folder_another_pack_writes_into_is_refused(
        tmp_path: Path, make_image: Callable[..., Path]) -> None:
    """Two `pack --force` into one folder both said they packed, and left shards of two packs under one index, or
    one's cleanup deleted the other's shards, or a damaged index; without --force the second called the first's
    shards "a pack that was killed" (a walk).  A pack holds the folder (an flock on it) while it writes."""
    src = class_tree(tmp_path / "src", make_image)
    out = tmp_path / "out"
    pack(open_dataset(src), out, shard_size=3000)
    (out / INDEX_NAME).unlink()  # as the first pack's shards look before it writes its index
    said = f"another `prefetchd pack` is writing into {out}; wait for it to finish, or pack into another folder"
    held = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # as the other pack holds it
        for force in ([], ["--force"]):
            result = CliRunner().invoke(cli_main, ["pack", str(src), str(out), *force])
            assert result.exit_code == 1 and said in result.output and "killed" not in result.output, result.output
        with pytest.raises(DatasetError, match="another `prefetchd pack` is writing into"):
            pack(open_dataset(src), out, shard_size=3000, force=True)
        assert sorted(p.name for p in out.iterdir()) == sorted(f"shard-{i:06d}.tar" for i in range(5))  # untouched
    finally:
        os.close(held)
    pack(open_dataset(src), out, shard_size=3000, force=True)  # once the other is done
    assert len(open_dataset(out)) == 5


def test_pack_refuses_a_file_as_out_and_says_an_interrupt_with_its_code(
        tmp_path: Path, make_image: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Help says a file OUT exits 1 (it was click's 2); Ctrl-C was click's "Aborted!", exit 1, a refusal's code."""
    src = class_tree(tmp_path / "src", make_image)
    (tmp_path / "afile").write_text("")
    result = CliRunner().invoke(cli_main, ["pack", str(src), str(tmp_path / "afile")])
    assert result.exit_code == 1 and f"{tmp_path / 'afile'} is a file; pass a folder" in result.output, result.output

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(shards_module, "pack", interrupted)
    result = CliRunner().invoke(cli_main, ["pack", str(src), str(tmp_path / "out")])
    assert result.exit_code == 130 and "interrupted: the shards this pack wrote in" in result.output, result.output


def test_a_pack_that_fails_or_is_interrupted_leaves_none_of_its_shards(
        tmp_path: Path, make_image: Callable[..., Path], small_tmpfs: Path, shm_dir: Path) -> None:
    """A full disk and a read-only folder were tracebacks (tarfile's ENOSPC at a shard's close, mkdir's EROFS)
    that left shards without an index; Ctrl-C left them too, and the next pack said only "not empty" (a user's
    walk).  Each is now said, and what the pack wrote is gone."""
    src = class_tree(tmp_path / "src", make_image)
    free = os.statvfs(small_tmpfs)
    (small_tmpfs / "fill").write_bytes(b"\0" * (free.f_bavail * free.f_frsize - 4096))  # one page left
    result = CliRunner().invoke(cli_main, ["pack", str(src), str(small_tmpfs / "p"), "--shard-size", "4kB"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert (f"Error: cannot write the pack in {small_tmpfs / 'p'}: No space left on device" in result.output
            and "free space there, or pack into another filesystem" in result.output), result.output
    assert [p.name for p in small_tmpfs.iterdir()] == ["fill"]
    with mounted_tmpfs(shm_dir / "ro", "size=1m,ro") as read_only:
        result = CliRunner().invoke(cli_main, ["pack", str(src), str(read_only / "p")])
        assert result.exit_code == 1, result.output
        # Said before the source is indexed (it was once packing began), as a read-only mount, not a permission.
        assert (f"Error: cannot pack into {read_only / 'p'}: cannot create it: {read_only} is on a filesystem mounted "
                "read-only") in result.output and "packing" not in result.output, result.output

    def interrupted(items: Iterator[int]) -> Iterator[int]:
        for i in items:
            if i == 3:
                raise KeyboardInterrupt
            yield i

    (tmp_path / "kept").mkdir()
    for out in (tmp_path / "new", tmp_path / "kept"):
        with pytest.raises(KeyboardInterrupt):
            pack(open_dataset(src), out, shard_size=2048, progress=interrupted)
    assert not (tmp_path / "new").exists() and list((tmp_path / "kept").iterdir()) == []


def test_a_damaged_or_foreign_shard_index_is_refused(tmp_path: Path, make_image: Callable[..., Path]) -> None:
    out = tmp_path / "out"
    pack(open_dataset(class_tree(tmp_path / "src", make_image)), out, shard_size=10**6)
    good = (out / INDEX_NAME).read_bytes()
    (out / INDEX_NAME).write_bytes(good[: len(good) // 2])
    with pytest.raises(DatasetError, match=r"prefetchd-index\.npz is damaged.*--force"):
        open_dataset(out)
    # Bytes numpy would take for a pickle: damaged, and no advice to load it unsafely.
    (out / INDEX_NAME).write_bytes(b"overwritten by something else\n")
    with pytest.raises(DatasetError, match=r"prefetchd-index\.npz is damaged \(not a numpy \.npz archive.*--force") as err:
        open_dataset(out)
    assert "unsafely" not in str(err.value)
    with np.load(io.BytesIO(good)) as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["version"] = np.array(99)
    np.savez(out / INDEX_NAME, **arrays)
    with pytest.raises(DatasetError, match="version 99"):
        open_dataset(out)


def test_pack_cli_writes_shards_from_a_file_list(tmp_path: Path, make_image: Callable[..., Path]) -> None:
    class_tree(tmp_path / "src", make_image)
    (tmp_path / "src" / "list.csv").write_text("cat/a.jpg,0\ndog/c.jpg,1\nmissing.jpg,1\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(cli_main, ["pack", str(tmp_path / "src" / "list.csv"), str(out), "--shard-size", "1MB"])
    assert result.exit_code == 0, result.output
    assert f"packed 3 samples of {tmp_path / 'src' / 'list.csv'} into" in result.output  # the list, not its folder
    assert "into 1 shard (" in result.output and "; 1 unreadable file packed empty" in result.output
    shards = open_dataset(out)
    assert shards.labels.tolist() == [0, 1, 1] and shards.member_sizes is not None
    assert shards.member_sizes[2] == 0  # the missing file: an empty member the daemon replaces
    bad = CliRunner().invoke(cli_main, ["pack", str(tmp_path / "src"), str(tmp_path / "o2"), "--shard-size", "1XB"])
    assert bad.exit_code == 2 and "1GB, 500MB or 1GiB" in bad.output


def test_a_listed_directory_or_fifo_is_packed_empty_with_a_warning_naming_it(
    tmp_path: Path, make_image: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Neither is readable as an image: packed as an empty member, as a missing file is, not a traceback."""
    make_image(tmp_path / "a.jpg")
    (tmp_path / "folder.jpg").mkdir()
    os.mkfifo(tmp_path / "pipe.jpg")
    (tmp_path / "l.csv").write_text("a.jpg,0\nfolder.jpg,0\npipe.jpg,1\n")
    with caplog.at_level("WARNING"):
        summary = pack(open_dataset(tmp_path / "l.csv"), tmp_path / "out", shard_size=10**6)
    assert summary["unreadable"] == 2
    assert f"{tmp_path}/folder.jpg is a directory, not a regular file" in caplog.text
    assert f"{tmp_path}/pipe.jpg is a FIFO, not a regular file" in caplog.text
    assert "packed as an empty member" in caplog.text
    shards = open_dataset(tmp_path / "out")
    assert shards.member_sizes is not None and shards.member_sizes.tolist()[1:] == [0, 0]


def test_index_logs_count_in_the_singular_where_one(tmp_path: Path, make_image: Callable[..., Path],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    make_image(tmp_path / "src" / "cat" / "a.jpg")
    with caplog.at_level("INFO"):
        pack(open_dataset(tmp_path / "src"), tmp_path / "out", shard_size=10**6)
        open_dataset(tmp_path / "out")
    assert f"indexed {tmp_path / 'src'}: 1 sample in 1 class (" in caplog.text
    assert f"indexed shards {tmp_path / 'out'}: 1 sample in 1 class, 1 shard (" in caplog.text


def test_pack_cli_refuses_a_url_out_instead_of_writing_a_folder_named_after_it(
    tmp_path: Path, make_image: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    src = class_tree(tmp_path / "src", make_image)
    monkeypatch.chdir(tmp_path)  # where Path("s3://bkt/packed") would be created: s3:/bkt/packed
    result = CliRunner().invoke(cli_main, ["pack", str(src), "s3://bkt/packed"])
    assert result.exit_code == 2, result.output
    assert "s3://bkt/packed is a URL, but pack writes shards to a local folder" in result.output
    assert "then `prefetchd start --data s3://bkt/packed`" in result.output
    assert not (tmp_path / "s3:").exists()


def test_pack_cli_refuses_an_out_inside_its_source_before_writing(tmp_path: Path, make_image: Callable[..., Path]) -> None:
    """Shards packed into the class folders would be a class without images there (or, with
    --force on the root itself, an index that turns the source into a shard folder)."""
    src = class_tree(tmp_path / "src", make_image)
    before = sorted(p.relative_to(src) for p in src.rglob("*"))
    for out, flags in [(src / "packed", []), (src / "cat" / "packed", []), (src, ["--force"])]:
        result = CliRunner().invoke(cli_main, ["pack", str(src), str(out), *flags])
        assert result.exit_code == 1, (out, result.output)
        assert f"{out} is inside the dataset being packed ({src.resolve()})" in result.output
    assert sorted(p.relative_to(src) for p in src.rglob("*")) == before
    assert len(open_dataset(src)) == 5
    missing = CliRunner().invoke(cli_main, ["pack", str(tmp_path / "nope"), str(tmp_path / "out")])
    assert missing.exit_code == 1 and "does not exist; expected a folder of class folders" in missing.output
    assert "--data" not in missing.output  # pack takes its source as SRC
    unshuffled = CliRunner().invoke(cli_main, ["pack", str(src), str(tmp_path / "out"), "--seed", "7"])
    assert unshuffled.exit_code == 2 and "--seed orders the samples of --shuffle" in unshuffled.output


def test_pack_refuses_an_out_holding_folders_even_with_force(tmp_path: Path, make_image: Callable[..., Path]) -> None:
    """A file list packed with --force into its images' folder: the index then made `--data` of that folder read
    the 2-sample pack instead of its 5 images in class folders, silently (a user's walk)."""
    src = class_tree(tmp_path / "src", make_image)
    listed = tmp_path / "src" / "list.csv"
    listed.write_text("cat/a.jpg,cat\ndog/c.jpg,dog\n")
    for flags in ([], ["--force"]):
        result = CliRunner().invoke(cli_main, ["pack", str(listed), str(src), *flags])
        assert result.exit_code == 1, result.output
        assert f"{src} holds folders of images (cat, dog, emu); packed there, its prefetchd-index.npz would make `--data {src}` " \
               "read the pack instead of them; pack into a new folder" in " ".join(result.output.split())
    assert not (src / "prefetchd-index.npz").exists() and not list(src.glob("shard-*.tar"))
    assert len(open_dataset(src)) == 5
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")  # a file beside a pack reads as the pack: --force may
    # Nor are folders without images classes: a filesystem's lost+found (packing onto a disk's root), a notebook's.
    (tmp_path / "out" / "lost+found").mkdir()
    (tmp_path / "out" / ".ipynb_checkpoints" / "a").mkdir(parents=True)
    (tmp_path / "out" / ".ipynb_checkpoints" / "a" / "n.ipynb").write_text("{}")
    assert CliRunner().invoke(cli_main, ["pack", str(listed), str(tmp_path / "out"), "--force"]).exit_code == 0
    assert len(open_dataset(tmp_path / "out")) == 2


def test_a_symbolic_link_loop_in_the_dataset_is_one_line_naming_it(tmp_path: Path,
                                                                    make_image: Callable[..., Path]) -> None:
    """ImageFolder (and the index walk) met it as a traceback: a class entry that loops, or a root that does."""
    src = class_tree(tmp_path / "src", make_image)
    (src / "loop").symlink_to("loop")
    (tmp_path / "root").symlink_to("root")
    for data, named in ((src, src / "loop"), (tmp_path / "root", tmp_path / "root")):
        with pytest.raises(DatasetError, match=rf"^{re.escape(str(named))}: .*symbolic link.* loop"):
            open_dataset(data)
        packed = CliRunner().invoke(cli_main, ["pack", str(data), str(tmp_path / "out")])
        assert packed.exit_code == 1 and f"{named}: " in packed.output and "Traceback" not in packed.output, \
            packed.output


@pytest.mark.skipif(os.geteuid() != 0, reason="drops to user nobody in a forked child")
def test_a_dataset_root_the_daemon_cannot_list_is_a_dataset_error(shm_dir: Path,
                                                                  make_image: Callable[..., Path]) -> None:
    """A folder the daemon's user may enter but not list (0711) was a PermissionError out of the scan: a daemon
    serving jobs died on such a job, and again on the same job.json at every restart."""
    shm_dir.chmod(0o755)
    src = class_tree(shm_dir / "src", make_image)
    src.chmod(0o711)

    def index() -> str:
        open_dataset(src)
        return "indexed"

    said = as_nobody(index)
    assert said == (f"DatasetError: cannot index {src}: {src}: permission denied: it belongs to root (uid 0) and "
                    "group root (mode 0711): its group may not read it either; ask root (uid 0) for access"), said


@pytest.mark.skipif(os.geteuid() != 0, reason="drops to user nobody in a forked child")
def test_class_folders_the_daemon_may_not_enter_are_not_taken_for_a_pack(shm_dir: Path,
                                                                        make_image: Callable[..., Path]) -> None:
    """Class folders inside a folder the daemon's user may not enter, or themselves closed to it (0700), were
    said as "cannot read shard index .../prefetchd-index.npz: Permission denied", a pack's problem."""
    shm_dir.chmod(0o755)
    inside = class_tree(shm_dir / "private" / "src", make_image)
    (shm_dir / "private").chmod(0o700)
    closed = class_tree(shm_dir / "closed", make_image)
    closed.chmod(0o700)

    def index(data: Path) -> Callable[[], str]:
        def run() -> str:
            open_dataset(data)
            return "indexed"
        return run

    # The folder that stops it is named, whose it is and its mode (a review: "private/src: Permission denied"
    # named the class tree, not the folder above it that the daemon's user may not enter).
    for data, closed_one in ((inside, shm_dir / "private"), (closed, closed)):
        said = as_nobody(index(data))
        assert said == (f"DatasetError: cannot index {data}: {closed_one}: permission denied: it belongs to root (uid "
                        "0) and group root (mode 0700): its group may not read it either; ask root (uid 0) for "
                        "access"), said
    # One class folder it may not list: ImageFolder's walk sees it empty; it was "cannot index ...:
    # .../square/status.json: Permission denied", from the look for a buffer inside it.
    closed.chmod(0o755)
    (closed / "dog").chmod(0o700)
    said = as_nobody(index(closed))
    assert said == (f"DatasetError: cannot read class folder {closed / 'dog'}: {closed / 'dog'}: permission denied: it "
                    "belongs to root (uid 0) and group root (mode 0700): its group may not read it either; ask root "
                    "(uid 0) for access"), said


# -- bad samples in every layout ------------------------------------------------------


@pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")
def test_missing_and_undecodable_listed_files_are_replaced_and_counted(
    tmp_path: Path, make_image: Callable[..., Path]
) -> None:
    """A list naming a missing file and a non-image, and the shards packed from it:
    both are replaced by the next sample and reported, as in class folders."""
    make_image(tmp_path / "a.jpg", size=(20, 20))
    make_image(tmp_path / "d.png", size=(20, 20), seed=3)
    (tmp_path / "c.jpg").write_bytes(b"not a jpeg")
    (tmp_path / "l.csv").write_text("a.jpg,0\ngone.jpg,0\nc.jpg,1\nd.png,1\n")
    listed = open_dataset(tmp_path / "l.csv")
    pack(listed, tmp_path / "shards", shard_size=10**6)
    for index in (listed, open_dataset(tmp_path / "shards")):
        batch = tmp_path / "batch.tmp"
        slot = 16 * 16 * 3
        batch.write_bytes(bytes(4 * slot))
        job = WorkerJob(index, np.arange(4, dtype=np.int64), 16, True, 1)
        result = run_task(job, Task(0, str(batch), 0, slot, 0, ((0, 0), (1, 1), (2, 2), (3, 3))))
        assert isinstance(result, Filled), result
        assert [s[1] for s in result.slots] == [0, 3, 3, 3]  # 1 and 2 replaced by the next sample that decodes
        assert len(result.failures) == 3  # gone.jpg, then c.jpg twice (as itself and as 1's first replacement)


def test_a_missing_or_cut_shard_is_refused_at_start(tmp_path: Path, make_image: Callable[..., Path]) -> None:
    """Neighbouring samples share a shard, so replacing them cannot get past a lost one: the start says so."""
    out = tmp_path / "out"
    assert pack(open_dataset(class_tree(tmp_path / "src", make_image)), out, shard_size=2000)["shards"] > 2
    shard = out / "shard-000001.tar"
    os.truncate(shard, 600)  # inside its first member (from byte 512)
    with pytest.raises(DatasetError, match=r"shard-000001\.tar is 600 bytes, but .*prefetchd-index\.npz "
                                           r"has members up to byte \d+: it was cut short or replaced; restore it, or "
                                           r"pack it again from the class folders or file list it was made from: "
                                           rf"`prefetchd pack <that folder or list> {re.escape(str(out))} --force`"):
        open_dataset(out)
    shard.unlink()
    with pytest.raises(DatasetError, match=r"shard-000001\.tar, named by .*prefetchd-index\.npz, is missing"):
        open_dataset(out)


def test_shards_changed_under_a_reader_stop_the_job_rather_than_serve_other_images(
    tmp_path: Path, make_image: Callable[..., Path]
) -> None:
    """Packed again (shuffled) while indexed, or a shard removed: no read returns what the old index
    calls sample i, and a task stops the job with a DatasetError instead of replacing samples."""
    source = open_dataset(class_tree(tmp_path / "src", make_image))
    out = tmp_path / "out"
    pack(source, out, shard_size=10**6)
    index, reader = open_dataset(out), SampleReader(open_dataset(out))
    pack(source, out, shard_size=10**6, shuffle_seed=3, force=True)
    with np.load(out / INDEX_NAME) as npz:
        moved = [i for i, src in enumerate(npz["source_index"].tolist()) if src != i]
    refused = 0
    for i in range(len(index)):
        try:
            got = bytes(reader.read(i))
        except ShardChanged as exc:
            assert f"not sample {i}'s" in str(exc) and "packed again" in str(exc) and "--reset" in str(exc), exc
            refused += 1
        else:  # the same member at the same place: still sample i
            assert got == bytes(SampleReader(source).read(i)), i
    assert moved and refused >= len(moved), (moved, refused)
    batch, slot = tmp_path / "batch.tmp", 8 * 8 * 3
    batch.write_bytes(bytes(len(index) * slot))
    job = WorkerJob(index, np.arange(len(index), dtype=np.int64), 8, True, 1)
    (out / "shard-000000.tar").unlink()
    with pytest.raises(ShardChanged) as gone:  # the worker's loop makes it the task's failure
        run_task(job, Task(0, str(batch), 0, slot, 0, ((0, 0),)))
    failed = failure_of(0, gone.value)
    assert failed.fatal is DatasetError and "shard-000000.tar: it is gone. The shards changed" in failed.reason


def test_shards_repack_with_each_members_format(tmp_path: Path, make_image: Callable[..., Path]) -> None:
    source = open_dataset(class_tree(tmp_path / "src", make_image))
    pack(source, tmp_path / "a", shard_size=10**6)
    pack(open_dataset(tmp_path / "a"), tmp_path / "b", shard_size=10**6)
    with tarfile.open(tmp_path / "b" / "shard-000000.tar") as tar:
        names = tar.getnames()
    assert names[:4] == ["000000000.jpg", "000000000.cls", "000000001.png", "000000001.cls"]
    repacked = open_dataset(tmp_path / "b")
    assert [bytes(SampleReader(repacked).read(i)) for i in range(5)] == \
        [bytes(SampleReader(source).read(i)) for i in range(5)]


def coloured_ppms(root: Path, per_class: int = 8) -> Path:
    """Two classes of 32x32 PPMs whose class is their colour: every file is the same size, so a
    header that only names member i and its size cannot tell one pack of them from another."""
    for cls, rgb in (("blue", b"\x00\x00\xff"), ("red", b"\xff\x00\x00")):
        (root / cls).mkdir(parents=True)
        for k in range(per_class):
            (root / cls / f"{k}.ppm").write_bytes(b"P6\n32 32\n255\n" + rgb * (32 * 32 - 1) + bytes([k, k, k]))
    return root


def test_a_shuffled_repack_of_same_sized_images_is_noticed_at_the_next_read(tmp_path: Path) -> None:
    """Reviewer's case: 2 x 8 PPMs of 32x32 packed, read, then packed again with --force --shuffle --seed 3.
    Member i of the new pack has the same name and size as in the old one, so only the pack's stamp
    in the header tells them apart; a read must refuse rather than give a red image the label blue."""
    src, out = coloured_ppms(tmp_path / "src"), tmp_path / "out"
    assert CliRunner().invoke(cli_main, ["pack", str(src), str(out)]).exit_code == 0
    index = open_dataset(out)
    reader = SampleReader(index)
    colour = {0: b"\x00\x00\xff", 1: b"\xff\x00\x00"}  # blue, red: the classes sorted
    for i in range(len(index)):  # the daemon reading the pack as it was indexed
        assert bytes(reader.read(i))[13:16] == colour[int(index.labels[i])]
    repacked = CliRunner().invoke(cli_main, ["pack", str(src), str(out), "--force", "--shuffle", "--seed", "3"])
    assert repacked.exit_code == 0, repacked.output
    for i in range(len(index)):
        with pytest.raises(ShardChanged, match=rf"^{re.escape(str(out))}/shard-000000\.tar: member '{i:09d}\.ppm' "
                                               r"at byte \d+ is from pack 'pack-[0-9a-f]{26}', not from pack "
                                               rf"'{index.member_stamp}' whose index.*packed again.*--reset"):
            reader.read(i)
    batch, slot = tmp_path / "batch.tmp", 8 * 8 * 3
    batch.write_bytes(bytes(len(index) * slot))
    job = WorkerJob(index, np.arange(len(index), dtype=np.int64), 8, True, 1)
    with pytest.raises(ShardChanged) as stopped:  # a worker's task stops the job, it replaces nothing
        run_task(job, Task(0, str(batch), 0, slot, 0, ((0, 0), (1, 1))))
    assert failure_of(0, stopped.value).fatal is DatasetError


def test_the_pack_stamp_tells_packs_apart_and_packing_twice_gives_the_same_bytes(tmp_path: Path) -> None:
    """The stamp is known before writing: the same pack twice is byte for byte the same, while a
    shuffled, differently seeded or differently sized pack of the same source, or a pack of the source
    with a file renamed (the same sizes and labels, another order), names another pack."""
    source = open_dataset(coloured_ppms(tmp_path / "src", per_class=2))
    stamps = {}
    for name, seed, size in (("a", None, 10**6), ("again", None, 10**6), ("shuffled", 3, 10**6),
                             ("seed4", 4, 10**6), ("smaller", None, 10**5)):
        pack(source, tmp_path / name, shard_size=size, shuffle_seed=seed)
        stamps[name] = open_dataset(tmp_path / name).member_stamp
    assert (tmp_path / "a" / "shard-000000.tar").read_bytes() == (tmp_path / "again" / "shard-000000.tar").read_bytes()
    (tmp_path / "src" / "blue" / "0.ppm").rename(tmp_path / "src" / "blue" / "9.ppm")
    pack(open_dataset(tmp_path / "src"), tmp_path / "renamed", shard_size=10**6)
    stamps["renamed"] = open_dataset(tmp_path / "renamed").member_stamp
    assert stamps["a"] == stamps["again"]
    assert len({stamps[k] for k in ("a", "shuffled", "seed4", "smaller", "renamed")}) == 5
    with tarfile.open(tmp_path / "shuffled" / "shard-000000.tar") as tar:  # what `tar tvf` shows as the owner
        assert {m.uname for m in tar.getmembers()} == {stamps["shuffled"]} and len(str(stamps["shuffled"])) == 31


def test_a_pack_indexed_before_the_stamp_is_read_without_it(tmp_path: Path) -> None:
    """Version 1 indexes written before the stamp lack its array: they are read, and not checked for it."""
    out = tmp_path / "out"
    pack(open_dataset(coloured_ppms(tmp_path / "src", per_class=2)), out, shard_size=10**6)
    with np.load(out / INDEX_NAME) as npz:
        arrays = {k: npz[k] for k in npz.files if k != "stamp"}
    np.savez(out / INDEX_NAME, **arrays)
    index = open_dataset(out)
    assert index.member_stamp is None
    assert bytes(SampleReader(index).read(3))[13:16] == b"\xff\x00\x00"


@pytest.mark.parametrize("url", [False, True], ids=["local", "fsspec"])
def test_a_shard_cut_short_under_a_reader_says_its_size_and_the_members_bytes_once(tmp_path: Path, url: bool) -> None:
    """Reviewer's case: a shard truncated to 8000 bytes was named twice, with the read's start as its
    end and the header's offset as the member's."""
    out = tmp_path / "out"
    pack(open_dataset(coloured_ppms(tmp_path / "src", per_class=2)), out, shard_size=10**6)
    index = open_dataset(f"file://{out}" if url else out)
    reader = SampleReader(index)
    assert index.member_offsets is not None and index.member_offsets[1] < 8000 < index.member_offsets[2]
    os.truncate(out / "shard-000000.tar", 8000)
    shard = f"{index.root.rstrip('/')}/shard-000000.tar"
    for i in (1, 2):  # cut inside the member; cut before its header
        start, size = int(index.member_offsets[i]), 32 * 32 * 3 + 13
        with pytest.raises(ShardChanged) as cut:
            reader.read(i)
        assert str(cut.value).startswith(
            f"{shard}: it is 8000 bytes, but the index puts sample {i} ({i:09d}.*, {size} bytes) at bytes "
            f"{start}-{start + size}. The shards changed after this daemon read their index"), cut.value
        assert str(cut.value).count("shard-000000.tar") == 1 and "--reset" in str(cut.value)


def test_val_fraction_holds_out_the_same_images_in_every_layout_of_the_data(tmp_path: Path) -> None:
    """Reviewer's case: the held-out images of a shuffled pack were picked by shard position, so images
    held out of the class folders landed in the pack's train split.  The split is drawn over the source,
    through a pack of a shuffled pack too."""
    folders = open_dataset(coloured_ppms(tmp_path / "src"))
    pack(folders, tmp_path / "plain", shard_size=10**6)
    pack(folders, tmp_path / "shuffled", shard_size=10**6, shuffle_seed=3)
    pack(open_dataset(tmp_path / "shuffled"), tmp_path / "again", shard_size=10**6, shuffle_seed=5)
    assert open_dataset(tmp_path / "plain").source_index is None  # sample i is the source's: no array kept

    def images(index: SampleIndex, split: str) -> list[bytes]:
        members = split_members(len(index), split, 0.25, index.source_index)
        return sorted(bytes(SampleReader(index).read(int(i))) for i in members)

    for split in ("val", "train"):
        expected = images(folders, split)
        assert len(set(expected)) == len(expected) == (4 if split == "val" else 12)
        for layout in ("plain", "shuffled", "again"):
            assert images(open_dataset(tmp_path / layout), split) == expected, (layout, split)
    again = open_dataset(tmp_path / "again")
    assert again.source_index is not None
    for i, src in enumerate(again.source_index.tolist()):  # the folders' sample, not the shuffled pack's
        assert bytes(SampleReader(again).read(i)) == bytes(SampleReader(folders).read(src))


def test_pack_into_a_folder_this_user_may_not_write_is_refused_before_the_source_is_indexed(shm_dir: Path) -> None:
    """It was refused only once every sample had been indexed and packing began ("packing 160 samples", then the
    error): minutes for a large source, though check_pack_target says it refuses before anything is read (a walk as
    a non-root user)."""
    from prefetchd.daemon.sources.shards import check_pack_target
    from tests.as_nobody import as_nobody

    shm_dir.chmod(0o755)
    closed = shm_dir / "closed"
    closed.mkdir(mode=0o755)  # root's: nobody may not write in it
    shut = shm_dir / "shut"
    shut.mkdir(mode=0o700)  # nor enter it: stat-ing a path in it was a PermissionError (exit 4, not pack's 1)
    for out, stops in ((closed / "packed", closed), (closed, closed), (shut / "packed", shut)):

        def check(out: Path = out) -> str:
            try:
                check_pack_target(None, out, force=True)
            except Exception as exc:
                return str(exc)
            return "not refused"

        said = as_nobody(check)
        assert said.startswith(f"cannot pack into {out}: "), said
        assert f"{stops}: permission denied: it belongs to root (uid 0)" in said, said
