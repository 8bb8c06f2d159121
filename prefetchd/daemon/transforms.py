"""Decode one image and augment it into an H x W x 3 uint8 array.

train: torchvision's RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3, its
10-try rejection sampling and centre fallback) + horizontal flip with p=0.5.
val:   resize the shorter side to size / 0.875, then centre crop.

Crop and resize happen in one antialiased bilinear resample of the crop box
(Pillow ``resize(box=...)``), which is both what the two-step torchvision
pipeline computes and cheaper, since only the box is resampled.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

Box = tuple[float, float, float, float]  # left, top, right, bottom

SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
VAL_RESIZE_RATIO = 0.875
_EXIF_ORIENTATION = 0x0112


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


def center_crop_box(width: int, height: int, size: int) -> Box:
    """The region of the original image that resize-shorter-side + centre-crop keeps."""
    short = min(width, height)
    resized = int(size / VAL_RESIZE_RATIO)  # torchvision's Resize(int(size / 0.875)) truncates too
    # Size of the crop measured in original pixels.
    crop = min(short, size * short / resized)
    left, top = (width - crop) / 2, (height - crop) / 2
    return (left, top, left + crop, top + crop)


def load_rgb(path: Path) -> Image.Image:
    """Decode ``path`` to RGB, honouring EXIF orientation."""
    with Image.open(path) as img:
        oriented: Image.Image = img
        if img.getexif().get(_EXIF_ORIENTATION, 1) != 1:
            oriented = ImageOps.exif_transpose(img)
        return oriented.convert("RGB")


def augment(path: Path, size: int, train: bool, rng: np.random.Generator | None) -> np.ndarray:
    img = load_rgb(path)
    w, h = img.size
    if train:
        if rng is None:
            raise ValueError("train augmentation needs the sample's random stream")
        box = random_resized_crop_box(w, h, rng)
        flip = bool(rng.random() < 0.5)
    else:
        box, flip = center_crop_box(w, h, size), False
    out = img.resize((size, size), Image.Resampling.BILINEAR, box=box)
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out)
