"""What feeds the model in steps 3 and 4 of ``tools/gpu_check.py``: each feed a context manager
that gives endless ``Batches`` (images, labels, whether the batch opens an epoch) and ends what
it started: synthetic tensors already on the device (the ceiling), a prefetchd daemon read by
``BufferLoader``, ImageFolder + DataLoader as users run it today, and DALI's GPU pipeline."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from gpu_check_plan import Sizes, not_a_tool
from prefetchd.bench.contenders import classic_transform
from prefetchd.bench.report import why_not_runnable
from prefetchd.trainer import BufferLoader
from prefetchd.trainer.config import TrainConfig
from prefetchd.trainer.spawn import spawn_daemon
from prefetchd.trainer.tensors import IMAGENET_MEAN, IMAGENET_STD

log = logging.getLogger(__name__)

# Every wait on another process is bounded; a stuck step fails with this in its message.
WAIT_SECONDS = 180.0

Batches = Iterator[tuple[torch.Tensor, torch.Tensor, bool]]  # images, labels, whether the batch opens an epoch
Feed = Callable[[], AbstractContextManager[Batches]]


@contextlib.contextmanager
def prefetchd_feed(data: Path, sizes: Sizes, workers: int, device: torch.device, root: Path) -> Iterator[Batches]:
    buffer = root / f"prefetchd-gpu-check-{os.getpid()}"
    shutil.rmtree(buffer, ignore_errors=True)
    # Full batches only, as the DataLoader feed's drop_last=True: a short last batch made
    # cudnn.benchmark tune itself again inside the first daemon-fed round (H100 lease, e14658c:
    # one fifth of that round at 1389 images/s, the GPU busy, no step waiting for data).
    config = TrainConfig(buffer=buffer, batch_size=sizes.batch_size, image_size=sizes.image_size, workers=workers,
                         high_water=sizes.high_water, seed=0, quiet=True, drop_last=True)
    daemon = spawn_daemon(buffer, data, "train", config, echo=log.info)
    if daemon is None:
        raise RuntimeError(f"{buffer} is already served by another daemon; stop it first")
    try:
        daemon.wait_ready(WAIT_SECONDS)
        loader = BufferLoader(buffer, device=device, normalize=True, timeout=WAIT_SECONDS)
        try:
            yield _epochs(lambda: ((b.images, b.labels) for b in loader), f"the daemon's buffer {buffer}")
        finally:
            loader.close()
    finally:
        daemon.stop()
        shutil.rmtree(buffer, ignore_errors=True)


@contextlib.contextmanager
def dataloader_feed(data: Path, sizes: Sizes, workers: int, device: torch.device) -> Iterator[Batches]:
    from torch.utils.data import DataLoader
    from torchvision import datasets

    # What users run today: PIL decode, RandomResizedCrop, flip, float32 normalised in the workers.
    transform = classic_transform(sizes.image_size, uint8=False)
    loader = DataLoader(datasets.ImageFolder(str(data), transform=transform), batch_size=sizes.batch_size,
                        shuffle=True, drop_last=True, num_workers=workers, persistent_workers=True,
                        prefetch_factor=2, pin_memory=device.type == "cuda", timeout=WAIT_SECONDS,
                        generator=torch.Generator().manual_seed(0))
    it = _epochs(lambda: iter(loader), f"the DataLoader over {data}")
    try:
        yield it
    finally:
        it.close()
        workers_iter = getattr(loader, "_iterator", None)  # persistent workers outlive an epoch: end them now
        if workers_iter is not None:
            workers_iter._shutdown_workers()


@contextlib.contextmanager
def synthetic_feed(sizes: Sizes, classes: int, device: torch.device) -> Iterator[Batches]:
    images = torch.randn(sizes.batch_size, 3, sizes.image_size, sizes.image_size, device=device)
    images = images.contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, classes, (sizes.batch_size,), device=device)

    def forever() -> Batches:
        while True:
            yield images, labels, False

    yield forever()


def dali_missing(device: torch.device) -> str | None:
    why = why_not_runnable("dali")  # `prefetchd bench`'s word for a DALI that is not installed or does not import
    if why:
        return f"skipped: {why}"
    if device.type != "cuda":
        return "skipped: DALI's mixed decoder needs a GPU (dry run on the CPU)"
    return None


@contextlib.contextmanager
def dali_feed(data: Path, sizes: Sizes, workers: int, device: torch.device) -> Iterator[Batches]:
    # Untyped on purpose: DALI's stubs differ between releases (2.4's lack fn's and types'
    # names), and this is the one place that uses them.
    dali: Any = importlib.import_module("nvidia.dali")
    fn, types = dali.fn, dali.types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    @dali.pipeline_def  # type: ignore[untyped-decorator]
    def pipeline() -> Any:
        # readers.file labels class folders in sorted order, as ImageFolder does.
        jpegs, labels = fn.readers.file(file_root=str(data), random_shuffle=True, name="reader")
        images = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB)
        images = fn.resize(images, resize_x=sizes.image_size, resize_y=sizes.image_size)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="HWC",
                                          mean=[m * 255 for m in IMAGENET_MEAN], std=[s * 255 for s in IMAGENET_STD],
                                          mirror=fn.random.coin_flip())
        return images, labels.gpu()

    pipe = pipeline(batch_size=sizes.batch_size, num_threads=workers, device_id=device.index or 0, seed=0)
    pipe.build()
    it = DALIGenericIterator([pipe], ["images", "labels"], reader_name="reader", auto_reset=True)

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for out in it:
            # NHWC memory seen as NCHW is channels_last, which the model wants anyway.
            yield out[0]["images"].permute(0, 3, 1, 2), out[0]["labels"].reshape(-1).long()

    yield _epochs(batches, f"DALI over {data}")


def _epochs(epoch: Callable[[], Iterator[Any]],
            what: str) -> Generator[tuple[torch.Tensor, torch.Tensor, bool], None, None]:
    """Batches across epochs, as a training loop that runs for a number of steps sees them, each
    marked where it opens an epoch (a DataLoader waits there for its workers' first batches)."""
    while True:
        got = False
        for images, labels in epoch():
            yield images, labels, not got
            got = True
        if not got:
            raise RuntimeError(f"{what}: an epoch without batches")


if __name__ == "__main__":  # imported by tools/gpu_check.py; run alone it has nothing to do
    not_a_tool(__file__)
