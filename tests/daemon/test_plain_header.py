"""jpeg_crop.plain_header: every JPEG it reads, Pillow opens and reads the same way (stored size
and EXIF orientation), so that the plan drawn from it is the plan Pillow's reading gives; any
other file is left to Pillow (None)."""

from __future__ import annotations

import io
import random
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from prefetchd.bad_images import damage, make_bad_images
from prefetchd.daemon import jpeg_crop
from prefetchd.daemon.decode import exif_orientation

pytestmark = pytest.mark.skipif(
    not jpeg_crop.available(),
    reason="prefetchd.daemon._cropjpeg is not built (no C compiler or libjpeg-turbo headers at install time)")

ORIENTATION, X_RESOLUTION, RESOLUTION_UNIT, MAKE = 0x0112, 0x011A, 0x0128, 0x010F
SHORT, LONG, RATIONAL, ASCII = 3, 4, 5, 2
XMP_PREFIX = b"http://ns.adobe.com/xap/1.0/\x00"


def pillow_view(data: bytes) -> tuple[int, int, int] | str:
    """(width, height, orientation) as decode.read_header reads them from Pillow, for a JPEG the crop-aware
    path takes (RGB or L); else what Pillow made of the file."""
    limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None  # off, as in a worker: the daemon has its own
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with Image.open(io.BytesIO(data)) as img:
                if img.format != "JPEG" or img.mode not in ("RGB", "L"):
                    return f"{img.format} {img.mode}"
                return img.width, img.height, exif_orientation(img)
        except Exception as exc:  # whatever Pillow raises, the file is not one plain_header may read
            return type(exc).__name__
        finally:
            Image.MAX_IMAGE_PIXELS = limit


def exif(endian: str, entries: list[tuple[int, int, int, bytes]]) -> bytes:
    """An EXIF segment's payload: a TIFF header and IFD0 of ``entries`` (tag, type, count, 4 value bytes)."""
    e = "<" if endian == "II" else ">"
    ifd = struct.pack(e + "H", len(entries)) + b"".join(struct.pack(e + "HHI", *entry[:3]) + entry[3] for entry in entries)
    return b"Exif\x00\x00" + endian.encode() + struct.pack(e + "HI", 42, 8) + ifd + struct.pack(e + "I", 0)


def short(endian: str, value: int) -> bytes:
    return struct.pack("<HH" if endian == "II" else ">HH", value, 0)


def jpeg(mode: str = "RGB", size: tuple[int, int] = (53, 37), exif_payload: bytes | None = None, **kw: object) -> bytes:
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).convert(mode)
    out = io.BytesIO()
    img.save(out, "JPEG", **({"exif": exif_payload} if exif_payload else {}), **kw)
    return out.getvalue()


def with_segment(data: bytes, marker: int, payload: bytes) -> bytes:
    """``data`` with a segment inserted right after its SOI."""
    return data[:2] + struct.pack(">BBH", 0xFF, marker, len(payload) + 2) + payload + data[2:]


def oriented(endian: str, orientation: int, **kw: object) -> bytes:
    return jpeg(exif_payload=exif(endian, [(MAKE, ASCII, 4, b"abc\x00"), (ORIENTATION, SHORT, 1, short(endian, orientation))]),
                **kw)


@pytest.mark.parametrize("endian", ["II", "MM"])
@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("kind", [{}, {"mode": "L"}, {"progressive": True}, {"subsampling": 0}, {"dpi": (300, 300)}])
def test_reads_the_size_and_orientation_pillow_reads(endian: str, orientation: int, kind: dict[str, object]) -> None:
    data = oriented(endian, orientation, **kind)
    assert jpeg_crop.plain_header(data) == (53, 37, orientation) == pillow_view(data)


def test_reads_a_file_without_exif_and_one_with_pillows_own_exif_and_icc_profile() -> None:
    assert jpeg_crop.plain_header(jpeg()) == (53, 37, 1) == pillow_view(jpeg())
    tags = Image.Exif()
    tags[ORIENTATION], tags[X_RESOLUTION] = 6, 300.0
    data = jpeg(exif_payload=tags.tobytes(), icc_profile=bytes(range(256)) * 300, comment=b"a comment")  # 2 ICC segments
    assert jpeg_crop.plain_header(data) == (53, 37, 6) == pillow_view(data)


