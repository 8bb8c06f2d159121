"""Batch files: round trip, layout invariants, and refusal of malformed input.

The malformed-input properties allow exactly two outcomes for any bytes:
``ProtocolError``, or a batch whose every tensor is aligned, inside the file and
disjoint from the others and which ``map_batch`` can view.
"""

from __future__ import annotations

import copy
import os
import shutil
import struct
import tempfile
import tracemalloc
from collections.abc import Iterator
from math import prod
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from prefetchd.buffer_protocol import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    PAGE_SIZE,
    VERSION,
    BatchLayout,
    BatchMeta,
    ProtocolError,
    batch_name,
    list_temp_files,
    map_batch,
    not_of_stream,
    parse_batch,
    write_batch,
)
from prefetchd.buffer_protocol.batch import DTYPES, MAX_META_LEN, REQUIRED_TENSORS, align

FAST = settings(max_examples=60, deadline=500, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=150, deadline=500, suppress_health_check=[HealthCheck.too_slow])

INT63 = 2**63 - 1


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batches")


def _fresh_dir(base: Path) -> Path:
    # Hypothesis runs many examples per test; function-scoped tmp_path would be shared.
    return Path(tempfile.mkdtemp(dir=base))


# -- a valid file to damage ---------------------------------------------------


def _valid_batch(n: int = 2, h: int = 8, w: int = 8, c: int = 3) -> bytes:
    layout = BatchLayout.plan(n, h, w, c)
    buf = bytearray(layout.file_len)
    head = layout.encode_header(epoch=3, step=5, seed=7, producer="test", job="7ce11fc278a4f287", rank=1)
    buf[: len(head)] = head
    rng = np.random.default_rng(0)
    for name, spec in layout.tensors.items():
        data = rng.integers(0, 100, spec.shape).astype(DTYPES[spec.dtype]).tobytes()
        buf[spec.offset : spec.offset + len(data)] = data
    return bytes(buf)


VALID = _valid_batch()
VALID_META_LEN = struct.unpack_from("<I", VALID, 12)[0]
VALID_META: dict[str, Any] = msgpack.unpackb(VALID[HEADER_SIZE : HEADER_SIZE + VALID_META_LEN])


def _with_meta(meta: Any, size: int = len(VALID)) -> bytes:
    """A ``size``-byte file with ``meta`` as its metadata, right header lengths and VALID's payload pages."""
    packed: bytes = msgpack.packb(meta, use_bin_type=True)
    header_len = align(HEADER_SIZE + len(packed))
    head = (HEADER.pack(MAGIC, VERSION, 0, len(packed), header_len, size) + packed).ljust(header_len, b"\0")
    return head + VALID[header_len:size].ljust(size - header_len, b"\0")


def _write(directory: Path, data: bytes, name: str = "x.batch") -> Path:
    path = directory / name
    path.write_bytes(data)
    return path


def _huge_empty_images_meta() -> dict[str, Any]:
    meta = copy.deepcopy(VALID_META)
    meta["tensors"]["images"].update(shape=[0, 2**40, 2**40, 2**40], length=0)
    for t in ("labels", "indices"):
        meta["tensors"][t].update(shape=[0], length=0)
    return meta


# -- checking one parse -------------------------------------------------------


