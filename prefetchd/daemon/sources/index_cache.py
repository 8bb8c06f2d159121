"""A cache of class-folder indexes, so a restart does not walk a million files
(or list a million objects) again.

Entries are ``.npz`` files (no pickle) written through a temporary name; an
unreadable, damaged, other-version or other-dataset entry is ignored and
rewritten.  ``objects.py`` keeps the index of class folders under a URL here as
``objects-<hash of the URL and the store's endpoint>.npz``, trusted until ``--refresh-index``.

On disk there is one file per dataset root, ``<cache dir>/classfolders-<hash of the root>.npz``,
holding the index and the stamp (size, mtime, ctime and inode) of every folder
it was built from.  It is used only while every one of those folders still has
its stamp: adding, removing or renaming an entry changes the folder's mtime and
ctime, so such edits are seen at the cost of one stat per folder (about a
thousand for ImageNet) instead of one per file.  The ctime catches what mtime
alone misses: ``rsync -a`` renames a changed file into place and then sets the
folder's mtime back, and no one can set a ctime back.  A symbolic link that led nowhere
at the scan is checked too: one that leads somewhere now (its disk mounted, its folder
made) means a rescan.  Edits that leave every folder alone are not seen: a file rewritten
in place (same name, new content).
``--refresh-index`` rescans and rewrites the entry.

Folder mtimes come from a coarse clock (a few ms), so a file added within the
same tick as the scan could leave a folder's stamp unchanged.  As git does for
its index, a scan that saw a folder modified (by its mtime) within
``RACY_SECONDS`` of its start (and no later than its end) is not cached; the next start scans again.
"""

from __future__ import annotations

import atexit
import errno
import functools
import hashlib
import logging
import os
import pwd
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from prefetchd.daemon.dataset import MISSING, Progress, SampleIndex, folder_stamp, no_progress, pack_paths, scan_tree, sized
from prefetchd.daemon.sources.npz import load_arrays
from prefetchd.locations import temp_file

log = logging.getLogger(__name__)

FORMAT = "prefetchd-index-cache"
VERSION = 3  # 2: folder stamps hold ctime and inode as well as size and mtime; 3: and dangling links
INDEX_ARRAYS = ("path_blob", "path_offsets", "labels")
FOLDER_ARRAYS = ("dir_blob", "dir_offsets", "signature")  # what a class-folder entry adds
RACY_SECONDS = 2.0


# Where systemd/prefetchd@.service's `CacheDirectory=prefetchd` puts the cache (a system unit's is under /var/cache),
# which it passes in $CACHE_DIRECTORY: named where the default is shown outside the unit (`prefetchd config --show`).
# tests/integration/test_systemd_unit.py keeps the two equal.
UNIT_CACHE_DIRECTORY = Path("/var/cache/prefetchd")


def default_cache_dir() -> Path:
    """systemd's ``CacheDirectory=`` (it sets $CACHE_DIRECTORY), else the user's cache folder.

    As the XDG spec says, an empty or relative $XDG_CACHE_HOME is ignored; so is such a $HOME (cron, `env -i`,
    a container's HOME=""), which would put the cache in whatever folder the daemon was started from: the
    account's home folder is used instead."""
    systemd = os.environ.get("CACHE_DIRECTORY")
    if systemd:
        return Path(systemd.split(":")[0])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "prefetchd"
    home = os.environ.get("HOME", "")
    if not os.path.isabs(home):
        try:
            home = pwd.getpwuid(os.getuid()).pw_dir
        except KeyError:  # a uid without an account (a container's --user 12345): no home at all
            return _private_temp_cache()
    return Path(home) / ".cache" / "prefetchd"


@functools.cache
def _private_temp_cache() -> Path:
    """A folder of this process's own (0700, a random name) in the temp folder, for a user with no home: a name
    known in advance there (/tmp/prefetchd-UID) is one another user may make first and plant indexes in (a
    walk).  Its indexes do not outlive the process (removed at its exit: each run left one, index and all, a walk
    as a uid with no account): set $XDG_CACHE_HOME or --index-cache to keep them."""
    folder = tempfile.mkdtemp(prefix="prefetchd-index-cache-")
    creator = os.getpid()

    def remove() -> None:
        if os.getpid() == creator:  # not a forked child's exit: the folder is its parent's
            shutil.rmtree(folder, ignore_errors=True)

    atexit.register(remove)
    return Path(folder)


