"""From a mapped batch file to tensors: is it the batch the manifest promises, and how its uint8
pixels become the normalised floats a model takes.

Normalisation is ``(x / 255 - mean) / std`` per channel, as torchvision's ``ToTensor`` then
``Normalize``, done as ``x * scale - shift`` in two in-place passes after the move to the
device (uint8 crosses the bus, a quarter of float32's bytes); the GPU path
(``prefetchd.trainer.gpu``) takes the same ``scale`` and ``shift``.  The fused form rounds
differently from torchvision's three passes: within 5e-7 of them (float32 values in
[-2.2, 2.7] for the ImageNet statistics), never bit for bit.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from prefetchd.buffer_protocol import Manifest, MappedBatch, not_of_stream
from prefetchd.buffer_protocol.manifest import batch_len
from prefetchd.trainer.batch import Batch

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# One-channel data: the mean of the three ImageNet channels, as torchvision's
# grayscale recipes use.
GRAY_MEAN = (0.449,)
GRAY_STD = (0.226,)


def check_statistics(normalize: bool, mean: Sequence[float] | None, std: Sequence[float] | None) -> None:
    """Refuse ``mean`` and ``std`` that could not mean what was meant, before any buffer is read."""
    if not normalize and (mean is not None or std is not None):
        raise ValueError("mean= and std= apply only with normalize=True, which normalize=False turns off; "
                         "leave them out, or normalize")
    if (mean is None) != (std is None):  # one of a dataset's statistics beside ImageNet's other is neither's
        raise ValueError("mean= and std= go together: pass both, or neither for the defaults (ImageNet's)")
    for name, values in (("mean", mean), ("std", std)):
        if values is not None and not _per_channel(values):  # mean=0.5 was "'float' object is not iterable"
            raise ValueError(f"{name}={values!r}: pass one number per channel, such as {name}=(0.5, 0.5, 0.5)")
    if (mean is not None and not all(0 <= m <= 1 for m in mean)) or (std is not None and not all(s <= 1 for s in std)):
        # The images become float in [0, 1] first, as after torchvision's ToTensor: 0-255 values shift everything.
        raise ValueError(f"mean={mean!r}, std={std!r}: pass them in [0, 1] units, as torchvision's Normalize "
                         "takes them after ToTensor (0-255 values: divide them by 255)")


def _per_channel(values: object) -> bool:
    """Whether ``values`` is a sequence (a tuple, a list, a 1-d tensor or array) of numbers."""
    if isinstance(values, (torch.Tensor, np.ndarray)):
        return values.ndim == 1
    return isinstance(values, Sequence) and not isinstance(values, str) and all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values)


def normalization(mean: Sequence[float] | None, std: Sequence[float] | None, channels: int, buffer: Path,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``scale`` and ``shift`` on ``device`` for images of ``channels`` channels (those in ``buffer``):
    from ``mean`` and ``std``, or by default ImageNet's (one channel: their mean)."""
    if mean is None or std is None:
        defaults = {3: (IMAGENET_MEAN, IMAGENET_STD), 1: (GRAY_MEAN, GRAY_STD)}
        if channels not in defaults:
            raise ValueError(
                f"{buffer}: images have {channels} channels and normalize=True has defaults only for "
                "1 or 3; pass mean= and std= (one value per channel) or normalize=False"
            )
        mean = mean if mean is not None else defaults[channels][0]
        std = std if std is not None else defaults[channels][1]
    if len(mean) != channels or len(std) != channels or not all(s > 0 for s in std):
        raise ValueError(
            f"mean={tuple(mean)!r}, std={tuple(std)!r}: need {channels} values each (images in {buffer} "
            "have that many channels) and positive std"
        )
    # x * scale - shift == (x / 255 - mean) / std.
    std_t = torch.as_tensor(std, dtype=torch.float64).cpu()  # a list, or a tensor already (no copy warning)
    scale = (1.0 / (255.0 * std_t)).to(torch.float32).view(1, channels, 1, 1)
    shift = (torch.as_tensor(mean, dtype=torch.float64).cpu() / std_t).to(torch.float32).view(1, channels, 1, 1)
    return scale.to(device), shift.to(device)


