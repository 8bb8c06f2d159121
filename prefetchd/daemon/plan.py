"""The random decisions of one sample, all drawn before any pixel is decoded.

Every random decision of a sample is drawn from its own stream
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

Boxes are in the oriented image's pixels, with fractional edges (the val centre crop);
``pixel_box`` rounds one to whole pixels inside an image, ``scaled_box`` takes one to a
DCT-scaled decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Box = tuple[float, float, float, float]  # left, top, right, bottom
PixelBox = tuple[int, int, int, int]

SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
VAL_RESIZE_RATIO = 0.875
JITTER_OPERATIONS = ("brightness", "contrast", "saturation")  # torchvision adjust_<name>, indexed by a plan


@dataclass(frozen=True)
class AugmentOptions:
    """The optional augmentations of the train split (``DaemonConfig`` fields of the same names)."""

    color_jitter: float | None = None
    scale_jitter: tuple[int, int] | None = None
    transform: str | None = None  # "package.module:callable"


NO_OPTIONS = AugmentOptions()


@dataclass(frozen=True)
class Plan:
    """The random decisions of one sample, all drawn before decoding."""

    box: Box
    flip: bool = False
    jitter_order: tuple[int, ...] = ()
    jitter_factors: tuple[float, ...] = ()


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
    """The region of the original image that torchvision's ``Resize(int(size / 0.875))`` + ``CenterCrop(size)``
    keep, in its pixels.  As torchvision computes it: the resize truncates the longer side to a whole pixel (so
    each axis has its own scale) and the crop rounds its offset to a whole resized pixel.  The centred square of
    the ideal scale, kept before, was up to an output pixel off that region (3.4 source pixels at 224 px on an
    867 x 894 image; a user's walk), where the docs promised half a source pixel (``pixel_box``'s rounding)."""
    resized = int(size / VAL_RESIZE_RATIO)  # at least size: the crop never pads
    if width <= height:
        new_w, new_h = resized, int(resized * height / width)
    else:
        new_w, new_h = int(resized * width / height), resized
    left, top = int(round((new_w - size) / 2.0)), int(round((new_h - size) / 2.0))
    sx, sy = width / new_w, height / new_h
    return (left * sx, top * sy, (left + size) * sx, (top + size) * sy)


def plan_sample(width: int, height: int, size: int, train: bool, rng: np.random.Generator | None,
                options: AugmentOptions = NO_OPTIONS) -> Plan:
    """Draw a sample's decisions for an image of this oriented size (the module docstring gives the order)."""
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


def pixel_box(box: Box, width: int, height: int) -> PixelBox:
    """``box`` rounded to whole pixels, inside the image and at least one pixel wide and high."""
    left = min(max(int(round(box[0])), 0), width - 1)
    top = min(max(int(round(box[1])), 0), height - 1)
    right = min(max(int(round(box[2])), left + 1), width)
    bottom = min(max(int(round(box[3])), top + 1), height)
    return (left, top, right, bottom)


def scaled_box(box: Box, scale: int) -> Box:
    """``box`` in the pixels of a decode at 1/``scale``."""
    return (box[0] / scale, box[1] / scale, box[2] / scale, box[3] / scale)
