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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prefetchd.daemon.errors import DatasetError

log = logging.getLogger(__name__)

# torchvision.datasets.folder.IMG_EXTENSIONS: the same list, so indices agree.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# The seed of --val-fraction's split is fixed and separate from --seed, so
# changing the training seed can never move samples between train and val.
SPLIT_SEED = 0x5EED_5A1D


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

    def __len__(self) -> int:
        return len(self.labels)

    def file(self, j: int) -> str:
        """File ``j``'s path relative to the root."""
        lo, hi = self.path_offsets[j], self.path_offsets[j + 1]
        return os.fsdecode(self.path_blob[lo:hi].tobytes())

    def location(self, i: int) -> tuple[str, int, int | None]:
        """(file relative to the root, byte offset, size or ``None`` for the whole file) of sample ``i``."""
        if self.member_files is None:
            return self.file(i), 0, None
        assert self.member_offsets is not None and self.member_sizes is not None
        return self.file(int(self.member_files[i])), int(self.member_offsets[i]), int(self.member_sizes[i])

    def name(self, i: int) -> str:
        """Sample ``i`` as a user finds it: its file, and the byte range within a shard."""
        rel, offset, size = self.location(i)
        where = f"{self.root.rstrip('/')}/{rel}"
        return where if size is None else f"{where} (bytes {offset}-{offset + size})"

    def path(self, i: int) -> Path:
        """The local file of sample ``i`` in an unpacked local layout."""
        return Path(self.root) / self.location(i)[0]

    @property
    def nbytes(self) -> int:
        arrays = (self.path_blob, self.path_offsets, self.labels, self.member_files, self.member_offsets,
                  self.member_sizes)
        return sum(a.nbytes for a in arrays if a is not None)


def scan_class_folders(root: Path, tick: Callable[[], object] = lambda: None) -> SampleIndex:
    """Index ``root`` exactly as ImageFolder would, and fingerprint its state.

    ``tick`` is called once per class folder, so a caller can prove it is alive
    (systemd's watchdog) while a large tree is walked.
    """
    root = Path(root)
    if not root.exists():
        raise DatasetError(f"dataset root {root} does not exist; pass --data with a folder of class folders")
    if not root.is_dir():
        raise DatasetError(f"dataset root {root} is not a directory; pass --data with a folder of class folders")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise DatasetError(
            f"dataset root {root} has no class folders; expected {root}/<class>/<image>.jpg "
            "(one folder per class, as for torchvision ImageFolder)"
        )
    digest = hashlib.sha256()
    rel_paths: list[bytes] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        tick()
        count = 0
        for dirpath, _dirs, files in sorted(os.walk(root / cls, followlinks=True)):
            for name in sorted(files):
                if not name.lower().endswith(IMG_EXTENSIONS):
                    continue
                full = os.path.join(dirpath, name)
                rel = os.fsencode(os.path.relpath(full, root))
                try:
                    st = os.stat(full)
                    stamp = f"{st.st_size}:{st.st_mtime_ns}"
                except OSError:  # broken link or unreadable: decode fails later and is replaced
                    stamp = "missing"
                digest.update(rel + b"\0" + stamp.encode() + b"\0")
                rel_paths.append(rel)
                labels.append(label)
                count += 1
        if count == 0:
            raise DatasetError(
                f"class folder {root / cls} has no images (looked for {', '.join(IMG_EXTENSIONS)}); "
                "add images or remove the folder"
            )
        digest.update(f"class:{cls}\0".encode())
    lengths = np.fromiter((len(p) for p in rel_paths), dtype=np.int64, count=len(rel_paths))
    offsets = np.zeros(len(rel_paths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    blob = np.frombuffer(b"".join(rel_paths), dtype=np.uint8)
    index = SampleIndex(
        root=str(root.resolve()),
        classes=tuple(classes),
        path_blob=blob,
        path_offsets=offsets,
        labels=np.asarray(labels, dtype=np.int64),
        fingerprint=digest.hexdigest()[:32],
    )
    log.info(
        "indexed %s: %d samples in %d classes (%.0f bytes of index per sample)",
        root, len(index), len(classes), index.nbytes / max(1, len(index)),
    )
    return index


def split_members(n: int, split: str, val_fraction: float | None) -> np.ndarray:
    """Sorted sample indices that belong to ``split``.

    Without a validation fraction the whole dataset is the split.  With one, a
    fixed seeded permutation puts ``round(n * fraction)`` samples in val and the
    rest in train; the two never overlap.
    """
    if val_fraction is None:
        return np.arange(n, dtype=np.int64)
    n_val = int(round(n * val_fraction))
    perm = np.random.Generator(np.random.PCG64(SPLIT_SEED)).permutation(n)
    chosen = perm[:n_val] if split == "val" else perm[n_val:]
    if len(chosen) == 0:
        raise DatasetError(
            f"--val-fraction {val_fraction} leaves the {split} split of {n} samples empty; choose a fraction "
            "strictly between 0 and 1 that leaves samples on both sides"
        )
    return np.sort(chosen).astype(np.int64)
