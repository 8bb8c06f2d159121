"""Class folders in object storage: ``s3://bucket/prefix/<class>/<image>``.

Listed as a local tree is scanned, so that sample ``i`` is the same image
whether the tree is on disk or under a prefix: classes are the sorted "folders"
directly under the prefix, files are taken per class in the order of a sorted
``os.walk`` (by folder, then by name) with ImageFolder's extensions,
case-insensitively.  Each class is listed by its own request stream in a thread
pool: one flat listing per class prefix instead of one walk of the whole tree.

The index is cached on disk (``<cache dir>/objects-<hash of the URL and the
endpoint>.npz``: the same bucket on another endpoint is another store) and a
restart uses it without listing: telling whether a prefix changed would take
the listing the cache saves.  It is trusted as it is until ``--refresh-index``;
one HEAD of its first object at start turns missing credentials, a deleted
bucket or deleted objects into a clear error there rather than in every worker.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from prefetchd.daemon.dataset import IMG_EXTENSIONS, Progress, SampleIndex, class_marker, no_progress, pack_paths, sized
from prefetchd.daemon.errors import DatasetError
from prefetchd.daemon.sources.index_cache import cache_file, default_cache_dir, load_entry, save_entry
from prefetchd.daemon.sources.storage import FsspecStorage, StorageDenied, StorageUnavailable
from prefetchd.words import counted

log = logging.getLogger(__name__)

LIST_THREADS = 16  # class prefixes listed at once; each listing is a sequence of 1000-key pages


def _stamp(info: dict[str, Any]) -> str:
    tag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("mtime") or info.get("LastModified")
    return f"{info.get('size')}:{tag}"


def list_class_folders(storage: FsspecStorage, tick: Progress = no_progress) -> SampleIndex:
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
                tick(f"{counted(len(rel_paths), 'image')} in {label} of {counted(len(classes), 'class folder')} "
                     "listed so far")
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
                digest.update(class_marker(cls))
    except (StorageDenied, StorageUnavailable) as exc:
        raise DatasetError(str(exc)) from None
    blob, offsets = pack_paths(rel_paths)
    index = SampleIndex(
        root=url,
        classes=tuple(classes),
        path_blob=blob,
        path_offsets=offsets,
        labels=np.asarray(labels, dtype=np.int64),
        fingerprint=digest.hexdigest()[:32],
    )
    log.info("listed %s: %s in %.1f s", url, sized(len(index), len(classes)), time.monotonic() - started)
    return index


def cache_entry(storage: FsspecStorage, cache_dir: Path | None = None) -> Path:
    """The index-cache file of the class folders under ``storage.url`` on the endpoint it reaches."""
    return cache_file(cache_dir or default_cache_dir(), "objects", f"{storage.url}\0{storage.endpoint()}")


def cached_url_class_folders(storage: FsspecStorage, cache_dir: Path | None = None, refresh: bool = False,
                             tick: Progress = no_progress) -> SampleIndex:
    """The class-folder index under ``storage.url``: from the cache unless ``refresh``, else listed and cached.

    An entry is the URL's on one endpoint: the same bucket and prefix on MinIO and on AWS (or on
    staging and production) are different data, and one's index would give the other's samples."""
    endpoint = storage.endpoint()
    cached = cache_entry(storage, cache_dir)
    entry = None if refresh else load_entry(cached, storage.url, f"listing {storage.url} again",
                                            match={"endpoint": endpoint})
    if entry is None:
        index = list_class_folders(storage, tick=tick)
        try:
            save_entry(cached, index, endpoint=np.array(endpoint))
        except OSError as exc:
            log.warning("cannot write the index cache %s (%s); the next start lists %s again; pass --index-cache "
                        "DIR with a writable folder", cached, exc.strerror or exc, index.root)
        return index
    found = entry[0]
    log.info("indexed %s from the cache %s: %s (--refresh-index lists it again)",
             storage.url, cached, sized(len(found), len(found.classes)))
    first = storage.path(found.file(0))
    storage.fs.invalidate_cache()  # info() answers from an earlier listing of this process otherwise
    try:
        storage.call(f"checking {storage.url}", lambda: storage.fs.info(first))
    except StorageDenied as exc:
        raise DatasetError(str(exc)) from None
    except FileNotFoundError:
        raise DatasetError(f"{found.name(0)} in the cached index {cached} is gone; the data changed since it "
                           "was listed: run the command again with --refresh-index (it lists the prefix anew)") from None
    except OSError as exc:  # unreachable now: the workers' reads retry, and say so if it lasts
        log.warning("cannot check %s (%s); going on with the cached index", storage.url, exc)
    return found
