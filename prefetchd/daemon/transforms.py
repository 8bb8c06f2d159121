"""Decode one image and augment it into an H x W x 3 uint8 array.

Augmentation.  Every random decision of a sample is drawn from its own stream
(``sampler.sample_rng``), in this order, from the image's *oriented* size alone
(before any pixel is decoded, so the decode path cannot change a draw):

1. the crop box —
   train: torchvision's RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3, its
          10-try rejection sampling and centre fallback), or with
          ``scale_jitter=(lo, hi)`` the ResNet scale augmentation: the shorter
          side resized to a length drawn from [lo, hi], then a random square crop;
   val:   resize the shorter side to size / 0.875, then centre crop (no draws);
2. train: a horizontal flip with p=0.5;
3. with ``color_jitter``: the order of brightness/contrast/saturation, then their
   factors (torchvision's ColorJitter);
4. a user ``transform`` hook gets the stream after all of the above, with the
   augmented image as a uint8 3 x size x size tensor (a view of channels-last
   memory; ``.contiguous()`` if the hook needs planar memory).

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

The header (size, EXIF orientation) decides the draws.  Where the C extension is built, a
plain JPEG's comes from its markers (``jpeg_crop.plain_header``: 0.4 us against Pillow's
parser's 22 us, 3 % of an image's CPU: tools/decode_floor.py); any other file's, from Pillow's parser, which
also opens a plain JPEG's header again when the crop-aware decoder refuses the file.
plain_header reads only what Pillow opens and reads the same way (tested on mutated
headers too), so the draws never depend on which of the two read the header.

Before either decoder runs, the header's pixel count is checked against
``max_image_pixels`` (Pillow's own bomb limit by default): a few hundred bytes
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

Crop, resize, flip — one resampler for every path.  The integer crop box is
copied once out of the decoded image into a contiguous H x W x 3 array; the
antialiased bilinear resize (the bytes of ``torchvision.transforms.v2.functional.resize``:
torch's uint8 kernel with PIL-compatible weights, where the CPU has it) reads that
channels-last memory and writes its result channels-last too, mirrored where the
plan flips, so the resized image already has the batch slot's H x W x 3 layout: no
transpose, no strided copy.  Where the C extension is built the resize is its own
(``_resample.c``): torch's integer arithmetic in torch's order, so the same bytes
(tests/daemon/test_resample.py), with AVX2 where the CPU has it; else torch's
``interpolate``, called directly.  Measured on this project's 2-core machine, one core,
RandomResizedCrop to 224 px from 333-500 px JPEGs: resizing the crop view gives CHW
(0.53 ms) and the transpose to H x W x 3 adds 0.36 ms; the crop copy (0.07 ms) plus the
channels-last resize take 0.40 ms in all, the flip of the result 0.03 ms.  (Pillow's
antialiased resize of the box: 1.17 ms.)  The C kernel takes 0.15-0.16 ms per image
against torch's 0.18 for the full-scale boxes of 375 ImageNet-like JPEGs to 224 px,
flipped every other time (``tools/decode_floor.py``).  A flip before
or after the resize gives identical bytes (1800 of 1800 crops checked); the kernel
mirrors as it writes.  Boxes with fractional edges (the val centre crop, a draft-scaled
box) are rounded to whole pixels: at most half a source pixel, under half an output
pixel.

torch and torchvision are imported inside the functions that need them, not at the
top: importing them costs ~3.4 s and ~370 MB of private memory per process (measured
with a CUDA wheel), and the controller and every CLI command import this module only
for its names (options, hook validation).  A worker imports what its job needs when it
starts (``needed_modules``): with the C extension built, on a CPU with torch's uint8
kernel, neither, unless the job jitters colours (torchvision) or has a hook (torch);
a JPEG the crop-aware decoder refuses imports both when it comes.  That took a cold
``prefetchd start`` to its first batch from 3.1 s (torch and torchvision in every
worker) to 1.9 s (torch alone) to 0.6 s on this project's 2-core machine
(``tools/cold_start.py``, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import importlib
import io
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from prefetchd.daemon import jpeg_crop
from prefetchd.daemon.errors import ConfigError
from prefetchd.daemon.sources.storage import ImageRefused, read_bytes

if TYPE_CHECKING:
    import torch

Box = tuple[float, float, float, float]  # left, top, right, bottom
PixelBox = tuple[int, int, int, int]
Hook = Callable[["torch.Tensor", np.random.Generator], "torch.Tensor"]

SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
VAL_RESIZE_RATIO = 0.875
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
JITTER_OPERATIONS = ("brightness", "contrast", "saturation")  # torchvision adjust_<name>, indexed by a plan
# Pillow's Image.MAX_IMAGE_PIXELS: about a quarter GiB of 24-bit pixels.
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")


@dataclass(frozen=True)
class AugmentOptions:
    """The optional augmentations of the train split (``DaemonConfig`` fields of the same names)."""

    color_jitter: float | None = None
    scale_jitter: tuple[int, int] | None = None
    transform: str | None = None  # "package.module:callable"


NO_OPTIONS = AugmentOptions()


@dataclass
class StageTimes:
    """Seconds one sample spent in each stage (all tries, when a sample was replaced):
    read the file; decode (header, the sample's draws, decoding); augment (crop,
    resize, flip, jitter, hook)."""

    read: float = 0.0
    decode: float = 0.0
    augment: float = 0.0


@dataclass(frozen=True)
class Plan:
    """The random decisions of one sample, all drawn before decoding."""

    box: Box
    flip: bool = False
    jitter_order: tuple[int, ...] = ()
    jitter_factors: tuple[float, ...] = ()


@dataclass
class _Decoded:
    """A decoded image: ``pixels`` (H x W x 3 uint8, any strides) or a Pillow RGB image,
    and how many source pixels one decoded pixel spans (the draft scale); or, from the
    crop-aware decoder, the crop box alone (``crop``, contiguous H x W x 3 uint8)."""

    pixels: np.ndarray | None = None
    image: Image.Image | None = field(default=None, repr=False)
    scale: int = 1
    crop: np.ndarray | None = None


@dataclass
class _Header:
    """What the plan and the decoders read from a file's header.  ``image``: Pillow's reading
    of it; None for a plain JPEG (``jpeg_crop.plain_header``) until a full decode needs it."""

    width: int  # stored, before the EXIF orientation
    height: int
    orientation: int
    jpeg: bool  # libjpeg's DCT scaling applies
    rgb_jpeg: bool  # ... and decode_jpeg and the crop-aware decoder give Pillow's RGB of it
    image: Image.Image | None = field(default=None, repr=False)

    @property
    def oriented(self) -> tuple[int, int]:
        return _oriented(self.width, self.height, self.orientation)


class HookError(RuntimeError):
    """The user's transform hook failed or broke its contract: a bug to fix, not a bad image."""


