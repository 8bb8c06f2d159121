"""Batch files: the unit the daemon writes and the trainer maps.

A batch file is a fixed little-endian header, a msgpack metadata map, zero
padding up to ``header_len`` (a multiple of the page size) and page-aligned
payloads, so each payload can be memory-mapped and handed to the GPU as is::

    offset  size  field        struct
    0       8     magic        8s    b"PFDBATCH"
    8       2     version      H     protocol version (VERSION)
    10      2     flags        H     reserved, 0
    12      4     meta_len     I     bytes of msgpack metadata after the header
    16      8     header_len   Q     bytes before the first payload, page aligned
    24      8     file_len     Q     total file length in bytes
    32      ...   metadata (msgpack map), zero padding, payloads

The metadata map holds ``format``, ``epoch``, ``step``, ``seed``, ``producer``,
``replaced`` (samples substituted because they could not be decoded), ``job`` and
``rank`` (the stream it belongs to: its manifest's ``job_key`` and ``rank``) and
``tensors``: name -> {dtype, shape, offset, length}.  Every batch carries
``images`` (uint8, N x H x W x C), ``labels`` and ``indices`` (int64, N).

SPEC.md beside this file is the normative text; tests keep the two equal.
``writer.py`` writes batch files (begin, fill slots, commit or abort); this
module plans their layout and reads them.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from prefetchd.buffer_protocol.errors import MAX_INT, ProtocolError, user_name
from prefetchd.buffer_protocol.layout import check_owned

MAGIC = b"PFDBATCH"
VERSION = 1
HEADER_FORMAT = "<8sHHIQQ"
HEADER = struct.Struct(HEADER_FORMAT)
HEADER_SIZE = HEADER.size  # 32 bytes
PAGE_SIZE = 4096
BATCH_FORMAT = "prefetchd.batch"

MAX_META_LEN = 1 << 20
MAX_TENSORS = 16
MAX_DIMS = 8
MAX_FILE_LEN = 1 << 40

DTYPES: Mapping[str, np.dtype[Any]] = {
    "uint8": np.dtype("<u1"),
    "int64": np.dtype("<i8"),
    "float32": np.dtype("<f4"),
}
REQUIRED_TENSORS = {"images": "uint8", "labels": "int64", "indices": "int64"}


def align(n: int, to: int = PAGE_SIZE) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class TensorSpec:
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def length(self) -> int:
        return prod(self.shape) * DTYPES[self.dtype].itemsize

    def as_meta(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "offset": self.offset, "length": self.length}


@dataclass(frozen=True)
class BatchLayout:
    """Where everything goes in one batch file, fixed before any pixel is written."""

    header_len: int
    tensors: Mapping[str, TensorSpec]
    file_len: int

    @classmethod
    def plan(cls, n: int, height: int, width: int, channels: int = 3) -> BatchLayout:
        # One page holds header and metadata: the map has a fixed set of small
        # fields (its size is checked when encoded), and a page keeps payloads aligned.
        header_len = PAGE_SIZE
        specs: dict[str, TensorSpec] = {}
        offset = header_len
        for name, dtype, shape in (
            ("images", "uint8", (n, height, width, channels)),
            ("labels", "int64", (n,)),
            ("indices", "int64", (n,)),
        ):
            spec = TensorSpec(dtype, shape, offset)
            specs[name] = spec
            offset = align(offset + spec.length)
        return cls(header_len, specs, offset)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one image in the images payload (H x W x C)."""
        images = self.tensors["images"]
        return prod(images.shape[1:])

    def slot_offset(self, slot: int) -> int:
        return self.tensors["images"].offset + slot * self.slot_bytes

    def encode_header(
        self, *, epoch: int, step: int, seed: int, producer: str, replaced: int = 0,
        job: str | None = None, rank: int | None = None,
    ) -> bytes:
        """Header, metadata and padding: exactly ``header_len`` bytes.  ``job`` and ``rank``: the stream's (its
        manifest's ``job_key`` and ``rank``), which the daemon always gives; left out where None, as a daemon
        before them wrote its batches (tests and tools write such batches too)."""
        fields: dict[str, Any] = {
            "format": BATCH_FORMAT,
            "epoch": epoch,
            "step": step,
            "seed": seed,
            "producer": producer,
            "replaced": replaced,
        }
        if job is not None:
            fields["job"] = job
        if rank is not None:
            fields["rank"] = rank
        fields["tensors"] = {name: spec.as_meta() for name, spec in self.tensors.items()}
        meta: bytes = msgpack.packb(fields, use_bin_type=True)
        if HEADER_SIZE + len(meta) > self.header_len:
            raise ProtocolError(
                f"batch metadata is {len(meta)} bytes, more than the {self.header_len - HEADER_SIZE} "
                "reserved for it; this is a bug in prefetchd, please report it"
            )
        head = HEADER.pack(MAGIC, VERSION, 0, len(meta), self.header_len, self.file_len)
        return (head + meta).ljust(self.header_len, b"\0")


