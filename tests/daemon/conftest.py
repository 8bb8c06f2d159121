"""Helpers for the daemon's unit tests: tiny images written with Pillow, and a
directory on the real tmpfs."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

# Pillow picks the encoder from the extension; these spell it out so that
# upper-case and odd extensions still get a real image of the right kind.
_FORMATS = {
    ".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".ppm": "PPM", ".bmp": "BMP",
    ".pgm": "PPM", ".tif": "TIFF", ".tiff": "TIFF", ".webp": "WEBP",
}


def write_image(path: Path, size: tuple[int, int] = (6, 4), mode: str = "RGB", seed: int = 0) -> Path:
    """Write a small noise image; the format follows the (case-insensitive) extension."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    w, h = size
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    fmt = _FORMATS.get(path.suffix.lower(), "PNG")
    if path.suffix.lower() == ".pgm":
        img = img.convert("L")
    elif mode != "RGB":
        img = img.convert(mode)
    img.save(path, format=fmt)
    return path


@pytest.fixture
def make_image() -> Callable[..., Path]:
    return write_image


@pytest.fixture
def shm_buffer() -> Iterator[Path]:
    """A fresh directory on /dev/shm (falls back to /tmp where /dev/shm is missing)."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path("/tmp")
    path = base / f"prefetchd-daemon-unit-{uuid.uuid4().hex[:10]}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def homeless(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A uid with no account and HOME="", as a container's --user 12345: the index cache's default is then a
    private temp folder of the process's own (made afresh for the test, forgotten after it)."""
    import prefetchd.daemon.sources.index_cache as index_cache

    def no_account(uid: int) -> object:
        raise KeyError(uid)

    for name in ("CACHE_DIRECTORY", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", "")
    monkeypatch.setattr(index_cache.pwd, "getpwuid", no_account)
    index_cache._private_temp_cache.cache_clear()
    yield
    index_cache._private_temp_cache.cache_clear()
