"""`prefetchd show`: the next waiting batch as a labelled image grid."""

from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw

from prefetchd.buffer_protocol import Manifest, MappedBatch, Progress, list_batches, map_batch
from prefetchd.buffer_protocol.layout import STREAM_PREFIX
from prefetchd.daemon.errors import DaemonError

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


def render_next_batch(buffer: Path, out: Path, max_images: int = 64) -> MappedBatch:
    """Write the grid of the next waiting batch to ``out``, whose suffix picks the image format, in its
    folder, which is not created (`prefetchd show` refuses a missing one: ``missing_folder``)."""
    if out.suffix.lower() not in Image.registered_extensions():
        raise DaemonError(f"--out {out}: name an image file such as batch.png or batch.jpg (the suffix picks the "
                          "format)")
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
        draw.text((x + 2, y + h * scale + 1), f"{name} #{int(batch.indices[i])}", fill="black")
    try:
        grid.save(out)
    except OSError as exc:
        raise DaemonError(f"cannot write {out}: {exc.strerror or exc}; pass --out with a writable path") from None
    return batch
