"""The sample index of a class-folder dataset, kept in numpy arrays.

Sample ``i`` is ``torchvision.datasets.ImageFolder(root).samples[i]``: the same
class order, file order and extensions.  Paths live in one byte blob with an
offset array rather than a list of strings, so forked or spawned workers share
pages instead of copying them as Python refcounts change.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prefetchd.access import cannot_read
from prefetchd.buffer_protocol.layout import STATUS_NAME
from prefetchd.daemon.errors import ConfigError, DatasetError
from prefetchd.words import agreeing, counted

log = logging.getLogger(__name__)

# torchvision.datasets.folder.IMG_EXTENSIONS: the same list, so indices agree.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# The seed of --val-fraction's split is fixed and separate from --seed, so
# changing the training seed can never move samples between train and val.
SPLIT_SEED = 0x5EED_5A1D

# What a walk of the dataset reports at least once a second while it lasts: what it has found so far ("1200
# images in 34 folders listed so far"), for a starting job's status and log and for pack's log.  A long walk (a
# million files on a network filesystem: minutes) said only "indexing DATA" until it ended.
Progress = Callable[[str], object]
PROGRESS_LOG_SECONDS = 10.0  # a long walk's log line this often (``logged_progress``), as pack's while it packs


def no_progress(_found: str) -> None:
    """The ``Progress`` of a walk nobody watches."""


def logged_progress(what: str, also: Progress = no_progress) -> Progress:
    """A walk's ``Progress`` that logs "WHAT: what was found so far" every ``PROGRESS_LOG_SECONDS`` from its
    start (not at all for a shorter walk) and tells ``also`` each time (a status)."""
    due = time.monotonic() + PROGRESS_LOG_SECONDS

    def found(so_far: str) -> None:
        nonlocal due
        also(so_far)
        if time.monotonic() >= due:
            log.info("%s: %s", what, so_far)
            due = time.monotonic() + PROGRESS_LOG_SECONDS

    return found


@dataclass(frozen=True)
class SampleIndex:
    """Where each sample's bytes are and its label, whatever the layout.

    Unpacked layouts (class folders, file lists): sample ``i`` is the whole of
    file ``i``.  Packed layouts (shards): sample ``i`` is ``member_sizes[i]``
    bytes at ``member_offsets[i]`` of file ``member_files[i]``.
    """

    root: str  # a local folder (absolute) or a URL; every file below is relative to it
    classes: tuple[str, ...]
    path_blob: np.ndarray  # uint8: every relative file path, utf-8/fs-encoded, back to back
    path_offsets: np.ndarray  # int64, len files + 1
    labels: np.ndarray  # int64, len n
    fingerprint: str
    member_files: np.ndarray | None = None  # int32 per sample: the file it is packed in
    member_offsets: np.ndarray | None = None  # int64 per sample
    member_sizes: np.ndarray | None = None  # int64 per sample
    member_stamp: str | None = None  # what every member's tar header names as its pack (None: not checked)
    source_index: np.ndarray | None = None  # int64 per sample of a shuffled pack: its sample in the data packed

    def __len__(self) -> int:
        return len(self.labels)

    def file(self, j: int) -> str:
        """File ``j``'s path relative to the root."""
        return blob_path(self.path_blob, self.path_offsets, j)

    def location(self, i: int) -> tuple[str, int, int | None]:
        """(file relative to the root, byte offset, size or ``None`` for the whole file) of sample ``i``."""
        if self.member_files is None:
            return self.file(i), 0, None
        assert self.member_offsets is not None and self.member_sizes is not None
        return self.file(int(self.member_files[i])), int(self.member_offsets[i]), int(self.member_sizes[i])

    def name(self, i: int, packed_from: PackedFrom | None = None) -> str:
        """Sample ``i`` as a user finds it: its file, and within a shard its byte range and, given the
        pack's ``packed_from``, the file it was packed from (to show a failure: without it the name is
        the sample's identity, one per sample, which counting and deduplication key on)."""
        rel, offset, size = self.location(i)
        notes = [] if size is None else [f"bytes {offset}-{offset + size}"]
        if packed_from is not None:
            notes.append(f"packed from {packed_from.where(i)}")
        where = _under(self.root, rel)
        return f"{where} ({', '.join(notes)})" if notes else where

    def path(self, i: int) -> Path:
        """The local file of sample ``i`` in an unpacked local layout."""
        return Path(self.root) / self.location(i)[0]

    @property
    def nbytes(self) -> int:
        arrays = (self.path_blob, self.path_offsets, self.labels, self.member_files, self.member_offsets,
                  self.member_sizes, self.source_index)
        return sum(a.nbytes for a in arrays if a is not None)


