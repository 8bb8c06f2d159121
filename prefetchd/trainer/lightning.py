"""Lightning: a ``LightningDataModule`` over prefetchd buffers (``prefetchd.lightning.BufferDataModule``).

::

    dm = BufferDataModule("/dev/shm/train", "/dev/shm/val")       # daemons started by hand or by systemd
    dm = BufferDataModule("/dev/shm/train", "/dev/shm/val",       # or started (and stopped) here
                          data="/data/train", val_data="/data/val", epochs=90, batch_size=256)
    trainer = lightning.Trainer(max_epochs=90)
    trainer.fit(model, datamodule=dm)                             # training_step: images, labels = batch
    trainer.fit(model, datamodule=dm, ckpt_path="last.ckpt")      # resumes exact to the batch

How it fits Lightning's loops:

- Every ``iter()`` Lightning makes over the training loader is the rest of the
  epoch the loader stands in (a checkpoint may have put it mid-epoch); an epoch
  Lightning left unfinished (``limit_train_batches``) is not continued but skipped,
  also by a resume from its checkpoint (saved as the next epoch's start) and by a
  second ``fit`` of the same Trainer (whose ``current_epoch`` is past the new loader's).
  Every validation pass is the whole of the validation stream's ``current_epoch``
  (``set_epoch`` each time), so the sanity check's two batches take nothing away.
- The checkpoint holds where the training loader stands after the last batch the
  model was *handed* (``transfer_batch_to_device``), not where the loader is: Lightning
  fetches one batch ahead, so the loader's own position would skip a batch on a
  resume from a mid-epoch checkpoint.  For the same reason the loader is given to
  Lightning inside a wrapper without ``state_dict``: Lightning would otherwise save
  that read-ahead position in its loop state and restore it over ours.
- Under DDP every rank reads its own stream (``ranks.wait_for_stream``), and a
  checkpoint, which rank 0 writes, holds every rank's position (gathered when it is
  taken); one daemon per node serves the node's ranks, started by local rank 0 in
  ``prepare_data``.
- Batches arrive on the trainer's device already: ``transfer_batch_to_device`` hands
  them on untouched (Lightning's default would try to rebuild the frozen ``Batch``).
- Daemons are started as ``prefetchd-train --spawn-daemon`` starts them (its
  ``spawn_daemon``), so both take the same options to the same command line.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.trainer.states import TrainerFn
except ModuleNotFoundError as exc:  # said as --ray and s3:// say theirs: it was a bare "No module named" (a walk)
    if not (exc.name or "").startswith("lightning"):
        raise
    raise ModuleNotFoundError(f"prefetchd's BufferDataModule needs Lightning ({exc}): pip install "
                              "'prefetchd[lightning]'", name=exc.name) from exc
import torch

from prefetchd.launch import signals_held
from prefetchd.trainer.errors import SetupError
from prefetchd.trainer.loader import Batch, BufferLoader
from prefetchd.trainer.rank_state import gather_states, own_state
from prefetchd.trainer.ranks import Ranks, wait_for_stream
from prefetchd.trainer.config import TrainConfig
from prefetchd.trainer.spawn import (SpawnedDaemon, check_held_out, check_same_classes, check_served_job, check_split,
                                     spawn_daemon)
from prefetchd.trainer.wait_bounds import DEFAULT_TIMEOUT
from prefetchd.words import counted

logger = logging.getLogger(__name__)

DATA_ARGUMENT = {"train": "data", "val": "val_data"}  # the argument naming each split's dataset


class _Epochs:
    """A BufferLoader as Lightning iterates it: each ``iter()`` is one epoch.

    Training (``whole_epochs=False``) goes on from where the loader stands, which a checkpoint
    may have put mid-epoch; only an epoch that Lightning left unfinished in this process
    (``limit_train_batches``, ``max_steps``) is skipped to the next one's start.  Lightning's
    ``current_epoch`` is no guide there: right after a resume it can still name the epoch the
    checkpoint closed.  Validation (``whole_epochs=True``) is the whole of the stream's
    ``current_epoch`` on every pass (its last epoch past the job's end, as after fit), chosen as the pass
    fetches its first batch: Lightning also ``iter()``s the loader it loads to check that it is iterable,
    and on a resume it loads it for the epoch that ``current_epoch`` still names.  Deliberately without
    ``state_dict``: see the module docstring.
    """

    def __init__(self, loader: BufferLoader, current_epoch: Callable[[], int], whole_epochs: bool) -> None:
        self.loader = loader
        self._current_epoch = current_epoch
        self._whole_epochs = whole_epochs
        self._started: tuple[int, int] | None = None  # where the last iter() began

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Batch]:
        if self._whole_epochs:
            return self._whole_epoch()
        epoch, step = self.loader.position
        if epoch < self._current_epoch():
            # Lightning is past the loader's epoch: it cut that one short and closed it (limit_train_batches,
            # then an epoch-end checkpoint resumed, which holds the position after its last batch), or this
            # is a later fit of the same Trainer, with a new loader at (0, 0).
            self.loader.set_epoch(self._current_epoch())
        elif step != 0 and self._started is not None and (epoch, step) != self._started:
            self.loader.set_epoch(epoch + 1)
        self._started = self.loader.position
        return iter(self.loader)

    def _whole_epoch(self) -> Iterator[Batch]:
        # A generator: an iter() that fetches nothing moves nothing, so the loader keeps the epoch
        # BufferDataModule named for the first pass (a checkpoint's closed epoch would otherwise replace it).
        # After fit, Lightning's current_epoch is the number of epochs trained: a val job of as many is at its
        # end there, an empty epoch. A val split's epochs are all alike: the last one is validated instead.
        epochs = self.loader.manifest.epochs
        self.loader.set_epoch(min(self._current_epoch(), epochs - 1) if epochs else self._current_epoch())
        yield from self.loader


class BufferDataModule(pl.LightningDataModule):
    """Training (and validation) batches from prefetchd daemons, for ``Trainer.fit(datamodule=...)``.

    Args:
        train_buffer: the training daemon's ``--buffer``.
        val_buffer: the validation daemon's ``--buffer`` (``--split val``); None: no validation.
        data, val_data: the datasets to start the daemons on (anything ``prefetchd start --data`` takes), as
            ``prefetchd-train --spawn-daemon`` does, when no daemon serves the buffer yet; the
            daemons this module started are stopped at the end of fit/validate (and when the
            process exits, should fit raise: Lightning then calls no teardown). None: the
            daemons are started elsewhere (``prefetchd start``, systemd).
        epochs, seed, batch_size, image_size, workers, high_water: the started daemons' options
            (``prefetchd start --epochs ...``); None leaves the daemon's default.  Only with ``data``: without
            it the running daemon's job decides them, and they are refused (ValueError).
        normalize, timeout, pin, loader_options: passed to each ``BufferLoader``.
    """

    def __init__(
        self,
        train_buffer: str | os.PathLike[str],
        val_buffer: str | os.PathLike[str] | None = None,
        *,
        data: str | os.PathLike[str] | None = None,
        val_data: str | os.PathLike[str] | None = None,
        epochs: int | None = None,
        seed: int | None = None,
        batch_size: int | None = None,
        image_size: int | None = None,
        workers: int | None = None,
        high_water: int | None = None,
        normalize: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        **loader_options: Any,
    ) -> None:
        super().__init__()
        if val_data is not None and val_buffer is None:
            raise ValueError(f"val_data={str(val_data)!r} needs a val_buffer for its daemon to write into")
        if val_data is not None and data is None:
            raise ValueError("val_data is given but data is not: pass data= too, or start both daemons yourself")
        daemon_options = dict(epochs=epochs, seed=seed, batch_size=batch_size, image_size=image_size, workers=workers,
                              high_water=high_water)
        unused = {name: value for name, value in daemon_options.items() if value is not None}
        if data is None and unused:  # were ignored without a word: the batches were the running daemon's size
            given = ", ".join(f"{name}={value!r}" for name, value in unused.items())
            raise ValueError(f"{given}: options of the daemons this module starts, given data=; without it the "
                             f"daemon serving {train_buffer} decides them (`prefetchd status --buffer {train_buffer}` "
                             "shows its job): pass data= to start one with them, or leave them out")
        self.train_buffer = Path(train_buffer)
        self.val_buffer = Path(val_buffer) if val_buffer is not None else None
        # A str stays a str (it may be a URL); a path-like becomes a Path.
        self._data = {split: d if d is None or isinstance(d, str) else Path(d)
                      for split, d in (("train", data), ("val", val_data))}
        self._daemon_config = TrainConfig(
            buffer=self.train_buffer, epochs=epochs, seed=seed if seed is not None else 0, batch_size=batch_size,
            image_size=image_size, workers=workers, high_water=high_water, timeout=timeout,
            spawn_daemon=data is not None, quiet=True,
        )
        self._loader_options: dict[str, Any] = {"normalize": normalize, "timeout": timeout, **loader_options}
        self._timeout = timeout
        self._train: BufferLoader | None = None
        self._val: BufferLoader | None = None
        self._handed: tuple[int, int] | None = None  # (epoch, step) after the last training batch handed over
        self._pending: dict[str, Any] | None = None  # this rank's state from a checkpoint, until the loader exists
        self._spawned: list[SpawnedDaemon] = []

    # -- Lightning's hooks -----------------------------------------------------------

    def prepare_data(self) -> None:
        """Start the daemons asked for (local rank 0 of each node; Lightning calls it there only)."""
        ranks = self._ranks()
        todo = [("train", self.train_buffer), ("val", self.val_buffer)]
        for split, buffer in todo:
            data = self._data[split]
            if data is None or buffer is None:
                continue
            with signals_held():  # a Ctrl-C between the launch and the registration of its stop left it running
                spawned = spawn_daemon(buffer, data, split, self._daemon_config, logger.info, ranks)
                if spawned is not None:
                    if not self._spawned:
                        # Lightning calls no teardown when fit raises: the daemons would outlive the process.
                        atexit.register(self._stop_spawned)
                    self._spawned.append(spawned)
        for spawned in self._spawned:
            spawned.wait_ready(self._timeout)

    def train_dataloader(self) -> _Epochs:
        if self._train is None:
            self._train = self._open("train", self.train_buffer)
            self._handed = None
            if self._pending is not None:
                self._train.load_state_dict(self._pending)
                self._pending = None
            self._name_first_validation(self._train.position[0])
        return _Epochs(self._train, self._current_epoch, whole_epochs=False)

    def val_dataloader(self) -> _Epochs | list[Any]:
        if self.val_buffer is None:
            return []  # Lightning's "no validation"
        if self._val is None:
            self._val = self._open("val", self.val_buffer)
        return _Epochs(self._val, self._current_epoch, whole_epochs=True)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        if not isinstance(batch, Batch):
            return super().transfer_batch_to_device(batch, device, dataloader_idx)
        if self.trainer is not None and self.trainer.training and self._train is not None:
            step = batch.step + 1
            self._handed = (batch.epoch, step) if step < len(self._train) else (batch.epoch + 1, 0)
        if batch.images.device == device and batch.labels.device == device:
            return batch  # the loader put it there; a move would be a copy
        return replace(batch, images=batch.images.to(device), labels=batch.labels.to(device))

    def state_dict(self) -> dict[str, Any]:
        """Every rank's training position (gathered under DDP: rank 0 writes the checkpoint)."""
        if self._train is None:
            return {}
        own = self._train.state_dict()
        if self._handed is not None:
            own["epoch"], own["step"] = self._handed
            trainer = self.trainer
            if own["step"] and trainer is not None and trainer.training and own["step"] >= trainer.num_training_batches:
                # Lightning has trained all of this epoch it will (limit_train_batches): a resume starts the next,
                # as the run would have.  After it, Lightning's current_epoch still names this one for a while.
                own["epoch"], own["step"] = own["epoch"] + 1, 0
        return gather_states(own)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return  # saved before any training loader existed
        own = own_state(state_dict, self._ranks())
        if self._train is None:
            self._pending = own
        else:
            self._train.load_state_dict(own)
            self._handed = None

    def teardown(self, stage: str) -> None:
        """Close the loaders (their last position reaches progress.json) and stop the daemons started here."""
        for loader in (self._train, self._val):
            if loader is not None:
                loader.close()
        self._train = self._val = None
        self._stop_spawned()

    def _stop_spawned(self) -> None:
        while self._spawned:
            self._spawned.pop().stop()

    # -- helpers -------------------------------------------------------------------

    def _name_first_validation(self, trained: int) -> None:
        """As fit begins training ``trained``, the training loader's epoch: the val loader's progress file names
        where its first validation pass begins.

        Lightning opens the val loader only when it first validates, or loads it as the first epoch that validates
        begins, unless a sanity check ran (that loader is left as it is); with
        ``check_val_every_n_epoch`` > 1 and no sanity check, `prefetchd status` of the val buffer showed an earlier
        run's position, its pid GONE, or no trainer, for whole epochs.  A resume too: the checkpoint holds no val
        position, and right after a resume from an epoch-end checkpoint Lightning's ``current_epoch`` can still name
        the epoch the checkpoint closed (see ``_Epochs``), which is not validated again: ``trained`` is ahead then.
        """
        trainer = self.trainer
        if self.val_buffer is None or self._val is not None or trainer is None or not trainer.enable_validation:
            return
        self._val = self._open("val", self.val_buffer)
        epoch, every = max(trainer.current_epoch, trained), trainer.check_val_every_n_epoch
        if every:
            epoch += -(epoch + 1) % every
        epochs = self._val.manifest.epochs
        if epochs:
            epoch = min(epoch, epochs - 1)  # as _Epochs validates past the job's end
        self._val.load_state_dict({**self._val.state_dict(), "epoch": epoch, "step": 0})

    def _check_epochs(self, loader: BufferLoader, split: str) -> None:
        """In fit: SetupError where the Trainer would train past the end of ``loader``'s job.  Lightning found out
        only at the first epoch past it, after training an empty one (``max_epochs=100`` over a daemon of
        ``--epochs 90``: 90 epochs, then a traceback).  A run that ends on ``max_steps`` or a Timer
        (``max_epochs`` -1 then) may end in time: left to its ``set_epoch`` past the end."""
        trainer = self.trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return
        produced, wanted = loader.manifest.epochs, trainer.max_epochs
        if produced is None or wanted is None or 0 <= wanted <= produced:
            return
        if wanted == -1 and trainer.max_steps != -1:
            return
        trains = "trains without end" if wanted == -1 else f"trains {counted(wanted, 'epoch')}"
        what = "validation epoch" if split == "val" else "epoch"
        raise SetupError(
            f"Trainer(max_epochs={wanted}) {trains}, but the daemon of {loader.buffer} produces only "
            f"{counted(produced, what)} (its --epochs): pass Trainer(max_epochs={produced}), or restart the daemon "
            f"with --epochs {wanted if wanted != -1 else 'N'} or without --epochs "
            f"({DATA_ARGUMENT[split]}= here starts it with BufferDataModule(epochs=...))"
        )

    def _ranks(self) -> Ranks:
        trainer = self.trainer
        if trainer is None:
            return Ranks()
        return Ranks(rank=trainer.global_rank, world_size=trainer.world_size, local_rank=trainer.local_rank,
                     local_world_size=trainer.num_devices)

    def _current_epoch(self) -> int:
        return self.trainer.current_epoch if self.trainer is not None else 0

    def _open(self, split: str, buffer: Path) -> BufferLoader:
        device = self.trainer.strategy.root_device if self.trainer is not None else torch.device("cpu")
        stream = wait_for_stream(buffer, self._ranks(), self._timeout, split)
        loader = BufferLoader(stream, device=device, **self._loader_options)
        data = self._data[split]
        try:
            check_split(loader, split, "val_buffer" if split == "val" else "buffer")
            self._check_epochs(loader, split)
            # Whichever opens second: Lightning's sanity check reads validation before training.
            train, val = (self._train, loader) if split == "val" else (loader, self._val)
            if train is not None and val is not None:
                check_same_classes(train, val)
                check_held_out(train, val)
            if data is not None:  # a daemon already running there was used as it is: it must serve what data= asks
                check_served_job(self._daemon_config, loader, data, f"BufferDataModule({DATA_ARGUMENT[split]}=...)",
                                 "arguments")
        except BaseException:
            loader.close()
            raise
        return loader


__all__ = ["BufferDataModule"]