def check_parse(data: bytes, workdir: Path | None = None) -> BatchMeta | None:
    """Parse ``data``: a ProtocolError, or a batch that satisfies every reader check."""
    try:
        meta = parse_batch(data, "fuzzed.batch")
    except ProtocolError as exc:
        assert "fuzzed.batch" in str(exc)
        return None
    size = len(data)
    magic, version, _flags, meta_len, header_len, file_len = HEADER.unpack_from(data)
    assert (magic, version, file_len) == (MAGIC, VERSION, size)
    assert HEADER_SIZE + meta_len <= header_len <= size and header_len % PAGE_SIZE == 0
    spans = []
    for name, spec in meta.tensors.items():
        assert spec.dtype in DTYPES, name
        assert spec.offset % PAGE_SIZE == 0 and header_len <= spec.offset, name
        assert spec.offset + spec.length <= size, name
        spans.append((spec.offset, spec.offset + spec.length))
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    for name, dtype in REQUIRED_TENSORS.items():
        assert meta.tensors[name].dtype == dtype
    n = meta.size
    assert len(meta.tensors["images"].shape) == 4
    assert meta.tensors["labels"].shape == meta.tensors["indices"].shape == (n,)
    for value in (meta.epoch, meta.step, meta.seed, meta.replaced):
        assert type(value) is int and 0 <= value <= INT63
    assert isinstance(meta.producer, str)
    assert meta.job is None or isinstance(meta.job, str)
    assert meta.rank is None or type(meta.rank) is int and 0 <= meta.rank <= INT63
    if workdir is not None:
        path = _write(workdir, data, f"{os.getpid()}-fuzz.batch")
        mapped = map_batch(path)
        assert mapped.images.shape == meta.tensors["images"].shape
        assert mapped.labels.shape == mapped.indices.shape == (n,)
    return meta


# -- round trip ---------------------------------------------------------------


@st.composite
def batches(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(0, 8))
    h, w = draw(st.integers(1, 16)), draw(st.integers(1, 16))
    c = draw(st.sampled_from([1, 3]))
    int64s = hnp.arrays(np.int64, (n,))
    return {
        "images": draw(hnp.arrays(np.uint8, (n, h, w, c))),
        "labels": draw(int64s),
        "indices": draw(int64s),
        "epoch": draw(st.integers(0, INT63)),
        "step": draw(st.integers(0, INT63)),
        "seed": draw(st.integers(0, INT63)),
        "replaced": draw(st.integers(0, INT63)),
        "producer": draw(st.text(max_size=64)),
        "job": draw(st.none() | st.text(max_size=16)),
        "rank": draw(st.none() | st.integers(0, INT63)),
    }


@FAST
@given(b=batches())
def test_write_then_map_round_trips(b: dict[str, Any], workdir: Path) -> None:
    d = _fresh_dir(workdir)
    try:
        path = d / batch_name(b["epoch"] % 10**6, b["step"] % 10**8)
        write_batch(path, b["images"], b["labels"], b["indices"], epoch=b["epoch"], step=b["step"],
                    seed=b["seed"], producer=b["producer"], replaced=b["replaced"], job=b["job"], rank=b["rank"])
        assert os.listdir(d) == [path.name] and path.name.endswith(".batch")
        assert list(list_temp_files(d)) == []
        mapped = map_batch(path)
        for name in ("images", "labels", "indices"):
            got, want = getattr(mapped, name), b[name]
            assert got.dtype == DTYPES[REQUIRED_TENSORS[name]] and got.shape == want.shape
            assert got.tobytes() == want.tobytes(), name
        m = mapped.meta
        assert (m.epoch, m.step, m.seed, m.replaced, m.producer, m.job, m.rank) == (
            b["epoch"], b["step"], b["seed"], b["replaced"], b["producer"], b["job"], b["rank"])
        assert m.size == len(b["labels"])
        assert path.stat().st_size == BatchLayout.plan(*b["images"].shape).file_len
    finally:
        shutil.rmtree(d)


def test_parse_accepts_bytes_memoryview_and_mmap(tmp_path: Path) -> None:
    import mmap

    path = _write(tmp_path, VALID)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        metas = [parse_batch(VALID), parse_batch(memoryview(VALID)), parse_batch(mm)]
    assert metas[0] == metas[1] == metas[2]
    assert (metas[0].epoch, metas[0].step, metas[0].seed, metas[0].producer) == (3, 5, 7, "test")


