"""A small, learnable image-classification dataset in ``ImageFolder`` layout.

Each class is a shape drawn in a class-specific hue (with jitter) on a noisy,
randomly coloured background; images differ in size, aspect ratio, position and
scale, and are saved in a mix of formats (mostly JPEG at varying quality, some
PNG and WebP, a few uppercase extensions, and per split one grayscale, one
palette and one RGBA image, given at least 3 classes of 4 images) so that
decoders meet what real folders contain.

Everything is a pure function of ``seed``: every image draws from its own
generator keyed by (seed, split, class, index), so the files are byte-identical
across runs (for the same Pillow build) and independent of generation order.
"""

from __future__ import annotations

import colorsys
import logging
import math
import shutil
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

log = logging.getLogger(__name__)

# Order matters: the first ``classes`` shapes are used, and hues are spread
# evenly over those, so any prefix is a well separated set of classes.
SHAPES = ("circle", "square", "triangle", "star", "cross", "ring", "diamond", "crescent")
SPLITS = ("train", "val")

# Share of images per format; JPEG dominates as in real photo folders.
_JPEG_SHARE = 0.70
_PNG_SHARE = 0.15  # the rest is WebP
_UPPER_SHARE = 0.12  # of JPEGs: ".JPG" / ".JPEG", which ImageFolder accepts

# (class, index) of the images saved in an unusual mode, so that every split
# carries each of them once.
_GRAY_AT = (0, 1)  # JPEG in mode L
_PALETTE_AT = (1, 2)  # PNG in mode P
_RGBA_AT = (2, 3)  # PNG in mode RGBA (opaque alpha)

ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True)
class DatasetSummary:
    """What ``make_shapes_dataset`` wrote."""

    root: Path
    classes: tuple[str, ...]  # sorted, as ImageFolder orders (and labels) them
    counts: Mapping[str, int]  # split -> number of images
    formats: Mapping[str, int] = field(default_factory=dict)  # file extension -> count

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def line(self) -> str:
        counts = ", ".join(f"{split} {n}" for split, n in self.counts.items())
        formats = ", ".join(f"{ext} {n}" for ext, n in sorted(self.formats.items()))
        return f"{self.root}: {len(self.classes)} classes ({', '.join(self.classes)}); {counts}; {formats}"


def make_shapes_dataset(
    root: Path,
    *,
    classes: int = 4,
    train_per_class: int = 200,
    val_per_class: int = 50,
    size_range: tuple[int, int] = (72, 128),
    seed: int = 0,
    progress: ProgressFn | None = None,
    overwrite: bool = False,
) -> DatasetSummary:
    """Write ``root/train/<class>/NNNNN.<ext>`` and ``root/val/<class>/...``.

    ``size_range`` bounds width and height independently, so images are
    rarely square.  ``val_per_class=0`` writes no ``val`` folder at all
    (ImageFolder refuses empty class folders).  An existing non-empty split
    folder is refused unless ``overwrite`` is set, because files left from an
    earlier run would silently join the new dataset.
    """
    root = Path(root)
    if not 1 <= classes <= len(SHAPES):
        raise ValueError(f"classes is {classes}; the generator knows {len(SHAPES)} shapes, pick 1 to {len(SHAPES)}")
    if train_per_class < 1 or val_per_class < 0:
        raise ValueError(
            f"train_per_class={train_per_class}, val_per_class={val_per_class}: "
            "need at least 1 training image per class and a non-negative validation count"
        )
    lo, hi = size_range
    if not 16 <= lo <= hi:
        raise ValueError(f"size_range is {size_range}; need 16 <= min <= max")
    if seed < 0:
        raise ValueError(f"seed is {seed}; use a non-negative integer")

    per_split = {"train": train_per_class, "val": val_per_class}
    splits = [s for s in SPLITS if per_split[s] > 0]
    for split in splits:
        target = root / split
        if target.exists() and any(target.iterdir()):
            if not overwrite:
                raise FileExistsError(
                    f"{target} is not empty; pass overwrite=True (--overwrite) or choose another directory"
                )
            shutil.rmtree(target)

    names = SHAPES[:classes]
    total = classes * sum(per_split[s] for s in splits)
    formats: Counter[str] = Counter()
    done = 0
    for split in splits:
        split_id = SPLITS.index(split)
        for cls, name in enumerate(names):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_split[split]):
                rng = np.random.default_rng([seed, split_id, cls, i])
                ext = _render(folder, i, cls, classes, (lo, hi), rng)
                formats[ext.lower()] += 1
                done += 1
                if progress is not None:
                    progress(done, total)

    summary = DatasetSummary(
        root=root,
        classes=tuple(sorted(names)),
        counts={s: classes * per_split[s] for s in splits},
        formats=dict(formats),
    )
    log.info("wrote %s", summary.line())
    return summary


