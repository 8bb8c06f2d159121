"""Read an image's header and decode what its crop needs.

Decoding, by the file's magic bytes, never its name:

* JPEG (RGB or grayscale) where the optional C extension is built: only the crop
  box's rows and columns, rounded out to the MCU grid, DCT-scaled like the draft
  decode below where the crop is at least twice the output (``jpeg_crop``: ~30% less
  decode time, bit-identical to cutting the box from the full decode).  With an EXIF
  orientation the box is turned back into stored pixels and the decoded crop turned
  forward.  Any file it would not decode exactly as a full decode does — a warning,
  an error, CMYK, a rare subsampling — goes on to the paths below, which decide as before.
  It reads the file to its end the first time (damage below the crop must refuse the
  file as a full decode would); a worker's ``jpeg_crop.CleanFiles`` remembers a file that
  passed, and later crops of it stop after their last row (~0.1 ms of ~0.9 less).
* JPEG (RGB or grayscale) whose crop is less than twice the output:
  ``torchvision.io.decode_jpeg`` with EXIF orientation (libjpeg-turbo).
* JPEG whose crop is at least twice the output: Pillow with ``draft`` (libjpeg's
  DCT scaling by 1/2, 1/4 or 1/8, chosen so the crop still has at least the
  output's pixels).  decode_jpeg cannot scale (torchvision 0.29), and decoding
  fewer pixels beats decoding faster: ImageNet-like JPEGs doubled to ~1000 px,
  224 px output, one core: train 177 img/s this way against 152 with full
  decodes, val 219 against 181; at 128 px from ImageNet-sized files 435 against 409.
* Everything else — PNG, WebP, CMYK/YCCK JPEGs, palette, 16-bit — and any JPEG
  torchvision refuses: Pillow, converted to RGB as ImageFolder's loader does:
  alpha (RGBA, LA, a palette's transparency) is dropped, not composited, the
  same on every path (a JPEG has none); an animated image gives its first frame.
  One exception: 16-bit grayscale keeps its high byte, where Pillow's convert
  (and so ImageFolder) clips every value above 255 to white.
  (torchvision's decode_png would save little: 5.3 ms against Pillow's 6.4 ms
  for 330 KB photo PNGs, where inflating dominates, and only for 8-bit modes
  whose conversion matches Pillow's; not worth a third path for a rare format.)

The header (size, EXIF orientation) decides the draws (``plan``).  Where the C extension is
built, a plain JPEG's comes from its markers (``jpeg_crop.plain_header``: 0.4 us against
Pillow's parser's 22 us, 3 % of an image's CPU: tools/decode_floor.py); any other file's,
from Pillow's parser, which also opens a plain JPEG's header again when the crop-aware
decoder refuses the file.  plain_header reads only what Pillow opens and reads the same way
(tested on mutated headers too), so the draws never depend on which of the two read it.

Before either decoder runs, the header's pixel count is checked against
``max_image_pixels`` (Pillow's bomb warning threshold by default): a few hundred bytes
of JPEG can declare 40000 x 40000 pixels, and decode_jpeg would allocate all
4.8 GB of them.  Only regular files are read: a FIFO in a class folder would
block ``open`` forever, a device would never end.  Such files raise
``ImageRefused`` and are replaced like any undecodable sample.

Both decoders wrap the same libjpeg-turbo: a JPEG decoded at full scale gives
bit-identical pixels either way (tested, EXIF orientations included), and the
crop-aware decoder gives the same box as either (tested, tests/daemon/test_jpeg_crop.py).
Which decoder runs is a pure function of the file's bytes, the crop box and
whether the extension is built, so the output stays a pure function of
(seed, epoch, index) and the file, and is the same with or without the extension.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from prefetchd.daemon import jpeg_crop
from prefetchd.daemon.plan import Box, pixel_box, scaled_box
from prefetchd.daemon.sources.storage import ImageRefused

JPEG_MAGIC = b"\xff\xd8\xff"
MAX_DRAFT_SCALE = 8  # libjpeg's DCT scaling goes down to 1/8
# Pillow modes of a JPEG that decode_jpeg turns into exactly Pillow's RGB; CMYK
# and YCCK (Pillow: "CMYK") go through Pillow, which knows Adobe's inversion.
_TORCHVISION_JPEG_MODES = ("RGB", "L")
_EXIF_ORIENTATION = 0x0112
_TRANSPOSED_ORIENTATIONS = (5, 6, 7, 8)  # width and height swap
# Each EXIF orientation as the steps that turn stored pixels into shown ones: flip the rows
# (upside down), flip the columns (mirror), then transpose.  E.g. 6, "rotate 90 degrees
# clockwise to display", is Pillow's ROTATE_270 = rows flipped, then transposed.
_EXIF_STEPS = {2: (False, True, False), 3: (True, True, False), 4: (True, False, False), 5: (False, False, True),
               6: (True, False, True), 7: (True, True, True), 8: (False, True, True)}
# Pillow's Image.MAX_IMAGE_PIXELS, above which it warns (it refuses above twice that, which ImageFolder loads):
# about a quarter GiB of 24-bit pixels.
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")


@dataclass
class Decoded:
    """A decoded image: ``pixels`` (H x W x 3 uint8, any strides) or a Pillow RGB image,
    and how many source pixels one decoded pixel spans (the draft scale); or, from the
    crop-aware decoder, the crop box alone (``crop``, contiguous H x W x 3 uint8)."""

    pixels: np.ndarray | None = None
    image: Image.Image | None = field(default=None, repr=False)
    scale: int = 1
    crop: np.ndarray | None = None


@dataclass
class Header:
    """What the plan and the decoders read from a file's header.  ``image``: Pillow's reading
    of it; None for a plain JPEG (``jpeg_crop.plain_header``) until a full decode needs it; for a
    file that is no JPEG, its whole image decoded and upright (``read_header``)."""

    width: int  # stored, before the EXIF orientation
    height: int
    orientation: int
    jpeg: bool  # libjpeg's DCT scaling applies
    rgb_jpeg: bool  # ... and decode_jpeg and the crop-aware decoder give Pillow's RGB of it
    image: Image.Image | None = field(default=None, repr=False)

    @property
    def oriented(self) -> tuple[int, int]:
        """Width and height after the EXIF orientation."""
        transposed = self.orientation in _TRANSPOSED_ORIENTATIONS
        return (self.height, self.width) if transposed else (self.width, self.height)


def draft_scale(box: Box, size: int) -> int:
    """The largest DCT scale (1, 2, 4, 8) that leaves the crop at least ``size`` pixels a side."""
    side = min(box[2] - box[0], box[3] - box[1])
    scale = 1
    while scale < MAX_DRAFT_SCALE and side >= 2 * scale * size:
        scale *= 2
    return scale


def exif_orientation(img: Image.Image) -> int:
    """The EXIF orientation (1-8) Pillow reads in ``img``'s header; 1 where there is none."""
    value = img.getexif().get(_EXIF_ORIENTATION, 1)
    return value if isinstance(value, int) else 1


