"""Packed shards: a dataset as POSIX tar files plus an index of member offsets.

    OUT/shard-000000.tar        000000000.jpg 000000000.cls 000000001.png 000000001.cls ...
    OUT/shard-000001.tar        (WebDataset's convention: members <key>.<ext>, the label as text in <key>.cls)
    OUT/prefetchd-index.npz     format, version, classes, fingerprint, shards, stamp, and per sample:
                                shard (int32), offset and size of its image member's data (int64), label (int64),
                                source_index (int64), and the file it was packed from (source_root, and
                                source_path_blob and source_path_offsets as SampleIndex keeps paths)

Any tar reader (``tar tf``, Python's tarfile, WebDataset) reads the shards; the
daemon reads sample ``i`` with one positioned read of ``size[i]`` bytes at
``offset[i]`` of its shard, and the 512-byte USTAR header before them:

    bytes 0-99     name      <key>.<ext>, the key sample i's (KEY)
    bytes 124-135  size      octal, size[i]
    bytes 265-296  uname     the pack's stamp (STAMP_FIELD), 31 characters and a NUL

The stamp is a hash of what decides which sample lands where and with which
label (format, version, the shuffle seed, the shard size, and the source index:
classes, each sample's file relative to the root, its byte range, its label),
known before the first byte is written.  Two packs of the same data with the same
options are the same bytes, wherever the source was read from (a local folder or
a bucket); a pack made otherwise (shuffled or not, another seed, files added,
removed, renamed or relabelled) names another pack in every header, even where
member ``i`` has the same name and size.  Indexes written before the stamp (no
``stamp`` array) are read without it.  The index is written last, through a temporary
name, so a folder whose pack was interrupted has no index and is not taken
for a dataset.  Sample ``i`` of the shards is sample ``i`` of the source
unless the pack was shuffled (then ``source_index[i]`` says which sample of the
data first packed it was, through packs of packs: what --val-fraction splits on).
Its file there is recorded too, so that a sample that does not decode is shown with
the file to mend (``read_packed_from``: read only then, neither at start nor by the daemon's
workers); indexes written before that (no ``source_root``) are read without it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import logging
import os
import re
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from prefetchd.access import no_access
from prefetchd.buffer_protocol.ownership import lock_file_held
from prefetchd.daemon.dataset import IMG_EXTENSIONS, PackedFrom, SampleIndex, pack_paths, sized
from prefetchd.daemon.errors import DatasetError
from prefetchd.daemon.sources.npz import load_arrays
from prefetchd.daemon.sources.storage import (URL_READERS, ImageRefused, ShortRead, Storage, StorageDenied,
                                              StorageUnavailable, is_url, open_ranged, storage_for)
from prefetchd.locations import inside
from prefetchd.words import counted

log = logging.getLogger(__name__)

INDEX_NAME = "prefetchd-index.npz"
FORMAT = "prefetchd-shards"
VERSION = 1
SHARD_NAME = "shard-{:06d}.tar"
KEY = "{:09d}"
BLOCK = tarfile.BLOCKSIZE  # 512: tar pads every member's data to whole blocks
STAMP_FIELD = slice(265, 297)  # USTAR's uname: 32 bytes, the stamp's 31 characters and a NUL
STAMP_PREFIX = "pack-"  # what `tar tvf` shows as the owner: "pack-<26 hex digits>"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """``1GB`` (10^9), ``500MB``, ``1GiB`` (2^30), ``4096`` (bytes) -> bytes."""
    m = _SIZE.match(text)
    unit = (m.group(2) or "").lower() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write a number with a unit such as 1GB, 500MB or 1GiB")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"{text!r} is less than one byte; shards need a positive size such as 1GB")
    return size


# -- reading ----------------------------------------------------------------------


class ShardChanged(OSError):
    """A shard is gone, cut short, or holds other members than the index says: the pack changed after
    the daemon read its index (packed again with --force, a shard removed).  Not one sample's fault,
    so not replaced: every neighbour is in the same shard, and one that still decodes would be
    another sample's image under this one's label."""


def pack_stamp(index: SampleIndex, shuffle_seed: int | None, shard_size: int) -> str:
    """The pack's name in every member's header: a function of what decides the layout, so the same
    pack twice is the same bytes, and a shuffled or unshuffled pack, or one of changed data, differs.

    Not the source's fingerprint: that covers where the files are and their mtimes, so the same
    images read from a bucket would pack to other bytes than a local copy of them.  A file rewritten
    in place under its name keeps the stamp: its member is still that file, under that file's label."""
    digest = hashlib.sha256(f"{FORMAT}:{VERSION}:{shuffle_seed}:{shard_size}\0".encode())
    digest.update(b"".join(os.fsencode(c) + b"\0" for c in index.classes))
    for array, dtype in ((index.path_offsets, "<i8"), (index.path_blob, "u1"), (index.labels, "<i8"),
                         (index.member_files, "<i4"), (index.member_offsets, "<i8"), (index.member_sizes, "<i8"),
                         (index.source_index, "<i8")):
        if array is not None:
            digest.update(np.ascontiguousarray(array, dtype=dtype).tobytes())
    return STAMP_PREFIX + digest.hexdigest()[:STAMP_FIELD.stop - STAMP_FIELD.start - 1 - len(STAMP_PREFIX)]


