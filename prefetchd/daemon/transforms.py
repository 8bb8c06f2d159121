"""Decode one image and augment it into an H x W x 3 uint8 array: the pipeline, stage by stage.

1. the header: size and EXIF orientation (``decode.read_header``);
2. the sample's random decisions, from the oriented size alone (``plan.plan_sample``), so that
   the decode path can never change a draw;
3. the decode of what the crop needs, and the one copy of the crop out of it (``decode``);
4. the antialiased resize, mirrored where the plan flips (``resample``);
5. colour jitter (torchvision) and the user's hook (``hook``), where the job has them.

The output is a pure function of (seed, epoch, index) and the file's bytes, the same with or
without the C extension (``jpeg_crop``) and on every worker.

torch and torchvision are imported inside the functions that need them, not at the
top: importing them costs ~3.4 s and ~370 MB of private memory per process (measured
with a CUDA wheel), and the controller and every CLI command import these modules only
for their names (options, hook validation).  A worker imports what its job needs when it
starts (``needed_modules``): with the C extension built, on a CPU with torch's uint8
kernel, neither, unless the job jitters colours (torchvision) or has a hook (torch);
a JPEG the crop-aware decoder refuses imports both when it comes.  That took a cold
``prefetchd start`` to its first batch from 3.1 s (torch and torchvision in every
worker) to 1.9 s (torch alone) to 0.6 s on this project's 2-core machine
(``tools/cold_start.py``, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from prefetchd.daemon import decode, jpeg_crop, resample
from prefetchd.daemon.decode import DEFAULT_MAX_IMAGE_PIXELS
from prefetchd.daemon.hook import apply_hook
from prefetchd.daemon.plan import JITTER_OPERATIONS, NO_OPTIONS, AugmentOptions, Plan, plan_sample
from prefetchd.daemon.sources.storage import read_bytes

if TYPE_CHECKING:
    import torch


@dataclass
class StageTimes:
    """Seconds one sample spent in each stage (all tries, when a sample was replaced):
    read the file; decode (header, the sample's draws, decoding); augment (crop,
    resize, flip, jitter, hook)."""

    read: float = 0.0
    decode: float = 0.0
    augment: float = 0.0


def preload(options: AugmentOptions = NO_OPTIONS) -> None:
    """Import what augmenting with ``options`` needs now: a worker calls this when it starts, so
    that its first sample is not charged the seconds of the import."""
    for module in needed_modules(options):
        importlib.import_module(module)


def needed_modules(options: AugmentOptions = NO_OPTIONS) -> tuple[str, ...]:
    """The modules augmenting with ``options`` imports.  torch (~1.8 s to import here: most of a cold
    start) only where it resizes, jitters or runs the user's hook: the C extension resizes where it
    is built.  torchvision (~1.6 s more) only where it decodes or
    jitters: the whole-image JPEG decoder when the crop-aware extension is not built, and colour
    jitter.  Otherwise a JPEG the extension refuses, decoded whole by ``decode_jpeg``, imports both
    then (PNGs go to Pillow)."""
    torchvision = not jpeg_crop.available() or bool(options.color_jitter)
    torch = torchvision or options.transform is not None
    return (*(("torch",) if torch else ()),
            *(("torchvision.io", "torchvision.transforms.v2.functional") if torchvision else ()))


def _jitter(hwc: torch.Tensor, plan: Plan) -> torch.Tensor:
    from torchvision.transforms.v2 import functional as TF

    chw = hwc.permute(2, 0, 1)
    for i in plan.jitter_order:
        adjust = getattr(TF, f"adjust_{JITTER_OPERATIONS[i]}")
        chw = adjust(chw, plan.jitter_factors[i])
    return chw.permute(1, 2, 0)


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
                  tracked: jpeg_crop.TrackedFile | None = None, into: np.ndarray | None = None) -> np.ndarray:
    """Decode the image in ``data`` and augment it into a contiguous ``size`` x ``size`` x 3 uint8 array:
    ``into``, written in place and returned, where given (a worker's batch slot: the resize writes
    the slot's pages itself, instead of a new array that is then copied there), else a new one.

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
        # The header only (size, EXIF orientation; for a file that is not a plain JPEG, Pillow's
        # image of it, not closed: the Pillow path may hand back this very image, and a BytesIO
        # holds no OS resource).
        header = decode.read_header(data, name, max_pixels)
        plan = plan_sample(*header.oriented, size, train, rng, options)
        decoded = decode.decode(data, name, max_pixels, header, plan.box, size, tracked)
    finally:
        t2 = time.perf_counter()
        if times is not None:
            times.decode += t2 - t1
    more = bool(plan.jitter_order) or options.transform is not None
    result = resample.resize(decode.cut(decoded, plan.box), size, plan.flip, None if more else into)
    if more:
        import torch

        out = torch.from_numpy(result)
        if plan.jitter_order:
            out = _jitter(out, plan)
        if options.transform is not None:
            if rng is None:
                raise ValueError(f"the transform hook {options.transform} needs the sample's random stream")
            out = apply_hook(options.transform, out, rng, size, name)
        result = out.contiguous().numpy()
        if into is not None:
            into[...] = result
            result = into
    if times is not None:
        times.augment += time.perf_counter() - t2
    return result
