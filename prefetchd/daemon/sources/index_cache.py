"""Indexes saved to disk, so that a restart does not list a large dataset again.

One ``.npz`` per dataset location, named by a hash of the location, holding the
``SampleIndex`` arrays and a small JSON header (format, version, location,
classes, fingerprint).  No pickle: ``np.load(allow_pickle=False)``.  A file that
is unreadable, of another version or of another location is ignored (and
overwritten by the next save); ``--refresh-index`` skips it on purpose.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np

from prefetchd.daemon.dataset import SampleIndex

log = logging.getLogger(__name__)

FORMAT = "prefetchd.index"
VERSION = 1
ARRAYS = ("path_blob", "path_offsets", "labels", "member_files", "member_offsets", "member_sizes")


def default_cache_dir() -> Path:
    """systemd's CacheDirectory= (``$CACHE_DIRECTORY``), else ``$XDG_CACHE_HOME/prefetchd``, else ``~/.cache/prefetchd``."""
    if os.environ.get("CACHE_DIRECTORY"):
        return Path(os.environ["CACHE_DIRECTORY"].split(":")[0])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "prefetchd"


def cache_file(location: str, directory: Path | None = None) -> Path:
    digest = hashlib.sha256(location.encode()).hexdigest()[:24]
    return (directory or default_cache_dir()) / f"index-{digest}.npz"


def save_index(index: SampleIndex, path: Path) -> None:
    """Write atomically (temp name, then rename): a daemon killed mid-write leaves the old file or none."""
    header = {"format": FORMAT, "version": VERSION, "root": index.root, "classes": list(index.classes),
              "fingerprint": index.fingerprint}
    arrays = {name: getattr(index, name) for name in ARRAYS if getattr(index, name) is not None}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            np.savez(fh, header=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8), **arrays)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        log.warning("cannot save the index of %s to %s (%s); the next start lists it again", index.root, path, exc)


def load_index(path: Path, location: str) -> SampleIndex | None:
    """The index saved for ``location``, or None (with the reason logged) when there is no usable one."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            header = json.loads(npz["header"].tobytes())
            if header.get("format") != FORMAT or header.get("version") != VERSION or header.get("root") != location:
                log.info("ignoring %s: an index of another version or location", path)
                return None
            arrays = {name: npz[name] if name in npz.files else None for name in ARRAYS}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as exc:
        log.warning("ignoring the unreadable index cache %s (%s); listing again", path, exc)
        return None
    return SampleIndex(root=location, classes=tuple(header["classes"]), fingerprint=header["fingerprint"],
                       **arrays)  # type: ignore[arg-type]