def read_member(storage: Storage, index: SampleIndex, i: int) -> bytearray:
    """Sample ``i``'s bytes, with the tar header before them: the header must name sample ``i``'s
    member and size, and the indexed pack's stamp where the index has one, or the shard is not the one
    indexed (``ShardChanged``).  One read of 512 more bytes; the header then costs nothing to check."""
    rel, offset, size = index.location(i)
    assert size is not None, "read_member reads packed samples"
    try:
        data = storage.read(rel, offset - BLOCK, size + BLOCK)
    except FileNotFoundError:
        raise ShardChanged(_changed(index, rel, "it is gone")) from None
    except ShortRead as exc:
        raise ShardChanged(_changed(index, rel, f"it is {exc.file_size} bytes, but the index puts sample {i} "
                                                f"({KEY.format(i)}.*, {size} bytes) at bytes {offset}-{offset + size}")
                           ) from None
    header = bytes(data[:BLOCK])
    name = header[:100].split(b"\0", 1)[0]
    try:
        stored = int(header[124:136].strip(b"\0 ") or b"-1", 8)
    except ValueError:
        stored = -1
    if not name.startswith(KEY.format(i).encode() + b".") or stored != size:
        found = (f"member {name.decode()!r} of {stored} bytes" if name.isascii() and name.decode().isprintable()
                 and stored >= 0 else "no member")
        raise ShardChanged(_changed(index, rel, f"{found} starts at byte {offset}, not sample {i}'s "
                                                f"({KEY.format(i)}.*, {size} bytes)"))
    stamp = header[STAMP_FIELD].split(b"\0", 1)[0]
    if index.member_stamp is not None and stamp != index.member_stamp.encode():
        other = (f"pack {stamp.decode()!r}" if stamp.isascii() and stamp.decode().isprintable() and stamp
                 else "a pack without a stamp")
        raise ShardChanged(_changed(index, rel, f"member {name.decode()!r} at byte {offset} is from {other}, not "
                                                f"from pack {index.member_stamp!r} whose index this daemon read, so "
                                                f"it may not be sample {i}'s image"))
    del data[:BLOCK]  # a bytearray drops its head without copying the rest
    return data


def _changed(index: SampleIndex, rel: str, what: str) -> str:
    return (f"{index.root.rstrip('/')}/{rel}: {what}. The shards changed after this daemon read their index "
            "(packed again, or a shard removed or cut short?): restore them, or restart the daemon on the new "
            "pack (with --reset: its batches were built from the old one); if the folder was never one pack's "
            "(shards copied in from another), pack the dataset again into it (prefetchd pack --force)")


def pack_again(root: str) -> str:
    """What to do to write the pack at ``root`` again.  Its index records no source to put in the command
    (class folders or a file list: only the folder of their files, where it records any), so the command
    says in words what goes first.  A pack in object storage was packed locally and uploaded: pack writes
    only to a local folder."""
    made = "pack it again from the class folders or file list it was made from"
    if is_url(root):
        return (f"{made}, into a local folder (`prefetchd pack <that folder or list> <local folder> --force`), "
                f"and upload that folder to {root.rstrip('/')}")
    return f"{made}: `prefetchd pack <that folder or list> {root.rstrip('/')} --force`"