def _to_rgb(img: Image.Image) -> Image.Image:
    """Orient and convert as ImageFolder's loader (``Image.open(f).convert("RGB")``) plus EXIF.

    May return ``img`` itself, loaded (an RGB image needing no rotation): no copy."""
    oriented = ImageOps.exif_transpose(img) if exif_orientation(img) != 1 else img
    if oriented.mode in _SIXTEEN_BIT_MODES:
        # Pillow's convert clips 16-bit values to 255, a white image; keep the high byte instead.
        high = (np.asarray(oriented, dtype=np.uint16) >> 8).astype(np.uint8)
        return Image.fromarray(high).convert("RGB")
    if oriented.mode == "RGB":
        oriented.load()
        return oriented
    return oriented.convert("RGB")


def load_rgb(path: Path) -> Image.Image:
    """Decode ``path`` to RGB with Pillow, honouring EXIF orientation."""
    with Image.open(path) as img:
        rgb = _to_rgb(img)
        return rgb.copy() if rgb is img else rgb  # closing ``img`` frees its pixels


def read_header(data: bytearray, name: str, max_pixels: int) -> Header:
    """The header of the image in ``data``: a plain JPEG's from its markers, any other from
    Pillow's parser; ``ImageRefused`` for more than ``max_pixels`` pixels."""
    plain = jpeg_crop.plain_header(data)
    if plain is not None:
        _check_pixels(plain.width, plain.height, name, max_pixels)
        return Header(*plain, jpeg=True, rgb_jpeg=True)
    image = open_header(data, name, max_pixels)
    jpeg = data[:3] == JPEG_MAGIC and image.format in ("JPEG", "MPO")
    if not jpeg:
        # Pillow decodes it whole whatever the crop (no DCT scaling, no crop decode), so it is decoded here, upright,
        # and the plan sees the oriented image itself: Pillow reports a TIFF's size oriented and turns its pixels as
        # it loads them, yet reads the tag before the load, and a plan from the header and the tag cut a crop
        # planned for a landscape image from the portrait one (orientations 5-8, a walk).
        upright = _to_rgb(image)
        return Header(upright.width, upright.height, 1, False, False, upright)
    return Header(image.width, image.height, exif_orientation(image), jpeg, image.mode in _TORCHVISION_JPEG_MODES,
                  image)


