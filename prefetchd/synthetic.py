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
import os
import shutil
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from prefetchd.words import binary_size, counted

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
        return f"{self.root}: {counted(len(self.classes), 'class')} ({', '.join(self.classes)}); {counts}; {formats}"


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

    _check_writable(root)
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


def progress_lines(*, quiet: bool = False) -> Callable[[int, int], None]:
    """A ``progress`` callback for the generators that prints "done/total images" to stderr.

    Nothing is printed before the first image is written, so a refusal (a non-empty folder, a
    bad setting) is the only line. About every 1 % on a terminal, rewriting one line; about
    every 10 % otherwise, as plain lines that keep logs readable.
    """
    interactive = sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        step = max(1, total // (100 if interactive else 10))
        if quiet or (done % step and done != total):
            return
        if interactive:
            print(f"\r{done}/{total} images", end="\n" if done == total else "", file=sys.stderr, flush=True)
        else:
            print(f"{done}/{total} images", file=sys.stderr, flush=True)

    return progress


class OutputError(OSError):
    """The folder a dataset is to be written to cannot be written: not a folder, or not ours."""


def _check_writable(root: Path) -> None:
    """Create ``root`` (and its parents); OutputError, naming it, where that or writing into it fails."""
    if root.exists() and not root.is_dir():
        raise OutputError(f"{root} is a file, not a folder; pass a folder to write the dataset into")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create {root} ({exc.strerror or exc}); pass a folder you can write to") from exc
    if not os.access(root, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write into {root} (permission denied); pass a folder you can write to")


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


# -- ImageNet-like JPEGs for benchmarks -------------------------------------------
#
# Decode and resize cost scale with pixel count and JPEG entropy, so a benchmark
# dataset has to match ImageNet in both, not in content: the short side is
# uniform in 333-500 px, aspect ratios follow ImageNet's mix (mostly 4:3 and 3:4),
# JPEG quality is mostly ~90 (4:2:0, as ImageNet's files), and the pixels are
# 1/f noise (the spectrum of natural images) with soft-edged textured shapes and
# sensor grain, tuned so that files average ~100 KB (ImageNet train: ~110 KB).

IMAGENET_LIKE_SHORT_SIDE = (333, 500)
# (width / height, share): landscape 4:3 dominates ImageNet, then portrait 3:4.
IMAGENET_LIKE_ASPECTS = ((4 / 3, 0.55), (3 / 4, 0.20), (1.0, 0.10), (3 / 2, 0.08), (16 / 9, 0.07))
_PHOTO_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")


@dataclass(frozen=True)
class ImageNetLikeSummary:
    """What ``make_imagenet_like`` wrote."""

    root: Path
    classes: tuple[str, ...]  # sorted, as ImageFolder orders (and labels) them
    images: int
    total_bytes: int
    mean_width: float
    mean_height: float

    @property
    def mean_kb(self) -> float:
        return self.total_bytes / max(self.images, 1) / 1024

    def line(self) -> str:
        return (
            f"{self.root}: {counted(len(self.classes), 'class')}, {counted(self.images, 'JPEG')}, mean"
            f" {self.mean_width:.0f}x{self.mean_height:.0f} px, mean {self.mean_kb:.0f} KB, {binary_size(self.total_bytes)} in all"
        )


def make_imagenet_like(
    root: Path,
    *,
    classes: int = 10,
    per_class: int = 100,
    seed: int = 0,
    source: Path | None = None,
    progress: ProgressFn | None = None,
    workers: int = 1,
    overwrite: bool = False,
) -> ImageNetLikeSummary:
    """Write ``root/class_NNN/NNN_NNNNN.JPEG``: JPEGs shaped like ImageNet's for decode benchmarks.

    With ``source`` (a folder of photos, searched recursively) each image is a
    random crop of a random photo, resized to the drawn size, instead of a
    generated picture.  Every image draws from its own generator keyed by
    (seed, class, index), so the output is a pure function of the arguments
    (and of the files in ``source``), whatever ``workers`` is.  ``workers`` > 1
    renders in that many processes.  A non-empty ``root`` is refused unless
    ``overwrite`` is set (then it is deleted first).
    """
    root = Path(root)
    if classes < 1 or per_class < 1:
        raise ValueError(f"classes={classes}, per_class={per_class}: need at least 1 class and 1 image per class")
    if seed < 0:
        raise ValueError(f"seed is {seed}; use a non-negative integer")
    if workers < 1:
        raise ValueError(f"workers is {workers}; use 1 or more")
    photos: tuple[str, ...] = ()
    if source is not None:
        source = Path(source)
        if not source.is_dir():
            raise ValueError(f"source {source} is not a directory; pass a folder of photos (jpg, png, webp ...)")
        photos = tuple(
            str(p) for p in sorted(source.rglob("*")) if p.is_file() and p.suffix.lower() in _PHOTO_EXTENSIONS
        )
        if not photos:
            raise ValueError(f"source {source} holds no photos ({', '.join(_PHOTO_EXTENSIONS)}); pass another folder")
    _check_writable(root)
    if any(root.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{root} is not empty; pass overwrite=True (--overwrite) or choose another directory")
        shutil.rmtree(root)

    names = tuple(f"class_{c:03d}" for c in range(classes))
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
    jobs = [(str(root / names[c]), c, i, seed, photos) for c in range(classes) for i in range(per_class)]
    total = len(jobs)
    sizes: list[tuple[int, int, int]] = []

    def record(done: int, result: tuple[int, int, int]) -> None:
        sizes.append(result)
        if progress is not None:
            progress(done, total)

    if workers == 1:
        for done, job in enumerate(jobs, 1):
            record(done, _imagenet_like_one(job))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # Not the fork that Python before 3.14 defaults to on Linux: a caller may run threads (gpu_check runs
        # `pytest -m gpu` beside this), and a child forked while one of them holds a lock (logging's, say)
        # waits for it for good; Python 3.12 warns of it.  The fork server's children import this module.
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("forkserver")) as pool:
            for done, result in enumerate(pool.map(_imagenet_like_one, jobs, chunksize=8), 1):
                record(done, result)

    summary = ImageNetLikeSummary(
        root=root,
        classes=names,
        images=total,
        total_bytes=sum(s[0] for s in sizes),
        mean_width=float(np.mean([s[1] for s in sizes])),
        mean_height=float(np.mean([s[2] for s in sizes])),
    )
    log.info("wrote %s", summary.line())
    return summary


def _imagenet_like_one(job: tuple[str, int, int, int, tuple[str, ...]]) -> tuple[int, int, int]:
    """Render and save one image; return (file bytes, width, height)."""
    folder, cls, index, seed, photos = job
    rng = np.random.default_rng([seed, 0x1A6E, cls, index])
    short = int(rng.integers(IMAGENET_LIKE_SHORT_SIDE[0], IMAGENET_LIKE_SHORT_SIDE[1] + 1))
    aspects = [a for a, _ in IMAGENET_LIKE_ASPECTS]
    aspect = aspects[int(rng.choice(len(aspects), p=[p for _, p in IMAGENET_LIKE_ASPECTS]))]
    w, h = (round(short * aspect), short) if aspect >= 1 else (short, round(short / aspect))
    # ImageNet's encoders mostly used quality ~90; a tenth is spread over 75-95.
    quality = int(rng.integers(75, 96)) if rng.random() < 0.1 else int(np.clip(round(rng.normal(90, 1.5)), 85, 95))
    if photos:
        image = _photo_crop(photos[int(rng.integers(len(photos)))], w, h, rng)
    else:
        image = _natural_like(w, h, cls, rng)
    path = Path(folder) / f"{cls:03d}_{index:05d}.JPEG"
    image.save(path, "JPEG", quality=quality)
    return path.stat().st_size, w, h


def _photo_crop(photo: str, w: int, h: int, rng: np.random.Generator) -> Image.Image:
    with Image.open(photo) as opened:
        im = opened.convert("RGB")
        pw, ph = im.size
        # The largest crop of the target aspect that fits, scaled by 50-100 %.
        cw, ch = (pw, pw * h / w) if pw * h <= ph * w else (ph * w / h, ph)
        scale = rng.uniform(0.5, 1.0)
        cw, ch = cw * scale, ch * scale
        x0, y0 = rng.uniform(0, pw - cw), rng.uniform(0, ph - ch)
        return im.resize((w, h), Image.Resampling.BICUBIC, box=(x0, y0, x0 + cw, y0 + ch))


def _pink_noise(rng: np.random.Generator, h: int, w: int, alpha: float) -> np.ndarray:
    """Unit-variance noise whose amplitude spectrum falls as 1/f**alpha (alpha ~1: natural images)."""
    fy = np.fft.fftfreq(h).astype(np.float32)[:, None]
    fx = np.fft.rfftfreq(w).astype(np.float32)[None, :]
    f = np.sqrt(fx * fx + fy * fy)
    f[0, 0] = 1.0
    gain = f ** np.float32(-alpha)
    gain[0, 0] = 0.0
    spectrum = rng.standard_normal((h, w // 2 + 1, 2), dtype=np.float32).view(np.complex64)[..., 0] * gain
    out: np.ndarray = np.fft.irfft2(spectrum, s=(h, w)).astype(np.float32)
    out /= out.std() + np.float32(1e-6)
    return out


def _upsample(field: np.ndarray, w: int, h: int) -> np.ndarray:
    return np.asarray(Image.fromarray(field).resize((w, h), Image.Resampling.BICUBIC))


def _natural_like(w: int, h: int, cls: int, rng: np.random.Generator) -> Image.Image:
    from PIL import ImageFilter

    # Low-frequency fields are drawn at quarter size: the FFT is the costly step.
    sw, sh = max(16, w // 4), max(16, h // 4)
    smooth = _upsample(_pink_noise(rng, sh, sw, rng.uniform(1.3, 1.7)), w, h)
    detail = _pink_noise(rng, h, w, rng.uniform(0.55, 0.85))
    # Texture where this field is high (foliage, fur), smooth elsewhere (sky, walls).
    where = _upsample(_pink_noise(rng, sh, sw, 1.8), w, h)
    where = 1.0 / (1.0 + np.exp(-3.0 * (where + np.float32(rng.uniform(-1.0, 1.0)))))
    c1 = _upsample(_pink_noise(rng, sh, sw, 1.5), w, h)[..., None]
    c2 = _upsample(_pink_noise(rng, sh, sw, 1.5), w, h)[..., None]
    y = np.linspace(-1.0, 1.0, h, dtype=np.float32)[:, None]
    lum = rng.uniform(25, 45) * smooth + rng.uniform(24, 44) * where * detail + rng.uniform(-30, 30) * y
    # A class-specific tint, so classes differ a little, as real classes do.
    tint = np.array(colorsys.hsv_to_rgb((cls * 0.618) % 1.0, 0.35, 1.0), dtype=np.float32) * 40 - 20
    base = rng.uniform(70, 170, 3).astype(np.float32) + tint
    red_green = np.array([1.0, -0.4, -0.6], dtype=np.float32)
    green_blue = np.array([-0.3, 0.9, -0.6], dtype=np.float32)
    chroma = rng.uniform(8, 22) * (c1 * red_green + c2 * green_blue)
    img = base + lum[..., None] + chroma

    for _ in range(int(rng.integers(1, 6))):
        r = rng.uniform(0.1, 0.4) * min(w, h)
        cx, cy = rng.uniform(0.1 * w, 0.9 * w), rng.uniform(0.1 * h, 0.9 * h)
        x0, y0 = int(max(0, cx - 1.3 * r - 8)), int(max(0, cy - 1.3 * r - 8))
        x1, y1 = int(min(w, cx + 1.3 * r + 8)), int(min(h, cy + 1.3 * r + 8))
        mask = Image.new("L", (x1 - x0, y1 - y0), 0)
        draw = ImageDraw.Draw(mask)
        if rng.random() < 0.4:
            e = rng.uniform(0.5, 1.0)
            draw.ellipse((cx - x0 - r, cy - y0 - r * e, cx - x0 + r, cy - y0 + r * e), fill=255)
        else:
            n = int(rng.integers(3, 9))
            angles = np.sort(rng.uniform(0, 2 * math.pi, n))
            radii = r * rng.uniform(0.5, 1.2, n)
            draw.polygon([(cx - x0 + q * math.cos(t), cy - y0 + q * math.sin(t)) for t, q in zip(angles, radii)], fill=255)
        # Soft edges, as optics and depth of field give real object boundaries.
        alpha = np.asarray(mask.filter(ImageFilter.GaussianBlur(rng.uniform(0.6, 2.5))), dtype=np.float32)[..., None] / 255
        colour = rng.uniform(15, 240, 3).astype(np.float32)
        texture = np.roll(detail, (int(rng.integers(h)), int(rng.integers(w))), (0, 1))[y0:y1, x0:x1, None]
        shade = np.linspace(rng.uniform(-25, 0), rng.uniform(0, 25), x1 - x0, dtype=np.float32)[None, :, None]
        fg = colour + np.float32(rng.uniform(5, 30)) * texture + shade
        region = img[y0:y1, x0:x1]
        img[y0:y1, x0:x1] = region + alpha * (fg - region)

    img += rng.standard_normal((h, w, 3), dtype=np.float32) * np.float32(rng.uniform(1.5, 3.5))
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")
