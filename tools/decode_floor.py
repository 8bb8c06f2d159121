"""What one core can do per image: the decode and resize kernels alone, no daemon.

    python tools/decode_floor.py DATA [--images 375] [--size 224] [--rounds 3]

Over JPEGs of the class-folder dataset DATA (every file, or an even sample of
``--images``), with one torch thread, reports the CPU time per image (best of
``--rounds``) of:

* the header: Pillow's parser with the EXIF orientation (what the daemon read for every
  file before ``plain_header``, and still reads for any other) and ``jpeg_crop.plain_header``;
* torchvision ``decode_jpeg`` (what the daemon runs for a plain JPEG at full scale where the
  crop-aware decode below is not built or refuses the file; the fast path is that crop-aware decode);
* Pillow ``Image.open().convert("RGB")`` (what ImageFolder's loader runs);
* simplejpeg at full size and at the smallest libjpeg-turbo scale (M/8) that keeps the
  sample's RandomResizedCrop box at least ``--size`` pixels — if ``simplejpeg`` is installed;
* the crop-aware decode of the sample's box (``prefetchd.daemon.jpeg_crop``, where its
  C extension is built): reading the file to its end, as for a file seen the first time, and
  stopping after the box, as for a file a worker has read cleanly before (``CleanFiles``);
  the resize of that box to ``--size`` by the extension's kernel and by torch's;
* the daemon's whole ``augment()`` (read, decode, crop, antialiased resize, flip): on files
  seen the first time, on files known clean (a worker's steady state from the second epoch),
  and where the crop-aware decoder is built, once more with whole-image decodes.

This is the ceiling the daemon's workers can approach: images/s per core is about
1000 / the ``augment()`` line.  Figures go in docs/BENCHMARKS.md with the machine.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable
from pathlib import Path

import click
import torch
from PIL import Image

from prefetchd.bench.floor import SHOWN_BAD_FILES, AugmentLoop
from prefetchd.daemon import jpeg_crop
from prefetchd.daemon.jpeg_crop import CleanFiles, TrackedFile
from prefetchd.daemon.sampler import sample_rng
from prefetchd.daemon.decode import DEFAULT_MAX_IMAGE_PIXELS, exif_orientation, open_header, read_header
from prefetchd.daemon.plan import pixel_box, random_resized_crop_box
from prefetchd.daemon.resample import resize as resample
from prefetchd.daemon.transforms import augment, preload


def cpu_ms_per_item(n: int, fn: Callable[[int], object], rounds: int) -> float:
    """CPU milliseconds per call of ``fn(i)`` for i in range(n), best of ``rounds``."""
    best = math.inf
    for _ in range(rounds):
        start = time.process_time()
        for i in range(n):
            fn(i)
        best = min(best, time.process_time() - start)
    return best / n * 1e3


def _decodable(paths: list[Path], size: int) -> list[Path]:
    """``paths`` less the files the daemon's ``augment()`` cannot decode (a truncated JPEG, a text file named .jpg),
    as the bench's floor leaves them out, said with why: every kernel below would fail on them (one stopped the tool
    with a traceback)."""
    try:
        loop = AugmentLoop(paths, size)
    except ValueError as exc:  # none decodes
        raise click.ClickException(str(exc)) from None
    if loop.bad:
        print(f"left out {len(loop.bad)} of {len(paths)} files that do not decode: "
              + "; ".join(loop.left_out()["undecodable_files"]) + ("; ..." if len(loop.bad) > SHOWN_BAD_FILES else ""))
    return [path for i, path in enumerate(paths) if i not in loop.bad]


@click.command(help=__doc__.split("\n\n")[0], context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("data", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--images", type=click.IntRange(min=1), default=375, show_default=True,
              help="JPEGs to time, an even sample of DATA's.")
@click.option("--size", type=click.IntRange(min=8), default=224, show_default=True,
              help="Output side, as the daemon's --image-size.")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Times each kernel runs; the best counts.")
def main(data: Path, images: int, size: int, rounds: int) -> None:
    torch.set_num_threads(1)
    preload()
    from torchvision.io import ImageReadMode, decode_jpeg

    paths = sorted(p for p in data.glob("*/*") if p.suffix.lower() in (".jpg", ".jpeg"))
    if not paths:
        raise click.ClickException(f"{data}: no .jpg/.jpeg files in class folders; point it at a class-folder dataset")
    paths = paths[:: max(1, len(paths) // images)][: images]
    paths = _decodable(paths, size)
    datas = [p.read_bytes() for p in paths]
    buffers = [bytearray(data) for data in datas]  # what the daemon's header readers take
    boxes = []
    for i, (path, buffer) in enumerate(zip(paths, buffers)):
        width, height = read_header(buffer, str(path), DEFAULT_MAX_IMAGE_PIXELS).oriented
        boxes.append(pixel_box(random_resized_crop_box(width, height, sample_rng(0, 0, i)), width, height))

    n = len(datas)
    rows: list[tuple[str, float]] = [
        ("header: Pillow's parser + orientation", cpu_ms_per_item(
            n, lambda i: exif_orientation(open_header(buffers[i], str(paths[i]))), rounds)),
        ("torchvision decode_jpeg", cpu_ms_per_item(n, lambda i: decode_jpeg(
            torch.frombuffer(bytearray(datas[i]), dtype=torch.uint8), mode=ImageReadMode.RGB), rounds)),
        ("Pillow open + convert RGB", cpu_ms_per_item(
            n, lambda i: Image.open(io.BytesIO(datas[i])).convert("RGB"), rounds)),
    ]
    try:
        import simplejpeg
    except ImportError:
        print("simplejpeg not installed: its rows are skipped (pip install simplejpeg)")
    else:
        def scaled(i: int) -> object:
            jpeg = datas[i]
            height, width = simplejpeg.decode_jpeg_header(jpeg)[:2]
            left, top, right, bottom = boxes[i]
            factor = min(right - left, bottom - top) / size
            return simplejpeg.decode_jpeg(jpeg, min_width=math.ceil(width / factor),
                                          min_height=math.ceil(height / factor))

        rows.append(("simplejpeg full size", cpu_ms_per_item(n, lambda i: simplejpeg.decode_jpeg(datas[i]), rounds)))
        rows.append(("simplejpeg scaled to the crop", cpu_ms_per_item(n, scaled, rounds)))
    def train_augment(i: int) -> object:
        return augment(paths[i], size, True, sample_rng(0, 0, i))

    if jpeg_crop.available():
        rows.append(("header: plain_header (markers only)", cpu_ms_per_item(
            n, lambda i: jpeg_crop.plain_header(datas[i]), rounds)))
        # Full scale only: decode_box's box is in the scaled image's pixels, the draft of augment() is not here.
        rows.append(("crop-aware decode of the box", cpu_ms_per_item(
            n, lambda i: jpeg_crop.decode_box(datas[i], 1, *boxes[i]), rounds)))
        rows.append(("crop-aware decode, file known clean", cpu_ms_per_item(
            n, lambda i: jpeg_crop.decode_box(datas[i], 1, *boxes[i], to_end=False), rounds)))
        # The resize of those boxes (at full scale: larger than augment()'s DCT-scaled ones), flipped
        # every other time, by the extension's kernel and by torch's (the path without it).
        crops = [jpeg_crop.decode_box(datas[i], 1, *boxes[i]) for i in range(n)]
        if all(crop is not None for crop in crops):
            def resize(i: int) -> object:
                return resample(crops[i], size, bool(i % 2))  # type: ignore[arg-type]

            rows.append(("resize of the box (extension's kernel)", cpu_ms_per_item(n, resize, rounds)))
            with jpeg_crop.whole_image_only():
                rows.append(("resize of the box (torch's kernel)", cpu_ms_per_item(n, resize, rounds)))
        with jpeg_crop.whole_image_only():
            rows.append(("prefetchd augment(), whole-image decode", cpu_ms_per_item(n, train_augment, rounds)))
    else:
        print(f"no crop-aware rows: {jpeg_crop.decoder_summary()}")
    rows.append(("prefetchd augment() (train)", cpu_ms_per_item(n, train_augment, rounds)))
    if jpeg_crop.available():
        clean = CleanFiles(n, shared=False)
        for i in range(n):  # what a worker's first epoch learns
            augment(paths[i], size, True, sample_rng(0, 0, i), tracked=TrackedFile(clean, i))
        rows.append(("prefetchd augment(), files known clean", cpu_ms_per_item(
            n, lambda i: augment(paths[i], size, True, sample_rng(0, 0, i), tracked=TrackedFile(clean, i)),
            rounds)))

    mean_kb = sum(map(len, datas)) / len(datas) / 1024
    print(f"{len(datas)} JPEGs from {data} (mean {mean_kb:.0f} KB), one thread, CPU ms per image, "
          f"best of {rounds}:")
    print(f"  ({jpeg_crop.decoder_summary()})")
    for name, ms in rows:
        print(f"  {name:<40} {ms:8.4f} ms   ({1000 / ms:5.0f} img/s per core)")


if __name__ == "__main__":
    main()