def check_shards(index: SampleIndex, shards: list[str], where: str) -> None:
    """Refuse a pack whose shards are missing or shorter than the members the index puts in them."""
    assert index.member_files is not None and index.member_offsets is not None and index.member_sizes is not None
    ends = np.zeros(len(shards), dtype=np.int64)
    np.maximum.at(ends, index.member_files, index.member_offsets + index.member_sizes)
    found = storage_for(index.root).sizes(shards)
    for shard, end in zip(shards, ends.tolist()):
        if shard not in found:
            raise DatasetError(f"shard {index.root.rstrip('/')}/{shard}, named by {where}, is missing; restore it, "
                               f"or {pack_again(index.root)}")
        if found[shard] < end:
            raise DatasetError(f"shard {index.root.rstrip('/')}/{shard} is {found[shard]} bytes, but {where} has "
                               f"members up to byte {end}: it was cut short or replaced; restore it, or "
                               f"{pack_again(index.root)}")


def has_shard_index(location: str) -> bool:
    """Whether ``location`` is a folder with a shard index, asked through its storage."""
    try:
        storage_for(location).read(INDEX_NAME, 0, 1)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except (StorageDenied, StorageUnavailable):  # the store, not the index: the caller says what to fix
        raise
    except PermissionError:
        # A folder the daemon may not enter: whether an index is there cannot be told, and "cannot read shard
        # index" misled about class folders.  Indexing them says the folder is not readable, as it would a pack.
        return is_url(location) or os.access(location, os.X_OK)
    except OSError:  # the index exists but reading it fails: read_shard_index says why
        return True
    return True


# What the daemon reads of a pack's index at start: all but the files it was packed from (``_PACKED_FROM``, read
# at the first failure shown), whose bytes are not read.  They are half the index: at ImageNet's 1.28 M samples
# reading and dropping them made a start 0.2-0.4 s and 199 MiB of peak memory, rather than 0.08 s and 58 MiB
# (a 104 MB index, warm page cache; the 44 MiB index held included).
_HELD = ("format", "version", "classes", "fingerprint", "shards", "stamp", "shard", "offset", "size", "label",
         "source_index")
_PACKED_FROM = ("stamp", "label", "source_root", "source_path_blob", "source_path_offsets")


def _index_arrays(root: str, names: tuple[str, ...]) -> tuple[dict[str, np.ndarray], str]:
    """The arrays ``names`` of the shard index of the pack at ``root`` (a resolved folder or a URL), those
    it holds, and its path.  Ranged reads of the parts that hold them: the others are not read."""
    where = f"{root.rstrip('/')}/{INDEX_NAME}"
    try:
        with open_ranged(storage_for(root), INDEX_NAME) as file:
            return load_arrays(file, names), where
    except OSError as exc:
        raise DatasetError(f"cannot read shard index {where}: {exc.strerror or exc}") from None
    except ValueError as exc:  # load_arrays says what is wrong with the file, zip and npy errors included
        raise DatasetError(f"shard index {where} is damaged ({exc}); {pack_again(root)}") from None


