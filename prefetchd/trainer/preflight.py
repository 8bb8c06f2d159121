"""What a ``prefetchd-train`` run settles before its first step, the same on every rank: that this
user may read the buffers, the device, the number of epochs the daemons produce, the checkpoint plan
(rank 0's), and that every rank runs the same steps (DDP hangs otherwise)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prefetchd.trainer.checkpoint import CheckpointPlan, Checkpointer, existing_checkpoint
from prefetchd.trainer.collective import Collective
from prefetchd.trainer.config import TrainConfig
from prefetchd.trainer.errors import CheckpointError, OptionError, SetupError
from prefetchd.trainer.loader import BufferLoader
from prefetchd.trainer.manifest_wait import check_readable
from prefetchd.trainer.rank_store import differs_between_ranks
from prefetchd.trainer.ranks import Ranks
from prefetchd.trainer.report import metrics_unwritable
from prefetchd.words import counted


def check_access(buffer: Path, val_buffer: Path | None) -> None:
    """Refuse a buffer this user may not read, saying whose it is and how to join its group (``check_readable``,
    as the loader does, in the words of `prefetchd status`); one not there yet is a daemon's to make, and waited
    for."""
    for flag, path in (("--buffer", buffer), ("--val-buffer", val_buffer)):
        if path is not None:
            check_readable(path, flag)


def resolve_device(name: str, ranks: Ranks | None = None) -> torch.device:
    """The device of ``--device``; under torchrun ``cuda`` (or ``auto`` with CUDA) means cuda:LOCAL_RANK."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:  # torch's own message is a list of every backend it was built to know
        raise OptionError(f"--device {name}: not a device name; use auto, cpu, cuda or cuda:N (N: a GPU index)") from None
    if device.type not in ("cpu", "cuda"):
        raise OptionError(f"--device {name}: prefetchd-train trains on the CPU or a CUDA GPU; use auto, cpu, cuda or cuda:N")
    # A bad value on this machine, as a missing file is to click's path checks: exit code 2.
    if device.type == "cuda" and not torch.cuda.is_available():
        raise OptionError(f"--device {name}: CUDA is not available on this machine; use --device cpu or auto")
    if device.type == "cuda" and device.index is None and ranks is not None and ranks.distributed:
        count = torch.cuda.device_count()
        if ranks.local_rank >= count:
            raise SetupError(
                f"LOCAL_RANK {ranks.local_rank} needs a GPU of its own, but this machine has {count}; run at most "
                f"{count} processes per node (torchrun --nproc-per-node {count}), or pass --device cpu"
            )
        device = torch.device("cuda", ranks.local_rank)
    return device


def resolve_epochs(config: TrainConfig, train: BufferLoader, val: BufferLoader | None) -> int:
    produced = train.manifest.epochs
    if config.epochs is None:
        if produced is None:
            raise OptionError(f"the daemon of {train.buffer} produces epochs without end; pass --epochs N")
        return produced
    if produced is not None and config.epochs > produced:
        raise SetupError(
            f"--epochs {config.epochs}, but the daemon of {train.buffer} produces only {counted(produced, 'epoch')}; "
            f"restart it with --epochs {config.epochs} (or without --epochs), or train for fewer epochs"
        )
    if val is not None and val.manifest.epochs is not None and config.epochs > val.manifest.epochs:
        raise SetupError(
            f"--epochs {config.epochs}, but the daemon of {val.buffer} produces only "
            f"{counted(val.manifest.epochs, 'validation epoch')}; restart it with a matching --epochs (or without --epochs)"
        )
    return config.epochs


def agree_on_checkpoints(config: TrainConfig, coll: Collective) -> CheckpointPlan:
    """Rank 0's checkpoint plan, on every rank: a rank whose box was given no --checkpoint-dir
    (or another --checkpoint-every) would otherwise skip the collective of a save and hang the run.

    A run that does not resume refuses a --checkpoint-dir that holds a checkpoint already: its
    first save would replace the checkpoint of an earlier run (a forgotten --resume) without a word.
    And one that rank 0 cannot write is refused before any daemon starts, not after an epoch.
    """
    plan = coll.broadcast(CheckpointPlan.of(config))
    found: tuple[str, str] | None = None
    if coll.ranks.is_main and plan.path is not None:
        try:
            there = None if plan.resume else existing_checkpoint(plan.path)
        except CheckpointError as exc:
            found = ("error", str(exc))
        else:
            problem = Checkpointer(plan).unwritable()
            found = ("there", there) if there is not None else ("error", problem) if problem is not None else None
    found = coll.broadcast(found)  # every rank stops with rank 0's message
    if found is not None and found[0] == "error":
        raise CheckpointError(found[1])
    if found is not None:
        raise OptionError(
            f"--checkpoint-dir already holds a checkpoint, {found[1]}, and this run (without --resume) would "
            "start from scratch and overwrite it. Pass --resume to "
            "continue it, or choose another --checkpoint-dir (or remove that checkpoint to start over)"
        )
    return plan


