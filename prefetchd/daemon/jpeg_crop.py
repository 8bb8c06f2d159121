"""Decode only the rows and columns of a JPEG that the crop keeps, where the C extension is built.

``prefetchd.daemon._cropjpeg`` (``_cropjpeg.c``, built by setup.py when a C compiler
and libjpeg-turbo's headers are present) skips the rows above the box, narrows every
row to the iMCU columns around it and stops converting pixels below it, with
libjpeg-turbo's DCT scaling on top where the crop is at least twice the output.
Measured on this project's 2-core machine (shared, load average ~2.6), 200
ImageNet-like JPEGs (~96 KB, mean 542 x 441), RandomResizedCrop 224 boxes, one
thread, medians of 7 interleaved rounds: header, decode and crop 1.02 ms against
1.44 ms for the whole-image path (``decode_jpeg`` or Pillow's draft); the daemon's
whole ``augment()`` 17% less CPU (tools/decode_floor.py; docs/BENCHMARKS.md).
PyTurboJPEG was measured too and loses: its 1.x crop is a lossless transform
(entropy-decode, re-encode, decode again: 1.73 ms), its 2.x needs libturbojpeg 3
and has no partial decode either.

The box it returns is bit-identical to the same box cut from a full decode at the
same scale (tests/daemon/test_jpeg_crop.py: 4:2:0, 4:2:2, 4:4:4, grayscale,
progressive, restart markers, any size; ``decode`` turns the box through the EXIF
orientation and the crop back), and it refuses — ``None`` here, so the caller runs
the full decode — every file a full decode would fail or warn on.  So pixels do not
depend on whether a machine has the extension, provided the system's libjpeg-turbo,
which it links, decodes as the copies bundled in torchvision and Pillow do (here 2.1.5
against those of torchvision 0.29.1 and Pillow 13: identical; the tests check it on
each machine, and decoders of different libjpeg-turbo releases could differ by a level
or two, as torchvision and Pillow of different releases already can).

A file a worker has decoded cleanly to its end once is remembered (``CleanFiles``, shared
by a pool's workers): later crops of it stop after their last row, the same pixels sooner.

It also reads a plain JPEG's size and EXIF orientation from its markers (``plain_header``),
which is all the plan and the crop need from the header: Pillow's parser, which the other
paths still use, took 22 us of each ~0.75 ms image.

The extension also resizes (``resize``, ``_resample.c``): torch's antialiased bilinear
uint8 kernel, byte for byte, so that a worker needs no torch (``resample``).

Without the extension ``available()`` is False, the daemon decodes whole images and
resizes with torch; ``decoder_summary()`` is the line ``prefetchd start`` logs once.
"""

from __future__ import annotations

import importlib
import logging
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from prefetchd.daemon.extension_sources import source_digest

log = logging.getLogger(__name__)

# pip keeps the wheel it built without the extension and reinstalls that one, even with --force-reinstall and
# --no-binary, unless told --no-cache-dir (a walk of a package install).
INSTALL_HINT = ("install a C compiler and libjpeg-turbo's headers (Debian: apt-get install gcc "
                "libjpeg62-turbo-dev; Ubuntu: gcc libjpeg-turbo8-dev; Fedora: gcc libjpeg-turbo-devel), "
                "then reinstall prefetchd from source: pip install -e . in a checkout, or pip install "
                "--force-reinstall --no-deps --no-cache-dir --no-binary prefetchd prefetchd")


REBUILD_HINT = "build it again: pip install -e . in the checkout (or python setup.py build_ext --inplace there)"


def _load() -> tuple[ModuleType | None, str | None]:
    """The extension, or None and why it is not used: None where it is not built (``INSTALL_HINT`` says how)."""
    name = "prefetchd.daemon._cropjpeg"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            return None, None
        return None, f"is built but does not load ({exc}); {REBUILD_HINT}"
    except ImportError as exc:  # its library missing or another one (a wheel built elsewhere), a file damaged
        return None, (f"is built but does not load ({exc}): install the libjpeg-turbo library it was built against "
                      f"(Debian: libjpeg62-turbo; Ubuntu: libjpeg-turbo8), or {REBUILD_HINT}")
    expected = source_digest(Path(__file__).parent)
    if expected is not None and getattr(module, "SOURCE_DIGEST", "") != expected:
        return None, (f"was built from other sources than this prefetchd's ({module.__file__}: a checkout changed "
                      f"since it was built); {REBUILD_HINT}")
    return module, None


_extension, unusable = _load()


def available() -> bool:
    return _extension is not None


@contextmanager
def whole_image_only() -> Iterator[None]:
    """Inside the block this process decodes whole images and resizes with torch even where the
    extension is built: the comparison of tools/decode_floor.py."""
    global _extension
    saved, _extension = _extension, None
    try:
        yield
    finally:
        _extension = saved


def decoder_summary() -> str:
    """Which JPEG decoder this install has, and how to get the faster one if it lacks it."""
    if _extension is not None:
        version = int(_extension.LIBJPEG_TURBO_VERSION_NUMBER)
        return (f"JPEG decoder: crop-aware (libjpeg-turbo {version // 1000000}.{version // 1000 % 1000}."
                f"{version % 1000}: only the crop's rows and columns are decoded)")
    built = unusable if unusable is not None else f"is not built: {INSTALL_HINT}"
    return ("JPEG decoder: whole-image (torchvision/Pillow); the crop-aware decoder (~30% less decode time, "
            f"~17% less CPU per RandomResizedCrop image) {built}")