def read_shard_index(location: str) -> SampleIndex:
    """The index of a packed dataset, checked before it is trusted.  Without the files it was packed
    from, whose bytes are not read: ``read_packed_from`` reads those when they are wanted."""
    root = location if is_url(location) else str(Path(location).resolve())
    arrays, where = _index_arrays(root, _HELD)
    fmt = str(arrays.get("format", ""))
    version = int(arrays["version"]) if "version" in arrays else None
    if fmt != FORMAT or version != VERSION:
        raise DatasetError(f"{where} is format {fmt!r} version {version}, but this prefetchd reads {FORMAT!r} "
                           f"version {VERSION}; pack the dataset again with this version or upgrade prefetchd")
    try:
        shards = [str(s) for s in arrays["shards"]]
        classes = tuple(str(c) for c in arrays["classes"])
        shard = arrays["shard"].astype(np.int32, copy=False)
        offset = arrays["offset"].astype(np.int64, copy=False)
        size = arrays["size"].astype(np.int64, copy=False)
        label = arrays["label"].astype(np.int64, copy=False)
        fingerprint = str(arrays["fingerprint"])
        stamp = str(arrays["stamp"]) if "stamp" in arrays else None  # packs before the stamp: not checked
        source = arrays["source_index"].astype(np.int64, copy=False) if "source_index" in arrays else None
    except KeyError as exc:
        raise DatasetError(f"shard index {where} lacks {exc}; pack the dataset again") from None
    n = len(label)
    if not (len(shard) == len(offset) == len(size) == n) or n == 0:
        raise DatasetError(f"shard index {where}: per-sample arrays disagree in length or are empty; pack again")
    if shard.min() < 0 or shard.max() >= len(shards) or label.min() < 0 or label.max() >= len(classes) \
            or offset.min() < 0 or size.min() < 0:
        raise DatasetError(f"shard index {where}: a shard number, label, offset or size is out of range; pack again")
    if source is not None and (len(source) != n or source.min() < 0 or source.max() >= n
                               or np.bincount(source, minlength=n).max() != 1):
        raise DatasetError(f"shard index {where}: source_index is not an order of its {n} samples; pack again")
    if source is not None and np.array_equal(source, np.arange(n)):
        source = None  # an unshuffled pack: sample i is the source's, and the daemon keeps no array for it
    if stamp is not None and not (stamp.isascii() and stamp.isprintable()
                                  and 0 < len(stamp) < STAMP_FIELD.stop - STAMP_FIELD.start):
        raise DatasetError(f"shard index {where}: its stamp {stamp!r} is not one pack writes; pack again")
    blob, offsets = pack_paths([os.fsencode(s) for s in shards])
    index = SampleIndex(
        root=root, classes=classes, path_blob=blob,
        path_offsets=offsets, labels=label, fingerprint=fingerprint,
        member_files=shard, member_offsets=offset, member_sizes=size, member_stamp=stamp, source_index=source,
    )
    check_shards(index, shards, where)
    log.info("indexed shards %s: %s, %s (%.0f bytes of index per sample)",
             root, sized(n, len(classes)), counted(len(shards), "shard"), index.nbytes / n)
    return index


def read_packed_from(index: SampleIndex) -> PackedFrom | None:
    """The files the samples of pack ``index`` were packed from, read again from its index; None where
    it recorded none (packed before packs recorded them, or from a pack that recorded none).  A
    ``DatasetError`` where the index cannot be read, or is no longer the one ``index`` was read from."""
    arrays, where = _index_arrays(index.root, _PACKED_FROM)
    if "source_root" not in arrays:
        return None
    stamp = str(arrays["stamp"]) if "stamp" in arrays else None
    if len(arrays.get("label", ())) != len(index) or stamp != index.member_stamp:
        raise DatasetError(f"{where} is no longer the index of the pack read before (packed again?)")
    try:
        packed_from = PackedFrom(str(arrays["source_root"]), arrays["source_path_blob"].astype(np.uint8, copy=False),
                                 arrays["source_path_offsets"].astype(np.int64, copy=False))
    except KeyError as exc:
        raise DatasetError(f"shard index {where} lacks {exc}; pack the dataset again") from None
    offsets = packed_from.path_offsets
    if (len(offsets) != len(index) + 1 or offsets[0] != 0 or (np.diff(offsets) < 0).any()
            or offsets[-1] != len(packed_from.path_blob)):
        raise DatasetError(f"shard index {where}: source_path_offsets do not delimit a source path for each of its "
                           f"{len(index)} samples; pack again")
    return packed_from


# -- writing ----------------------------------------------------------------------


def _member(name: str, size: int, stamp: str) -> tarfile.TarInfo:
    # Fixed owner, mode and time: packing the same data twice gives the same bytes.  The owner's name
    # is the pack's stamp (uid 0 stays: tar extracting as root maps an unknown name to the uid).
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.uname = size, 0o644, 0, stamp
    return info


_MAGIC = ((b"\xff\xd8\xff", "jpg"), (b"\x89PNG", "png"), (b"BM", "bmp"), (b"II*\0", "tif"), (b"MM\0*", "tif"),
          (b"P5", "pgm"), (b"P6", "ppm"))


def _extension(index: SampleIndex, i: int, data: bytes) -> str:
    """The member's extension: the source file's, or for a sample that was itself packed, its format's."""
    if index.member_files is None:
        ext = os.path.splitext(index.file(i))[1].lower().lstrip(".")
        return ext if ext and ext.isalnum() else "img"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return next((ext for magic, ext in _MAGIC if data.startswith(magic)), "img")