def test_a_batch_names_its_stream_and_one_of_an_earlier_daemon_names_none() -> None:
    """``job`` and ``rank`` tell a batch of another rank or job renamed to a stream's name from its own
    (``not_of_stream``); a batch of a daemon before them has neither, and is one only where its manifest does not
    say that the daemon's batches name their stream."""
    meta = parse_batch(VALID)
    assert (meta.job, meta.rank) == ("7ce11fc278a4f287", 1)
    assert not not_of_stream(meta, "7ce11fc278a4f287", 1, keyed=True)
    assert not_of_stream(meta, "7ce11fc278a4f287", 0, keyed=False), "another rank's, whatever the manifest says"
    assert not_of_stream(meta, "0123456789abcdef", 1, keyed=False), "another job's"
    older = copy.deepcopy(VALID_META)
    del older["job"], older["rank"]
    old = parse_batch(_with_meta(older))
    assert (old.job, old.rank) == (None, None)
    assert not not_of_stream(old, "7ce11fc278a4f287", 1, keyed=False)
    assert not_of_stream(old, "7ce11fc278a4f287", 1, keyed=True)
    half = copy.deepcopy(VALID_META)
    del half["rank"]
    assert not_of_stream(parse_batch(_with_meta(half)), "7ce11fc278a4f287", 1, keyed=False)
    for key, value in (("job", 5), ("job", None), ("rank", -1), ("rank", "1")):
        with pytest.raises(ProtocolError, match=f"metadata field '{key}'"):
            parse_batch(_with_meta({**VALID_META, key: value}))


def test_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    # A producer id too long for the one metadata page makes encode_header refuse.
    images = np.zeros((1, 2, 2, 3), np.uint8)
    with pytest.raises(ProtocolError, match="metadata"):
        write_batch(tmp_path / batch_name(0, 0), images, np.zeros(1), np.zeros(1),
                    epoch=0, step=0, seed=0, producer="p" * 5000)
    assert os.listdir(tmp_path) == []


def test_consumer_writes_stay_private(tmp_path: Path) -> None:
    path = tmp_path / batch_name(0, 0)
    images = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)
    write_batch(path, images, np.array([1, 2]), np.array([10, 20]), epoch=0, step=0, seed=0, producer="p")
    before = path.read_bytes()
    mapped = map_batch(path)
    assert mapped.images.flags.writeable and not mapped.images.flags.owndata
    mapped.images[...] = 255
    mapped.labels[:] = -1
    mapped.indices[0] = 99
    assert path.read_bytes() == before
    again = map_batch(path)
    assert again.images.tobytes() == images.tobytes()
    assert again.labels.tolist() == [1, 2] and again.indices.tolist() == [10, 20]


def test_map_refuses_symlink_and_passes_missing_file_through(tmp_path: Path) -> None:
    target = _write(tmp_path, VALID, "real.batch")
    link = tmp_path / "link.batch"
    link.symlink_to(target)
    with pytest.raises(ProtocolError, match="link.batch"):
        map_batch(link)
    with pytest.raises(FileNotFoundError):
        map_batch(tmp_path / "gone.batch")


@pytest.mark.parametrize("size", [0, 1, HEADER_SIZE - 1])
def test_map_refuses_short_file(tmp_path: Path, size: int) -> None:
    with pytest.raises(ProtocolError, match="shorter than"):
        map_batch(_write(tmp_path, VALID[:size]))


# -- layout -------------------------------------------------------------------


@settings(max_examples=200, deadline=500)
@given(n=st.integers(0, 4096), h=st.integers(1, 4096), w=st.integers(1, 4096), c=st.sampled_from([1, 3, 4]))
def test_layout_invariants(n: int, h: int, w: int, c: int) -> None:
    layout = BatchLayout.plan(n, h, w, c)
    assert layout.header_len % PAGE_SIZE == 0 and layout.header_len >= HEADER_SIZE
    spans = []
    for name, spec in layout.tensors.items():
        assert spec.offset % PAGE_SIZE == 0 and spec.offset >= layout.header_len, name
        assert spec.offset + spec.length <= layout.file_len, name
        spans.append((spec.offset, spec.offset + spec.length))
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    assert layout.file_len % PAGE_SIZE == 0
    assert layout.file_len == max(layout.header_len, align(max(end for _, end in spans)))
    assert set(layout.tensors) == set(REQUIRED_TENSORS)
    assert layout.tensors["images"].shape == (n, h, w, c)
    assert layout.tensors["labels"].shape == layout.tensors["indices"].shape == (n,)
    assert layout.slot_bytes == h * w * c
    if n:
        images = layout.tensors["images"]
        assert layout.slot_offset(0) == images.offset
        assert layout.slot_offset(n - 1) + layout.slot_bytes == images.offset + images.length
    head = layout.encode_header(epoch=INT63, step=INT63, seed=INT63, producer="d" * 64, replaced=INT63)
    assert len(head) == layout.header_len
    if layout.file_len <= 1 << 20:
        meta = parse_batch(head + bytes(layout.file_len - layout.header_len))
        assert dict(meta.tensors) == dict(layout.tensors)