# -- the random decisions -------------------------------------------------------------


def random_resized_crop_box(width: int, height: int, rng: np.random.Generator) -> Box:
    area = width * height
    log_lo, log_hi = math.log(RATIO[0]), math.log(RATIO[1])
    for _ in range(10):
        target = area * rng.uniform(*SCALE)
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return (left, top, left + w, top + h)
    in_ratio = width / height
    if in_ratio < RATIO[0]:
        w, h = width, int(round(width / RATIO[0]))
    elif in_ratio > RATIO[1]:
        w, h = int(round(height * RATIO[1])), height
    else:
        w, h = width, height
    top, left = (height - h) // 2, (width - w) // 2
    return (left, top, left + w, top + h)


def scale_jitter_box(width: int, height: int, size: int, bounds: tuple[int, int], rng: np.random.Generator) -> Box:
    """ResNet's scale augmentation as a box in original pixels: the shorter side
    resized to S drawn uniformly from ``bounds`` (inclusive), then a random
    ``size`` x ``size`` crop, i.e. a square of ``size * short / S`` source pixels."""
    shorter = int(rng.integers(bounds[0], bounds[1] + 1))
    short = min(width, height)
    side = max(1, min(short, int(round(size * short / shorter))))
    top = int(rng.integers(0, height - side + 1))
    left = int(rng.integers(0, width - side + 1))
    return (left, top, left + side, top + side)