def private_temp(cache_dir: Path) -> bool:
    """Whether ``cache_dir`` is this process's private temp cache (``_private_temp_cache``): its indexes last one
    run, which the note on the default says (it was called "this user's cache folder", a walk)."""
    return _private_temp_cache.cache_info().currsize > 0 and cache_dir == _private_temp_cache()


def cache_file(cache_dir: Path, kind: str, location: str | Path) -> Path:
    """The entry of ``kind`` ("classfolders", "objects") for the dataset at ``location``."""
    key = hashlib.sha256(os.fsencode(location)).hexdigest()[:24]
    return cache_dir / f"{kind}-{key}.npz"


def _signature(folders: list[tuple[str, str]]) -> str:
    """(folder relative to the root, its stamp) pairs, hashed."""
    digest = hashlib.sha256()
    for rel, stamp in folders:
        digest.update(os.fsencode(rel) + b"\0" + stamp.encode() + b"\0")
    return digest.hexdigest()


def _stamps_now(root: Path, rel_dirs: list[str]) -> list[tuple[str, str]]:
    """The stamps of ``root``'s folders (and of its dangling links) now; one that is gone stamps as missing."""
    stamps = []
    for rel in rel_dirs:
        try:
            stamps.append((rel, folder_stamp(os.stat(os.path.join(root, rel) if rel else root))))
        except OSError:
            stamps.append((rel, MISSING))
    return stamps


def _unpack_strings(blob: np.ndarray, offsets: np.ndarray) -> list[str]:
    raw = blob.tobytes()
    return [os.fsdecode(raw[offsets[k]:offsets[k + 1]]) for k in range(len(offsets) - 1)]


def load_entry(path: Path, root: str, again: str, extra: tuple[str, ...] = (),
               match: Mapping[str, str] | None = None) -> tuple[SampleIndex, dict[str, np.ndarray]] | None:
    """The index saved in ``path`` for ``root`` and its ``extra`` arrays, or None with the reason logged
    (``again`` says what happens instead, e.g. "rescanning ROOT").  ``match``: what else the entry must
    have been saved for besides ``root`` (``objects.py``: the endpoint), as string arrays saved beside it."""
    try:
        arrays = load_arrays(path)
    except (FileNotFoundError, NotADirectoryError):  # no entry (the cache folder is a file: saving says so)
        return None
    except OSError as exc:
        # "and rewriting it" only where it can be: else the warning that saving it fails follows (a walk).
        rewrite = " and rewriting it" if os.access(path.parent, os.W_OK | os.X_OK) else ""
        log.warning("cannot read index cache %s (%s); %s%s", path, exc.strerror or exc, again, rewrite)
        return None
    except ValueError as exc:
        log.warning("index cache %s is damaged (%s); %s and rewriting it", path, exc, again)
        return None
    try:
        if (str(arrays["format"]) != FORMAT or int(arrays["version"]) != VERSION or str(arrays["root"]) != root
                or any(name not in arrays or str(arrays[name]) != value for name, value in (match or {}).items())):
            log.info("index cache %s is from another version or dataset; %s", path, again)
            return None
        labels = arrays["labels"].astype(np.int64, copy=False)
        offsets = arrays["path_offsets"].astype(np.int64, copy=False)
        if len(offsets) < 2 or len(offsets) != len(labels) + 1 or offsets[-1] != len(arrays["path_blob"]):
            raise ValueError("path offsets disagree with the labels or the path blob")
        index = SampleIndex(
            root=root, classes=tuple(str(c) for c in arrays["classes"]),
            path_blob=arrays["path_blob"].astype(np.uint8, copy=False), path_offsets=offsets, labels=labels,
            fingerprint=str(arrays["fingerprint"]),
        )
        return index, {name: arrays[name] for name in extra}
    except (KeyError, ValueError, IndexError) as exc:
        # A missing array's KeyError says only its name: "damaged ('format')" (a walk).
        why = f"it has no {exc.args[0]!r} array" if isinstance(exc, KeyError) and exc.args else exc
        log.warning("index cache %s is damaged (%s); %s and rewriting it", path, why, again)
        return None