def mismatch(mapped: MappedBatch, epoch: int, step: int, manifest: Manifest, buffer: Path, *,
             keyed: bool | None = None) -> str | None:
    """How ``mapped`` differs from batch (epoch, step) of ``manifest``'s job in ``buffer``; None if it does not.
    ``keyed``: whether the daemon's batches name their stream (``not_of_stream``); the manifest's
    ``keyed_batches`` where None."""
    meta, m = mapped.meta, manifest
    path = mapped.path
    if not_of_stream(meta, m.job_key, m.rank, keyed=m.keyed_batches if keyed is None else keyed):
        what = (f"names no job and rank (a batch of a prefetchd before batches named them, as {buffer}'s daemon's do)"
                if meta.job is None and meta.rank is None else f"is a batch of {meta.stream}")
        return (f"{path}: {what}, at epoch {meta.epoch} step {meta.step}, but this stream is rank {m.rank} of job "
                f"{m.job_key} (its manifest.json): the daemon writes only this stream's batches here, so someone who "
                "may rename the buffer's files (a member of its group?) renamed it there, from another rank's folder "
                "or kept from an earlier job. Remove it (the daemon builds that batch again)")
    if (meta.epoch, meta.step) != (epoch, step):
        return (f"{path}: holds epoch {meta.epoch} step {meta.step} but its name says epoch {epoch} step {step}; "
                "delete it (the daemon regenerates missing batches)")
    n, h, w, c = mapped.images.shape
    expected = batch_len(step, m.batch_size, m.samples_per_epoch)  # a short batch is an epoch's last alone
    if (h, w, c) != (m.image_size, m.image_size, m.channels) or n != expected or meta.seed != m.seed:
        return (f"{path}: {n} images of {h}x{w}x{c} with seed {meta.seed}, but manifest.json promises {expected} "
                f"of {m.image_size}x{m.image_size}x{m.channels} with seed {m.seed} at step {step}: the batch "
                f"belongs to another job (or its writer does not follow SPEC.md's sizes). Stop the daemon, delete "
                f"the *.batch files in {buffer} and restart it")
    for name, values, end in (("labels", mapped.labels, len(m.classes)), ("indices", mapped.indices, m.num_samples)):
        if int(values.min()) < 0 or int(values.max()) >= end:
            return (f"{path}: {name} range over [{int(values.min())}, {int(values.max())}] but the manifest has "
                    f"{end} {'classes' if name == 'labels' else 'samples'}; delete it (the daemon regenerates "
                    "missing batches)")
    return None


def to_batch(mapped: MappedBatch, epoch: int, step: int, device: torch.device,
             normalized: tuple[torch.Tensor, torch.Tensor] | None) -> Batch:
    """``mapped`` as tensors on ``device`` (a plain copy there; CUDA's pinned path is ``gpu``), normalised
    with ``normalized``'s ``(scale, shift)`` where given."""
    non_blocking = device.type == "cuda"
    # HWC bytes seen as NCHW: a free permute whose strides are channels_last.
    images = torch.from_numpy(mapped.images).permute(0, 3, 1, 2).to(device, non_blocking=non_blocking)
    # Copies (8 bytes an image), not views of the mapping: only the uint8 images are handed out zero-copy, so a
    # batch file cut short under the trainer (by anyone who may write the buffer) faults no normalised batch.
    labels = torch.from_numpy(mapped.labels.copy()).to(device, non_blocking=non_blocking)
    if normalized is not None:
        scale, shift = normalized
        # Convert after the move: uint8 crosses the bus, a quarter of float32's bytes.
        images = images.to(torch.float32).mul_(scale).sub_(shift)
    return Batch(images=images, labels=labels, indices=torch.from_numpy(mapped.indices.copy()), epoch=epoch,
                 step=step, replaced=mapped.meta.replaced)


__all__ = ["GRAY_MEAN", "GRAY_STD", "IMAGENET_MEAN", "IMAGENET_STD", "check_statistics", "mismatch", "normalization",
           "to_batch"]
