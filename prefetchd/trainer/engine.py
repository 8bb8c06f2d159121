"""The epoch loop of ``prefetchd-train``: one ``Run`` over its loaders, with checkpoints at step and
epoch ends, an exact resume, and the figures each epoch reports.

A plain, complete engine (SGD or AdamW, linear warmup then cosine, label
smoothing, bf16 autocast, channels_last, exact checkpoint/resume) whose numbers
say whether the data path keeps up: per epoch it reports loss, top-1, top-5,
images/s and the *data-wait share*, the fraction of the epoch spent inside the
loaders' ``next()``.  A share near zero means the daemon keeps the model fed.
The jobs around it have rooms of their own: a pass over a loader (``passes``), the
model, optimizer and schedule (``model``), what is settled before the first step
(``preflight``).

Under torchrun the model is wrapped in DistributedDataParallel, the epoch's
figures are summed over the ranks, and rank 0 alone prints, writes the metrics
and the checkpoint, which holds every rank's loader position (see ``ranks``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from prefetchd.buffer_protocol import batch_name
from prefetchd.trainer.checkpoint import (
    CHECKPOINT_FORMAT, CHECKPOINT_VERSION, CheckpointPlan, Checkpointer, check_resumable, load_checkpoint, rng_state,
    set_rng_state,
)
from prefetchd.trainer.collective import Collective
from prefetchd.trainer.config import TrainConfig, plain_config
from prefetchd.trainer.errors import CheckpointError
from prefetchd.trainer.loader import BufferLoader
from prefetchd.trainer.model import build_model, build_optimizer, check_classes, check_last_batch, warmup_cosine
from prefetchd.trainer.passes import TOP_K, PassState, PassStats, Recover, pass_stats, run_pass
from prefetchd.trainer.ranks import Ranks
from prefetchd.trainer.report import ProgressLine, metrics_document, write_metrics
from prefetchd.words import counted

logger = logging.getLogger(__name__)


class Run:
    """One training run over its loaders: the epoch loop, checkpoints at step and epoch ends, resume."""

    def __init__(self, config: TrainConfig, device: torch.device, train_loader: BufferLoader,
                 val_loader: BufferLoader | None, epochs: int, val_buffer: Path | None,
                 echo: Callable[[str], None], coll: Collective | None = None,
                 plan: CheckpointPlan | None = None) -> None:
        self.config, self.device, self.epochs, self.echo = config, device, epochs, echo
        self.train_loader, self.val_loader, self.val_buffer = train_loader, val_loader, val_buffer
        self.coll = coll if coll is not None else Collective(Ranks())
        self.ranks = self.coll.ranks
        check_classes(train_loader.manifest)
        classes = train_loader.classes
        self.k = max(1, min(TOP_K, len(classes)))
        model = build_model(config.model, len(classes), config.pretrained, echo)  # refuses an unknown name
        check_last_batch(config.model, len(classes), train_loader.manifest)
        # ``net`` is the model itself (saved, evaluated); ``model`` what trains: DDP's wrapper under torchrun,
        # which averages the gradients over the ranks in the backward pass.
        self.net = model.to(device).to(memory_format=torch.channels_last)
        self.model: nn.Module = self.net
        if self.ranks.distributed:
            self.model = DistributedDataParallel(
                self.net, device_ids=[device.index] if device.type == "cuda" else None
            )
            # DDP gave every rank rank 0's initial weights; from here each rank draws its own
            # randomness (dropout), else all ranks would drop the same units on different data.
            torch.manual_seed(config.seed + self.ranks.rank)
        self.optimizer = build_optimizer(config, self.net)
        steps = len(train_loader)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(round(config.warmup_epochs * steps), max(1, epochs * steps))
        )
        self.criterion = nn.CrossEntropyLoss(label_smoothing=config.label_smoothing)
        # Under torchrun rank 0's plan (see agree_on_checkpoints): every rank joins the same saves.
        self.plan = plan if plan is not None else CheckpointPlan.of(config)
        self.checkpointer = Checkpointer(self.plan)
        self.per_epoch: list[dict[str, Any]] = []
        self.epoch = 0
        self.global_step = 0
        self.partial: PassState | None = None  # sums of the train pass a checkpoint interrupted
        self.epoch_lr: float | None = None
        self.resumed_from: dict[str, Any] | None = None
        self.should_stop: Callable[[], bool] = lambda: False
        self.stop_signal: Callable[[], str] = lambda: "SIGTERM"  # the name of the signal ``should_stop`` says came
        self.recover: Recover | None = None  # replaces a dead or stuck daemon (--spawn-daemon)
        self.stop_reason: str | None = None
        self.saved_step: int | None = None  # the global step of the last checkpoint saved or resumed from

    # -- checkpoint documents

    def _rank_state(self, partial: PassState | None) -> dict[str, Any]:
        """What differs between ranks: the loaders' positions, the pass's sums so far, the RNG."""
        return {
            "loaders": {
                "train": self.train_loader.state_dict(),
                "val": self.val_loader.state_dict() if self.val_loader is not None else None,
            },
            "partial": asdict(partial) if partial is not None else None,
            "rng": rng_state(self.device),
        }

    def _save(self, partial: PassState | None) -> None:
        """Write the checkpoint (rank 0) with every rank's state; collective: every rank calls it at the same step."""
        if self.checkpointer.path is None:
            return
        states = self.coll.gather(self._rank_state(partial))
        if states is not None:
            self.checkpointer.save(self._doc(states))
        self.saved_step = self.global_step

    def _doc(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        doc = {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "config": plain_config(self.config),
            "epoch": self.epoch,
            "global_step": self.global_step,
            "model": self.net.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "epoch_lr": self.epoch_lr,
            "metrics": self.per_epoch,
            "world_size": self.ranks.world_size,
            **states[0],  # rank 0's at the top: a one-rank checkpoint keeps its layout
        }
        if self.ranks.distributed:
            doc["ranks"] = states
        return doc

    def _restore(self) -> None:
        assert self.checkpointer.path is not None
        path = self.checkpointer.path
        # Rank 0 reads the checkpoint it wrote and hands it to the others, so ranks on other
        # boxes need no shared filesystem; a bad file stops every rank with the same message.
        found: tuple[str, Any] | None = None
        if self.ranks.is_main:
            try:
                found = ("doc", load_checkpoint(path))
            except FileNotFoundError:
                found = ("missing", None)
            except CheckpointError as exc:
                found = ("error", str(exc))
        found = self.coll.broadcast(found)
        assert found is not None
        if found[0] == "missing":
            self.echo(f"prefetchd-train: --resume: no checkpoint at {path} yet; starting from scratch")
            return
        if found[0] == "error":
            raise CheckpointError(found[1])
        doc: dict[str, Any] = found[1]
        check_resumable(path, doc, self.config, self.ranks.world_size, warn=self.ranks.is_main)
        mine = doc["ranks"][self.ranks.rank] if self.ranks.distributed else doc
        try:
            self.net.load_state_dict(doc["model"])
            self.optimizer.load_state_dict(doc["optimizer"])
            self.scheduler.load_state_dict(doc["scheduler"])
        except (KeyError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{path}: does not fit this run ({' '.join(str(exc).split())[:300]})") from None
        self._follow_the_options(int(doc["global_step"]), warn=self.ranks.is_main)
        loaders = mine["loaders"]
        self.train_loader.load_state_dict(loaders["train"])
        if self.val_loader is not None:
            if loaders.get("val") is not None:
                self.val_loader.load_state_dict(loaders["val"])
            else:
                self.val_loader.load_state_dict({**self.val_loader.state_dict(), "epoch": doc["epoch"], "step": 0})
        self.epoch = int(doc["epoch"])
        self.global_step = int(doc["global_step"])
        self.per_epoch = list(doc["metrics"])
        self.partial = PassState(**mine["partial"]) if mine.get("partial") else None
        self.epoch_lr = doc.get("epoch_lr")
        set_rng_state(mine["rng"], self.device)
        position = self.train_loader.position
        self.resumed_from = {"epoch": self.epoch, "global_step": self.global_step, "position": list(position)}
        self.saved_step = self.global_step
        # Counted from 1 as the progress lines count; the batch file's name counts from 0.
        epochs = self.train_loader.manifest.epochs
        after = (f"every training batch of the job's {counted(epochs, 'epoch')} was read" if epochs is not None
                 and position[0] >= epochs else  # not "step 1 of epoch 4" of a 3-epoch job (a review)
                 f"the next training batch is step {position[1] + 1} of epoch {position[0] + 1} ({batch_name(*position)})")
        self.echo(f"prefetchd-train: resumed from {path}: epoch {self.epoch + 1}, global step {self.global_step}; "
                  f"{after}")

    def _follow_the_options(self, global_step: int, warn: bool) -> None:
        """This run's --lr, --weight-decay, --momentum and schedule (--epochs, --warmup-epochs) at the step
        reached, not the checkpoint's: loading an optimizer and a scheduler brings back the values they
        were built with, and a changed option would be ignored after ``check_resumable`` named it."""
        config, groups = self.config, self.optimizer.param_groups
        saved = groups[0]["lr"]
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        self.scheduler.base_lrs = [config.peak_lr] * len(groups)
        for group in groups:
            group["initial_lr"] = config.peak_lr
            group["lr"] = config.peak_lr * factor  # as LambdaLR computes it: unchanged options resume bit-exact
            group["weight_decay"] = config.decay
            if "momentum" in group:
                group["momentum"] = config.momentum
        if warn and not math.isclose(saved, groups[0]["lr"], rel_tol=1e-6):
            logger.warning("resuming at global step %d with a learning rate of %.4g, not the checkpoint's %.4g: "
                           "this run's --lr, --epochs and --warmup-epochs set the schedule", global_step,
                           groups[0]["lr"], saved)

    # -- the loop

    def run(self) -> dict[str, Any]:
        config, echo = self.config, self.echo
        if self.plan.resume:
            self._restore()
        if self.val_loader is not None and self.resumed_from is None:
            # Its progress file says where the first validation pass begins from now, not once it begins a
            # training epoch later: until then `prefetchd status` of the val buffer showed an earlier run's
            # position (its pid GONE), or no trainer.  A resume's checkpoint told it already (_restore).
            self.val_loader.load_state_dict({**self.val_loader.state_dict(), "epoch": self.epoch, "step": 0})
        m = self.train_loader.manifest
        if not config.quiet:
            echo(
                f"prefetchd-train: {config.model} on {self.device}, {counted(len(self.train_loader.classes), 'class')}, "
                f"{counted(len(self.train_loader), 'step')} of {m.batch_size} x {m.image_size}px per epoch, "
                f"{counted(self.epochs, 'epoch')}, "
                f"{config.optimizer} lr {config.peak_lr:g}, buffer {config.buffer} (pin {self.train_loader.pin})"
                + (f", val buffer {self.val_buffer}" if self.val_buffer else "")
                + (f"; {self.ranks.world_size} ranks ({self.coll.backend}), each on its own stream, figures summed "
                   "over the ranks" if self.ranks.distributed else "")
            )
        # A stop asked while the run waits for a batch ends the wait (a stalled daemon would hold it). Ranks
        # also end it when another rank announced a stop, and take no step before they agree (``_before_step``):
        # a rank that stopped alone would leave the others in the gradient all-reduce.
        for loader in (self.train_loader, self.val_loader):
            if loader is not None:
                loader.stop_requested = self._stop_requested
        run_start = time.perf_counter()
        # A resume of a run that --max-steps stopped, with the same limit: it has nothing more to train, but
        # an epoch whose training ended at the limit still gets its validation and row (it was stopped in it).
        if config.max_steps is not None and self.global_step >= config.max_steps and self.epoch < self.epochs:
            self.stop_reason = "--max-steps"
        stopped = self.stop_reason is not None and self.train_loader.position[0] == self.epoch
        try:
            while self.epoch < self.epochs and not stopped:
                stopped = self._epoch()
        except BaseException:
            # A run that ends on an error (a daemon lost for good, a rank gone) or Ctrl-C leaves its metrics as one
            # stopped does: the epochs it finished, or the header alone; it left none (a review of README's trainer;
            # for Ctrl-C, a user's walk).
            with contextlib.suppress(OSError):
                self._write_metrics(self._metrics(None, finished=False))
            raise
        total_s = time.perf_counter() - run_start
        metrics = self._metrics(total_s, finished=not stopped)
        if stopped:
            if self.checkpointer.path is not None:
                saved, then = f", checkpoint {self.checkpointer.path}", "continue with --resume"
            else:
                saved, then = "", "no --checkpoint-dir, so no checkpoint to continue from"
            echo(f"stopped after global step {self.global_step} ({self.stop_reason}{saved}); {then}")
        else:
            val_top1 = metrics["final_val_top1"]
            # After a resume the images count every epoch, the time only this process's part.
            took = (f"in {total_s:.1f} s" if self.resumed_from is None else
                    f"in all ({total_s:.1f} s since resuming at global step {self.resumed_from['global_step']})")
            echo(
                f"done: {metrics['train_images']} training images {took}, "
                + (f"final val top-1 {val_top1:.2%}" if val_top1 is not None else "no validation buffer")
                + f", data-wait share {metrics['data_wait_share']:.1%}"
            )
        self._write_metrics(metrics)
        return metrics

    def _epoch(self) -> bool:
        """One epoch (or its rest after a resume); True when --max-steps or ``should_stop`` stopped it."""
        config, epoch, device = self.config, self.epoch, self.device
        tag = f"epoch {epoch + 1}/{self.epochs}"
        wall = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if self.partial is None:
            self.epoch_lr = self.optimizer.param_groups[0]["lr"]
        resumed_s = self.partial.seconds if self.partial is not None else 0.0

        def after_step(snapshot: Callable[[], PassState]) -> bool:
            self.global_step += 1
            # A signal reaches the ranks at different steps; they stop together at the first step any saw it.
            terminated = self.coll.any(self.should_stop())
            if terminated:  # first: at the --max-steps step too, the exit is a SIGTERM's (the validation is skipped)
                self.stop_reason = self.stop_signal()
            elif config.max_steps is not None and self.global_step >= config.max_steps:
                self.stop_reason = "--max-steps"
            # --max-steps on an epoch's last step: that epoch's validation and line still come, and the run
            # stops after them (the end of ``_epoch``); a SIGTERM does not wait for them.
            epoch_trained = self.train_loader.position[0] != epoch
            stop = self.stop_reason is not None and (terminated or not epoch_trained)
            if stop or self.checkpointer.due(self.global_step):
                self._save(snapshot())
            return stop

        if self.train_loader.position[0] == epoch:
            tr = run_pass(
                self.model, self.train_loader, self.criterion,
                ProgressLine(sys.stderr, f"{tag} train", len(self.train_loader), self._progress_shown),
                self.optimizer, self.scheduler,
                topk=self.k, amp=config.amp, start=self.partial, after_step=after_step,
                between_steps=lambda snapshot, error: self._save_between_steps(snapshot(), error),
                recover=self.recover, before_step=self._before_step,
            )
        else:  # the checkpoint was taken after the pass's last step
            tr = pass_stats(self.partial or PassState(), self.k)
        self.partial = None
        if tr.stopped:
            self.stop_reason = self.stop_reason or self.stop_signal()  # set by a step's end, else asked during a wait
            return True
        va = None
        if self.val_loader is not None:
            if self.val_loader.position != (epoch, 0):
                self.val_loader.load_state_dict({**self.val_loader.state_dict(), "epoch": epoch, "step": 0})
            # The bare model: evaluation needs no gradient averaging; the ranks only agree before each step.
            va = run_pass(
                self.net, self.val_loader, self.criterion,
                ProgressLine(sys.stderr, f"{tag} val", len(self.val_loader), self._progress_shown),
                topk=self.k, amp=config.amp, recover=self.recover,
                after_step=None if self.ranks.distributed else lambda _: self._stop_in_validation(tr.state),
                # The train pass is whole: a resume from it runs this validation again.
                between_steps=lambda _, error: self._save_between_steps(tr.state, error),
                before_step=self._before_step,
            )
            if va.stopped:
                self.stop_reason = self.stop_signal()
                return True
        epoch_s = time.perf_counter() - wall + resumed_s
        wait_s = tr.wait_seconds + (va.wait_seconds if va else 0.0)
        tr, va, epoch_s, wait_s, wait_share_max = self._over_ranks(tr, va, epoch_s, wait_s)
        row = epoch_row(
            epoch, self.epoch_lr, tr, va, wait_s=wait_s, epoch_s=epoch_s,
            cuda_max_memory_mib=torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
            global_step=self.global_step, wait_share_max=wait_share_max if self.ranks.distributed else None,
        )
        self.per_epoch.append(row)
        self.epoch += 1
        k = self.k
        val_text = f"val loss {va.loss:.4f} top-1 {va.top1:6.2%} top-{k} {va.topk:6.2%}" if va else "val -"
        memory = f"  cuda max {row['cuda_max_memory_mib']:.0f} MiB" if row["cuda_max_memory_mib"] is not None else ""
        self.echo(
            f"{tag}  train loss {tr.loss:.4f} top-1 {tr.top1:6.2%} top-{k} {tr.topk:6.2%}  {val_text}  "
            f"{row['images_per_s']:.1f} img/s  data-wait {row['data_wait_share']:.1%}{memory}"
        )
        self._save(None)
        self._write_metrics(self._metrics(None, finished=False))
        if self.stop_reason is not None and self.epoch == self.epochs:
            self.stop_reason = None  # --max-steps on the last epoch's last step: the run is simply done
        return self.stop_reason is not None

    def _stop_in_validation(self, trained: PassState) -> bool:
        """After a validation step: whether a stop asked for ends the run there, with the checkpoint a stop
        during a validation wait saves (the whole training pass: the resume validates again).  One process
        only: ranks stop together before their next step (``_before_step``)."""
        if not self.should_stop():
            return False
        self._save_between_steps(trained, None)
        return True

    def _stop_requested(self) -> bool:
        return self.should_stop() or self.coll.stop_announced()

    @property
    def _before_step(self) -> Callable[[bool], bool] | None:
        """Under torchrun: whether the ranks stop before the next step, all of them agreeing (see
        ``Collective.agree_to_stop``); None with one process, whose own wait ends at a stop."""
        if not self.ranks.distributed:
            return None
        return lambda stopping: self.coll.agree_to_stop(stopping or self.should_stop(), self.should_stop)

    def _save_between_steps(self, partial: PassState, error: Exception | None) -> None:
        """A wait for a batch ended without one (a stop asked for, or ``error``: the daemon lost): save the
        last step's state unless the last checkpoint holds it.  Ranks save on a stop, which they agreed on
        before the step (``_before_step``), not on an error of one rank's loader: the others are not here."""
        if self.checkpointer.path is None or self.saved_step == self.global_step:
            return
        if self.ranks.distributed and error is not None:
            return
        self._save(partial)
        if error is not None:  # a stop says where its checkpoint is in its own line
            self.echo(f"prefetchd-train: saved a checkpoint of global step {self.global_step} before stopping on "
                      f"the error below; continue from it with --resume ({self.checkpointer.path})")

    @property
    def _progress_shown(self) -> bool:
        return not self.config.quiet and self.ranks.is_main

    def _over_ranks(
        self, tr: PassStats, va: PassStats | None, epoch_s: float, wait_s: float
    ) -> tuple[PassStats, PassStats | None, float, float, float]:
        """The epoch's figures over all ranks: images, losses and hits summed, times of the slowest rank.

        The data-wait seconds become the mean over the ranks (so the share stays a
        fraction of the epoch), and the largest single rank's share is kept too:
        under DDP the most starved rank holds every rank back.
        """
        share = min(1.0, wait_s / epoch_s) if epoch_s > 0 else 0.0
        if not self.ranks.distributed:
            return tr, va, epoch_s, wait_s, share
        passes = [tr.state] + ([va.state] if va is not None else [])
        sums, maxima = self.coll.reduce(
            [x for p in passes for x in (p.loss_sum, p.correct1, p.correctk, p.seen, p.wait_seconds)],
            [*(p.seconds for p in passes), epoch_s, share],
        )
        world = self.ranks.world_size
        reduced = [
            PassState(loss_sum=sums[5 * i], correct1=round(sums[5 * i + 1]), correctk=round(sums[5 * i + 2]),
                      seen=round(sums[5 * i + 3]), wait_seconds=sums[5 * i + 4] / world, seconds=maxima[i])
            for i in range(len(passes))
        ]
        tr = pass_stats(reduced[0], tr.k, tr.stopped)
        va = pass_stats(reduced[1], va.k, va.stopped) if va is not None else None
        return tr, va, maxima[-2], tr.wait_seconds + (va.wait_seconds if va else 0.0), maxima[-1]

    # -- metrics

    def _metrics(self, total_s: float | None, finished: bool) -> dict[str, Any]:
        # The values the run used, where the options left them to a default worked out at start.
        used = replace(self.config, lr=self.config.peak_lr, weight_decay=self.config.decay, epochs=self.epochs,
                       val_buffer=self.val_buffer)
        return metrics_document(
            self.per_epoch, config=used, device=self.device, pin=self.train_loader.pin,
            world_size=self.ranks.world_size, num_epochs=self.epochs, k=self.k, finished=finished,
            resumed_from=self.resumed_from, stopped_by=self.stop_reason, global_steps=self.global_step, total_s=total_s,
        )

    def _write_metrics(self, metrics: dict[str, Any]) -> None:
        if self.ranks.is_main:
            write_metrics(self.config, metrics, csv_columns(self.k, self.ranks.distributed))


def epoch_row(epoch: int, lr: float | None, tr: PassStats, va: PassStats | None, *, wait_s: float, epoch_s: float,
              cuda_max_memory_mib: float | None, global_step: int, wait_share_max: float | None) -> dict[str, Any]:
    """An epoch's row of the metrics files, over all ranks; ``wait_share_max`` (the most starved rank's
    data-wait share) under torchrun only, None leaves its column out."""
    k = tr.k
    row: dict[str, Any] = {
        "epoch": epoch,
        "lr": lr,
        "train_loss": tr.loss,
        "train_top1": tr.top1,
        f"train_top{k}": tr.topk,
        "train_images": tr.images,
        "train_s": tr.seconds,
        "val_loss": va.loss if va else None,
        "val_top1": va.top1 if va else None,
        f"val_top{k}": va.topk if va else None,
        "val_images": va.images if va else None,
        "val_s": va.seconds if va else None,
        "images_per_s": tr.images / tr.seconds if tr.seconds > 0 else 0.0,
        "data_wait_s": wait_s,
        "epoch_s": epoch_s,
        "data_wait_share": min(1.0, wait_s / epoch_s) if epoch_s > 0 else 0.0,
        "cuda_max_memory_mib": cuda_max_memory_mib,
        "global_step": global_step,
    }
    if wait_share_max is not None:
        row["data_wait_share_max"] = wait_share_max
    return row


def csv_columns(k: int, distributed: bool) -> list[str]:
    """The header of --metrics-csv: the keys of an epoch's row (here an empty epoch's, so the two never
    differ), known before the first epoch ends, so that a run stopped before it (--max-steps, SIGTERM)
    leaves a file of every column and no row, not one of ``epoch`` alone."""
    empty = pass_stats(PassState(), k)
    return list(epoch_row(0, None, empty, None, wait_s=0.0, epoch_s=0.0, cuda_max_memory_mib=None, global_step=0,
                          wait_share_max=0.0 if distributed else None))


__all__ = ["Run", "csv_columns", "epoch_row"]