def decode_box(data: bytes | bytearray, scale: int, left: int, top: int, right: int, bottom: int,
               to_end: bool = True) -> np.ndarray | None:
    """The box ``[left, right) x [top, bottom)`` of the JPEG in ``data`` decoded at 1/``scale``
    (box in scaled pixels) as a writable, contiguous H x W x 3 uint8 array; ``None`` where the
    extension is missing or a full decode of the file would fail or warn (the caller decodes
    in full then, and so names the problem as it always has).

    ``to_end=False`` stops after the box's last row, and so is only for a file whose whole
    stream has decoded cleanly before (``CleanFiles``): for any other it could accept what a
    full decode refuses (damage below the box, or that only the end of the stream shows)."""
    if _extension is None:
        return None
    try:
        rows = _extension.decode_box(data, scale, left, top, right, bottom, to_end)
    except _extension.DecodeError as exc:
        log.debug("crop-aware decode refused the file (%s): decoding it in full", exc)
        return None
    return np.frombuffer(rows, dtype=np.uint8).reshape(bottom - top, right - left, 3)


class JpegHeader(NamedTuple):
    """A JPEG's stored size and its EXIF orientation (1-8)."""

    width: int
    height: int
    orientation: int


def plain_header(data: bytes | bytearray) -> JpegHeader | None:
    """The header of a plain JPEG, read from its markers (0.4 us, against 22 us for Pillow's
    parser with the orientation: tools/decode_floor.py): the file is one Pillow opens and reads
    the same way (``_cropjpeg.c`` says what "plain" takes; tests/daemon/test_plain_header.py
    checks the agreement, also on mutated headers).  ``None`` without the extension or for any
    other file: Pillow reads those."""
    if _extension is None:
        return None
    got = _extension.plain_header(data)
    return JpegHeader(*got) if got is not None else None


def resize(pixels: np.ndarray, size: int, mirror: bool, into: np.ndarray | None = None) -> np.ndarray | None:
    """Contiguous H x W x 3 uint8 ``pixels`` resized to ``size`` x ``size`` x 3 as torch's antialiased
    bilinear uint8 kernel does (``_resample.c``), columns mirrored if ``mirror``, as a writable array:
    ``into`` (a contiguous ``size`` x ``size`` x 3 uint8 array, written in place) or a new one.
    None where the extension is missing."""
    if _extension is None:
        return None
    height, width = pixels.shape[:2]
    if into is not None:
        _extension.resize(pixels, height, width, size, size, mirror, True, into)
        return into
    out = _extension.resize(pixels, height, width, size, size, mirror)
    return np.frombuffer(out, dtype=np.uint8).reshape(size, size, 3)


class CleanFiles:
    """Which samples' JPEG files a crop-aware decode has read to the end without a warning.

    The decode of a crop must read the file to its end (``decode_box``), so that a file damaged
    below the crop is refused as a full decode refuses it; that check is the same in every
    epoch, and ~0.1 ms of the ~0.9 ms decode of an ImageNet-sized JPEG.  This table remembers
    it: one uint32 per sample, the byte count of the file that passed (0: not yet), and a crop
    of a file that passed stops after its last row — the same pixels.  A file whose size
    changed is checked again; one rewritten in place with other bytes of the same size is not,
    and so could then be accepted where a full decode would refuse it (restart the daemon after
    rewriting files in place).

    ``shared``: the table lives in a memfd, and a pool's workers, which receive it when they
    start (pickling it while a process is spawned passes the descriptor), share what each
    learns; 4 bytes per sample, in memory only, gone with the last process that holds it.
    Unshared: a table of this process alone (a Ray worker on another node).
    """

    def __init__(self, samples: int, shared: bool = True, _fd: int | None = None) -> None:
        self.samples = samples
        nbytes = 4 * max(samples, 1)
        self._fd = _fd if _fd is not None else (os.memfd_create("prefetchd-clean-files", os.MFD_CLOEXEC)
                                                if shared else -1)
        if self._fd >= 0:
            if _fd is None:
                os.ftruncate(self._fd, nbytes)
            self._map: mmap.mmap | None = mmap.mmap(self._fd, nbytes)
            self._sizes = memoryview(self._map).cast("I")
        else:
            self._map = None
            self._sizes = memoryview(bytearray(nbytes)).cast("I")

    def __reduce__(self) -> tuple[Any, ...]:
        if self._fd < 0:
            return (CleanFiles, (self.samples, False))
        from multiprocessing.reduction import DupFd

        return (_attach, (DupFd(self._fd), self.samples))

    @property
    def fd(self) -> int:
        """The memfd behind a shared table (-1: unshared), for a process started without
        multiprocessing, which gets it passed open and calls ``attach``."""
        return self._fd

    @classmethod
    def attach(cls, fd: int, samples: int) -> CleanFiles:
        """This process's end of a shared table whose memfd it holds as ``fd``."""
        return cls(samples, _fd=fd)

    def known_clean(self, index: int, nbytes: int) -> bool:
        return nbytes > 0 and self._sizes[index] == nbytes  # 0 in the table: not known

    def record_clean(self, index: int, nbytes: int) -> None:
        if nbytes < 1 << 32:
            self._sizes[index] = nbytes

    def close(self) -> None:
        self._sizes.release()
        if self._map is not None:
            self._map.close()
            os.close(self._fd)
            self._map, self._fd = None, -1


def _attach(fd: Any, samples: int) -> CleanFiles:
    """The spawned process's end of a shared ``CleanFiles``."""
    return CleanFiles.attach(fd.detach(), samples)


class TrackedFile(NamedTuple):
    """One sample's entry in a ``CleanFiles`` table, for the decode of that sample."""

    table: CleanFiles
    sample: int

    def known_clean(self, nbytes: int) -> bool:
        return self.table.known_clean(self.sample, nbytes)

    def record_clean(self, nbytes: int) -> None:
        self.table.record_clean(self.sample, nbytes)
