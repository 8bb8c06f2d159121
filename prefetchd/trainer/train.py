"""The reference trainer behind ``prefetchd-train``: a torchvision model fed from a buffer.

It is deliberately plain (SGD, cosine schedule, cross-entropy, channels_last) so
that what it measures is the data path: per epoch it prints loss, top-1,
images/s and the *data-wait share*, the fraction of the epoch spent inside the
loaders' ``next()``.  A share near zero means the daemon keeps the model fed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import click
import torch
import torchvision
from torch import nn

from prefetchd.buffer_protocol import ProtocolError
from prefetchd.trainer.errors import LoaderError
from prefetchd.trainer.loader import Batch, BufferLoader

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1  # a configuration problem found before training (click.ClickException)
EXIT_BUFFER = 3  # the buffer could not deliver: LoaderError / ProtocolError
EXIT_INTERRUPTED = 130

METRICS_FORMAT = "prefetchd.train_metrics"
METRICS_VERSION = 1


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on; the CLI's defaults come from here."""

    buffer: Path
    val_buffer: Path | None = None
    epochs: int | None = None
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    model: str = "resnet18"
    device: str = "auto"
    timeout: float = 120.0
    metrics_json: Path | None = None
    threads: int | None = None
    quiet: bool = False


@dataclass
class PassStats:
    """One pass (train or val) over one epoch of a loader."""

    loss: float
    top1: float
    images: int
    seconds: float
    wait_seconds: float


# -- progress display -------------------------------------------------------------


class _ProgressLine:
    """A carriage-return-updated line on a tty, else a line at every quarter of the pass."""

    def __init__(self, stream: IO[str], label: str, total: int, enabled: bool) -> None:
        self._stream = stream
        self._label = label
        self._total = max(total, 1)
        self._enabled = enabled
        self._tty = enabled and stream.isatty()
        self._last = 0.0
        self._next_quarter = 1
        self._drawn = False

    def update(self, done: int, loss: Callable[[], float]) -> None:
        if not self._enabled:
            return
        if self._tty:
            now = time.monotonic()
            # Throttled: reading the loss syncs with the GPU.
            if now - self._last >= 0.2 or done == self._total:
                self._last = now
                self._stream.write(f"\r{self._label} {done}/{self._total}  loss {loss():.4f}\033[K")
                self._stream.flush()
                self._drawn = True
        elif done * 4 >= self._next_quarter * self._total:
            while done * 4 >= self._next_quarter * self._total:
                self._next_quarter += 1
            self._stream.write(f"{self._label} {done}/{self._total}  loss {loss():.4f}\n")
            self._stream.flush()

    def finish(self) -> None:
        if self._drawn:
            self._stream.write("\r\033[K")
            self._stream.flush()


# -- training ---------------------------------------------------------------------


def _timed(loader: BufferLoader) -> Iterator[tuple[Batch, float]]:
    """The loader's batches, each with the seconds spent waiting inside ``next()``."""
    it = iter(loader)
    while True:
        start = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return
        yield batch, time.perf_counter() - start