@dataclass(frozen=True)
class PackedFrom:
    """The files a pack's samples were packed from, as its index records them: the folder (or URL) first
    packed, and each sample's file relative to it, as ``SampleIndex`` keeps paths.  Not part of the
    ``SampleIndex`` that the controller and every worker hold (some 36 bytes per sample, for a name
    shown only when a sample fails): read from the pack's index when a failure is shown."""

    root: str
    path_blob: np.ndarray
    path_offsets: np.ndarray  # int64, len samples + 1

    def file(self, i: int) -> str:
        """The file sample ``i`` was packed from, relative to the root."""
        return blob_path(self.path_blob, self.path_offsets, i)

    def where(self, i: int) -> str:
        """The file sample ``i`` was packed from, as the user finds it."""
        return _under(self.root, self.file(i))


def blob_path(blob: np.ndarray, offsets: np.ndarray, j: int) -> str:
    """Path ``j`` of paths kept as ``pack_paths`` keeps them."""
    return os.fsdecode(blob[offsets[j]:offsets[j + 1]].tobytes())


def _under(root: str, rel: str) -> str:
    """File ``rel`` of the dataset at ``root``: a listed absolute path stays one."""
    return rel if rel.startswith("/") else f"{root.rstrip('/')}/{rel}"


def sized(samples: int, classes: int) -> str:
    """A dataset's size as the index logs give it: "5 samples in 2 classes", "1 sample in 1 class"."""
    return f"{counted(samples, 'sample')} in {counted(classes, 'class')}"