def _not_plain() -> dict[str, tuple[bytes, object]]:
    """Files plain_header leaves to Pillow, with what Pillow reads there (a view, or just "any")."""
    ii = "II"
    no_orientation = jpeg(exif_payload=exif(ii, [(MAKE, ASCII, 4, b"abc\x00")]))
    xmp = XMP_PREFIX + b'<x:xmpmeta><rdf:Description tiff:Orientation="6"/></x:xmpmeta>'
    two_exif = with_segment(oriented(ii, 3), 0xE1, exif(ii, [(ORIENTATION, SHORT, 1, short(ii, 6))]))
    lossless = bytearray(jpeg())
    sof = lossless.index(b"\xff\xc0")
    lossless[sof + 1] = 0xC3
    # A frame segment one byte longer than its components: Pillow reads components 3 bytes at a time.
    frame_len = int.from_bytes(jpeg()[sof + 2:sof + 4], "big")
    long_frame = jpeg()[:sof + 2] + (frame_len + 1).to_bytes(2, "big") + jpeg()[sof + 4:sof + 2 + frame_len] + b"\x00" \
        + jpeg()[sof + 2 + frame_len:]
    return {
        # Pillow takes the orientation from XMP where EXIF has none: 6 here, where EXIF alone says 1.
        "XMP orientation": (with_segment(no_orientation, 0xE1, xmp), (53, 37, 6)),
        "two EXIF segments": (two_exif, "any"),
        "orientation as a LONG": (jpeg(exif_payload=exif(ii, [(ORIENTATION, LONG, 1, struct.pack("<I", 6))])), "any"),
        "orientation 9": (oriented(ii, 9), "any"),
        "two orientation entries": (jpeg(exif_payload=exif(ii, [(ORIENTATION, SHORT, 1, short(ii, 6)),
                                                                (ORIENTATION, SHORT, 1, short(ii, 3))])), "any"),
        # Pillow reads an X resolution for the DPI and fails on a one-letter ASCII one: its open fails.
        "X resolution as ASCII": (jpeg(exif_payload=exif(ii, [(RESOLUTION_UNIT, SHORT, 1, short(ii, 2)),
                                                              (X_RESOLUTION, ASCII, 1, b"7\x00\x00\x00")])),
                                  "UnidentifiedImageError"),
        "EXIF value outside the segment": (jpeg(exif_payload=exif(ii, [(MAKE, ASCII, 400, struct.pack("<I", 30)),
                                                                       (ORIENTATION, SHORT, 1, short(ii, 6))])), "any"),
        "MPO index": (with_segment(jpeg(), 0xE2, b"MPF\x00" + bytes(40)), "any"),
        # Segments Pillow reads past the end of: its open fails.
        "Photoshop block": (with_segment(jpeg(), 0xED, b"Photoshop 3.0\x008BIM\x04\x04"), "UnidentifiedImageError"),
        "short JFIF segment": (with_segment(jpeg()[:2] + jpeg()[20:], 0xE0, b"JFIF\x00\x01"), "UnidentifiedImageError"),
        "short Adobe segment": (with_segment(jpeg(), 0xEE, b"Adobe\x00"), "UnidentifiedImageError"),
        "short ICC segment": (with_segment(jpeg(), 0xE2, b"ICC_PROFILE\x00\x01"), "UnidentifiedImageError"),
        "CMYK": (jpeg("CMYK"), "JPEG CMYK"),
        "lossless frame": (bytes(lossless), "any"),
        "frame segment longer than its components": (long_frame, "UnidentifiedImageError"),
        "truncated header": (jpeg()[:120], "any"),
        "a PNG": (b"\x89PNG\r\n\x1a\n" + bytes(40), "any"),
    }


@pytest.mark.parametrize("what", list(_not_plain()))
def test_leaves_other_files_to_pillow(what: str) -> None:
    data, pillow = _not_plain()[what]
    assert jpeg_crop.plain_header(data) is None
    if pillow != "any":
        assert pillow_view(data) == pillow


def test_agrees_with_pillow_on_the_bad_image_corpus(tmp_path: Path) -> None:
    corpus = make_bad_images(tmp_path / "bad")
    read = 0
    for path in sorted(corpus.root.rglob("*")):
        if path.is_file() and (got := jpeg_crop.plain_header(path.read_bytes())) is not None:
            read += 1
            assert got == pillow_view(path.read_bytes()), path.name
    assert read > 0  # the corpus's good JPEGs


def test_agrees_with_pillow_on_mutated_headers() -> None:
    """Bytes changed, cut or inserted anywhere before the first scan: whatever plain_header still
    reads, Pillow must open and read the same way (a rule missing from _cropjpeg.c fails here)."""
    seeds = [oriented(e, o, **kind) for e in ("II", "MM") for o in (1, 6, 8)
             for kind in ({}, {"mode": "L"}, {"progressive": True}, {"dpi": (72, 72)})]
    rng = random.Random(0)
    read = 0
    for _ in range(20000):
        seed = rng.choice(seeds)
        data = damage(rng, seed, seed.index(b"\xff\xda") + 4, cut=0.1)
        got = jpeg_crop.plain_header(data)
        if got is not None:
            read += 1
            assert got == pillow_view(data), data[:600].hex()
    assert read > 1000  # enough mutants are still plain for the agreement to mean something