def run_pass(
    model: nn.Module,
    loader: BufferLoader,
    criterion: nn.Module,
    progress: _ProgressLine,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> PassStats:
    """Train (with an optimizer) or evaluate (without) over the rest of the loader's epoch."""
    training = optimizer is not None
    model.train(training)
    device = loader.device
    # Sums stay on the device so no step waits for the GPU just to log.
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    seen = 0
    wait = 0.0
    start = time.perf_counter()
    with torch.set_grad_enabled(training):
        for done, (batch, waited) in enumerate(_timed(loader), start=1):
            wait += waited
            images, labels = batch
            logits = model(images)
            loss = criterion(logits, labels)
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
            n = labels.shape[0]
            loss_sum += loss.detach().double() * n
            correct += (logits.argmax(dim=1) == labels).sum()
            seen += n
            progress.update(done, lambda: loss_sum.item() / max(seen, 1))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    progress.finish()
    return PassStats(
        loss=loss_sum.item() / seen if seen else math.nan,
        top1=correct.item() / seen if seen else math.nan,
        images=seen,
        seconds=time.perf_counter() - start,
        wait_seconds=wait,
    )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise click.ClickException(f"--device {name}: CUDA is not available on this machine; use --device cpu or auto")
    return device


def _resolve_epochs(config: TrainConfig, train: BufferLoader, val: BufferLoader | None) -> int:
    produced = train.manifest.epochs
    if config.epochs is None:
        if produced is None:
            raise click.UsageError(
                f"the daemon of {train.buffer} produces epochs without end; pass --epochs N", ctx=None
            )
        return produced
    if produced is not None and config.epochs > produced:
        raise click.ClickException(
            f"--epochs {config.epochs}, but the daemon of {train.buffer} produces only {produced} epochs; "
            f"restart it with --epochs {config.epochs} (or without --epochs), or train for fewer epochs"
        )
    if val is not None and val.manifest.epochs is not None and config.epochs > val.manifest.epochs:
        raise click.ClickException(
            f"--epochs {config.epochs}, but the daemon of {val.buffer} produces only {val.manifest.epochs} "
            "validation epochs; restart it with a matching --epochs (or without --epochs)"
        )
    return config.epochs


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def train(config: TrainConfig, echo: Callable[[str], None] = click.echo) -> dict[str, Any]:
    """Run the whole training; returns the metrics document (also written to ``metrics_json``)."""
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    with ExitStack() as stack:
        train_loader = stack.enter_context(BufferLoader(config.buffer, device=device, timeout=config.timeout))
        val_loader = None
        if config.val_buffer is not None:
            val_loader = stack.enter_context(BufferLoader(config.val_buffer, device=device, timeout=config.timeout))
            if val_loader.classes != train_loader.classes:
                raise click.ClickException(
                    f"{config.val_buffer} has classes {val_loader.classes[:5]}... but {config.buffer} has "
                    f"{train_loader.classes[:5]}...; both daemons must serve the same class folders"
                )
        epochs = _resolve_epochs(config, train_loader, val_loader)
        classes = train_loader.classes
        try:
            model = torchvision.models.get_model(config.model, weights=None, num_classes=len(classes))
        except ValueError as exc:
            raise click.ClickException(f"--model {config.model}: {exc}") from None
        model = model.to(device, memory_format=torch.channels_last)
        optimizer = torch.optim.SGD(
            model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, epochs * len(train_loader)))
        criterion = nn.CrossEntropyLoss()
        m = train_loader.manifest
        if not config.quiet:
            echo(
                f"prefetchd-train: {config.model} on {device}, {len(classes)} classes, {len(train_loader)} steps "
                f"of {m.batch_size} x {m.image_size}px per epoch, {epochs} epochs, buffer {config.buffer}"
                + (f", val buffer {config.val_buffer}" if config.val_buffer else "")
            )

        per_epoch: list[dict[str, Any]] = []
        run_start = time.perf_counter()
        for epoch in range(epochs):
            epoch_start = time.perf_counter()
            tag = f"epoch {epoch + 1}/{epochs}"
            lr = optimizer.param_groups[0]["lr"]
            tr = run_pass(
                model, train_loader, criterion,
                _ProgressLine(sys.stderr, f"{tag} train", len(train_loader), not config.quiet),
                optimizer, scheduler,
            )
            va = None
            if val_loader is not None:
                va = run_pass(
                    model, val_loader, criterion,
                    _ProgressLine(sys.stderr, f"{tag} val", len(val_loader), not config.quiet),
                )
            epoch_s = time.perf_counter() - epoch_start
            wait_s = tr.wait_seconds + (va.wait_seconds if va else 0.0)
            row = {
                "epoch": epoch,
                "lr": lr,
                "train_loss": tr.loss,
                "train_top1": tr.top1,
                "train_images": tr.images,
                "train_s": tr.seconds,
                "val_loss": va.loss if va else None,
                "val_top1": va.top1 if va else None,
                "val_images": va.images if va else None,
                "val_s": va.seconds if va else None,
                "images_per_s": tr.images / tr.seconds if tr.seconds > 0 else 0.0,
                "data_wait_s": wait_s,
                "epoch_s": epoch_s,
                "data_wait_share": wait_s / epoch_s if epoch_s > 0 else 0.0,
            }
            per_epoch.append(row)
            val_text = f"val loss {va.loss:.4f} top-1 {va.top1:6.2%}" if va else "val -"
            echo(
                f"{tag}  train loss {tr.loss:.4f} top-1 {tr.top1:6.2%}  {val_text}  "
                f"{row['images_per_s']:.1f} img/s  data-wait {row['data_wait_share']:.1%}"
            )

    total_s = time.perf_counter() - run_start
    total_wait = sum(r["data_wait_s"] for r in per_epoch)
    total_train_images = sum(r["train_images"] for r in per_epoch)
    total_train_s = sum(r["train_s"] for r in per_epoch)
    final = per_epoch[-1] if per_epoch else {}
    metrics: dict[str, Any] = {
        "format": METRICS_FORMAT,
        "version": METRICS_VERSION,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "device": str(device),
        "num_epochs": epochs,
        "epochs": [{k: (_finite(v) if isinstance(v, float) else v) for k, v in r.items()} for r in per_epoch],
        "final_train_top1": _finite(final["train_top1"]) if final else None,
        "final_val_top1": _finite(final["val_top1"]) if final.get("val_top1") is not None else None,
        "data_wait_share": total_wait / total_s if total_s > 0 else 0.0,
        "images_per_s": total_train_images / total_train_s if total_train_s > 0 else 0.0,
        "total_s": total_s,
    }
    val_top1 = metrics["final_val_top1"]
    echo(
        f"done: {total_train_images} training images in {total_s:.1f} s, final val top-1 "
        + (f"{val_top1:.2%}" if val_top1 is not None else "-")
        + f", data-wait share {metrics['data_wait_share']:.1%}"
    )
    if config.metrics_json is not None:
        _write_json(config.metrics_json, metrics)
    return metrics


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    # Atomic, so a dashboard polling the file never reads half a document.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


