"""Datasets wherever users keep them, behind one seam.

``open_dataset(location)`` recognizes the layout at ``location`` and indexes it
into a ``SampleIndex``; ``SampleReader(index).read(i)`` returns sample ``i``'s
encoded bytes from its storage.  The producer and workers see only these two,
so every layout gets the same determinism and bad-sample handling.

Layouts, tried in this order:
- packed shards: a folder holding ``prefetchd-index.npz`` (``shards.py``, written by `prefetchd pack`);
- a file list: ``location`` is a ``.csv``/``.tsv``/``.txt`` of ``path,label`` rows (``filelist.py``);
- class folders, as torchvision ImageFolder (``prefetchd.daemon.dataset``, cached by ``index_cache.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from prefetchd.daemon.dataset import SampleIndex, scan_class_folders
from prefetchd.daemon.sources.index_cache import cached_class_folders
from prefetchd.daemon.sources.filelist import is_file_list, read_file_list
from prefetchd.daemon.sources.shards import has_shard_index, read_shard_index
from prefetchd.daemon.sources.storage import Storage, is_url, storage_for


def open_dataset(location: str | Path, tick: Callable[[], object] = lambda: None, index_cache: Path | None = None,
                 refresh_index: bool = False) -> SampleIndex:
    """Index the dataset at ``location``; ``tick`` is called now and then while that takes long.

    Class folders are cached in ``index_cache`` (no cache when ``None``); ``refresh_index``
    rescans them even when the cache looks current."""
    location = str(location)
    storage_for(location)  # an unsupported URL is refused here, before any listing
    if is_file_list(location):
        return read_file_list(location)
    if has_shard_index(location):
        return read_shard_index(location)
    if index_cache is not None and Path(location).is_dir():
        return cached_class_folders(Path(location), index_cache, refresh_index, tick)
    return scan_class_folders(Path(location), tick=tick)


class SampleReader:
    """Reads samples of one index; made once per worker process (storages may hold connections)."""

    def __init__(self, index: SampleIndex) -> None:
        self.index = index
        self.storage: Storage = storage_for(index.root)

    def read(self, i: int) -> bytearray:
        rel, offset, size = self.index.location(i)
        return self.storage.read(rel, offset, size)


__all__ = ["SampleIndex", "SampleReader", "is_url", "open_dataset"]