def center_crop_box(width: int, height: int, size: int) -> Box:
    """The region of the original image that resize-shorter-side + centre-crop keeps."""
    short = min(width, height)
    resized = int(size / VAL_RESIZE_RATIO)  # torchvision's Resize(int(size / 0.875)) truncates too
    # Size of the crop measured in original pixels.
    crop = min(short, size * short / resized)
    left, top = (width - crop) / 2, (height - crop) / 2
    return (left, top, left + crop, top + crop)


def plan_sample(width: int, height: int, size: int, train: bool, rng: np.random.Generator | None,
                options: AugmentOptions = NO_OPTIONS) -> Plan:
    """Draw a sample's decisions for an image of this oriented size (see the module docstring for the order)."""
    if not train:
        return Plan(center_crop_box(width, height, size))
    if rng is None:
        raise ValueError("train augmentation needs the sample's random stream")
    if options.scale_jitter is not None:
        box = scale_jitter_box(width, height, size, options.scale_jitter, rng)
    else:
        box = random_resized_crop_box(width, height, rng)
    flip = bool(rng.random() < 0.5)
    if not options.color_jitter:
        return Plan(box, flip)
    order = tuple(int(i) for i in rng.permutation(len(JITTER_OPERATIONS)))
    lo, hi = max(0.0, 1.0 - options.color_jitter), 1.0 + options.color_jitter
    factors = tuple(float(rng.uniform(lo, hi)) for _ in JITTER_OPERATIONS)
    return Plan(box, flip, order, factors)


def draft_scale(box: Box, size: int) -> int:
    """The largest DCT scale (1, 2, 4, 8) that leaves the crop at least ``size`` pixels a side."""
    side = min(box[2] - box[0], box[3] - box[1])
    scale = 1
    while scale < MAX_DRAFT_SCALE and side >= 2 * scale * size:
        scale *= 2
    return scale


def pixel_box(box: Box, width: int, height: int) -> PixelBox:
    """``box`` rounded to whole pixels, inside the image and at least one pixel wide and high."""
    left = min(max(int(round(box[0])), 0), width - 1)
    top = min(max(int(round(box[1])), 0), height - 1)
    right = min(max(int(round(box[2])), left + 1), width)
    bottom = min(max(int(round(box[3])), top + 1), height)
    return (left, top, right, bottom)


def preload(options: AugmentOptions = NO_OPTIONS) -> None:
    """Import what augmenting with ``options`` needs now: a worker calls this when it starts, so
    that its first sample is not charged the seconds of the import."""
    for module in needed_modules(options):
        importlib.import_module(module)


def needed_modules(options: AugmentOptions = NO_OPTIONS) -> tuple[str, ...]:
    """The modules augmenting with ``options`` imports.  torch (~1.8 s to import here: most of a cold
    start) only where it resizes, jitters or runs the user's hook: the C extension resizes where it
    is built and the CPU has the uint8 kernel.  torchvision (~1.6 s more) only where it decodes or
    jitters: the whole-image JPEG decoder when the crop-aware extension is not built, and colour
    jitter.  Otherwise a JPEG the extension refuses, decoded whole by ``decode_jpeg``, imports both
    then (PNGs go to Pillow)."""
    torchvision = not jpeg_crop.available() or bool(options.color_jitter)
    torch = torchvision or not uint8_kernel() or options.transform is not None
    return (*(("torch",) if torch else ()),
            *(("torchvision.io", "torchvision.transforms.v2.functional") if torchvision else ()))


# -- reading and decoding -------------------------------------------------------------