def decode(data: bytearray, name: str, max_pixels: int, header: Header, box: Box, size: int,
           tracked: jpeg_crop.TrackedFile | None) -> Decoded:
    """What the crop ``box`` (oriented pixels) needs of the image in ``data``, for a ``size`` px
    output: the box alone from the crop-aware decoder, or the image, DCT-scaled where the box
    is at least twice the output (the module docstring lists the paths)."""
    scale = draft_scale(box, size) if header.jpeg else 1
    if header.rgb_jpeg:
        crop = _decode_crop(data, header, box, scale, tracked)
        if crop is not None:
            return Decoded(crop=crop)
    # Pillow's header, for a plain JPEG the crop-aware decoder refused: it opens and reads every
    # plain JPEG as plain_header does (tested), so the plan drawn from that reading still holds.
    image = header.image if header.image is not None else open_header(data, name, max_pixels)
    if scale == 1 and header.rgb_jpeg:
        import torch
        from torchvision.io import ImageReadMode, decode_jpeg

        try:
            chw = decode_jpeg(torch.frombuffer(data, dtype=torch.uint8), mode=ImageReadMode.RGB,
                              apply_exif_orientation=True)
        except RuntimeError:
            pass  # e.g. a truncated file: Pillow decides below, and names the problem if it fails too
        else:
            hwc = chw.permute(1, 2, 0).numpy()  # decode_jpeg's CHW is a view of H x W x 3 memory
            if hwc.shape[:2] == header.oriented[::-1]:
                return Decoded(pixels=hwc)
            # The two EXIF readers disagree: Pillow's reading decided the box, so Pillow decodes.
    if scale > 1:
        stored_width = image.width
        drafted = image.draft("RGB", (stored_width // scale, image.height // scale))
        # Pillow reports the scale it chose as the source width in decoded pixels.
        scale = round(stored_width / drafted[1][2]) if drafted is not None else 1
    return Decoded(image=_to_rgb(image), scale=scale)


def _decode_crop(data: bytearray, header: Header, box: Box, scale: int,
                 tracked: jpeg_crop.TrackedFile | None) -> np.ndarray | None:
    """The crop-aware decoder's box: the pixels ``cut`` would take from the full decode at
    ``scale``, EXIF orientation applied; None without the extension or where it refuses.
    ``tracked``: where this file's clean decodes are remembered (``jpeg_crop.CleanFiles``)."""
    if not jpeg_crop.available():
        return None
    flip_rows, flip_cols, transpose = _EXIF_STEPS.get(header.orientation, (False, False, False))
    # libjpeg's size at 1/scale rounds up, as Pillow's draft size does.
    stored_w, stored_h = -(-header.width // scale), -(-header.height // scale)
    shown_w, shown_h = (stored_h, stored_w) if transpose else (stored_w, stored_h)
    left, top, right, bottom = pixel_box(scaled_box(box, scale), shown_w, shown_h)
    # The box in the stored image: undo the transpose, then the flips.
    if transpose:
        left, top, right, bottom = top, left, bottom, right
    if flip_rows:
        top, bottom = stored_h - bottom, stored_h - top
    if flip_cols:
        left, right = stored_w - right, stored_w - left
    known_clean = tracked is not None and tracked.known_clean(len(data))
    pixels = jpeg_crop.decode_box(data, scale, left, top, right, bottom, to_end=not known_clean)
    if pixels is None:
        return None
    if tracked is not None and not known_clean:
        tracked.record_clean(len(data))
    flips = tuple(dim for dim, flip in ((0, flip_rows), (1, flip_cols)) if flip)
    if not flips and not transpose:
        return pixels
    turned = np.flip(pixels, flips) if flips else pixels
    return np.ascontiguousarray(turned.transpose(1, 0, 2) if transpose else turned)


def cut(decoded: Decoded, box: Box) -> np.ndarray:
    """The crop as a contiguous H x W x 3 array: the one copy out of the decoded image."""
    if decoded.crop is not None:
        return decoded.crop
    scaled = scaled_box(box, decoded.scale)
    if decoded.pixels is not None:
        h, w = decoded.pixels.shape[:2]
        left, top, right, bottom = pixel_box(scaled, w, h)
        return np.ascontiguousarray(decoded.pixels[top:bottom, left:right])
    assert decoded.image is not None
    left, top, right, bottom = pixel_box(scaled, *decoded.image.size)
    # np.array, not np.asarray: Pillow hands numpy read-only bytes, torch wants writable memory.
    return np.array(decoded.image.crop((left, top, right, bottom)))


def open_header(data: bytearray, path: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Pillow's view of the header (size, mode, EXIF), refused when it has more than ``max_pixels``."""
    try:
        header = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:  # Pillow's own limit, where it is still on
        raise ImageRefused(f"{path}: {exc} (max_image_pixels is {max_pixels}); raise --max-image-pixels "
                           "if such images are real") from None
    except UnidentifiedImageError:  # its own message names a BytesIO, not the file
        what = "an empty file" if not data else f"{len(data)} bytes starting {bytes(data[:8])!r}"
        raise ImageRefused(f"{path}: not an image format Pillow or torchvision reads ({what})") from None
    _check_pixels(header.width, header.height, path, max_pixels)
    return header


def _check_pixels(w: int, h: int, path: str, max_pixels: int) -> None:
    if w * h > max_pixels:
        raise ImageRefused(f"{path}: {w} x {h} = {w * h / 1e6:.0f} Mpx is more than max_image_pixels "
                           f"({max_pixels / 1e6:.0f} Mpx), as a decompression bomb would be; raise "
                           "--max-image-pixels if such images are real")
