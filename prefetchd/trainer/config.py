"""The trainer's configuration: one frozen dataclass from which ``prefetchd-train``'s options are derived.

Each field's metadata (see :mod:`prefetchd.options`) is its flag: type, range,
default and help text are written here once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Literal

from prefetchd.buffer_protocol import check_consumer
from prefetchd.buffer_protocol.manifest import BATCH_SIZES, IMAGE_SIZES
from prefetchd.options import setting
from prefetchd.trainer.wait_bounds import DAEMON_GRACE, DEFAULT_STALL_TIMEOUT, DEFAULT_TIMEOUT

# How batches reach a CUDA device (``trainer.gpu``); here, which imports no torch, for the --pin option.
PinMode = Literal["auto", "staging", "register", "none"]
PIN_MODES: tuple[PinMode, ...] = ("auto", "staging", "register", "none")
OPTIMIZERS = ("sgd", "adamw")
# (peak learning rate, weight decay) when not given: the usual ResNet recipes for each.
OPTIMIZER_DEFAULTS = {"sgd": (0.05, 5e-4), "adamw": (1e-3, 0.05)}
_SPAWN = "With --spawn-daemon: "


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on; ``prefetchd-train``'s options and their defaults come from here."""

    # Not readable by click: ``train`` says whose a buffer this user may not read is, and how to join its group.
    buffer: Path = setting(MISSING, "Training buffer (the daemon's --buffer).", Path, readable=False, buffer=True)
    val_buffer: Path | None = setting(None, "Buffer of a --split val daemon; evaluated after every epoch.", Path,
                                      readable=False, buffer=True)
    epochs: int | None = setting(None, "Epochs to train  [default: the manifest's epochs]", int, minimum=1)
    model: str = setting("resnet18", "A torchvision classification model name.", str)
    pretrained: bool = setting(False, "Start from torchvision's default weights, if they are in the local torch hub cache (never downloads).", bool)
    optimizer: str = setting("sgd", None, str, choices=OPTIMIZERS)
    lr: float | None = setting(None, "Peak learning rate  [default: 0.05 for sgd, 0.001 for adamw]", float, minimum=0, min_open=True)  # None: OPTIMIZER_DEFAULTS
    # torch.optim.SGD refuses a negative momentum; 1 and above make the step grow without end.
    momentum: float = setting(0.9, "SGD momentum.", float, minimum=0, maximum=1, max_open=True)
    weight_decay: float | None = setting(None, "[default: 5e-4 for sgd, 0.05 for adamw]", float, minimum=0)  # None: OPTIMIZER_DEFAULTS
    warmup_epochs: float = setting(0.0, "Linear warmup to the peak lr, then cosine to 0 (per step).", float, minimum=0)
    label_smoothing: float = setting(0.0, None, float, minimum=0, maximum=1, max_open=True)
    amp: bool = setting(False, "bf16 autocast (meant for CUDA; allowed on the CPU).", bool)
    seed: int = setting(0, "Model initialisation; also the --seed of spawned daemons.", int)
    device: str = setting("auto", "auto, cpu, cuda or cuda:N.", str)
    pin: str = setting("auto", "How batches reach a CUDA device (auto = staging).", str, choices=PIN_MODES)
    timeout: float = setting(DEFAULT_TIMEOUT, "Seconds to wait for the manifest and for each batch; for a batch, while the daemon beats and says its builds wait for the dataset's storage (an object store's outage, a mount gone), counted from when it last said so.", float, minimum=0, min_open=True)
    daemon_timeout: float = setting(DEFAULT_STALL_TIMEOUT, "Seconds without a heartbeat from the daemon that owns a buffer before it counts as stuck (0: never); a dead daemon is noticed "
                                    f"within {DAEMON_GRACE:g} s of waiting for a batch it had not made.", float, minimum=0)
    daemon_restarts: int = setting(3, "With --spawn-daemon: restart a daemon that died or got stuck up to N times within 10 minutes, then stop with an error.", int, minimum=0)
    metrics_json: Path | None = setting(None, "Write per-epoch and final metrics here (after every epoch); its folder must exist.", Path, path="file")
    metrics_csv: Path | None = setting(None, "Write one CSV row per epoch here (after every epoch); its folder must exist.", Path, path="file")
    # A local Path, or a URL kept as a str: Path("s3://b/p") is "s3:/b/p".
    checkpoint_dir: Path | str | None = setting(None, "Save DIR/last.pt at every epoch's end (and see --checkpoint-every); DIR may be a URL such as s3://bucket/run1 (needs prefetchd[s3]; credentials from the standard AWS environment and files).", Path, location=True, path="dir")
    checkpoint_every: int | None = setting(None, "Also save every N training steps (needs --checkpoint-dir).", int, minimum=1)
    resume: bool = setting(False, "Continue from DIR/last.pt of --checkpoint-dir (from scratch if there is none); without it a run refuses a DIR that holds one.", bool)
    max_steps: int | None = setting(None, "Stop after this many training steps in all (resumed runs included), saving a checkpoint; on an epoch's last step, after that epoch's validation.", int, minimum=1)
    spawn_daemon: bool = setting(False, "Start `prefetchd start` for the buffers no daemon serves, and stop it at the end.", bool)
    data: Path | str | None = setting(None, _SPAWN + "the training dataset, as `prefetchd start --data` takes it: class folders, a .csv/.tsv/.txt file list of path,label rows, or a folder of shards from `prefetchd pack`; local or at an object-storage URL.", Path, location=True)
    val_data: Path | str | None = setting(None, _SPAWN + "the validation dataset, in any of --data's forms (buffer: --val-buffer, else BUFFER-val).", Path, location=True)
    batch_size: int | None = setting(None, _SPAWN + "the daemons' --batch-size.", int, minimum=BATCH_SIZES[0],
                                     maximum=BATCH_SIZES[1])
    image_size: int | None = setting(None, _SPAWN + "the daemons' --image-size.", int, minimum=IMAGE_SIZES[0],
                                     maximum=IMAGE_SIZES[1])
    workers: int | None = setting(None, _SPAWN + "the daemons' --workers.", int, minimum=1)
    high_water: int | None = setting(None, _SPAWN + "the daemons' --high-water.", int, minimum=1)
    drop_last: bool = setting(False, _SPAWN + "the training daemon's --drop-last: leave out each epoch's short last batch.", bool)
    reset: bool = setting(False, _SPAWN + "the daemons' --reset: delete what a buffer holds from a different job (after changing --batch-size or --drop-last, say) instead of refusing to start.", bool)
    consumer: str | None = setting(None, "This run's name among several trainers reading the same buffer (a sweep, an ensemble): 1-32 of A-Z a-z 0-9 _ -; it writes progress.NAME.json and the daemon keeps each batch until every consumer has passed it [default: the single trainer's progress.json].", str)
    threads: int | None = setting(None, "torch.set_num_threads for the trainer.", int, minimum=1)
    quiet: bool = setting(False, "No start line and no progress display (per-epoch lines stay).", bool, short="-q")

    def __post_init__(self) -> None:
        if self.consumer is not None:
            check_consumer(self.consumer)  # a bad name fails here, before any daemon is started

    @property
    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else OPTIMIZER_DEFAULTS[self.optimizer][0]

    @property
    def decay(self) -> float:
        return self.weight_decay if self.weight_decay is not None else OPTIMIZER_DEFAULTS[self.optimizer][1]