def oriented_size(img: Image.Image) -> tuple[int, int]:
    """Width and height after the EXIF orientation, from the header alone."""
    return _oriented(img.width, img.height, _orientation(img))


def _oriented(width: int, height: int, orientation: int) -> tuple[int, int]:
    return (height, width) if orientation in _TRANSPOSED_ORIENTATIONS else (width, height)


def _orientation(img: Image.Image) -> int:
    value = img.getexif().get(_EXIF_ORIENTATION, 1)
    return value if isinstance(value, int) else 1


def _to_rgb(img: Image.Image) -> Image.Image:
    """Orient and convert as ImageFolder's loader (``Image.open(f).convert("RGB")``) plus EXIF.

    May return ``img`` itself, loaded (an RGB image needing no rotation): no copy."""
    oriented = ImageOps.exif_transpose(img) if _orientation(img) != 1 else img
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


def _read_header(data: bytearray, name: str, max_pixels: int) -> _Header:
    """The header of the image in ``data``: a plain JPEG's from its markers, any other from
    Pillow's parser; ``ImageRefused`` for more than ``max_pixels`` pixels."""
    plain = jpeg_crop.plain_header(data)
    if plain is not None:
        _check_pixels(plain.width, plain.height, name, max_pixels)
        return _Header(*plain, jpeg=True, rgb_jpeg=True)
    image = open_header(data, name, max_pixels)
    jpeg = data[:3] == JPEG_MAGIC and image.format in ("JPEG", "MPO")
    return _Header(image.width, image.height, _orientation(image), jpeg, jpeg and image.mode in _TORCHVISION_JPEG_MODES,
                   image)


