"""The DALI contenders: NVIDIA DALI's CPU pipeline (``device_id=None``) with prefetchd's
augmentation, as uint8 HWC batches.

    dali             fn.readers.file -> fn.decoders.image_random_crop (crop-aware: libjpeg-turbo
                     decodes only the crop's rows and columns) -> fn.resize(S x S) -> fn.flip
    dali-fulldecode  fn.readers.file -> fn.decoders.image (the whole image)
                     -> fn.random_resized_crop(S x S) -> fn.flip

Both draw the crop as RandomResizedCrop does (prefetchd's SCALE and RATIO, 10 tries),
resize with DALI's default antialiased linear filter (torchvision's antialiased
bilinear, as the other contenders), flip with p=0.5, and read the same files with the
same labels as torchvision's ImageFolder.  ``num_threads`` is the worker count; the
caller pins the process (DALI's threads inherit the mask).

nvidia.dali is imported inside the functions: it is optional (``pip install
nvidia-dali-cuda130``) and ~0.5 s to import.
"""

from __future__ import annotations

import importlib
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

# DALI's reader shuffles by drawing each sample at random from a buffer of this many
# read ahead: its default, which DALI's ImageNet examples keep.
SHUFFLE_BUFFER = 1024
CROP_ATTEMPTS = 10  # torchvision's RandomResizedCrop tries 10 boxes before its centre fallback

DALI_CONTENDERS = {"dali": True, "dali-fulldecode": False}  # name -> crop-aware decoder


def dali_batches(
    samples: Sequence[tuple[str, int]], *, batch_size: int, image_size: int, threads: int, crop_aware: bool,
    seed: int = 0,
) -> Generator[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]], None, None]:
    """Endless (images uint8 B x S x S x 3, labels int32 B) batches of ``samples`` (path, label).

    The pipeline (and its threads) lives until the generator is closed.
    """
    from prefetchd.daemon.plan import RATIO, SCALE

    # Typed as Any on purpose: nvidia.dali ships partial stubs, so a typed import would
    # type-check differently on machines with and without it (CI has none).
    dali: Any = importlib.import_module("nvidia.dali")
    fn, types = dali.fn, dali.types

    pipe = dali.Pipeline(batch_size=batch_size, num_threads=threads, device_id=None, seed=seed)
    try:
        with pipe:
            encoded, labels = fn.readers.file(
                files=[path for path, _ in samples], labels=[label for _, label in samples],
                random_shuffle=True, initial_fill=SHUFFLE_BUFFER, name="reader",
            )
            crop = {"random_area": list(SCALE), "random_aspect_ratio": list(RATIO), "num_attempts": CROP_ATTEMPTS}
            if crop_aware:
                images = fn.decoders.image_random_crop(encoded, device="cpu", output_type=types.RGB, **crop)
                images = fn.resize(images, size=[image_size, image_size])
            else:
                images = fn.decoders.image(encoded, device="cpu", output_type=types.RGB)
                images = fn.random_resized_crop(images, size=[image_size, image_size], **crop)
            images = fn.flip(images, horizontal=fn.random.coin_flip(probability=0.5))
            pipe.set_outputs(images, labels)
        pipe.build()
        while True:
            out_images, out_labels = pipe.run()
            # as_array: one contiguous batch, as the other contenders collate theirs.
            yield out_images.as_array(), out_labels.as_array().reshape(-1)
    finally:
        del pipe  # stops DALI's threads now, not at some later garbage collection