# The settings whose None stands for OPTIMIZER_DEFAULTS[optimizer][i].
OPTIMIZER_DEFAULTED = {"lr": 0, "weight_decay": 1}


def setting_value(settings: Mapping[str, Any], key: str) -> Any:
    """``settings[key]`` of a ``plain_config`` (a checkpoint's, say), with None resolved where it stands for
    the optimizer's default: the value the run used."""
    value = settings[key]
    if value is None and key in OPTIMIZER_DEFAULTED and settings.get("optimizer") in OPTIMIZER_DEFAULTS:
        return OPTIMIZER_DEFAULTS[settings["optimizer"]][OPTIMIZER_DEFAULTED[key]]
    return value


def shown_setting(settings: Mapping[str, Any], key: str) -> str:
    """``settings[key]`` for a message: "default (0.0005)" where None stood for the optimizer's default."""
    value = setting_value(settings, key)
    return f"default ({value:g})" if settings[key] is None and value is not None else repr(value)


def plain_config(config: TrainConfig) -> dict[str, Any]:
    """The config as JSON-ready values (paths as strings), for metrics and checkpoints."""
    return {f.name: (str(v) if isinstance(v := getattr(config, f.name), Path) else v)
            for f in dataclasses.fields(config)}


__all__ = ["OPTIMIZERS", "OPTIMIZER_DEFAULTED", "OPTIMIZER_DEFAULTS", "TrainConfig", "plain_config", "setting_value", "shown_setting"]