def _decode(data: bytearray, name: str, max_pixels: int, header: _Header, box: Box, size: int,
            tracked: jpeg_crop.TrackedFile | None) -> _Decoded:
    scale = draft_scale(box, size) if header.jpeg else 1
    if header.rgb_jpeg:
        crop = _decode_crop(data, header, box, scale, tracked)
        if crop is not None:
            return _Decoded(crop=crop)
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
                return _Decoded(pixels=hwc)
            # The two EXIF readers disagree: Pillow's reading decided the box, so Pillow decodes.
    if scale > 1:
        stored_width = image.width
        drafted = image.draft("RGB", (stored_width // scale, image.height // scale))
        # Pillow reports the scale it chose as the source width in decoded pixels.
        scale = round(stored_width / drafted[1][2]) if drafted is not None else 1
    return _Decoded(image=_to_rgb(image), scale=scale)


def _decode_crop(data: bytearray, header: _Header, box: Box, scale: int,
                 tracked: jpeg_crop.TrackedFile | None) -> np.ndarray | None:
    """The crop-aware decoder's box: the pixels ``_crop`` would cut from the full decode at
    ``scale``, EXIF orientation applied; None without the extension or where it refuses.
    ``tracked``: where this file's clean decodes are remembered (``jpeg_crop.CleanFiles``)."""
    if not jpeg_crop.available():
        return None
    flip_rows, flip_cols, transpose = _EXIF_STEPS.get(header.orientation, (False, False, False))
    # libjpeg's size at 1/scale rounds up, as Pillow's draft size does.
    stored_w, stored_h = -(-header.width // scale), -(-header.height // scale)
    shown_w, shown_h = (stored_h, stored_w) if transpose else (stored_w, stored_h)
    left, top, right, bottom = pixel_box(_scaled(box, scale), shown_w, shown_h)
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


# -- augmenting -----------------------------------------------------------------------


def _scaled(box: Box, scale: int) -> Box:
    return (box[0] / scale, box[1] / scale, box[2] / scale, box[3] / scale)


def _crop(decoded: _Decoded, box: Box) -> np.ndarray:
    """The crop as a contiguous H x W x 3 array: the one copy out of the decoded image."""
    if decoded.crop is not None:
        return decoded.crop
    scaled = _scaled(box, decoded.scale)
    if decoded.pixels is not None:
        h, w = decoded.pixels.shape[:2]
        left, top, right, bottom = pixel_box(scaled, w, h)
        return np.ascontiguousarray(decoded.pixels[top:bottom, left:right])
    assert decoded.image is not None
    left, top, right, bottom = pixel_box(scaled, *decoded.image.size)
    # np.array, not np.asarray: Pillow hands numpy read-only bytes, torch wants writable memory.
    return np.array(decoded.image.crop((left, top, right, bottom)))


def _resize(crop: np.ndarray, size: int, mirror: bool) -> np.ndarray:
    """Antialiased bilinear resize of an H x W x 3 uint8 array to ``size`` x ``size`` x 3, columns
    mirrored if ``mirror``: the bytes of torchvision's ``v2.functional.resize(BILINEAR,
    antialias=True)`` then ``hflip``, which the tests compare.  As there: torch's uint8 kernel
    where the CPU has one (``uint8_kernel``), else float32 rounded back.  The uint8 kernel is
    the C extension's where it is built (the same bytes: tests/daemon/test_resample.py), so
    that a worker need not import torch at all; else torch's, called directly."""
    native = uint8_kernel()
    if native:
        resized = jpeg_crop.resize(crop, size, mirror)
        if resized is not None:
            return resized
    import torch
    import torch.nn.functional as F

    height, width = crop.shape[:2]
    hwc = torch.from_numpy(crop)
    if (height, width) != (size, size):
        # 1 x 3 x H x W over the H x W x 3 memory.  Its batch stride is restrided to the element count
        # so that torch allocates the output channels-last too (pytorch issue 68430, as torchvision does).
        image = hwc.permute(2, 0, 1).as_strided((1, 3, height, width), (hwc.numel(), 1, width * 3, 3))
        out = F.interpolate(image if native else image.float(), size=[size, size], mode="bilinear",
                            align_corners=False, antialias=True)
        if not native:
            out = out.round_().to(torch.uint8)
        hwc = out.reshape(3, size, size).permute(1, 2, 0)
    if mirror:
        hwc = hwc.flip(1)
    return hwc.contiguous().numpy()


@lru_cache(maxsize=1)
def uint8_kernel() -> bool:
    """Whether torchvision resizes a uint8 image in uint8 here (torch's uint8 kernel) rather than in
    float32: where torch's CPU capability is AVX2 or AVX-512, and on arm64.  Told without importing
    torch: torch's capability is AVX2 or more where the CPU has AVX2 and FMA, unless
    ATEN_CPU_CAPABILITY=default lowers it (tests/daemon/test_resample.py checks the two agree)."""
    machine = platform.machine()
    if machine in ("aarch64", "arm64"):
        return True
    if machine not in ("x86_64", "AMD64") or os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "default":
        return False
    return {"avx2", "fma"} <= _cpu_flags()


def resize_summary() -> str:
    """Which resize the workers run, and so whether they import torch: the line ``prefetchd start``
    logs once beside ``jpeg_crop.decoder_summary()``."""
    if not uint8_kernel():
        return ("resize: torch in float32, as torchvision resizes on this CPU (no AVX2 and FMA, or "
                "ATEN_CPU_CAPABILITY=default); workers import torch")
    if not jpeg_crop.available():
        return "resize: torch's uint8 kernel; workers import torch (the C extension would spare it)"
    return ("resize: the C extension's copy of torch's uint8 kernel; workers import torch only for a hook "
            "or colour jitter")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def _jitter(hwc: torch.Tensor, plan: Plan) -> torch.Tensor:
    from torchvision.transforms.v2 import functional as TF

    chw = hwc.permute(2, 0, 1)
    for i in plan.jitter_order:
        adjust = getattr(TF, f"adjust_{JITTER_OPERATIONS[i]}")
        chw = adjust(chw, plan.jitter_factors[i])
    return chw.permute(1, 2, 0)


def _apply_hook(name: str, hwc: torch.Tensor, rng: np.random.Generator, size: int, path: str) -> torch.Tensor:
    import torch

    hook = load_hook(name)
    try:
        out = hook(hwc.permute(2, 0, 1), rng)
    except Exception as exc:
        raise HookError(f"transform {name} failed on {path}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or tuple(out.shape) != (3, size, size):
        got = f"{out.dtype} tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise HookError(f"transform {name} returned a {got} for {path}; it must return a uint8 tensor of shape "
                        f"(3, {size}, {size})")
    return out.permute(1, 2, 0)


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


def augment(path: Path | str, size: int, train: bool, rng: np.random.Generator | None,
            options: AugmentOptions = NO_OPTIONS, times: StageTimes | None = None,
            max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, tracked: jpeg_crop.TrackedFile | None = None) -> np.ndarray:
    """Read the local file ``path`` and ``augment_bytes`` it."""
    t0 = time.perf_counter()
    data = read_bytes(path)
    if times is not None:
        times.read += time.perf_counter() - t0
    return augment_bytes(data, str(path), size, train, rng, options, times, max_pixels, tracked)


def augment_bytes(data: bytearray, name: str, size: int, train: bool, rng: np.random.Generator | None,
                  options: AugmentOptions = NO_OPTIONS, times: StageTimes | None = None,
                  max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                  tracked: jpeg_crop.TrackedFile | None = None) -> np.ndarray:
    """Decode the image in ``data`` and augment it into a contiguous ``size`` x ``size`` x 3 uint8 array.

    ``name`` says where the bytes came from, in errors.  ``rng`` is the sample's
    stream (train; the hook's stream in val).  Stage seconds are added to
    ``times``.  Bytes that cannot be decoded raise whatever the decoder raised
    (``ImageRefused`` for more than ``max_pixels`` pixels); a failing hook
    raises ``HookError``.  ``tracked``: the sample's entry in the worker's
    ``jpeg_crop.CleanFiles``, which spares the crop-aware decoder re-checking a file
    it has read to the end before; the pixels are the same with or without it.
    """
    t1 = time.perf_counter()
    try:
        # The header only (size, mode, EXIF); it is not closed because the Pillow
        # path may hand back this very image, and a BytesIO holds no OS resource.
        header = _read_header(data, name, max_pixels)
        plan = plan_sample(*header.oriented, size, train, rng, options)
        decoded = _decode(data, name, max_pixels, header, plan.box, size, tracked)
    finally:
        t2 = time.perf_counter()
        if times is not None:
            times.decode += t2 - t1
    result = _resize(_crop(decoded, plan.box), size, plan.flip)
    if plan.jitter_order or options.transform is not None:
        import torch

        out = torch.from_numpy(result)
        if plan.jitter_order:
            out = _jitter(out, plan)
        if options.transform is not None:
            if rng is None:
                raise ValueError(f"the transform hook {options.transform} needs the sample's random stream")
            out = _apply_hook(options.transform, out, rng, size, name)
        result = out.contiguous().numpy()
    if times is not None:
        times.augment += time.perf_counter() - t2
    return result


# -- the user's hook ------------------------------------------------------------------


def validate_hook(name: str) -> Hook:
    """Import the hook named ``"package.module:callable"``; a ``ConfigError`` says what is wrong."""
    module_name, _, attr = name.partition(":")  # the form was checked with the rest of the config
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as exc:  # the user's module may fail in any way while it is imported
        raise ConfigError(f"transform = {name!r}: cannot import {module_name} ({type(exc).__name__}: {exc}); "
                          "install it or add its folder to PYTHONPATH") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"transform = {name!r}: {module_name} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ConfigError(f"transform = {name!r}: {attr} is a {type(obj).__name__}, not a callable taking "
                          "(uint8 tensor, numpy Generator)")
    return obj


@lru_cache(maxsize=8)
def load_hook(name: str) -> Hook:
    """``validate_hook``, once per process; a failure here is the hook's bug, reported as ``HookError``."""
    try:
        return validate_hook(name)
    except ConfigError as exc:
        raise HookError(str(exc)) from None
