"""Crop, resize, flip: one resampler for every decode path.

The integer crop box is copied once out of the decoded image into a contiguous
H x W x 3 array (``decode.cut``); the antialiased bilinear resize (the bytes of ``torchvision.transforms.v2.functional.resize``:
torch's uint8 kernel with PIL-compatible weights, on every CPU: ``resize``) reads that
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
box) are rounded to whole pixels: at most half a source pixel, which is under half an output
pixel where the box shrinks; an image smaller than the output (a 3 x 3 icon at 64 px) gains up to
half its own pixel a side, so it differs from torchvision's resize more (a walk: mean 5 of 255).
"""

from __future__ import annotations

import numpy as np

from prefetchd.daemon import jpeg_crop


def resize(crop: np.ndarray, size: int, mirror: bool, into: np.ndarray | None = None) -> np.ndarray:
    """Antialiased bilinear resize of an H x W x 3 uint8 array to ``size`` x ``size`` x 3, columns
    mirrored if ``mirror``, into ``into`` where given (a batch slot: see ``transforms.augment_bytes``)
    or a new array: the bytes of torchvision's ``v2.functional.resize(BILINEAR, antialias=True)`` then
    ``hflip`` on a CPU with torch's uint8 kernel, which the tests compare.  The C extension's where it
    is built (so that a worker need not import torch at all), else torch's own uint8 kernel, called
    directly: the same integer arithmetic, so the same bytes on every CPU.

    Not torchvision's choice on an x86 CPU without AVX2 and FMA (or under ATEN_CPU_CAPABILITY=default),
    where it resizes in float32 and rounds: up to 1 apart on some bytes (7 % in a walk), so a batch would
    depend on the machine that built it, and a daemon restarted there (or a Ray node of another CPU)
    mixed such batches into one job with no word.  torch's uint8 kernel runs on any CPU (its generic loop
    where it has no AVX2 one), so every build of a batch has the same bytes."""
    resized = jpeg_crop.resize(crop, size, mirror, into)
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
        out = F.interpolate(image, size=[size, size], mode="bilinear", align_corners=False, antialias=True)
        hwc = out.reshape(3, size, size).permute(1, 2, 0)
    if mirror:
        hwc = hwc.flip(1)
    if into is not None:
        into[...] = hwc.numpy()
        return into
    return hwc.contiguous().numpy()


def resize_summary() -> str:
    """Which resize the workers run, and so whether they import torch: the line ``prefetchd start``
    logs once beside ``jpeg_crop.decoder_summary()``."""
    if not jpeg_crop.available():
        return "resize: torch's uint8 kernel; workers import torch (the C extension would spare it)"
    return ("resize: the C extension's copy of torch's uint8 kernel; workers import torch only for a hook "
            "or colour jitter")
