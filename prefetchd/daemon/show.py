"""`prefetchd show`: the next waiting batch as a labelled image grid."""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import warnings
from pathlib import Path

from PIL import Image, ImageDraw

from prefetchd.buffer_protocol import Manifest, MappedBatch, Progress, list_batches, map_batch
from prefetchd.buffer_protocol.layout import STREAM_PREFIX
from prefetchd.daemon.errors import DaemonError
from prefetchd.locations import missing_folder, probe_folder

LABEL_HEIGHT = 14
MIN_TILE = 96  # small images are scaled up so labels stay readable


def next_batch(buffer: Path) -> MappedBatch:
    progress = Progress.read(buffer) or Progress(0, 0)
    waiting = sorted(k for k in list_batches(buffer) if k >= (progress.epoch, progress.step))
    if not waiting:
        streams = sorted(d.name for d in buffer.glob(f"{STREAM_PREFIX}*") if d.is_dir())
        if streams:
            raise DaemonError(f"{buffer} holds one stream per rank ({', '.join(streams[:3])}"
                              f"{', ...' if len(streams) > 3 else ''}); pass one: --buffer {buffer / streams[0]}")
        raise DaemonError(f"{buffer} has no waiting batch; is a daemon filling it (`prefetchd status --buffer {buffer}`)?")
    return map_batch(list_batches(buffer)[waiting[0]])


def _format(suffix: str) -> str | None:
    """The Pillow format a file suffix names (``.JPG``: JPEG), as ``Image.save`` picks it; None for none."""
    return Image.registered_extensions().get(suffix.lower())


@functools.cache
def _writes_rgb(suffix: str) -> bool:
    """Whether Pillow here writes an RGB image in the format ``suffix`` names.  Asked by writing a pixel:
    a registered suffix may name a format Pillow only reads (.psd), one whose writer is a plugin not
    installed (.wmf, .h5) or one without RGB (.xbm), each a traceback at the save."""
    form = _format(suffix)
    if form is None or form not in Image.SAVE:
        return False
    try:
        with warnings.catch_warnings():  # a deprecated format's warning is for who writes in it
            warnings.simplefilter("ignore")
            Image.new("RGB", (1, 1)).save(io.BytesIO(), format=form)
    except (OSError, ValueError, KeyError):
        return False
    return True


# What a refused --out suggests: all ~40 suffixes Pillow writes (.jpe, .jfif, .vst, ...) buried the one to use.
COMMON_SUFFIXES = (".png", ".jpg", ".webp", ".tif", ".bmp")


def bad_suffix(out: Path) -> str | None:
    """Why ``--out`` ``out`` names no image format the grid can be written in; None when it names one."""
    if _writes_rgb(out.suffix):
        return None
    what = f"Pillow writes no RGB image as {out.suffix!r}" if out.suffix else "no suffix"
    common = " ".join(s for s in COMMON_SUFFIXES if _writes_rgb(s))  # a Pillow without WebP, say
    return (f"--out {out}: {what}, and the suffix picks the image format; name a file such as batch.png "
            f"(common suffixes: {common}, or any other suffix Pillow can write RGB images in)")


def unwritable_out(out: Path) -> str | None:
    """Why the grid cannot be written to ``out``, found before the batch is read (`prefetchd show`'s bad
    --out value): a suffix of no format it can be written in, a missing folder (not created:
    ``missing_folder``), a folder this user cannot create the file in; None when it can be.  An existing
    file is written in place, whatever its folder allows (click's ``writable`` asks whether it may be)."""
    if out.is_symlink() and not out.exists():  # a dangling link: the file is made where it points
        target = Path(os.path.realpath(out))
        if (problem := missing_folder(f"--out {out} links to", target)) is not None:
            return problem
        out = target
    if (problem := bad_suffix(out) or missing_folder("--out", out)) is not None:
        return problem
    if out.exists():
        return None
    try:
        probe_folder(out.parent, out.name)
    except OSError as exc:
        return f"--out {out}: cannot write in {out.parent} ({exc.strerror or exc}); pass a path in a folder you can write"
    return None


def render_next_batch(buffer: Path, out: Path, max_images: int = 64) -> MappedBatch:
    """Write the grid of the next waiting batch to ``out``, whose suffix picks the image format, in its
    folder, which is not created (`prefetchd show` refuses a missing one up front: ``unwritable_out``)."""
    if (problem := bad_suffix(out)) is not None:
        raise DaemonError(problem)
    batch = next_batch(buffer)
    manifest = Manifest.read(buffer)
    images = batch.images[:max_images]
    n, h, w, _ = images.shape
    scale = max(1, math.ceil(MIN_TILE / max(h, w)))
    tile_w, tile_h = w * scale, h * scale + LABEL_HEIGHT
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    grid = Image.new("RGB", (cols * tile_w, rows * tile_h), "white")
    draw = ImageDraw.Draw(grid)
    for i in range(n):
        x, y = (i % cols) * tile_w, (i // cols) * tile_h
        tile = Image.fromarray(images[i]).resize((w * scale, h * scale), Image.Resampling.NEAREST)
        grid.paste(tile, (x, y))
        label = int(batch.labels[i])
        name = manifest.classes[label] if 0 <= label < len(manifest.classes) else str(label)
        draw.text((x + 2, y + h * scale + 1), f"{drawable(name)} #{int(batch.indices[i])}", fill="black")
    save_checked(grid, out)
    return batch


def drawable(name: str) -> str:
    """A class name as the grid's label can show it: Pillow's default font draws only ASCII, so "café" and a
    Latin-1 folder name read as UTF-8 both came out "caf" and a box, "日本" as boxes, and a name with a newline cut
    its sample's number off (a user's walk).  Such names are spelled as Python escapes them, which tells them
    apart."""
    return name if name.isascii() and name.isprintable() else ascii(name)[1:-1]


def save_checked(image: Image.Image, out: Path) -> None:
    """Write ``image`` to ``out`` in the format its suffix names; DaemonError, and no partial file left, where the
    write fails.  Encoded in memory first: Pillow's JPEG and TIFF writers let a full disk pass, leaving a
    truncated file that `prefetchd show` said it wrote (a user's walk, on a nearly full tmpfs)."""
    encoded = io.BytesIO()
    image.save(encoded, format=_format(out.suffix))  # a suffix bad_suffix let through names one
    try:
        with open(out, "wb") as f:
            f.write(encoded.getbuffer())
    except OSError as exc:
        with contextlib.suppress(OSError):
            if out.is_file():
                out.unlink()
        raise DaemonError(f"cannot write {out}: {exc.strerror or exc}; pass --out with a writable path") from None