@dataclass(frozen=True)
class BatchMeta:
    epoch: int
    step: int
    seed: int
    producer: str
    replaced: int
    tensors: Mapping[str, TensorSpec]
    # The stream the daemon wrote it for: its manifest's job_key and rank.  None in a batch of a daemon before
    # them (a reader requires them where the manifest says ``keyed_batches``: ``not_of_stream``).
    job: str | None = None
    rank: int | None = None

    @property
    def size(self) -> int:
        return self.tensors["images"].shape[0]

    @property
    def stream(self) -> str:
        """The stream it names, for messages: "rank 1 of job 7ce11fc278a4f287"."""
        return f"rank {self.rank} of job {self.job}"


def not_of_stream(meta: BatchMeta, job: str, rank: int, *, keyed: bool) -> bool:
    """Whether ``meta`` is not a batch of the stream of job key ``job`` and rank ``rank`` (SPEC "What readers
    check"): it names another job or rank, or, where ``keyed`` (its manifest says the daemon writes them:
    ``Manifest.keyed_batches``), none.  A batch is a pure function of its job and position, not of its file:
    a member of a --group-access buffer's group may rename another rank's batch of the same position, or one
    kept from an earlier job of the same seed and sizes, to its name, and only these fields tell them apart."""
    if meta.job is None and meta.rank is None:
        return keyed
    return (meta.job, meta.rank) != (job, rank)


def _fail(name: str, what: str) -> ProtocolError:
    return ProtocolError(
        f"{name}: {what}. The file is damaged or was not written by prefetchd; "
        "delete it (the daemon regenerates missing batches) or clear the buffer."
    )


def _int(meta: Mapping[str, Any], key: str, name: str, lo: int = 0, hi: int = MAX_INT) -> int:
    value = meta.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise _fail(name, f"metadata field {key!r} is {value!r}, expected an integer in [{lo}, {hi}]")
    return value


def _tensor(raw: Any, tname: str, name: str, header_len: int, file_len: int) -> TensorSpec:
    if not isinstance(raw, dict):
        raise _fail(name, f"tensor {tname!r} is described by {type(raw).__name__}, expected a map")
    dtype = raw.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _fail(name, f"tensor {tname!r} has dtype {dtype!r}, expected one of {sorted(DTYPES)}")
    shape = raw.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(type(d) is int and 0 <= d <= MAX_FILE_LEN for d in shape)
    ):
        raise _fail(name, f"tensor {tname!r} has shape {shape!r}, expected up to {MAX_DIMS} sizes")
    if prod(max(d, 1) for d in shape) > MAX_FILE_LEN:  # also for empty tensors: numpy refuses such shapes
        raise _fail(name, f"tensor {tname!r} has shape {shape!r}, larger than any batch file")
    offset = _int(raw, "offset", name, header_len, file_len)
    length = _int(raw, "length", name, 0, file_len)
    spec = TensorSpec(str(dtype), tuple(shape), offset)
    if spec.length != length:
        raise _fail(name, f"tensor {tname!r} claims {length} bytes but shape {shape} of {dtype} is {spec.length}")
    if offset % PAGE_SIZE:
        raise _fail(name, f"tensor {tname!r} starts at {offset}, not a multiple of the page size {PAGE_SIZE}")
    if offset + length > file_len:
        raise _fail(name, f"tensor {tname!r} ends at byte {offset + length}, past the end of the file ({file_len})")
    return spec


