"""A class-folder dataset of the files that break image pipelines, with what each should give.

``make_bad_images(root)`` writes two class folders that mix valid images in
unusual encodings (CMYK, grayscale, 16-bit, palette with transparency, RGBA,
EXIF-rotated, progressive, animated WebP, uppercase extensions, a hidden file)
with files no decoder can use (truncated, empty, text named .jpg, decompression
bombs, a FIFO, a broken symlink, an AppleDouble ``._`` file, an unreadable file)
and with non-image files that an ImageFolder index never lists.

Every valid image is flat colour, or two flat halves for the EXIF-rotated one,
so that whatever a crop keeps, its expected colours are known: ``Corpus.valid``
maps each file to the colours of the left and right half of a centre crop *as
displayed* (EXIF applied, alpha dropped, first frame, 16-bit high byte).
``tools/make_bad_images.py`` is the command line; the bad-image tests use it.

``damage`` makes endless more from any file: bytes changed, cut or inserted (the C
extension's fuzzing: tests/daemon/test_plain_header.py, and under the sanitizers in
tests/daemon/test_resample.py).
"""

from __future__ import annotations

import itertools
import os
import random
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

Colour = tuple[int, int, int]
SIZE = (64, 48)  # width, height of the valid images
CLASSES = ("class_a", "class_b")


@dataclass(frozen=True)
class Corpus:
    """What ``make_bad_images`` wrote; paths are relative to ``root``."""

    root: Path
    valid: dict[str, tuple[Colour, Colour]] = field(default_factory=dict)  # -> (left half, right half)
    undecodable: dict[str, str] = field(default_factory=dict)  # -> what is wrong with it
    ignored: dict[str, str] = field(default_factory=dict)  # not images by extension: never indexed
    notes: list[str] = field(default_factory=list)


def _solid(colour: Colour, mode: str = "RGB") -> Image.Image:
    return Image.new("RGB", SIZE, colour).convert(mode)


def _patch_jpeg_size(data: bytes, width: int, height: int) -> bytes:
    """``data`` with the frame header (SOF0/SOF2) declaring ``width`` x ``height``."""
    i = 2
    while i < len(data):
        marker = data[i + 1]
        length = struct.unpack(">H", data[i + 2 : i + 4])[0]
        if marker in (0xC0, 0xC2):
            return data[: i + 5] + struct.pack(">HH", height, width) + data[i + 9 :]
        i += 2 + length
    raise ValueError("no frame header in the JPEG")


def _patch_png_size(data: bytes, width: int, height: int) -> bytes:
    """``data`` with its IHDR declaring ``width`` x ``height`` (CRC fixed, so only the size is wrong)."""
    ihdr = bytearray(data[12:29])  # b"IHDR" + 13 bytes of fields
    ihdr[4:12] = struct.pack(">II", width, height)
    return data[:12] + bytes(ihdr) + struct.pack(">I", zlib.crc32(ihdr)) + data[33:]


def damage(rng: random.Random, data: bytes, end: int | None = None, cut: float = 0.0) -> bytes:
    """``data`` with 1 to 4 bytes changed, or runs of up to 8 cut or inserted, before ``end`` (the
    whole file by default; a header's end to aim at it), and with probability ``cut`` cut short."""
    out = bytearray(data)
    end = len(data) if end is None else end
    for _ in range(rng.randint(1, 4)):
        at, roll = rng.randrange(0, max(1, min(end, len(out)))), rng.random()
        if roll < 0.6 and out:
            out[at] = rng.randrange(256)
        elif roll < 0.8:
            del out[at:at + rng.randint(1, 8)]
        else:
            out[at:at] = rng.randbytes(rng.randint(1, 8))
    return bytes(out[:rng.randrange(0, len(out) + 1)]) if rng.random() < cut else bytes(out)