# -- malformed input ----------------------------------------------------------


@FAST
@given(cut=st.integers(0, len(VALID) - 1))
def test_truncated_file_is_refused(cut: int) -> None:
    with pytest.raises(ProtocolError):
        parse_batch(VALID[:cut])


@FAST
@given(extra=st.binary(min_size=1, max_size=2 * PAGE_SIZE))
def test_extended_file_is_refused(extra: bytes) -> None:
    with pytest.raises(ProtocolError, match="header says the file is"):
        parse_batch(VALID + extra)


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, HEADER_SIZE + VALID_META_LEN - 1), st.integers(1, 255)),
                      min_size=1, max_size=4))
def test_flipped_header_or_metadata_bytes(flips: list[tuple[int, int]]) -> None:
    data = bytearray(VALID)
    for pos, mask in flips:
        data[pos] ^= mask
    check_parse(bytes(data))


def _field(valid: int, width_bits: int, *edges: int) -> st.SearchStrategy[int]:
    top = 2**width_bits - 1
    return st.one_of(st.just(valid), st.sampled_from([0, 1, top, top - 1, *edges]), st.integers(0, top))


@FUZZ
@given(
    magic=st.one_of(st.just(MAGIC), st.binary(min_size=8, max_size=8)),
    version=_field(VERSION, 16),
    flags=_field(0, 16),
    meta_len=_field(VALID_META_LEN, 32, MAX_META_LEN, MAX_META_LEN + 1, len(VALID)),
    header_len=_field(PAGE_SIZE, 64, 2 * PAGE_SIZE, len(VALID), HEADER_SIZE, PAGE_SIZE - 1),
    file_len=_field(len(VALID), 64, len(VALID) - 1, len(VALID) + 1),
)
def test_random_header_fields(magic: bytes, version: int, flags: int, meta_len: int,
                              header_len: int, file_len: int) -> None:
    data = HEADER.pack(magic, version, flags, meta_len, header_len, file_len) + VALID[HEADER_SIZE:]
    meta = check_parse(data)
    if meta is not None:
        assert (magic, version, file_len) == (MAGIC, VERSION, len(VALID))


# Values msgpack can carry, for fields that expect something else.
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
    st.text(max_size=12), st.binary(max_size=12),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=10,
)
# Sizes and offsets near the checks' boundaries, plus anything.
_numbers = st.one_of(
    st.sampled_from([-1, 0, 1, 2, 8, PAGE_SIZE - 1, PAGE_SIZE, 2 * PAGE_SIZE, 3 * PAGE_SIZE, 4 * PAGE_SIZE,
                     len(VALID), 2**31, 2**32, 2**40, 2**40 + 1, INT63, 2**64 - 1, -(2**63)]),
    st.integers(0, 8).map(lambda k: k * PAGE_SIZE),
    st.integers(PAGE_SIZE, 6 * PAGE_SIZE),  # inside the file, mostly misaligned
    st.integers(-(2**63), 2**64 - 1),
)
_shapes = st.one_of(st.lists(_numbers, max_size=9), st.lists(st.integers(0, 16), max_size=5), _values)
_dtypes = st.one_of(st.sampled_from([*DTYPES, "float64", "<u1", "UINT8", ""]), _values)