def parse_batch(buf: bytes | memoryview | mmap.mmap, name: str = "<batch>") -> BatchMeta:
    """Validate a whole batch file held in ``buf`` and return its metadata.

    Everything is checked against the buffer's real length, so no header value
    can make a reader look (or allocate) past what is there.
    """
    size = len(buf)
    if size < HEADER_SIZE:
        raise _fail(name, f"file is {size} bytes, shorter than the {HEADER_SIZE}-byte header")
    magic, version, flags, meta_len, header_len, file_len = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise _fail(name, f"magic is {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ProtocolError(
            f"{name}: written with buffer protocol version {version}, this prefetchd speaks version "
            f"{VERSION}; run prefetchd versions of one buffer protocol for daemon and trainer (`prefetchd --version` "
            "says which), or clear the buffer "
            "and restart the daemon"
        )
    if flags != 0:
        raise _fail(name, f"header flags are {flags:#x}; version {VERSION} defines none, so they must be 0")
    if file_len != size:
        raise _fail(name, f"header says the file is {file_len} bytes but it is {size}")
    if meta_len > MAX_META_LEN or HEADER_SIZE + meta_len > header_len or header_len > size:
        raise _fail(name, f"metadata length {meta_len} / header length {header_len} do not fit a {size}-byte file")
    if header_len % PAGE_SIZE:
        raise _fail(name, f"header length {header_len} is not a multiple of the page size {PAGE_SIZE}")
    try:
        meta = msgpack.unpackb(
            bytes(buf[HEADER_SIZE : HEADER_SIZE + meta_len]),
            raw=False,
            strict_map_key=True,
            max_bin_len=MAX_META_LEN,
            max_str_len=4096,
            max_array_len=MAX_DIMS,
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise _fail(name, f"metadata is not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != BATCH_FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise _fail(name, f"metadata format is {got!r}, expected {BATCH_FORMAT!r}")
    raw_tensors = meta.get("tensors")
    if not isinstance(raw_tensors, dict) or len(raw_tensors) > MAX_TENSORS:
        raise _fail(name, "metadata field 'tensors' is missing or not a map of at most 16 tensors")
    tensors = {str(t): _tensor(raw, str(t), name, header_len, size) for t, raw in raw_tensors.items()}
    for tname, dtype in REQUIRED_TENSORS.items():
        if tname not in tensors or tensors[tname].dtype != dtype:
            raise _fail(name, f"tensor {tname!r} of dtype {dtype} is missing")
    n = tensors["images"].shape[0] if tensors["images"].shape else -1
    if len(tensors["images"].shape) != 4 or any(tensors[t].shape != (n,) for t in ("labels", "indices")):
        raise _fail(name, "images must be N x H x W x C and labels, indices of length N")
    spans = sorted((s.offset, s.offset + s.length) for s in tensors.values())
    if any(end > nxt for (_, end), (nxt, _) in zip(spans, spans[1:])):
        raise _fail(name, "tensor payloads overlap")
    producer = meta.get("producer")
    if not isinstance(producer, str):
        raise _fail(name, f"metadata field 'producer' is {producer!r}, expected a string")
    job = meta.get("job")
    if "job" in meta and not isinstance(job, str):
        raise _fail(name, f"metadata field 'job' is {job!r}, expected a string")
    return BatchMeta(
        epoch=_int(meta, "epoch", name),
        step=_int(meta, "step", name),
        seed=_int(meta, "seed", name),
        producer=producer,
        replaced=_int(meta, "replaced", name),
        tensors=tensors,
        job=job,
        rank=_int(meta, "rank", name) if "rank" in meta else None,
    )


@dataclass(frozen=True)
class MappedBatch:
    """A validated batch file mapped into memory; arrays are views, not copies."""

    path: Path
    meta: BatchMeta
    images: np.ndarray
    labels: np.ndarray
    indices: np.ndarray


def _view(buf: mmap.mmap, spec: TensorSpec) -> np.ndarray:
    return np.frombuffer(buf, dtype=DTYPES[spec.dtype], count=prod(spec.shape), offset=spec.offset).reshape(
        spec.shape
    )


def map_batch(path: str | os.PathLike[str], dir_fd: int | None = None) -> MappedBatch:
    """Map a finished batch file and return validated zero-copy views of it.

    The file is opened read-only and mapped privately (copy-on-write): the
    shared file can never change through the mapping, and a consumer that
    modifies the arrays in place gets private pages instead of a crash.
    ``dir_fd``: the fd of the folder that holds it, through which its name is
    looked up (``layout.at``: no link put in the folder's place is followed);
    ``path`` is then what errors show.
    """
    try:
        # O_NONBLOCK: a FIFO named like a batch must not block the open; fstat refuses it below.
        # Before any Path is made: a loader polls for a batch not there yet with this call.
        fd = os.open(os.path.basename(path) if dir_fd is not None else path,
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        fix = ("a symbolic link, not a batch: remove it from the buffer" if exc.errno == errno.ELOOP
               else "check the buffer's permissions")
        raise ProtocolError(f"{path}: cannot open batch file ({exc.strerror}); {fix}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):  # map_batch(buffer): "remove it from the buffer" told to remove the buffer
            raise ProtocolError(f"{path}: a folder, not a batch file; pass one of its batches "
                                "(buffer_protocol.list_batches names them)")
        if not stat.S_ISREG(st.st_mode):
            raise ProtocolError(f"{path}: not a regular file; remove it from the buffer")
        # Only the daemon writes batches, as the owner of the buffer's folders: a member of a --group-access
        # buffer's group may rename a file of their own in under a batch's name, for the other members' trainers.
        # A reader by path checks it against the owner of the buffer (layout.check_owned), not of the folder it is
        # in: a member may rename a whole rank-NNNNN folder of theirs in.  One through ``dir_fd`` checked that folder
        # when it opened it (the daemon, which made it; a loader, against the buffer's owner).
        if dir_fd is None:
            check_owned(os.path.abspath(path), st.st_uid, "batches")
        elif st.st_uid != (owner := os.fstat(dir_fd).st_uid):
            raise ProtocolError(f"{path}: belongs to {user_name(st.st_uid)}, not to {user_name(owner)} who owns its "
                                f"folder {os.path.dirname(path)} and writes its batches: someone else (a member of the "
                                "buffer's group?) put it there; remove it")
        if st.st_size < HEADER_SIZE:
            raise _fail(str(path), f"file is {st.st_size} bytes, shorter than the {HEADER_SIZE}-byte header")
        buf = mmap.mmap(fd, st.st_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    where = Path(path)
    meta = parse_batch(buf, str(where))
    return MappedBatch(
        path=where,
        meta=meta,
        images=_view(buf, meta.tensors["images"]),
        labels=_view(buf, meta.tensors["labels"]),
        indices=_view(buf, meta.tensors["indices"]),
    )


def temp_name(final: Path) -> Path:
    """The name a batch is built under before it is published as ``final``."""
    return final.with_suffix(".tmp")