def pack_paths(paths: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """``(path_blob, path_offsets)`` of ``SampleIndex``: the paths back to back, and where each starts."""
    offsets = np.zeros(len(paths) + 1, dtype=np.int64)
    np.cumsum(np.fromiter((len(p) for p in paths), dtype=np.int64, count=len(paths)), out=offsets[1:])
    return np.frombuffer(b"".join(paths), dtype=np.uint8), offsets


# What a dataset location may be, for the errors of every command that takes one (start's and
# submit's --data, pack's SRC, prefetchd-train's --data and --val-data).
EXPECTED_DATA = ("expected a folder of class folders (ROOT/<class>/<image>.jpg), a .csv/.tsv/.txt list of path,label "
                 "rows, or a folder of shards from `prefetchd pack`")


SPLIT_NAMES = frozenset({"train", "training", "val", "valid", "validation", "test", "testing"})


def split_folders_as_classes(classes: tuple[str, ...], data: str) -> str | None:
    """The warning for a dataset whose only classes are split folders (--data /imagenet, not
    /imagenet/train, whose class folders are then searched for images as a class's subfolders are):
    accepted as ImageFolder accepts it, but almost surely a mistake."""
    if not classes or not all(c.lower() in SPLIT_NAMES for c in classes):
        return None
    first = next((c for c in classes if c.lower().startswith("train")), classes[0])
    found = (f"the classes of {data} are {', '.join(classes)}: split folders, not classes? Each image is labelled "
             "with its split" if len(classes) > 1 else
             f"the only class of {data} is {classes[0]}: a split folder, not a class? Every image has label 0")
    return (f"{found}. If that is not meant, pass --data {data.rstrip('/')}/{first}"
            + (" (and start a --split val daemon on the validation folder)" if len(classes) > 1 else ""))


def hidden_classes(classes: tuple[str, ...], data: str) -> str | None:
    """The warning for class folders whose names start with "." (a notebook's .ipynb_checkpoints, a desktop's
    .Trash-1000 copied along with the data): ImageFolder counts them as classes too, so prefetchd does, but their
    images then train as a class of their own, and the model has an output for it (a walk)."""
    hidden = [c for c in classes if c.startswith(".")]
    if not hidden:
        return None
    named = ", ".join(f"{c!r} (label {classes.index(c)})" for c in hidden[:3]) + (", ..." if len(hidden) > 3 else "")
    return (f"{counted(len(hidden), 'class folder')} of {data} {agreeing(len(hidden), 'is', 'are')} hidden: {named}. "
            "ImageFolder counts such folders as classes too, so they are classes here; if they are not, move them "
            "out of the dataset and start the daemon again")


def loose_images(data: str) -> str | None:
    """The warning for images directly in a class-folder dataset's root, in no class folder: ImageFolder leaves
    them out, so prefetchd does, without a word where most of a dataset could be there (a walk).  None for any
    other --data (a file list, shards, a URL) or a root that cannot be listed (indexing says why)."""
    try:
        with os.scandir(data) as listing:
            loose = sorted(e.name for e in listing if e.name.lower().endswith(IMG_EXTENSIONS) and e.is_file())
    except (OSError, ValueError):
        return None
    if not loose:
        return None
    named = ", ".join(loose[:3]) + (", ..." if len(loose) > 3 else "")
    return (f"{counted(len(loose), 'image')} directly in {data} ({named}) {agreeing(len(loose), 'is', 'are')} in "
            "no class folder, so left out, as ImageFolder leaves them out; to train on them, move them into the "
            "class folder of their label")


# Listing and stat-ing are system calls that release the GIL, and on network
# filesystems they mostly wait: more threads than cores still help there.
SCAN_THREADS = 8


@dataclass(frozen=True)
class Folder:
    """One listed folder: its stamp (taken before listing), image files with their stamps, subfolders."""

    path: str
    stamp: str
    files: list[tuple[str, str]]
    subdirs: list[str]
    identity: tuple[int, int] | None = None  # (st_dev, st_ino): which folder it is, wherever a link leads to it
    # Links that lead nowhere (yet): a folder linked in from a disk not mounted at the walk becomes one, and
    # nothing the walk stamped changes then (``dangling_links``).
    dangling: list[str] = field(default_factory=list)


MISSING = "missing"  # the stamp of a file or folder that could not be stat-ed


def class_marker(cls: str) -> bytes:
    """What a class adds to a fingerprint.  ``os.fsencode``: a class is a folder name, and one that is not
    UTF-8 (Latin-1 ``caf\\xe9``, which ImageFolder accepts) lives in ``str`` as surrogate escapes that
    ``str.encode()`` refuses; for UTF-8 names the bytes are the same."""
    return b"class:" + os.fsencode(cls) + b"\0"


def stat_stamp(st: os.stat_result) -> str:
    """A file's size and mtime: what the fingerprint covers."""
    return f"{st.st_size}:{st.st_mtime_ns}"


def folder_stamp(st: os.stat_result) -> str:
    """A folder's size, mtime, ctime and inode: what the index cache compares.  mtime alone misses
    ``rsync -a``, which renames a changed file into the folder and then restores the folder's mtime;
    nobody can set a ctime back, and a folder replaced by another (a new inode) is another folder.
    Not in the fingerprint: a copy of the tree (new ctimes, new inodes) holds the same samples."""
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"


def list_folder(path: str) -> Folder:
    """What ``os.walk(followlinks=True)`` sees in one folder: links to folders are folders,
    everything else (broken links included) a file; a folder it cannot list is empty."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return Folder(path, MISSING, [], [])
    files: list[tuple[str, str]] = []
    subdirs: list[str] = []
    dangling: list[str] = []
    try:
        st = os.fstat(fd)
        stamp = folder_stamp(st)
        # Listing by descriptor makes each entry's stat an fstatat() relative to the folder
        # instead of a lookup of the whole path: 20-30% less walk time measured on 100k files.
        with os.scandir(fd) as it:
            for entry in it:
                try:
                    is_dir = entry.is_dir()
                except OSError:
                    is_dir = False
                if is_dir:
                    subdirs.append(entry.name)
                    continue
                image = entry.name.lower().endswith(IMG_EXTENSIONS)
                if not image and not entry.is_symlink():  # from the listing's file type: no stat
                    continue
                try:
                    file_stamp = stat_stamp(entry.stat())
                except OSError:  # broken link or unreadable: decode fails later and is replaced
                    file_stamp = MISSING
                    if entry.is_symlink():
                        dangling.append(entry.name)
                if image:
                    files.append((entry.name, file_stamp))
    except OSError:
        return Folder(path, MISSING, [], [])
    finally:
        os.close(fd)  # scandir(fd) reads a duplicate and leaves this one open
    return Folder(path, stamp, files, subdirs, (st.st_dev, st.st_ino), dangling)


def _identities(path: str) -> frozenset[tuple[int, int]]:
    """The (st_dev, st_ino) of ``path`` (the dataset root above the class folders), or none."""
    try:
        st = os.stat(path)
    except OSError:
        return frozenset()
    return frozenset({(st.st_dev, st.st_ino)})


def walk_classes(tops: list[str], threads: int, tick: Progress) -> list[list[Folder]]:
    """Every folder under each of ``tops``, listed by a pool of threads, in ImageFolder's order:
    ``sorted(os.walk(top))`` sorts by folder path, and each folder's files by name.

    A link to a folder is followed, as ImageFolder follows it, except into a folder it is already
    inside: ``os.walk`` goes round such a loop until the path is too long (40 times for ``up -> ..``),
    and every image under it would be a sample 40 times over.  That is a DatasetError naming the link."""
    found: list[list[Folder]] = [[] for _ in tops]
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="scan") as pool:
        # Per listing: its top's position, and the identities of the folders above it.
        pending: dict[Future[Folder], tuple[int, frozenset[tuple[int, int]]]] = {
            pool.submit(list_folder, top): (k, _identities(os.path.dirname(top))) for k, top in enumerate(tops)}
        images = listed = 0
        try:
            while pending:
                # At least once a second, even while one huge folder is listed.
                tick(f"{counted(images, 'image')} in {counted(listed, 'folder')} listed so far")
                done, _ = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                for future in done:
                    k, above = pending.pop(future)
                    folder = future.result()
                    images, listed = images + len(folder.files), listed + 1
                    if folder.identity in above:
                        raise DatasetError(f"{folder.path} links to {os.path.realpath(folder.path)}, a folder it is "
                                           "inside: a loop, which would make every image below it a sample again and "
                                           "again; remove that link from the dataset")
                    found[k].append(folder)
                    inside = above | {folder.identity} if folder.identity is not None else above
                    for name in folder.subdirs:
                        pending[pool.submit(list_folder, os.path.join(folder.path, name))] = (k, inside)
        except BaseException:
            # A stop (``tick`` raises it), Ctrl-C or a refusal: the folders queued are not listed.  Leaving the block
            # waited for every one: on a slow filesystem `prefetchd stop` ran into its timeout (a walk).
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    for folders in found:
        folders.sort(key=lambda f: f.path)
        for folder in folders:
            folder.files.sort()
    return found


@dataclass(frozen=True)
class Scan:
    """A class-folder index and the folders it was built from, with their stamps
    (what the index cache checks to know the tree is unchanged)."""

    index: SampleIndex
    folders: list[tuple[str, str]]  # (path relative to the root, "" for the root itself; stamp); dangling links too


def scan_class_folders(root: Path, tick: Progress = no_progress, threads: int = SCAN_THREADS) -> SampleIndex:
    """Index ``root`` exactly as ImageFolder would, and fingerprint its state.

    ``tick`` is told what was found so far now and then, so a caller can prove it is alive
    (systemd's watchdog) and say how far it is while a large tree is walked.
    """
    return scan_tree(root, tick, threads).index


APPLE_DOUBLE_PREFIX = "._"  # the metadata files macOS writes beside each file on a volume that lacks its attributes


def apple_double_advice(root: str | Path, count: int = 2) -> str:
    """What to do about macOS's '._*' files (``count`` of them) in the dataset at ``root``."""
    return (f"delete {agreeing(count, 'it', 'them')} (`find {root} -name '{APPLE_DOUBLE_PREFIX}*' -delete`) and "
            "start again with --reset")


def _is_folder(entry: os.DirEntry[str]) -> bool:
    """Whether a dataset root's entry is a (class) folder; a link that cannot be followed is refused by name."""
    try:
        return entry.is_dir()
    except OSError as exc:  # ImageFolder fails on it too, with a traceback
        raise DatasetError(f"{entry.path}: cannot tell whether it is a class folder ({exc.strerror or exc}); a "
                           "symbolic link that leads round in a loop is: remove it, or point it at a folder") from None


def dangling_links(rel_folder: str, names: list[str]) -> list[tuple[str, str]]:
    """Stamps for the links in ``rel_folder`` that lead nowhere, as the index cache checks them: missing, until the
    link leads somewhere (its target mounted, made) and the tree must be walked again.  The link itself is an entry
    of a stamped folder; what it leads to is stamped nowhere else (a walk: a class folder linked to a disk mounted
    after the first start stayed out of the cached index)."""
    return [(os.path.join(rel_folder, name), MISSING) for name in names]


def scan_tree(root: Path, tick: Progress = no_progress, threads: int = SCAN_THREADS) -> Scan:
    root = Path(root)
    if not root.exists():
        raise DatasetError(f"dataset root {root} does not exist; {EXPECTED_DATA}")
    if not root.is_dir():
        raise DatasetError(f"dataset root {root} is not a directory; {EXPECTED_DATA}")
    root_stamp = folder_stamp(root.stat())
    with os.scandir(root) as listing:
        entries = list(listing)
    classes = sorted(e.name for e in entries if _is_folder(e))
    if not classes and any(root.glob("shard-*.tar")):
        raise DatasetError(f"{root} holds shards but no prefetchd-index.npz: `prefetchd pack` did not finish "
                           "(the index is written last); pack again with --force")
    if not classes:
        raise DatasetError(
            f"dataset root {root} has no class folders; expected {root}/<class>/<image>.jpg "
            "(one folder per class, as for torchvision ImageFolder)"
        )
    top = str(root)
    prefix = len(os.path.join(top, ""))
    walked = walk_classes([os.path.join(top, cls) for cls in classes], max(1, threads), tick)
    digest = hashlib.sha256()
    rel_paths: list[bytes] = []
    counts: list[int] = []
    stamps: list[tuple[str, str]] = [("", root_stamp)]
    stamps += dangling_links("", [e.name for e in entries if e.is_symlink() and not os.path.exists(e.path)])
    apple_double: list[str] = []
    for cls, folders in zip(classes, walked):
        count = 0
        for folder in folders:
            stamps.append((folder.path[prefix:], folder.stamp))
            stamps += dangling_links(folder.path[prefix:], folder.dangling)
            rel_dir = os.fsencode(folder.path[prefix:]) + b"/"
            for name, stamp in folder.files:
                rel = rel_dir + os.fsencode(name)
                digest.update(rel + b"\0" + stamp.encode() + b"\0")
                rel_paths.append(rel)
                if name.startswith(APPLE_DOUBLE_PREFIX):
                    apple_double.append(os.path.join(folder.path, name))
            count += len(folder.files)
        if count == 0:
            denied = cannot_read(root / cls)  # listed as empty, as ImageFolder's os.walk would
            if denied is not None:
                raise DatasetError(f"cannot read class folder {root / cls}: {denied}")
            if (root / cls / STATUS_NAME).is_file():  # made by a daemon before buffers inside --data were refused
                raise DatasetError(f"{root / cls} is a prefetchd buffer (it holds {STATUS_NAME}), not a class "
                                   f"folder: remove it (rm -r {root / cls}) and keep buffers outside the dataset")
            raise DatasetError(
                f"class folder {root / cls} has no images (looked for {', '.join(IMG_EXTENSIONS)}); "
                "add images or remove the folder"
            )
        counts.append(count)
        digest.update(class_marker(cls))
    blob, offsets = pack_paths(rel_paths)
    del rel_paths
    index = SampleIndex(
        root=str(root.resolve()),
        classes=tuple(classes),
        path_blob=blob,
        path_offsets=offsets,
        labels=np.repeat(np.arange(len(classes), dtype=np.int64), counts),
        fingerprint=digest.hexdigest()[:32],
    )
    log.info("indexed %s: %s (%.0f bytes of index per sample)", root, sized(len(index), len(classes)),
             index.nbytes / max(1, len(index)))
    if apple_double:
        n = len(apple_double)
        log.warning("%s named '._*' (macOS AppleDouble metadata, not %s), %s %s, %s here, as ImageFolder counts %s "
                    "too: %s replaced by the next sample that decodes%s: %s", counted(n, "file"),
                    agreeing(n, "an image", "images"), agreeing(n, "namely", "e.g."), apple_double[0],
                    agreeing(n, "is a sample", "are samples"), agreeing(n, "it", "them"), agreeing(n, "it is", "each is"),
                    agreeing(n, "", ", and a run of them ends the job"), apple_double_advice(root, n))
    return Scan(index, stamps)


def held_out_count(n: int, val_fraction: float) -> int:
    """How many of ``n`` samples ``val_fraction`` holds out as the val split (``split_members``); the rest are train's."""
    return int(round(n * val_fraction))


def split_members(n: int, split: str, val_fraction: float | None,
                  source_index: np.ndarray | None = None) -> np.ndarray:
    """Sorted sample indices that belong to ``split``.

    Without a validation fraction the whole dataset is the split.  With one, a
    fixed seeded permutation puts ``round(n * fraction)`` samples in val and the
    rest in train; the two never overlap.

    The split is drawn over the data as it was before packing: where sample ``i``
    is sample ``source_index[i]`` of the source (a shuffled pack), it is in val
    when that source sample is, so every layout of the same data holds out the
    same images.  Sorted either way (the workers find a sample's replacements by
    bisection): the pack's order, not the source's.
    """
    if val_fraction is None:
        return np.arange(n, dtype=np.int64)
    n_val = held_out_count(n, val_fraction)
    perm = np.random.Generator(np.random.PCG64(SPLIT_SEED)).permutation(n)
    if source_index is None:
        chosen = perm[:n_val] if split == "val" else perm[n_val:]
    else:
        held_out = np.zeros(n, dtype=bool)
        held_out[perm[:n_val]] = True
        chosen = np.flatnonzero(held_out[source_index] == (split == "val"))
    if len(chosen) == 0:
        # A setting to change (exit 2, which the unit does not restart into the same refusal), not bad data.
        raise ConfigError(
            f"--val-fraction {val_fraction} leaves the {split} split of {n} samples empty; choose a fraction "
            f"that holds out {'fewer' if split == 'train' else 'more'} (round(n x fraction) samples go to val)"
        )
    return np.sort(chosen).astype(np.int64)