def save_entry(path: Path, index: SampleIndex, **extra: np.ndarray) -> None:
    """Write the entry through a temporary name: a reader sees the old entry or the new, whole."""
    arrays: dict[str, Any] = {
        "format": np.array(FORMAT), "version": np.array(VERSION), "root": np.array(index.root),
        "classes": np.array(index.classes, dtype=str), "fingerprint": np.array(index.fingerprint),
        **{name: getattr(index, name) for name in INDEX_ARRAYS}, **extra,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # strerror "File exists" hides which path is in the way
        blocker = next((p for p in (path.parent, *path.parent.parents) if p.exists() and not p.is_dir()), None)
        if blocker is None:
            raise
        raise NotADirectoryError(errno.ENOTDIR, f"{blocker} is a file, not a folder") from None
    fd, tmp = temp_file(path.parent, f".{path.name}.", ".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: Path, root: Path) -> SampleIndex | None:
    """The cached index of ``root`` if the cache holds one and the tree still matches it."""
    again = f"rescanning {root}"
    found = load_entry(path, str(root), again, FOLDER_ARRAYS)
    if found is None:
        return None
    index, extra = found
    try:
        rel_dirs = _unpack_strings(extra["dir_blob"], extra["dir_offsets"])
    except (ValueError, IndexError) as exc:
        log.warning("index cache %s is damaged (%s); %s and rewriting it", path, exc, again)
        return None
    if _signature(_stamps_now(root, rel_dirs)) != str(extra["signature"]):
        log.info("%s changed since its index was cached (a folder's size, mtime, ctime or inode differs); "
                 "rescanning", root)
        return None
    return index


def save(path: Path, index: SampleIndex, rel_dirs: list[str], signature: str) -> None:
    dir_blob, dir_offsets = pack_paths([os.fsencode(rel) for rel in rel_dirs])
    save_entry(path, index, dir_blob=dir_blob, dir_offsets=dir_offsets, signature=np.array(signature))


def cached_class_folders(root: Path, cache_dir: Path, refresh: bool = False,
                         tick: Progress = no_progress) -> SampleIndex:
    """The class-folder index of ``root``, from ``cache_dir`` when the tree is unchanged."""
    root = Path(root).resolve()
    path = cache_file(cache_dir, "classfolders", root)
    if not refresh:
        index = load(path, root)
        if index is not None:
            log.info("indexed %s from the cache %s: %s (--refresh-index rescans)",
                     root, path, sized(len(index), len(index.classes)))
            return index
    started = time.time_ns()
    scan = scan_tree(root, tick)
    rel_dirs = [rel for rel, _stamp in scan.folders]
    # A folder's mtime past the scan's end is not racy: any later change sets it to that moment's time, which
    # differs (a tree unpacked from an archive made on a box whose clock ran ahead was never cached, a walk).
    ended = time.time_ns() + int(RACY_SECONDS * 1e9)
    racy = [rel for rel, stamp in scan.folders
            if stamp != MISSING and started - int(RACY_SECONDS * 1e9) <= int(stamp.split(":")[1]) <= ended]
    if racy:
        log.info("not caching the index of %s: %s changed less than %.0f s before the scan, too recently "
                 "for its mtime to prove later changes; the next start scans again",
                 root, os.path.join(root, racy[0]) if racy[0] else root, RACY_SECONDS)  # "": the root itself
        return scan.index
    # Stamps taken before each folder was listed: an edit during the scan makes the
    # signature differ next time, so a half-seen change is never cached as current.
    try:
        save(path, scan.index, rel_dirs, _signature(scan.folders))
    except OSError as exc:
        log.warning("cannot write the index cache %s (%s); the next start scans %s again; "
                    "pass --index-cache DIR with a writable folder", path, exc.strerror or exc, root)
    return scan.index