class ShardWriter:
    """Appends samples to numbered tar shards, starting a new one past ``shard_size`` bytes."""

    def __init__(self, out: Path, shard_size: int, stamp: str) -> None:
        self.out, self.shard_size, self.stamp = out, shard_size, stamp
        self.shards: list[str] = []
        self.tar: tarfile.TarFile | None = None

    def add(self, key: str, ext: str, data: bytes, label: int) -> tuple[int, int]:
        """Write one sample; (shard number, offset of its image data in that shard)."""
        cls = str(label).encode()
        # Two headers, both members' padded data, and the end-of-archive blocks padded to a record:
        # a shard never grows past shard_size unless one sample alone is bigger.
        need = 4 * BLOCK + -(-len(data) // BLOCK) * BLOCK + 2 * BLOCK + tarfile.RECORDSIZE
        if self.tar is None or (self.tar.offset > 0 and self.tar.offset + need > self.shard_size):
            self._next_shard()
        assert self.tar is not None
        self.tar.addfile(_member(f"{key}.{ext}", len(data), self.stamp), io.BytesIO(data))
        # After addfile the position is past the data and its padding to whole blocks.
        offset = self.tar.offset - -(-len(data) // BLOCK) * BLOCK
        self.tar.addfile(_member(f"{key}.cls", len(cls), self.stamp), io.BytesIO(cls))
        return len(self.shards) - 1, offset

    def _next_shard(self) -> None:
        self.close()
        name = SHARD_NAME.format(len(self.shards))
        self.shards.append(name)
        self.tar = tarfile.open(self.out / name, "w", format=tarfile.USTAR_FORMAT)

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()
            self.tar = None


def _source_paths(index: SampleIndex, order: np.ndarray) -> dict[str, np.ndarray]:
    """The index arrays naming the file each sample of a pack of ``index`` (in ``order``) was packed from,
    so that the daemon can show it beside a sample that does not decode: ``index``'s own files, or those
    a pack being packed again recorded (none where it recorded none)."""
    packed_from = PackedFrom(index.root, index.path_blob, index.path_offsets) if index.member_files is None \
        else read_packed_from(index)  # unpacked: sample i is file i
    if packed_from is None:
        return {}
    blob, offsets = packed_from.path_blob, packed_from.path_offsets
    packed_blob, packed_offsets = pack_paths([blob[offsets[i]:offsets[i + 1]].tobytes() for i in order.tolist()])
    return {"source_root": np.array(packed_from.root), "source_path_blob": packed_blob,
            "source_path_offsets": packed_offsets}


def check_pack_target(source_dir: str | Path | None, out: Path, force: bool, held: bool = False) -> None:
    """Refuse, before anything is read or written, an ``out`` that ``pack`` cannot use: a file, a
    folder holding folders, a folder holding something (without ``force``), or, where the dataset being packed is a local
    folder (class folders, shards; ``source_dir`` is its location, or None), that folder or one
    inside it.  Packed there, the shards would become a class folder without images, or the index
    would turn the source into a shard folder.  And a folder another pack is writing into, unless ``held``: the
    pack checking is the one that holds it (``_packing``)."""
    out = Path(out)
    # Before the source's index (minutes), after which it was said (a walk); and before anything stats ``out``,
    # which raises PermissionError under a folder this user may not enter.
    with contextlib.suppress(PermissionError):  # under a folder this user may not enter: no_access says so next
        if out.exists() and not out.is_dir():  # first: a file's access was said as a folder's ("may not write")
            raise DatasetError(f"{out} is a file; pass a folder (new or empty) to pack into")
    denied = no_access(out, write=True)
    if denied is not None:
        raise DatasetError(f"cannot pack into {out}: {denied}")
    if source_dir is not None and Path(source_dir).is_dir():
        source, target = Path(source_dir).resolve(), out.resolve()
        if inside(str(target), str(source)):
            raise DatasetError(f"{out} is inside the dataset being packed ({source}); pack into a folder "
                               "outside it")
    classes = _image_folders(out)
    if classes:
        # A file list's images are often in class folders beside it: packed there, the index would make `--data OUT`
        # read the pack, not those folders (with --force: it did, silently).
        raise DatasetError(f"{out} holds folders of images ({', '.join(classes[:3])}{', ...' if len(classes) > 3 else ''}); "
                           f"packed there, its {INDEX_NAME} would make `--data {out}` read the pack instead of them; "
                           "pack into a new folder")
    if not held and out.is_dir() and _packing_into(out):
        # Both went on with --force and left shards of two packs under one index, or one's cleanup deleted the
        # other's shards (a walk); without it the second called the first's shards "a pack that was killed".
        raise DatasetError(_another_pack(out))
    if out.is_dir() and any(out.iterdir()) and not force:
        shards = sum(1 for _ in out.glob("shard-*.tar"))
        if shards and not (out / INDEX_NAME).exists():
            raise DatasetError(f"{out} holds an unfinished pack ({counted(shards, 'shard')} without {INDEX_NAME}: a "
                               "pack that was killed); pass --force to replace it")
        raise DatasetError(f"{out} is not empty; pack into a new folder, or pass --force to replace "
                           "the shards and index in it")


def _image_folders(out: Path) -> list[str]:
    """The folders in ``out`` that hold an image somewhere below them (class folders), by name.  Not any folder: a
    filesystem's lost+found, a notebook's .ipynb_checkpoints, were refused as if they were classes (a walk)."""
    if not out.is_dir():
        return []
    found = []
    for entry in sorted(os.scandir(out), key=lambda e: e.name):
        if entry.is_dir() and any(name.lower().endswith(IMG_EXTENSIONS) for _, _, names in os.walk(entry.path)
                                  for name in names):
            found.append(entry.name)
    return found


def pack(index: SampleIndex, out: Path, shard_size: int, shuffle_seed: int | None = None, force: bool = False,
         progress: Callable[[Iterator[int]], Iterator[int]] = lambda it: it) -> dict[str, Any]:
    """Write ``index``'s samples into shards under ``out``; returns a summary.

    A sample that cannot be read is packed as an empty member, so indices stay
    aligned with the source and the daemon replaces it as it does any bad file.  A pack that
    cannot be written (a full disk, a read-only folder) is a DatasetError saying where and why, and
    one that fails or is interrupted (Ctrl-C) leaves none of its shards: an unfinished pack was a
    traceback, shards without an index, and "not empty" at the next try (a user's walk).
    """
    out = Path(out)
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DatasetError(f"cannot write the pack in {out}: {exc.strerror or exc}; {_pack_remedy(exc)}") from None
    try:
        with _packing(out):
            return _pack_into(index, out, shard_size, shuffle_seed, force, progress, made)
    except DatasetError:
        if made:  # refused: what it made goes, if nothing else came into it
            with contextlib.suppress(OSError):
                out.rmdir()
        raise


def _packing_into(out: Path) -> bool:
    """Whether a `prefetchd pack` holds ``out`` (``_packing``: an flock on the folder, which a daemon.lock's look
    tells as well)."""
    return lock_file_held(out.resolve())


@contextlib.contextmanager
def _packing(out: Path) -> Iterator[None]:
    """Hold ``out`` (an flock on the folder itself: nothing is added to the pack) while a pack writes into it; a
    second pack there is refused."""
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DatasetError(_another_pack(out)) from None
        yield
    finally:
        os.close(fd)


def _another_pack(out: Path) -> str:
    return f"another `prefetchd pack` is writing into {out}; wait for it to finish, or pack into another folder"


def _pack_into(index: SampleIndex, out: Path, shard_size: int, shuffle_seed: int | None, force: bool,
               progress: Callable[[Iterator[int]], Iterator[int]], made: bool) -> dict[str, Any]:
    """``pack`` once it holds ``out`` (which it ``made``, or not)."""
    # The command checked ``out`` against its source before indexing it; the hold is this pack's own.
    check_pack_target(None, out, force, held=True)
    if out.is_dir() and any(out.iterdir()):
        # The old index goes first: an interrupted repack must not look complete.
        (out / INDEX_NAME).unlink(missing_ok=True)
        for old in out.glob("shard-*.tar"):
            old.unlink()
    writer = ShardWriter(out, shard_size, pack_stamp(index, shuffle_seed, shard_size))
    try:
        return _write_pack(index, writer, shuffle_seed, progress)
    except OSError as exc:
        _remove_unfinished(writer, made)
        raise DatasetError(f"cannot write the pack in {out}: {exc.strerror or exc}"
                           f"{f' ({exc.filename})' if exc.filename else ''}; {_pack_remedy(exc)}") from None
    except BaseException:
        _remove_unfinished(writer, made)
        raise


def _pack_remedy(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space there, or pack into another filesystem (a pack takes about as much room as the dataset)"
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "pack into a folder you can write"
    return "pack into another folder"


def _remove_unfinished(writer: ShardWriter, made: bool) -> None:
    """Remove what a pack that failed wrote: its shards, its index's temporary file, and ``writer.out`` if the
    pack made it."""
    with contextlib.suppress(OSError):
        writer.close()
    for name in [*writer.shards, f".{INDEX_NAME}.tmp"]:
        with contextlib.suppress(OSError):
            (writer.out / name).unlink(missing_ok=True)
    if made:
        with contextlib.suppress(OSError):
            writer.out.rmdir()  # only if empty


def _write_pack(index: SampleIndex, writer: ShardWriter, shuffle_seed: int | None,
                progress: Callable[[Iterator[int]], Iterator[int]]) -> dict[str, Any]:
    from prefetchd.daemon.sources import SampleReader  # the package imports this module

    out = writer.out
    n = len(index)
    order = (np.random.Generator(np.random.PCG64(shuffle_seed)).permutation(n) if shuffle_seed is not None
             else np.arange(n)).astype(np.int64)
    # From object storage, many small reads in flight (see docs/SOURCES.md); the order stays the pack's.
    reader = SampleReader(index, URL_READERS if is_url(index.root) else 1)  # as a worker reads
    shard = np.zeros(n, dtype=np.int32)
    offset = np.zeros(n, dtype=np.int64)
    size = np.zeros(n, dtype=np.int64)
    labels = index.labels[order].astype(np.int64)
    unreadable = 0
    try:
        reads = reader.read_ahead(int(src) for src in order)
        for i, read in zip(progress(iter(range(n))), reads):
            src = int(order[i])
            try:
                data = bytes(read.result())
            except (StorageDenied, StorageUnavailable) as exc:  # the store, not the sample: packing empty would lose it
                raise DatasetError(f"cannot pack {index.root}: {exc}") from None
            except ImageRefused as exc:  # a directory or FIFO listed as a sample: it names the file
                log.warning("%s; packed as an empty member, which the daemon replaces", exc)
                data, unreadable = b"", unreadable + 1
            except OSError as exc:
                log.warning("cannot read %s (%s); packed as an empty member, which the daemon replaces",
                            index.name(src), exc.strerror or exc)
                data, unreadable = b"", unreadable + 1
            shard[i], offset[i] = writer.add(KEY.format(i), _extension(index, src, data), data, int(labels[i]))
            size[i] = len(data)
    finally:
        reader.close()
    writer.close()  # not in the finally: a shard that cannot be closed (ENOSPC) is a failed pack, not a crash in one
    digest = hashlib.sha256(f"{FORMAT}:{VERSION}:{index.fingerprint}:{shuffle_seed}:{writer.shard_size}".encode())
    digest.update(shard.tobytes() + offset.tobytes() + size.tobytes() + labels.tobytes())
    arrays = dict(
        format=np.array(FORMAT), version=np.array(VERSION), classes=np.array(index.classes, dtype=str),
        shards=np.array(writer.shards, dtype=str), fingerprint=np.array(digest.hexdigest()[:32]),
        shard=shard, offset=offset, size=size, label=labels, stamp=np.array(writer.stamp),
        # Of the data first packed, through a pack being packed again: what --val-fraction splits on.
        source_index=order if index.source_index is None else index.source_index[order],
        **_source_paths(index, order),
    )
    tmp = out / f".{INDEX_NAME}.tmp"
    with open(tmp, "wb") as fh:
        np.savez(fh, **arrays)  # type: ignore[arg-type]
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out / INDEX_NAME)
    return {"samples": n, "shards": len(writer.shards), "unreadable": unreadable,
            "bytes": sum((out / s).stat().st_size for s in writer.shards)}
