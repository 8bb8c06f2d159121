"""What ``prefetchd-train`` shows and writes: the progress display of a pass and the metrics files.

The metrics document (``--metrics-json``, format ``METRICS_FORMAT``) holds the
run's settings, one row per finished epoch and the run's totals; ``--metrics-csv``
holds the same rows.  Both are rewritten whole and atomically after every epoch,
so a dashboard polling them never reads half a file.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

import click
import torch

from prefetchd.locations import missing_folder, probe_folder
from prefetchd.trainer.config import TrainConfig, plain_config

if TYPE_CHECKING:
    from click._termui_impl import ProgressBar

METRICS_FORMAT = "prefetchd.train_metrics"
METRICS_VERSION = 2
# Reading the loss syncs with the GPU, so the display asks for it at most this often.
LOSS_REFRESH_SECONDS = 0.2


def _loss_text(loss: float | None) -> str | None:
    return f"loss {loss:.4f}" if loss is not None else None


class ProgressLine:
    """Steps done and the running loss of a pass: click's progress bar on a terminal, else a line at every quarter.

    click draws its bar only on a terminal (elsewhere it prints the label once), so
    a log file gets the quarter lines instead.  Used as a context manager: the bar
    is finished (and the cursor shown again) even when the pass fails.
    """

    def __init__(self, stream: TextIO, label: str, total: int, enabled: bool) -> None:
        self._stream = stream
        self._label = label
        self._total = max(total, 1)
        self._enabled = enabled
        self._tty = enabled and stream.isatty()
        self._bar: ProgressBar[float | None] | None = None
        self._closing = ExitStack()
        self._last = 0.0
        self._next_quarter = 1
        self._shown = 0

    def __enter__(self) -> ProgressLine:
        if self._tty:
            self._bar = self._closing.enter_context(click.progressbar(
                length=self._total, label=self._label, show_pos=True, item_show_func=_loss_text, file=self._stream,
            ))
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._closing.close()
        self._bar = None

    def update(self, done: int, loss: Callable[[], float]) -> None:
        if not self._enabled:
            return
        if self._bar is not None:
            now = time.monotonic()
            fresh = None
            if now - self._last >= LOSS_REFRESH_SECONDS or done == self._total:
                self._last = now
                fresh = loss()
            self._bar.update(done - self._shown, fresh)  # None keeps the loss last read
            self._shown = done
        elif not self._tty and done * 4 >= self._next_quarter * self._total:
            while done * 4 >= self._next_quarter * self._total:
                self._next_quarter += 1
            self._stream.write(f"{self._label} {done}/{self._total}  loss {loss():.4f}\n")
            self._stream.flush()


def finite(value: float) -> float | None:
    """JSON has no NaN: a figure of an empty pass is null."""
    return value if math.isfinite(value) else None


def metrics_document(
    rows: list[dict[str, Any]], *, config: TrainConfig, device: torch.device, pin: str, world_size: int,
    num_epochs: int, k: int, finished: bool, resumed_from: dict[str, Any] | None, stopped_by: str | None,
    global_steps: int, total_s: float | None,
) -> dict[str, Any]:
    """The metrics document of a run whose finished epochs are ``rows``."""
    total_wait = sum(r["data_wait_s"] for r in rows)
    epochs_s = sum(r["epoch_s"] for r in rows)
    train_images = sum(r["train_images"] for r in rows)
    train_s = sum(r["train_s"] for r in rows)
    final = rows[-1] if rows else {}
    return {
        "format": METRICS_FORMAT,
        "version": METRICS_VERSION,
        "config": plain_config(config),
        "device": str(device),
        "pin": pin,
        "world_size": world_size,
        "num_epochs": num_epochs,
        "top_k": k,
        "finished": finished,
        "resumed_from": resumed_from,
        "stopped_by": stopped_by,
        "global_steps": global_steps,
        "epochs": [{key: (finite(v) if isinstance(v, float) else v) for key, v in r.items()} for r in rows],
        "final_train_top1": finite(final["train_top1"]) if final else None,
        "final_val_top1": finite(final["val_top1"]) if final.get("val_top1") is not None else None,
        f"final_val_top{k}": finite(final[f"val_top{k}"]) if final.get(f"val_top{k}") is not None else None,
        "train_images": train_images,
        "data_wait_share": min(1.0, total_wait / epochs_s) if epochs_s > 0 else 0.0,
        "images_per_s": train_images / train_s if train_s > 0 else 0.0,
        "total_s": total_s if total_s is not None else epochs_s,
        "cuda_max_memory_mib": max((r["cuda_max_memory_mib"] or 0.0 for r in rows), default=None)
        if device.type == "cuda" else None,
    }


def write_metrics(config: TrainConfig, metrics: dict[str, Any], csv_columns: list[str]) -> None:
    """Write the document to ``--metrics-json`` and its rows, under ``csv_columns``, to ``--metrics-csv``, where given."""
    if config.metrics_json is not None:
        write_json(config.metrics_json, metrics)
    if config.metrics_csv is not None:
        write_csv(config.metrics_csv, metrics["epochs"], csv_columns)


def metrics_unwritable(config: TrainConfig) -> str | None:
    """Why ``--metrics-json`` or ``--metrics-csv`` cannot be written, found by creating and removing a
    probe in its folder before the first step (not after an epoch of training); None when both can.
    A missing folder is refused (``missing_folder``), not created."""
    for flag, path in (("--metrics-json", config.metrics_json), ("--metrics-csv", config.metrics_csv)):
        if path is None:
            continue
        if (missing := missing_folder(flag, path)) is not None:
            return missing
        folder = path.parent
        try:
            probe_folder(folder, path.name)
        except OSError as exc:
            return f"{flag} {path}: cannot write in {folder} ({exc.strerror or exc}); pass a path in a folder you can write"
    return None


def _write_atomic(path: Path, text: str) -> None:
    # Atomic, so a dashboard polling the file never reads half a document.
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, doc: dict[str, Any]) -> None:
    _write_atomic(path, json.dumps(doc, indent=1, allow_nan=False) + "\n")


def write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str]) -> None:
    """One row per finished epoch under a header of every column (without a row too), rewritten whole after
    each (a resumed run's file continues the same rows)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in columns})
    _write_atomic(path, out.getvalue())


__all__ = ["METRICS_FORMAT", "METRICS_VERSION", "ProgressLine", "finite", "metrics_document", "metrics_unwritable", "write_metrics"]