@dataclass(frozen=True)
class Alike:
    """An option every rank must be given alike: ``value`` is what is compared, ``shown`` how a rank's is said."""

    name: str
    value: Callable[[TrainConfig, bool], Any]  # (config, validation on) -> a picklable value
    shown: Callable[[Any], str]
    fix: str


# The options that decide which collectives a rank takes, and when: a rank given another value takes one
# the others do not, and the run hangs or fails with a peer's error in the wrong place.
#   --max-steps: the step at which the ranks stop and gather the checkpoint, while the others would go on
#     into the next step's agreement (Collective.agree_to_stop) and DDP's gradient all-reduce;
#   --spawn-daemon: the barriers while local rank 0 starts the daemons and before it stops them;
#   validation: each validation step is preceded by the ranks' agreement whether to stop.
# And the options of the model and of its training: DDP averages the gradients, but each rank's optimizer
# applies them, so ranks given another --lr (--optimizer, --momentum, ...) train apart without a word, and
# another --model failed in DDP's constructor with a traceback.
# Not here: --checkpoint-dir, --checkpoint-every and --resume are rank 0's on every rank
# (agree_on_checkpoints); --epochs is compared once the daemons' manifests resolve it (check_equal_steps);
# --seed only seeds a rank's initial weights, which DDP replaces with rank 0's.
SAME_VALUE = "pass the same value to every rank"


def _same(flag: str) -> Alike:
    """``flag`` (``--lr``: TrainConfig's ``lr``), whose value every rank must be given alike."""
    attr = flag.removeprefix("--").replace("-", "_")
    return Alike(flag, lambda c, _: getattr(c, attr), lambda v: "not given" if v is None else str(v), SAME_VALUE)


ALIKE = (
    _same("--max-steps"),
    Alike("--spawn-daemon", lambda c, _: c.spawn_daemon, lambda v: "given" if v else "not given",
          "pass it to every rank or to none"),
    Alike("validation", lambda _, val: val, lambda v: "on" if v else "off",
          "give every rank a validation buffer (--val-buffer, or --val-data with --spawn-daemon), or none"),
    *map(_same, ("--model", "--pretrained", "--optimizer", "--lr", "--momentum", "--weight-decay",
                 "--warmup-epochs", "--label-smoothing", "--amp")),
)


def agree_on_options(config: TrainConfig, validation: bool, coll: Collective) -> None:
    """Refuse, on every rank and before any daemon is started, options of ``ALIKE`` that differ between
    ranks (two boxes launched by hand with different command lines); one gather, at the start."""
    mine = [option.value(config, validation) for option in ALIKE]
    every = coll.all_gather(mine)
    differ = [differs_between_ranks(option.name, [option.shown(theirs[i]) for theirs in every], option.fix)
              for i, option in enumerate(ALIKE) if any(theirs[i] != mine[i] for theirs in every)]
    if differ:  # all of them at once: the next launch fixes every one
        raise OptionError(". ".join(differ))


def check_metrics_paths(config: TrainConfig, coll: Collective) -> None:
    """Refuse, before any daemon is started, a --metrics-json or --metrics-csv that rank 0 (which writes
    them) cannot write: without this the run failed after its first epoch, with a traceback.  A bad
    argument, as click's own path checks are: exit code 2, naming the flag and the path."""
    problem = coll.broadcast(metrics_unwritable(config) if coll.ranks.is_main else None)
    if problem is not None:
        raise OptionError(problem)


def check_equal_steps(coll: Collective, train: BufferLoader, val: BufferLoader | None, epochs: int) -> None:
    """DDP hangs unless every rank runs the same steps: the daemon pads the ranks' shares, this checks it."""
    mine = (len(train), len(val) if val is not None else None, epochs)
    every = coll.all_gather(mine)
    if any(other[:2] == mine[:2] and other[2] != mine[2] for other in every):
        raise OptionError(differs_between_ranks("--epochs", [str(e) for _, _, e in every],
                                                "pass the same --epochs to every rank", ", where not given the daemon's"))
    if any(other != mine for other in every):
        table = "; ".join(f"rank {r}: {counted(t, 'train step')}, {counted(v or 0, 'val step')}, {counted(e, 'epoch')}"
                          for r, (t, v, e) in enumerate(every))
        raise SetupError(
            f"the ranks would run different numbers of steps ({table}), and DDP would hang at the end; all ranks "
            "must read streams of one daemon job per buffer (the same --world-size, dataset and --batch-size)"
        )


__all__ = ["ALIKE", "Alike", "agree_on_checkpoints", "agree_on_options", "check_access", "check_equal_steps",
           "check_metrics_paths", "resolve_device", "resolve_epochs"]