# -- CLI ----------------------------------------------------------------------------

_D = TrainConfig  # defaults


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--buffer", type=click.Path(path_type=Path), required=True, help="Training buffer (the daemon's --buffer).")
@click.option("--val-buffer", type=click.Path(path_type=Path), default=None, help="Buffer of a --split val daemon; evaluated after every epoch.")
@click.option("--epochs", type=click.IntRange(min=1), default=None, help="Epochs to train  [default: the manifest's epochs]")
@click.option("--lr", type=float, default=_D.lr, show_default=True, help="Peak learning rate (cosine schedule over the run).")
@click.option("--momentum", type=float, default=_D.momentum, show_default=True)
@click.option("--weight-decay", type=float, default=_D.weight_decay, show_default=True)
@click.option("--model", default=_D.model, show_default=True, help="A torchvision classification model name (random init).")
@click.option("--device", default=_D.device, show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=_D.timeout, show_default=True, help="Seconds to wait for the manifest and for each batch.")
@click.option("--metrics-json", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write per-epoch and final metrics here.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch.set_num_threads for the trainer.")
@click.option("--quiet", "-q", is_flag=True, help="No start line and no progress display (per-epoch lines stay).")
@click.option("--verbose", "-v", is_flag=True, help="Log the loader's waits (INFO).")
def main(verbose: bool, **options: Any) -> None:
    """Train a torchvision model on the batches a prefetchd daemon writes into --buffer."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="prefetchd-train: %(levelname)s %(name)s: %(message)s"
    )
    config = TrainConfig(**options)
    try:
        train(config)
    except (LoaderError, ProtocolError) as exc:
        click.echo(f"prefetchd-train: {' '.join(str(exc).split())}", err=True)
        sys.exit(EXIT_BUFFER)
    except KeyboardInterrupt:
        click.echo("prefetchd-train: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)


__all__ = ["EXIT_BUFFER", "EXIT_INTERRUPTED", "PassStats", "TrainConfig", "main", "run_pass", "train"]


if __name__ == "__main__":
    main()
