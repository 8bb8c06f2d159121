"""The model ``prefetchd-train`` trains and how: a torchvision model (pretrained weights from the
local hub cache only), its optimizer (SGD or AdamW) and learning-rate schedule (linear warmup,
then cosine), and a check that the job's last batch is one the model can train on."""

from __future__ import annotations

import logging
import math
import os
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path

import click
import torch
import torchvision
from torch import nn

from prefetchd.buffer_protocol import Manifest
from prefetchd.trainer.config import TrainConfig
from prefetchd.trainer.errors import OptionError, SetupError

logger = logging.getLogger(__name__)


def cached_weights(model: str) -> tuple[str, Path]:
    """torchvision's default weights for ``model``: their name and where the torch hub cache keeps them."""
    try:
        weights = torchvision.models.get_model_weights(model).DEFAULT
    except (ValueError, KeyError, AttributeError):
        raise SetupError(f"--pretrained: torchvision has no pretrained weights for --model {model}") from None
    filename = os.path.basename(urllib.parse.urlparse(weights.url).path)
    return f"{type(weights).__name__}.{weights.name}", Path(torch.hub.get_dir()) / "checkpoints" / filename


def build_model(name: str, num_classes: int, pretrained: bool, echo: Callable[[str], None] = click.echo) -> nn.Module:
    """A torchvision model for ``num_classes``; with ``pretrained``, weights from the local hub cache only.

    The classifier of the pretrained weights rarely has ``num_classes``
    outputs: tensors whose shape differs stay freshly initialised.
    """
    check_model_name(name)
    try:
        model: nn.Module = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    except ValueError as exc:
        raise SetupError(f"--model {name}: {exc}") from None
    if not pretrained:
        return model
    weights, path = cached_weights(name)
    if not path.is_file():
        raise SetupError(
            f"--pretrained: {weights} is not in the local torch hub cache ({path}), and prefetchd-train never "
            f"downloads. Fetch it once where there is network access, e.g. `python -c \"import torchvision; "
            f"torchvision.models.get_model('{name}', weights='DEFAULT')\"`, and copy {path.name} to "
            f"{path.parent} (or point TORCH_HOME at a cache that has it)"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise SetupError(f"--pretrained: cannot read {path} ({exc}); delete it and fetch it again") from None
    own = model.state_dict()
    if not isinstance(state, Mapping) or any(key not in state for key in own if not key.endswith("num_batches_tracked")):
        missing = [key for key in own if not isinstance(state, Mapping) or key not in state][:5]
        raise SetupError(
            f"--pretrained: {path} does not hold weights for --model {name} (missing {missing}); delete it and "
            "fetch it again"
        )
    fitting = {key: value for key, value in state.items() if key in own and own[key].shape == value.shape}
    model.load_state_dict(fitting, strict=False)
    fresh = [key for key in own if key not in fitting]
    echo(
        f"prefetchd-train: --pretrained: {weights} from {path}"
        + (f"; kept freshly initialised for {num_classes} classes: {', '.join(fresh)}" if fresh else "")
    )
    return model


def check_model_name(name: str) -> None:
    """Refuse a --model that is no torchvision classification model (OptionError).  ``train`` asks first, before
    it waits for a buffer or starts a daemon: a typo is told at once, not after the manifest's --timeout."""
    if name not in classification_models():
        # Detection, segmentation, video and optical-flow models take other targets, and some of
        # them download a backbone when built: neither fits a trainer that never downloads.
        raise OptionError(
            f"--model {name}: not a torchvision classification model; prefetchd-train trains those only, such as "
            "resnet18, resnet50, mobilenet_v3_small, efficientnet_b0, vit_b_16 (all of them: python -c \"import "
            "torchvision; print(torchvision.models.list_models(module=torchvision.models))\")"
        )


def classification_models() -> list[str]:
    """The names torchvision registers as classification models (those of ``torchvision.models`` itself)."""
    return list(torchvision.models.list_models(module=torchvision.models))


# Image sizes tried, on the meta device, to tell a user whose model cannot run at the job's size which one it
# can: the usual ones of torchvision's recipes.
USUAL_SIZES = (32, 64, 96, 128, 160, 192, 224, 256, 299, 320, 384, 448, 512)


def _runs(name: str, num_classes: int, channels: int, size: int, batch: int) -> Exception | None:
    """Run ``name`` once in training mode on the meta device, where only shapes are computed (milliseconds);
    None if it ran, else what it raised."""
    try:
        with torch.device("meta"):
            model = build_model(name, num_classes, pretrained=False)
        model.train()
        model(torch.empty(batch, channels, size, size, device="meta"))
    except Exception as exc:
        return exc
    return None


def check_classes(manifest: Manifest) -> None:
    """Refuse a job of one class: a classifier's cross-entropy over one class is 0 whatever the weights,
    so nothing trains, and the usual cause is --data one folder too high (/imagenet holding train/)."""
    if len(manifest.classes) != 1:
        return
    raise SetupError(
        f"the training data {manifest.dataset_root} has one class ({manifest.classes[0]}): a classifier learns "
        "nothing from it. --data is the folder that holds a folder per class (ROOT/<class>/<image>.jpg); if "
        f"{manifest.classes[0]}/ holds the class folders, start the daemon with --data "
        f"{manifest.dataset_root.rstrip('/')}/{manifest.classes[0]} (with --spawn-daemon: pass that --data and --reset)"
    )


def check_last_batch(name: str, num_classes: int, manifest: Manifest) -> None:
    """Refuse, before the first step, a job whose images the model cannot take, and a job whose
    epochs end in a batch of one image that the model cannot train on: BatchNorm in training mode
    needs more than one value per channel, and a batch of one after global pooling (a small image
    size) has one.  Found by running the model on the meta device; a model the meta device cannot
    run (an operation without a meta kernel) is left to the real first epoch."""
    m = manifest
    problem = _runs(name, num_classes, m.channels, m.image_size, batch=2)
    if problem is not None:
        fits = [size for size in USUAL_SIZES if size != m.image_size
                and _runs(name, num_classes, m.channels, size, batch=2) is None]
        if not fits:  # it runs at no size: the meta device, not the size, is what it cannot take
            logger.debug("cannot check %s at %d px on the meta device: %s", name, m.image_size, problem)
            return
        exactly = len(fits) == 1
        bigger = [size for size in fits if size > m.image_size]
        size = bigger[0] if bigger else fits[-1]
        told = " ".join(str(problem).split())[:200]
        raise SetupError(
            f"--model {name} cannot run on images of {m.image_size} px ({told}); it needs images of "
            f"{'exactly' if exactly else 'at least' if bigger == fits else 'for example'} {size} px: start the daemon "
            f"with --image-size {size} (with --spawn-daemon, pass --image-size {size} --reset here), or pick another --model"
        )
    if m.steps_per_epoch < 1 or m.samples_per_epoch - (m.steps_per_epoch - 1) * m.batch_size != 1:
        return
    problem = _runs(name, num_classes, m.channels, m.image_size, batch=1)
    if isinstance(problem, ValueError) and "value per channel" in str(problem):
        raise SetupError(
            f"every epoch ends in a batch of 1 image ({m.samples_per_epoch} samples in batches of {m.batch_size}), "
            f"which {name} cannot train on at {m.image_size} px ({problem}). Start the daemon with --drop-last --reset "
            "(with --spawn-daemon, add them here), or pick a --batch-size that leaves more than one image over"
        ) from None
    if problem is not None:  # an operation without a meta kernel: no verdict here
        logger.debug("cannot check a one-image batch of %s on the meta device: %s", name, problem)


def build_optimizer(config: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    if config.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=config.peak_lr, weight_decay=config.decay)
    return torch.optim.SGD(model.parameters(), lr=config.peak_lr, momentum=config.momentum, weight_decay=config.decay)


def warmup_cosine(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Learning-rate factor of step ``s``: linear from 1/warmup to 1, then half a cosine to 0."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup_steps) / span)))

    return factor


__all__ = ["build_model", "build_optimizer", "cached_weights", "check_last_batch", "check_model_name", "classification_models", "warmup_cosine"]