@st.composite
def tensor_entries(draw: st.DrawFn, base: dict[str, Any] | None) -> Any:
    if base is None or draw(st.integers(0, 9)) == 0:
        if draw(st.booleans()):
            return draw(_values)
        base = {"dtype": "uint8", "shape": [1], "offset": PAGE_SIZE, "length": 1}
    entry = dict(base)
    strategies = {"dtype": _dtypes, "shape": _shapes, "offset": _numbers, "length": _numbers}
    damaged = draw(st.lists(st.sampled_from(list(strategies)), max_size=2, unique=True))
    for key in damaged:
        if draw(st.integers(0, 3)) == 0:
            entry.pop(key, None)
        else:
            entry[key] = draw(strategies[key])
    # Unless length itself is damaged, keep it consistent so the bounds and overlap checks are reached.
    dtype, shape = entry.get("dtype"), entry.get("shape")
    if ("length" not in damaged and isinstance(dtype, str) and dtype in DTYPES and isinstance(shape, list)
            and all(type(d) is int and d >= 0 for d in shape)):
        length = prod(shape) * DTYPES[dtype].itemsize
        if length < 2**64:
            entry["length"] = length
    if draw(st.integers(0, 9)) == 0:
        entry[draw(st.text(max_size=6))] = draw(_values)
    return entry


@st.composite
def metadata_maps(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 19)) == 0:
        return draw(_values)
    meta = copy.deepcopy(VALID_META)
    # Damage few top-level fields at a time, so that most examples reach the tensor checks.
    for key in draw(st.lists(st.sampled_from([k for k in meta if k != "tensors"]), max_size=2, unique=True)):
        action = draw(st.sampled_from(["drop", "replace", "number"]))
        if action == "drop":
            del meta[key]
        elif action == "replace":
            meta[key] = draw(_values)
        elif action == "number":
            meta[key] = draw(_numbers)
    if draw(st.integers(0, 9)) == 0:
        meta["tensors"] = draw(_values)
    else:
        tensors: dict[str, Any] = {}
        for name, entry in VALID_META["tensors"].items():
            action = draw(st.sampled_from(["keep", "keep", "keep", "mutate", "mutate", "drop"]))
            if action == "keep":
                tensors[name] = dict(entry)
            elif action == "mutate":
                tensors[name] = draw(tensor_entries(entry))
        for _ in range(draw(st.integers(0, 3))):
            # Extra tensors, often copies of a real one: same offset means overlap.
            source = draw(st.sampled_from([None, *VALID_META["tensors"].values()]))
            name = draw(st.one_of(st.sampled_from(["extra", "masks", "images"]), st.text(max_size=6)))
            tensors[name] = draw(tensor_entries(source))
        meta["tensors"] = tensors
    if draw(st.integers(0, 9)) == 0:
        meta[draw(st.text(max_size=6))] = draw(_values)
    return meta


@FUZZ
@given(meta=metadata_maps(), extra_pages=st.integers(0, 4))
def test_random_metadata_maps(meta: Any, extra_pages: int, workdir: Path) -> None:
    data = _with_meta(meta, len(VALID) + extra_pages * PAGE_SIZE)
    check_parse(data, workdir)


@FAST
@given(garbage=st.binary(max_size=256))
def test_garbage_metadata_bytes(garbage: bytes) -> None:
    head = HEADER.pack(MAGIC, VERSION, 0, len(garbage), PAGE_SIZE, len(VALID))
    check_parse((head + garbage).ljust(PAGE_SIZE, b"\0") + VALID[PAGE_SIZE:])


def _length_bombs() -> Iterator[tuple[str, bytes]]:
    """Metadata whose length prefixes promise far more than is there."""
    yield "array32", b"\xdd\xff\xff\xff\xff"
    yield "map32", b"\xdf\xff\xff\xff\xff"
    yield "bin32", b"\xc6\xff\xff\xff\xff"
    yield "str32", b"\xdb\xff\xff\xff\xff"
    yield "ext32", b"\xc9\xff\xff\xff\xff\x01"
    yield "deep nesting", b"\x91" * 100_000
    yield "wide shape", msgpack.packb({**VALID_META, "tensors": {
        **VALID_META["tensors"], "images": {"dtype": "uint8", "shape": [2**40] * 8, "offset": PAGE_SIZE,
                                             "length": 1}}})