def _render(
    folder: Path, index: int, cls: int, classes: int, size_range: tuple[int, int], rng: np.random.Generator
) -> str:
    """Draw one image, save it and return the extension used."""
    w = int(rng.integers(size_range[0], size_range[1] + 1))
    h = int(rng.integers(size_range[0], size_range[1] + 1))
    # One grain field serves background and shape: drawing normals is the
    # costliest step here, and float32 halves it.
    grain = rng.standard_normal((h, w, 3), dtype=np.float32)
    pixels = _background(w, h, grain, rng)

    # 35-70% of the short side keeps the shape inside most random crops.
    extent = rng.uniform(0.35, 0.70) * min(w, h)
    cx = rng.uniform(extent / 2, w - extent / 2)
    cy = rng.uniform(extent / 2, h - extent / 2)
    mask_img = Image.new("L", (w, h), 0)
    _draw_shape(ImageDraw.Draw(mask_img), SHAPES[cls], cx, cy, extent / 2, rng)
    mask = np.asarray(mask_img, dtype=bool)

    hue = (cls / classes + rng.normal(0.0, 0.025)) % 1.0
    rgb = np.array(colorsys.hsv_to_rgb(hue, rng.uniform(0.6, 1.0), rng.uniform(0.65, 1.0))) * 255
    # A gentle shading gradient and grain, so the shape is not one flat colour.
    ramp = np.linspace(-1.0, 1.0, w, dtype=np.float32)[None, :, None] * np.float32(rng.uniform(-18, 18))
    fg = rgb.astype(np.float32)[None, None, :] + ramp + grain * 5.0
    pixels = np.where(mask[:, :, None], fg, pixels)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")

    stem = f"{index:05d}"
    pick = rng.random()
    quality = int(rng.integers(70, 96))
    upper = rng.random() < _UPPER_SHARE
    if (cls, index) == _GRAY_AT:
        ext = ".jpg"
        image.convert("L").save(folder / f"{stem}{ext}", "JPEG", quality=quality)
    elif (cls, index) == _PALETTE_AT:
        ext = ".png"
        image.quantize(colors=64).save(folder / f"{stem}{ext}", "PNG", compress_level=1)
    elif (cls, index) == _RGBA_AT:
        ext = ".png"
        image.convert("RGBA").save(folder / f"{stem}{ext}", "PNG", compress_level=1)
    elif pick < _JPEG_SHARE:
        ext = (".JPEG" if rng.random() < 0.5 else ".JPG") if upper else ".jpg"
        image.save(folder / f"{stem}{ext}", "JPEG", quality=quality)
    elif pick < _JPEG_SHARE + _PNG_SHARE:
        ext = ".png"
        # Level 1: noisy pixels barely compress anyway, and it is 5x faster than the default.
        image.save(folder / f"{stem}{ext}", "PNG", compress_level=1)
    else:
        ext = ".webp"
        image.save(folder / f"{stem}{ext}", "WEBP", quality=quality, method=2)
    return ext


def _background(w: int, h: int, grain: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Smooth low-frequency colour blobs plus pixel grain, as float32 HxWx3."""
    gw, gh = int(rng.integers(2, 7)), int(rng.integers(2, 7))
    coarse = rng.integers(0, 256, (gh, gw, 3), dtype=np.uint8)
    # Pull towards grey so the shape's hue, not the background's, dominates.
    grey = coarse.mean(axis=2, keepdims=True)
    coarse = (grey + (coarse - grey) * rng.uniform(0.1, 0.5)).astype(np.uint8)
    smooth = np.asarray(Image.fromarray(coarse, "RGB").resize((w, h), Image.Resampling.BILINEAR), dtype=np.float32)
    return smooth + grain * np.float32(rng.uniform(4.0, 16.0))


def _polygon(cx: float, cy: float, radii: list[float], angle: float, sx: float = 1.0) -> list[tuple[float, float]]:
    """Points at evenly spaced angles with the given radii, rotated by ``angle`` and squeezed by ``sx``."""
    n = len(radii)
    out = []
    for k, r in enumerate(radii):
        a = angle + 2 * math.pi * k / n
        x, y = r * math.sin(a) * sx, -r * math.cos(a)
        out.append((cx + x, cy + y))
    return out


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, rng: np.random.Generator) -> None:
    tilt = math.radians(rng.uniform(-20, 20))
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        draw.ellipse(box, fill=255)
    elif shape == "ring":
        draw.ellipse(box, fill=255)
        inner = r * rng.uniform(0.45, 0.6)
        draw.ellipse((cx - inner, cy - inner, cx + inner, cy + inner), fill=0)
    elif shape == "crescent":
        draw.ellipse(box, fill=255)
        shift = r * 0.5
        a = rng.uniform(0, 2 * math.pi)
        ox, oy = cx + shift * math.cos(a), cy + shift * math.sin(a)
        draw.ellipse((ox - 0.85 * r, oy - 0.85 * r, ox + 0.85 * r, oy + 0.85 * r), fill=0)
    elif shape == "square":
        # Radius of the corners is r, so the side is r*sqrt(2); tilt stays small
        # so a square never looks like the (elongated) diamond.
        draw.polygon(_polygon(cx, cy, [r] * 4, math.pi / 4 + tilt), fill=255)
    elif shape == "diamond":
        draw.polygon(_polygon(cx, cy, [r] * 4, tilt / 2, sx=0.6), fill=255)
    elif shape == "triangle":
        draw.polygon(_polygon(cx, cy, [r] * 3, rng.uniform(0, 2 * math.pi / 3)), fill=255)
    elif shape == "star":
        draw.polygon(_polygon(cx, cy, [r, 0.42 * r] * 5, rng.uniform(0, 2 * math.pi / 5)), fill=255)
    elif shape == "cross":
        t = r * 0.32
        arm = [(-t, -r), (t, -r), (t, -t), (r, -t), (r, t), (t, t), (t, r), (-t, r), (-t, t), (-r, t), (-r, -t), (-t, -t)]
        c, s = math.cos(tilt), math.sin(tilt)
        draw.polygon([(cx + x * c - y * s, cy + x * s + y * c) for x, y in arm], fill=255)
    else:  # pragma: no cover - SHAPES and this function are kept together
        raise ValueError(f"unknown shape {shape!r}")
