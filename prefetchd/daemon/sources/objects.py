"""Class folders in object storage: ``s3://bucket/prefix/<class>/<image>``.

Listed as a local tree is scanned, so that sample ``i`` is the same image
whether the tree is on disk or under a prefix: classes are the sorted "folders"
directly under the prefix, files are taken per class in the order of a sorted
``os.walk`` (by folder, then by name) with ImageFolder's extensions,
case-insensitively.  Each class is listed by its own request stream in a thread
pool: one flat listing per class prefix instead of one walk of the whole tree.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from prefetchd.daemon.dataset import IMG_EXTENSIONS, SampleIndex
from prefetchd.daemon.errors import DatasetError
from prefetchd.daemon.sources.storage import FsspecStorage, StorageDenied, StorageUnavailable

log = logging.getLogger(__name__)

LIST_THREADS = 16  # class prefixes listed at once; each listing is a sequence of 1000-key pages


def _stamp(info: dict[str, Any]) -> str:
    tag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("mtime") or info.get("LastModified")
    return f"{info.get('size')}:{tag}"


def list_class_folders(storage: FsspecStorage, tick: Callable[[], object] = lambda: None) -> SampleIndex:
    """Index the class folders under ``storage.url`` exactly as ImageFolder would index them on disk."""
    url = storage.url
    started = time.monotonic()
    try:
        fs = storage.fs
        fs.invalidate_cache()  # a listing cached by an earlier job of this process may be stale
        root = storage.path()
        try:
            entries = storage.call(f"listing {url}", lambda: fs.ls(root, detail=True))
        except FileNotFoundError:
            raise DatasetError(f"{url}: nothing is stored under this prefix; check the URL (expected "
                               f"{url}/<class>/<image>.jpg, one folder per class)") from None
        classes = sorted(posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "directory")
        if not classes:
            raise DatasetError(f"{url} has no class folders; expected {url}/<class>/<image>.jpg "
                               "(one folder per class, as for torchvision ImageFolder)")

        def list_class(cls: str) -> dict[str, dict[str, Any]]:
            found: dict[str, dict[str, Any]] = storage.call(
                f"listing {url}/{cls}/", lambda: fs.find(f"{root}/{cls}/", detail=True))
            return found

        with ThreadPoolExecutor(min(LIST_THREADS, len(classes)), thread_name_prefix="list") as pool:
            listings = pool.map(list_class, classes)
            digest = hashlib.sha256()
            rel_paths: list[bytes] = []
            labels: list[int] = []
            for label, (cls, found) in enumerate(zip(classes, listings)):
                tick()
                files = []
                for name, info in found.items():
                    rel = name[len(root) + 1:]
                    if info.get("type") == "file" and rel.lower().endswith(IMG_EXTENSIONS):
                        files.append((posixpath.dirname(rel), posixpath.basename(rel), info))
                if not files:
                    raise DatasetError(f"class folder {url}/{cls}/ has no images (looked for "
                                       f"{', '.join(IMG_EXTENSIONS)}); add images or remove its objects")
                for folder, base, info in sorted(files, key=lambda f: (f[0], f[1])):
                    rel_b = os.fsencode(f"{folder}/{base}")
                    digest.update(rel_b + b"\0" + _stamp(info).encode() + b"\0")
                    rel_paths.append(rel_b)
                    labels.append(label)
                digest.update(f"class:{cls}\0".encode())
    except (StorageDenied, StorageUnavailable) as exc:
        raise DatasetError(str(exc)) from None
    lengths = np.fromiter((len(p) for p in rel_paths), dtype=np.int64, count=len(rel_paths))
    offsets = np.zeros(len(rel_paths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    index = SampleIndex(
        root=url,
        classes=tuple(classes),
        path_blob=np.frombuffer(b"".join(rel_paths), dtype=np.uint8),
        path_offsets=offsets,
        labels=np.asarray(labels, dtype=np.int64),
        fingerprint=digest.hexdigest()[:32],
    )
    log.info("listed %s: %d samples in %d classes in %.1f s", url, len(index), len(classes),
             time.monotonic() - started)
    return index