@pytest.mark.parametrize("name,meta", list(_length_bombs()), ids=[n for n, _ in _length_bombs()])
def test_length_bombs_allocate_little(name: str, meta: bytes) -> None:
    header_len = align(HEADER_SIZE + len(meta))
    data = (HEADER.pack(MAGIC, VERSION, 0, len(meta), header_len, header_len + PAGE_SIZE) + meta).ljust(
        header_len + PAGE_SIZE, b"\0")
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            parse_batch(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(data) + (1 << 20), f"{name}: parsing allocated {peak} bytes"


@pytest.mark.parametrize("version", [0, VERSION + 1, 65535])
def test_version_mismatch_names_both_versions(version: int) -> None:
    data = HEADER.pack(MAGIC, version, 0, VALID_META_LEN, PAGE_SIZE, len(VALID)) + VALID[HEADER_SIZE:]
    with pytest.raises(ProtocolError) as info:
        parse_batch(data, "old.batch")
    message = str(info.value)
    assert f"version {version}" in message and f"version {VERSION}" in message and "old.batch" in message


def test_overlapping_payloads_are_refused() -> None:
    meta = copy.deepcopy(VALID_META)
    meta["tensors"]["indices"]["offset"] = meta["tensors"]["labels"]["offset"]
    with pytest.raises(ProtocolError, match="overlap"):
        parse_batch(_with_meta(meta))


def test_tensor_past_end_is_refused() -> None:
    meta = copy.deepcopy(VALID_META)
    meta["tensors"]["indices"]["offset"] = len(VALID)
    with pytest.raises(ProtocolError, match="past the end"):
        parse_batch(_with_meta(meta))


@pytest.mark.parametrize("key", ["format", "epoch", "step", "seed", "producer", "replaced", "tensors"])
def test_missing_metadata_key_is_refused(key: str) -> None:
    meta = copy.deepcopy(VALID_META)
    del meta[key]
    with pytest.raises(ProtocolError):
        parse_batch(_with_meta(meta))


@pytest.mark.parametrize("dtype", [[], {}, ["uint8"], {"a": 1}])
def test_unhashable_dtype_is_a_protocol_error(dtype: Any) -> None:
    meta = copy.deepcopy(VALID_META)
    meta["tensors"]["labels"]["dtype"] = dtype
    with pytest.raises(ProtocolError, match="dtype"):
        parse_batch(_with_meta(meta))


def test_map_accepts_every_parsed_batch(tmp_path: Path) -> None:
    data = _with_meta(_huge_empty_images_meta())
    try:
        parse_batch(data)
    except ProtocolError:
        return  # refusing it at parse time is a fine fix too
    mapped = map_batch(_write(tmp_path, data))
    assert mapped.images.size == 0


def test_directory_named_like_a_batch_is_a_protocol_error(tmp_path: Path) -> None:
    path = tmp_path / batch_name(0, 0)
    path.mkdir()
    for i in range(8):  # directory sizes grow with entries on tmpfs too, past the header size
        (path / f"entry-{i:02d}").write_bytes(b"")
    if path.stat().st_size < HEADER_SIZE:
        pytest.skip("this filesystem reports directories smaller than the header")
    with pytest.raises(ProtocolError, match=path.name):
        map_batch(path)


@pytest.mark.parametrize("labels,indices", [([7], [1, 2]), ([7, 8, 9], [1, 2]), ([7, 8], [1, 2, 3])],
                         ids=["short-labels", "long-labels", "long-indices"])
def test_write_batch_refuses_mismatched_lengths(tmp_path: Path, labels: list[int], indices: list[int]) -> None:
    with pytest.raises(ValueError):
        write_batch(tmp_path / batch_name(0, 0), np.zeros((2, 4, 4, 3), np.uint8), np.array(labels),
                    np.array(indices), epoch=0, step=0, seed=0, producer="p")
    assert os.listdir(tmp_path) == []
