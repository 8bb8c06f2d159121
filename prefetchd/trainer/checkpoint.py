"""``prefetchd-train`` checkpoints: the file format, atomic save and load (local or at a URL), RNG state.

A checkpoint is one ``torch.save`` dictionary (``weights_only`` loadable)::

    format, version          CHECKPOINT_FORMAT, CHECKPOINT_VERSION; anything else is refused
    config                   the run's TrainConfig as plain values
    epoch, global_step       where the run stands; epoch_lr, metrics (the finished epochs' rows)
    model, optimizer, scheduler   state dicts
    world_size               ranks of the run; a resume needs the same
    loaders, partial, rng    rank 0's loader positions, half-finished pass sums and RNG states
    ranks                    under torchrun: every rank's (loaders, partial, rng)
"""

from __future__ import annotations

import io
import logging
import os
import random
import socket
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import psutil
import torch

from prefetchd.launch import signals_held
from prefetchd.locations import (LocationError, StorageDenied, StorageUnavailable, filesystem, probe_folder,
                                 with_retries)
from prefetchd.trainer.config import TrainConfig, plain_config, setting_value, shown_setting
from prefetchd.trainer.errors import CheckpointError
from prefetchd.words import counted

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "prefetchd.train_checkpoint"
CHECKPOINT_VERSION = 1
LAST_CHECKPOINT = "last.pt"
# A save at a URL is retried for about a minute (0.1 s doubling to 5 s between tries), not a read's ~3 s: it
# holds the work since the last one, and a few seconds of throttling at an epoch's end would end the run.
SAVE_RETRY_ATTEMPTS = 18
# Settings a checkpoint cannot be resumed under when they changed (the state would not fit).
_RESUME_FIXED = ("model", "optimizer")
# Settings that may change between a run and its resume without a warning.
_RESUME_FREE = ("resume", "quiet", "max_steps", "threads")


def save_checkpoint(path: Path | str, doc: Mapping[str, Any]) -> None:
    """Write ``doc`` with torch.save, atomically: a reader (or a restart after SIGKILL) sees the old file or the new.
    Ctrl-C, SIGTERM or SIGHUP while it writes act once it is written (``launch.signals_held``): a KeyboardInterrupt
    raised inside torch.save (Ctrl-C, or prefetchd-train's second stop signal) surfaces as torch's RuntimeError
    ("unexpected pos ...") and lost the checkpoint being written, often the one the first SIGTERM asked for; SIGHUP
    was not held, and lost it so (a walk).

    At a URL the whole checkpoint goes up in one PUT (or one multipart upload),
    which object stores make visible only when complete: atomic there too."""
    with signals_held():
        _save_checkpoint(path, doc)