def make_bad_images(root: Path, filler: int = 6) -> Corpus:
    """Write the corpus under ``root`` (which must not hold one yet) and describe it."""
    root = Path(root)
    a, b = (root / c for c in CLASSES)
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    corpus = Corpus(root)
    # Cycled: a list of 48 ran out at --filler 25 (StopIteration, a walk); a colour needs no file of its own.
    palette = itertools.cycle([(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40), (40, 200, 200),
                               (200, 40, 200), (230, 150, 60), (60, 150, 230), (150, 230, 60), (120, 60, 30),
                               (30, 120, 60), (60, 30, 120)])

    def valid(path: Path, colour: Colour, right: Colour | None = None) -> None:
        corpus.valid[str(path.relative_to(root))] = (colour, right or colour)

    # -- valid images in the encodings real folders contain -------------------------
    path = a / "cmyk.jpg"
    _solid((220, 30, 30), "CMYK").save(path, quality=95)
    valid(path, (220, 30, 30))
    path = a / "gray.jpg"
    _solid((128, 128, 128), "L").save(path, quality=95)
    valid(path, (128, 128, 128))
    path = a / "gray16.png"  # ImageFolder (Pillow's convert) would make it white
    Image.fromarray(np.full(SIZE[::-1], 200 * 256 + 77, dtype=np.uint16)).save(path)
    valid(path, (200, 200, 200))
    path = a / "palette_alpha.png"  # index 0 is fully transparent green: dropped alpha leaves green
    pal = Image.new("P", SIZE, 0)
    pal.putpalette([0, 128, 0, 255, 255, 255] + [0] * 762)
    pal.save(path, transparency=0)
    valid(path, (0, 128, 0))
    path = a / "rgba.png"
    rgba = _solid((10, 20, 200), "RGBA")
    rgba.putalpha(64)
    rgba.save(path)
    valid(path, (10, 20, 200))
    path = a / "exif_rotated.jpg"  # stored 96 x 48, top half red: displayed 48 x 96 with red on the right
    stored = np.zeros((48, 96, 3), dtype=np.uint8)
    stored[:24] = (220, 30, 30)
    stored[24:] = (30, 30, 220)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    Image.fromarray(stored).save(path, exif=exif, quality=95)
    valid(path, (30, 30, 220), (220, 30, 30))
    path = a / "progressive.jpg"
    colour = next(palette)
    _solid(colour).save(path, progressive=True, quality=95)
    valid(path, colour)
    path = a / "animated.webp"  # the first frame counts, as in ImageFolder
    colour = next(palette)
    frames = [_solid(colour), _solid((0, 0, 0)), _solid((255, 255, 255))]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0, lossless=True)
    valid(path, colour)
    for name in ("PHOTO.JPG", "scan.JPEG", "icon.Png", ".hidden.jpg"):  # ImageFolder lists hidden files too
        path = a / name
        colour = next(palette)
        _solid(colour).save(path, format="PNG" if name.lower().endswith(".png") else "JPEG", quality=95)
        valid(path, colour)
    for folder in (a, b):
        for i in range(filler):
            path = folder / f"plain_{i:03d}.jpg"
            colour = next(palette)
            _solid(colour).save(path, quality=95)
            valid(path, colour)

    # -- files no decoder can use ---------------------------------------------------
    def bad(path: Path, what: str) -> None:
        corpus.undecodable[str(path.relative_to(root))] = what

    good = (b / "plain_000.jpg").read_bytes()
    (b / "truncated.jpg").write_bytes(good[: len(good) // 2])
    bad(b / "truncated.jpg", "a JPEG cut in half")
    (b / "empty.jpg").write_bytes(b"")
    bad(b / "empty.jpg", "zero bytes")
    (b / "text.jpg").write_text("this is not an image\n")
    bad(b / "text.jpg", "text named .jpg")
    (b / "bomb.jpg").write_bytes(_patch_jpeg_size(good, 40000, 40000))
    bad(b / "bomb.jpg", "a JPEG header declaring 40000 x 40000 pixels (Pillow refuses it too)")
    buf = (a / "icon.Png").read_bytes()
    (b / "bomb.png").write_bytes(_patch_png_size(buf, 12000, 9000))
    bad(b / "bomb.png", "a PNG header declaring 12000 x 9000 pixels (Pillow would only warn)")
    os.mkfifo(b / "fifo.jpg")
    bad(b / "fifo.jpg", "a FIFO: opening it for reading would wait for a writer")
    os.symlink("does-not-exist.jpg", b / "broken_link.jpg")
    bad(b / "broken_link.jpg", "a symlink to a missing file")
    (b / "._plain_001.jpg").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(64))
    bad(b / "._plain_001.jpg", "macOS AppleDouble metadata named like an image")
    path = b / "unreadable.jpg"
    colour = next(palette)
    _solid(colour).save(path, quality=95)
    path.chmod(0)
    if os.geteuid() == 0:  # root reads a mode-000 file anyway: it is a valid image then
        valid(path, colour)
        corpus.notes.append("unreadable.jpg has mode 000, which root reads anyway: valid when run as root")
    else:
        bad(path, "mode 000: permission denied")

    # -- not images: an ImageFolder index never lists them ---------------------------
    for folder, name, content in ((a, "README.txt", b"notes\n"), (a, ".DS_Store", bytes(32)),
                                  (b, "labels.csv", b"file,label\n"), (b, "Thumbs.db", bytes(16))):
        (folder / name).write_bytes(content)
        corpus.ignored[str((folder / name).relative_to(root))] = "not an image extension"
    return corpus