def _save_checkpoint(path: Path | str, doc: Mapping[str, Any]) -> None:
    if isinstance(path, str):
        data = io.BytesIO()
        torch.save(dict(doc), data)
        fs, key = _checkpoint_fs(path)
        try:
            with_retries(f"saving {path}", lambda: fs.pipe_file(key, data.getvalue()), path, SAVE_RETRY_ATTEMPTS)
        except OSError as exc:  # StorageDenied, StorageUnavailable, or the store's refusal (a 400)
            raise CheckpointError(f"cannot save the checkpoint {path}: {exc}") from None
        return
    tmp = path.with_name(f"{_temp_prefix(path)}{os.getpid()}")
    _remove_orphaned_temp_files(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as fh:
            torch.save(dict(doc), fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot save the checkpoint {path}: {exc.strerror or exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)  # the rename itself survives a power cut
    finally:
        os.close(dir_fd)


def _temp_prefix(path: Path) -> str:
    """A save's temp file is this plus the writer's pid: ``.last.pt.tmp-HOST-PID``.  The host, so that on a
    folder shared between machines only this one's own orphans are told apart by their pid."""
    return f".{path.name}.tmp-{socket.gethostname()}-"


def _remove_orphaned_temp_files(path: Path) -> None:
    """Delete what a save killed mid-write on this machine left (a whole checkpoint's size): those of
    processes that are gone.  A live writer's, another run's in the same folder, is left alone, and so is
    every other machine's."""
    prefix = _temp_prefix(path)
    for tmp in path.parent.glob(f"{prefix}*"):
        pid = tmp.name.removeprefix(prefix)
        if pid.isdigit() and int(pid) != os.getpid() and not psutil.pid_exists(int(pid)):
            tmp.unlink(missing_ok=True)


def _checkpoint_fs(url: str) -> tuple[Any, str]:
    try:
        return filesystem(url)
    except LocationError as exc:
        raise CheckpointError(f"--checkpoint-dir: {exc}") from None


def _load_failure(exc: Exception) -> str:
    """What ``torch.load`` found wrong, in a line.  Its refusal of a file it cannot read safely is a paragraph on
    PyTorch 2.6's default and on loading unsafely, cut off mid-sentence here once (a user's walk, on a damaged
    file); its own finding is the line after "WeightsUnpickler error:"."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        found = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation", 1)[0]
        return f"damaged, or not a prefetchd-train checkpoint: {' '.join(found.split()) or type(exc).__name__}"
    return " ".join(text.split())[:300]


def load_checkpoint(path: Path | str) -> dict[str, Any]:
    """A checkpoint written by ``prefetchd-train``; CheckpointError says what is wrong with anything else."""
    source: Path | io.BytesIO = path if isinstance(path, Path) else io.BytesIO()
    if isinstance(path, str):  # a URL; FileNotFoundError when there is none yet
        fs, key = _checkpoint_fs(path)
        try:
            source = io.BytesIO(with_retries(f"loading {path}", lambda: fs.cat_file(key), path))
        except (StorageDenied, StorageUnavailable) as exc:
            raise CheckpointError(f"cannot load the checkpoint: {exc}") from None
    try:
        doc = torch.load(source, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"{path}: cannot read the checkpoint ({_load_failure(exc)}); delete it to train from "
            "scratch, or point --checkpoint-dir at an intact one"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: not a prefetchd-train checkpoint (no format {CHECKPOINT_FORMAT!r})")
    version = doc.get("version")
    if version != CHECKPOINT_VERSION:
        later = isinstance(version, int) and not isinstance(version, bool) and version > CHECKPOINT_VERSION
        raise CheckpointError(
            f"{path}: checkpoint version {version!r}; this prefetchd-train reads version {CHECKPOINT_VERSION}: "
            + ("resume with the prefetchd that wrote it, or a later one" if later else
               "it is no checkpoint this prefetchd-train wrote")
            + "; or train from scratch: without --resume, into another --checkpoint-dir"
        )
    return doc


def rng_state(device: torch.device) -> dict[str, Any]:
    version, keys, gauss = random.getstate()
    np_state = cast(tuple[Any, ...], np.random.get_state(legacy=True))
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if device.type == "cuda" else [],
        "python": {"version": version, "keys": torch.tensor(keys, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "gauss": float(np_state[4]),
        },
    }


def set_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda"):
        torch.cuda.set_rng_state_all(state["cuda"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["keys"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        ("MT19937", npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["gauss"])
    )


@dataclass(frozen=True)
class CheckpointPlan:
    """Where a run's checkpoints go, how often, and whether it resumes: rank 0's --checkpoint-dir,
    --checkpoint-every and --resume.  Under torchrun every rank follows rank 0's plan, whatever its
    own command line says: saving and resuming are collectives every rank must join at the same
    step, and only rank 0 reads and writes the file (so only its box needs --checkpoint-dir)."""

    path: Path | str | None  # DIR/last.pt (a str at a URL); None: the run saves no checkpoint
    every: int | None
    resume: bool

    @classmethod
    def of(cls, config: TrainConfig) -> CheckpointPlan:
        where = config.checkpoint_dir
        path = (None if where is None else f"{where}/{LAST_CHECKPOINT}" if isinstance(where, str)
                else where / LAST_CHECKPOINT)
        return cls(path, config.checkpoint_every, config.resume)


class Checkpointer:
    """Saves DIR/last.pt every N steps and at every epoch's end."""

    def __init__(self, plan: CheckpointPlan) -> None:
        self.path = plan.path
        self.every = plan.every

    def due(self, global_step: int) -> bool:
        return self.path is not None and self.every is not None and global_step % self.every == 0

    def save(self, doc: Mapping[str, Any]) -> None:
        if self.path is not None:
            save_checkpoint(self.path, doc)

    def unwritable(self) -> str | None:
        """Why no checkpoint can be saved where --checkpoint-dir says, found by writing and removing a
        probe before the first step (not after an epoch of training); None when one can."""
        if self.path is None:
            return None
        if isinstance(self.path, str):
            fs, key = _checkpoint_fs(self.path)
            probe = f"{key}.probe-{os.getpid()}"
            try:
                with_retries(f"writing a probe next to {self.path}", lambda: fs.pipe_file(probe, b""), self.path)
            except Exception as exc:  # any refusal: denied, unreachable, a 400, a bucket name the client rejects
                return f"--checkpoint-dir: cannot write there: {' '.join(str(exc).split()) or type(exc).__name__}"
            with suppress(Exception):
                fs.rm(probe)  # written, and only its removal failed: checkpoints can be saved
            return None
        directory = self.path.parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe_folder(directory, self.path.name)
        except OSError as exc:
            return (f"--checkpoint-dir {directory}: cannot write there ({exc.strerror or exc}); pass a folder "
                    "this user can write")
        return None


def existing_checkpoint(path: Path | str) -> str | None:
    """What a run that does not resume would overwrite at ``path``, described for a message
    ("PATH (global step 12, epoch 2)"); None where there is no checkpoint.  CheckpointError where the
    object store cannot say now (unreachable, throttling, denied): taken for "none", a short outage let
    the run overwrite an earlier run's checkpoint.  Other failures to ask give None: the write probe
    before the first step says what is wrong."""
    if isinstance(path, str):
        fs, key = _checkpoint_fs(path)
        try:
            if not with_retries(f"looking for {path}", lambda: bool(fs.exists(key)), path):
                return None
        except (StorageDenied, StorageUnavailable) as exc:
            raise CheckpointError(f"cannot tell whether --checkpoint-dir holds a checkpoint of an earlier run, which "
                                  f"this run (without --resume) would overwrite: {exc}") from None
        except Exception:
            return None
    elif not path.is_file():
        return None
    try:
        doc = load_checkpoint(path)
    except FileNotFoundError:
        return None
    except CheckpointError as exc:
        return f"{path}, which this prefetchd-train cannot read ({exc})"
    # Epochs done, not "epoch N": the next epoch's number read "epoch 3" of a finished 2-epoch run.
    done = doc.get("metrics")
    return (f"{path} (global step {doc.get('global_step')}"
            + (f", {counted(len(done), 'epoch')} done)" if isinstance(done, list) else ")"))


def check_resumable(path: Path | str, doc: Mapping[str, Any], config: TrainConfig, world_size: int,
                    warn: bool = True) -> None:
    """Refuse a checkpoint this run cannot continue (other rank count, model or optimizer); log other changes."""
    saved_world = int(doc.get("world_size", 1))
    if saved_world != world_size:
        how = f"under torchrun with {saved_world} processes in all" if saved_world > 1 else "without torchrun"
        raise CheckpointError(
            f"{path}: the checkpoint was taken with {counted(saved_world, 'rank')}, this run has "
            f"{world_size}; every rank continues its own stream from its saved position, so "
            f"resume {how}, or use another --checkpoint-dir"
        )
    saved = doc.get("config") or {}
    for key in _RESUME_FIXED:
        if key in saved and saved[key] != getattr(config, key):
            raise CheckpointError(
                f"{path}: the checkpoint was taken with --{key} {saved[key]}, this run has --{key} "
                f"{getattr(config, key)}; resume with the checkpoint's settings or use another --checkpoint-dir"
            )
    now = plain_config(config)
    # Compared and shown as used: a None in either is the optimizer's default, not a value of its own.
    changed = [f"{k}: {shown_setting(saved, k)} -> {shown_setting(now, k)}" for k in now
               if k in saved and setting_value(saved, k) != setting_value(now, k) and k not in _RESUME_FREE]
    if changed and warn:
        logger.warning("resuming %s with changed settings: %s", path, "; ".join(changed))


__all__ = [
    "CHECKPOINT_FORMAT", "CHECKPOINT_VERSION", "LAST_CHECKPOINT", "CheckpointPlan", "Checkpointer", "check_resumable", "existing_checkpoint", "load_checkpoint",
    "rng_state", "save_checkpoint", "set_rng_state",
]
