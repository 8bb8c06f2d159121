"""The reference trainer behind ``prefetchd-train``: a torchvision model fed from a buffer.

A plain, complete training engine (SGD or AdamW, linear warmup then cosine,
label smoothing, bf16 autocast, channels_last, exact checkpoint/resume) whose
numbers say whether the data path keeps up: per epoch it prints loss, top-1,
top-5, images/s and the *data-wait share*, the fraction of the epoch spent
inside the loaders' ``next()``.  A share near zero means the daemon keeps the
model fed.

Checkpoints (``--checkpoint-dir``, a local folder or an object-storage URL
such as ``s3://bucket/run1``) hold everything the run depends on: model,
optimizer, scheduler, both loaders' positions, the epoch, the half-finished
epoch's sums, the metrics so far and the RNG states.  Because batch (epoch,
step) is bit-identical whenever it is produced, ``--resume`` continues with
exactly the batch after the checkpoint, whether the daemon still holds it or
has to make it again.

The trainer never imports the daemon: ``--spawn-daemon`` starts one through
the ``prefetchd start`` command line and stops it at the end.

Under torchrun (``torchrun --nproc-per-node N -m prefetchd.trainer.train ...``)
every rank reads its own stream of the buffer, the model is wrapped in
DistributedDataParallel (gloo on the CPU, nccl on CUDA), the epoch's figures
are summed over the ranks, and rank 0 alone prints, writes the metrics and the
checkpoint, which holds every rank's loader position (see ``ranks``).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any, cast

import click
import numpy as np
import torch
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from prefetchd.buffer_protocol import ProtocolError, daemon_pid, stop_daemon_process, stream_dir
from prefetchd.buffer_protocol.layout import MANIFEST_NAME, owning_buffer
from prefetchd.locations import LocationError, StorageDenied, StorageUnavailable, filesystem, is_url, normalize, with_retries
from prefetchd.trainer.errors import CheckpointError, DaemonGone, DaemonRestartsExhausted, DaemonStuck, LoaderError
from prefetchd.trainer.gpu import PIN_MODES, PinMode
from prefetchd.trainer.loader import Batch, BufferLoader
from prefetchd.trainer.ranks import Collective, Ranks, wait_for_stream

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1  # a configuration problem found before training (click.ClickException), a bad checkpoint
EXIT_BUFFER = 3  # the buffer could not deliver: LoaderError / ProtocolError
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # SIGTERM: stopped at a step boundary with a checkpoint

METRICS_FORMAT = "prefetchd.train_metrics"
METRICS_VERSION = 2
CHECKPOINT_FORMAT = "prefetchd.train_checkpoint"
CHECKPOINT_VERSION = 1
LAST_CHECKPOINT = "last.pt"

OPTIMIZERS = ("sgd", "adamw")
# (peak learning rate, weight decay) when not given: the usual ResNet recipes for each.
OPTIMIZER_DEFAULTS = {"sgd": (0.05, 5e-4), "adamw": (1e-3, 0.05)}
TOP_K = 5
DAEMON_STOP_SECONDS = 30.0
DAEMON_KILL_SECONDS = 5.0  # a dead or stuck daemon gets this long after SIGTERM before SIGKILL
RESTART_WINDOW_SECONDS = 600.0  # --daemon-restarts counts the restarts within this window
# Settings a checkpoint cannot be resumed under when they changed (the state would not fit).
_RESUME_FIXED = ("model", "optimizer")


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on; the CLI's defaults come from here."""

    buffer: Path
    val_buffer: Path | None = None
    epochs: int | None = None
    model: str = "resnet18"
    pretrained: bool = False
    optimizer: str = "sgd"
    lr: float | None = None  # None: OPTIMIZER_DEFAULTS
    momentum: float = 0.9
    weight_decay: float | None = None  # None: OPTIMIZER_DEFAULTS
    warmup_epochs: float = 0.0
    label_smoothing: float = 0.0
    amp: bool = False
    seed: int = 0
    device: str = "auto"
    pin: str = "auto"
    timeout: float = 120.0
    daemon_timeout: float = 60.0  # 0: never call a daemon stuck
    daemon_restarts: int = 3
    metrics_json: Path | None = None
    metrics_csv: Path | None = None
    checkpoint_dir: Path | str | None = None  # a str is a URL
    checkpoint_every: int | None = None
    resume: bool = False
    max_steps: int | None = None
    spawn_daemon: bool = False
    data: Path | str | None = None  # a str is a URL
    val_data: Path | str | None = None
    batch_size: int | None = None
    image_size: int | None = None
    workers: int | None = None
    high_water: int | None = None
    threads: int | None = None
    quiet: bool = False

    @property
    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else OPTIMIZER_DEFAULTS[self.optimizer][0]

    @property
    def decay(self) -> float:
        return self.weight_decay if self.weight_decay is not None else OPTIMIZER_DEFAULTS[self.optimizer][1]


@dataclass
class PassState:
    """The running sums of a pass: what a mid-epoch checkpoint saves and a resume continues from."""

    loss_sum: float = 0.0
    correct1: int = 0
    correctk: int = 0
    seen: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0


@dataclass
class PassStats:
    """One pass (train or val) over one epoch of a loader."""

    loss: float
    top1: float
    images: int
    seconds: float
    wait_seconds: float
    topk: float = math.nan
    k: int = 1
    stopped: bool = False  # ended early because ``after_step`` asked to
    state: PassState = field(default_factory=PassState)  # the sums behind the figures


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


Recover = Callable[[BufferLoader, LoaderError], bool]


def _timed(loader: BufferLoader, recover: Recover | None = None) -> Iterator[tuple[Batch, float]]:
    """The loader's batches, each with the seconds spent waiting inside ``next()``.

    When the loader gives up on its daemon (gone or stuck) and ``recover`` brings a
    new one up (True), the same iterator asks again for the same (epoch, step): the
    position moves only when a batch is handed over, so none is skipped or repeated.
    """
    it = iter(loader)
    while True:
        start = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return
        except (DaemonGone, DaemonStuck) as exc:
            if recover is None or not recover(loader, exc):
                raise
            continue
        yield batch, time.perf_counter() - start


def run_pass(
    model: nn.Module,
    loader: BufferLoader,
    criterion: nn.Module,
    progress: _ProgressLine,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    *,
    topk: int = TOP_K,
    amp: bool = False,
    start: PassState | None = None,
    after_step: Callable[[Callable[[], PassState]], bool] | None = None,
    recover: Recover | None = None,
) -> PassStats:
    """Train (with an optimizer) or evaluate (without) over the rest of the loader's epoch.

    ``start`` continues the sums of a pass that a checkpoint interrupted.
    ``after_step`` is called after every optimizer step with a function that
    snapshots the sums; returning True ends the pass there.  ``recover`` is
    asked to replace a dead or stuck daemon (see ``_timed``).
    """
    training = optimizer is not None
    model.train(training)
    device = loader.device
    k = max(1, min(topk, len(loader.classes)))
    begun = start or PassState()
    # Sums stay on the device so no step waits for the GPU just to log.
    loss_sum = torch.full((), begun.loss_sum, dtype=torch.float64, device=device)
    correct1 = torch.full((), begun.correct1, dtype=torch.int64, device=device)
    correctk = torch.full((), begun.correctk, dtype=torch.int64, device=device)
    seen = begun.seen
    wait = begun.wait_seconds
    t0 = time.perf_counter()

    def snapshot() -> PassState:
        return PassState(
            loss_sum=loss_sum.item(), correct1=int(correct1.item()), correctk=int(correctk.item()), seen=seen,
            seconds=begun.seconds + time.perf_counter() - t0, wait_seconds=wait,
        )

    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if amp else nullcontext()
    stopped = False
    with torch.set_grad_enabled(training):
        for done, (batch, waited) in enumerate(_timed(loader, recover), start=1):
            wait += waited
            images, labels = batch
            with autocast:
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
            correct1 += (logits.argmax(dim=1) == labels).sum()
            correctk += (logits.topk(k, dim=1).indices == labels[:, None]).any(dim=1).sum()
            seen += n
            progress.update(done, lambda: loss_sum.item() / max(seen, 1))
            if after_step is not None and after_step(snapshot):
                stopped = True
                break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    progress.finish()
    return _stats(snapshot(), k, stopped)


def _stats(state: PassState, k: int, stopped: bool = False) -> PassStats:
    n = state.seen
    return PassStats(
        loss=state.loss_sum / n if n else math.nan,
        top1=state.correct1 / n if n else math.nan,
        topk=state.correctk / n if n else math.nan,
        k=k,
        images=n,
        seconds=state.seconds,
        wait_seconds=state.wait_seconds,
        stopped=stopped,
        state=state,
    )


def resolve_device(name: str, ranks: Ranks | None = None) -> torch.device:
    """The device of ``--device``; under torchrun ``cuda`` (or ``auto`` with CUDA) means cuda:LOCAL_RANK."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise click.ClickException(f"--device {name}: CUDA is not available on this machine; use --device cpu or auto")
    if device.type == "cuda" and device.index is None and ranks is not None and ranks.distributed:
        count = torch.cuda.device_count()
        if ranks.local_rank >= count:
            raise click.ClickException(
                f"LOCAL_RANK {ranks.local_rank} needs a GPU of its own, but this machine has {count}; run at most "
                f"{count} processes per node (torchrun --nproc-per-node {count}), or pass --device cpu"
            )
        device = torch.device("cuda", ranks.local_rank)
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


# -- model, optimizer, schedule --------------------------------------------------------


def cached_weights(model: str) -> tuple[str, Path]:
    """torchvision's default weights for ``model``: their name and where the torch hub cache keeps them."""
    try:
        weights = torchvision.models.get_model_weights(model).DEFAULT
    except (ValueError, KeyError, AttributeError):
        raise click.ClickException(f"--pretrained: torchvision has no pretrained weights for --model {model}") from None
    filename = os.path.basename(urllib.parse.urlparse(weights.url).path)
    return f"{type(weights).__name__}.{weights.name}", Path(torch.hub.get_dir()) / "checkpoints" / filename


def build_model(name: str, num_classes: int, pretrained: bool, echo: Callable[[str], None] = click.echo) -> nn.Module:
    """A torchvision model for ``num_classes``; with ``pretrained``, weights from the local hub cache only.

    The classifier of the pretrained weights rarely has ``num_classes``
    outputs: tensors whose shape differs stay freshly initialised.
    """
    try:
        model: nn.Module = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    except ValueError as exc:
        raise click.ClickException(f"--model {name}: {exc}") from None
    if not pretrained:
        return model
    weights, path = cached_weights(name)
    if not path.is_file():
        raise click.ClickException(
            f"--pretrained: {weights} is not in the local torch hub cache ({path}), and prefetchd-train never "
            f"downloads. Fetch it once where there is network access, e.g. `python -c \"import torchvision; "
            f"torchvision.models.get_model('{name}', weights='DEFAULT')\"`, and copy {path.name} to "
            f"{path.parent} (or point TORCH_HOME at a cache that has it)"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise click.ClickException(f"--pretrained: cannot read {path} ({exc}); delete it and fetch it again") from None
    own = model.state_dict()
    if not isinstance(state, Mapping) or any(key not in state for key in own if not key.endswith("num_batches_tracked")):
        missing = [key for key in own if not isinstance(state, Mapping) or key not in state][:5]
        raise click.ClickException(
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


# -- checkpoints ------------------------------------------------------------------------


def save_checkpoint(path: Path | str, doc: Mapping[str, Any]) -> None:
    """Write ``doc`` with torch.save, atomically: a reader (or a restart after SIGKILL) sees the old file or the new.

    At a URL the whole checkpoint goes up in one PUT (or one multipart upload),
    which object stores make visible only when complete: atomic there too."""
    if isinstance(path, str):
        data = io.BytesIO()
        torch.save(dict(doc), data)
        fs, key = _checkpoint_fs(path)
        try:
            with_retries(f"saving {path}", lambda: fs.pipe_file(key, data.getvalue()), path)
        except (StorageDenied, StorageUnavailable) as exc:
            raise CheckpointError(f"cannot save the checkpoint: {exc}") from None
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            torch.save(dict(doc), fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
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


def _checkpoint_fs(url: str) -> tuple[Any, str]:
    try:
        return filesystem(url)
    except LocationError as exc:
        raise CheckpointError(f"--checkpoint-dir: {exc}") from None


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
            f"{path}: cannot read the checkpoint ({' '.join(str(exc).split())[:300]}); delete it to train from "
            "scratch, or point --checkpoint-dir at an intact one"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: not a prefetchd-train checkpoint (no format {CHECKPOINT_FORMAT!r})")
    if doc.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint version {doc.get('version')!r}; this prefetchd-train reads version "
            f"{CHECKPOINT_VERSION}"
        )
    return doc


def _rng_state(device: torch.device) -> dict[str, Any]:
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


def _set_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda"):
        torch.cuda.set_rng_state_all(state["cuda"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["keys"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        ("MT19937", npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["gauss"])
    )


# -- spawning daemons ---------------------------------------------------------------------


@dataclass
class SpawnedDaemon:
    """A `prefetchd start` process this trainer started."""

    proc: subprocess.Popen[bytes]
    buffer: Path
    started: float  # time.time() at the start: a manifest older than this is an earlier daemon's
    streams: tuple[Path, ...] = ()  # the stream directories it serves; () is the buffer itself
    command: tuple[str, ...] = ()  # how it was started, to start it again
    split: str = "train"
    restarts: deque[float] = field(default_factory=deque)  # time.monotonic() of each restart

    def wait_ready(self, timeout: float) -> None:
        """Wait until the daemon owns the buffer and has written its manifests; say so if it died first."""
        proc, buffer = self.proc, self.buffer
        deadline = time.monotonic() + timeout
        manifests = [d / MANIFEST_NAME for d in (self.streams or (buffer,))]
        while True:
            code = proc.poll()
            if code is not None:
                command = " ".join(str(a) for a in proc.args) if isinstance(proc.args, list) else str(proc.args)
                raise click.ClickException(
                    f"the daemon started for {buffer} exited with code {code} before serving it (its message is "
                    f"above); the command was: {command}"
                )
            try:
                fresh = all(m.stat().st_mtime >= self.started - 0.05 for m in manifests)
            except FileNotFoundError:
                fresh = False
            if fresh and daemon_pid(buffer) == proc.pid:
                return
            if time.monotonic() >= deadline:
                raise click.ClickException(
                    f"the daemon started for {buffer} (pid {proc.pid}) wrote no manifest within {timeout:g} s; it "
                    "may still be indexing a large dataset: pass a larger --timeout"
                )
            time.sleep(0.05)

    def restart(self, cause: LoaderError, limit: int, timeout: float, echo: Callable[[str], None]) -> None:
        """Replace this daemon (dead, or stuck: it is killed) with a new one on the same buffer and wait
        until it serves; the new one resumes from progress.json, so the trainer goes on where it was.

        Raises DaemonRestartsExhausted when ``limit`` restarts within RESTART_WINDOW_SECONDS are spent.
        """
        what = "is stuck" if isinstance(cause, DaemonStuck) else "is gone"
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > RESTART_WINDOW_SECONDS:
            self.restarts.popleft()
        if len(self.restarts) >= limit:
            spent = (f"it was restarted {len(self.restarts)} times within {RESTART_WINDOW_SECONDS:.0f} s, the most "
                     f"--daemon-restarts {limit} allows" if limit else "--daemon-restarts 0 allows no restart")
            raise DaemonRestartsExhausted(
                f"the {self.split} daemon this trainer started for {self.buffer} (pid {self.proc.pid}) {what} and "
                f"{spent}; giving up rather than restarting it in a loop. Its own messages are above; the last "
                f"failure: {' '.join(str(cause).split())}. Fix the cause, then continue with --resume (and a "
                "--checkpoint-dir)"
            ) from cause
        self.stop(DAEMON_KILL_SECONDS)  # dead or stuck: not worth the graceful wait
        self.restarts.append(now)
        echo(f"prefetchd-train: the {self.split} daemon for {self.buffer} (pid {self.proc.pid}) {what}; restarting "
             f"it ({len(self.restarts)} of at most {limit} restarts within {RESTART_WINDOW_SECONDS:.0f} s)")
        logger.warning("%s", " ".join(str(cause).split()))
        self.started = time.time()
        self.proc = subprocess.Popen(list(self.command), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        self.wait_ready(timeout)
        echo(f"prefetchd-train: the {self.split} daemon for {self.buffer} runs again (pid {self.proc.pid}); "
             "continuing from the same batch")

    def stop(self, seconds: float = DAEMON_STOP_SECONDS) -> None:
        if stop_daemon_process(self.proc, seconds):
            logger.warning("the daemon (pid %d) did not stop within %g s of SIGTERM; killed it", self.proc.pid, seconds)


def spawn_daemon(buffer: Path, data: Path | str, split: str, config: TrainConfig,
                 echo: Callable[[str], None], ranks: Ranks | None = None) -> SpawnedDaemon | None:
    """Start `prefetchd start` for ``buffer`` unless a daemon owns it already.

    Under torchrun the daemon produces the streams of every rank on this box
    (``--world-size``, ``--ranks``) with one worker pool.  Returns at once, so
    several daemons start up side by side; then :meth:`SpawnedDaemon.wait_ready`.
    """
    pid = daemon_pid(buffer)
    if pid is not None:
        echo(f"prefetchd-train: {buffer} is served by the running daemon (pid {pid}); not starting another")
        return None
    cmd = [sys.executable, "-m", "prefetchd", "start", "--buffer", str(buffer), "--data", str(data),
           "--split", split, "--seed", str(config.seed), "--log-level", "warning"]
    if config.epochs is not None:
        cmd += ["--epochs", str(config.epochs)]
    streams: tuple[Path, ...] = ()
    if ranks is not None and ranks.distributed:
        cmd += ["--world-size", str(ranks.world_size), "--ranks", ranks.ranks_flag()]
        streams = tuple(stream_dir(buffer, r, ranks.world_size) for r in ranks.local_ranks)
    for flag, value in (("--batch-size", config.batch_size), ("--image-size", config.image_size),
                        ("--workers", config.workers), ("--high-water", config.high_water)):
        if value is not None:
            cmd += [flag, str(value)]
    started = time.time()
    # The daemon's warnings and errors go to our stderr. It is not tied to us: if we are
    # killed it keeps filling the buffer, and a restarted trainer finds it ready.
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    if not config.quiet:
        served = f", ranks {ranks.ranks_flag()} of {ranks.world_size}" if streams and ranks is not None else ""
        echo(f"prefetchd-train: started the {split} daemon for {buffer} (pid {proc.pid}) on {data}{served}")
    return SpawnedDaemon(proc, buffer, started, streams=streams, command=tuple(cmd), split=split)


def _check_spawn_options(config: TrainConfig) -> None:
    spawn_only = {"data": "--data", "val_data": "--val-data", "batch_size": "--batch-size",
                  "image_size": "--image-size", "workers": "--workers", "high_water": "--high-water"}
    if not config.spawn_daemon:
        given = [flag for key, flag in spawn_only.items() if getattr(config, key) is not None]
        if given:
            raise click.UsageError(f"{', '.join(given)} configure the daemon that --spawn-daemon starts; add "
                                   "--spawn-daemon, or pass them to `prefetchd start`")
        return
    if config.data is None:
        raise click.UsageError("--spawn-daemon needs --data ROOT (the class-folder dataset to serve)")
    if config.epochs is None:
        raise click.UsageError("--spawn-daemon needs --epochs N (the daemon produces that many epochs)")


def _check_served_job(config: TrainConfig, loader: BufferLoader, data: Path | str | None) -> None:
    """With --spawn-daemon a daemon that was already running must serve what the flags ask for."""
    m = loader.manifest
    wrong = []
    if data is not None and normalize(m.dataset_root) != normalize(data) and (
            isinstance(data, str) or Path(m.dataset_root).resolve() != data.resolve()):
        wrong.append(f"dataset {m.dataset_root}, not {data}")
    if config.batch_size is not None and m.batch_size != config.batch_size:
        wrong.append(f"batch size {m.batch_size}, not {config.batch_size}")
    if config.image_size is not None and m.image_size != config.image_size:
        wrong.append(f"image size {m.image_size}, not {config.image_size}")
    if wrong:
        raise click.ClickException(
            f"the daemon serving {loader.buffer} produces {'; '.join(wrong)}. Stop it (`prefetchd stop --buffer "
            f"{owning_buffer(loader.buffer)}`) to let --spawn-daemon start the job asked for, or drop the differing "
            "flags"
        )


# -- the run ------------------------------------------------------------------------------


class _Checkpointer:
    """Saves DIR/last.pt every N steps and at every epoch's end."""

    def __init__(self, config: TrainConfig) -> None:
        where = config.checkpoint_dir
        self.path: Path | str | None = (None if where is None else f"{where}/{LAST_CHECKPOINT}" if isinstance(where, str)
                                        else where / LAST_CHECKPOINT)
        self.every = config.checkpoint_every

    def due(self, global_step: int) -> bool:
        return self.path is not None and self.every is not None and global_step % self.every == 0

    def save(self, doc: Mapping[str, Any]) -> None:
        if self.path is not None:
            save_checkpoint(self.path, doc)


def train(
    config: TrainConfig, echo: Callable[[str], None] = click.echo, should_stop: Callable[[], bool] | None = None,
    ranks: Ranks | None = None,
) -> dict[str, Any]:
    """Run the whole training; returns the metrics document (also written to ``metrics_json``).

    ``should_stop`` is asked after every training step; True ends the run there,
    with a checkpoint, as ``--max-steps`` does (``main`` wires it to SIGTERM).
    ``ranks`` defaults to what torchrun's environment says (one rank without it).
    """
    if config.optimizer not in OPTIMIZERS:
        raise click.UsageError(f"--optimizer {config.optimizer}: choose one of {', '.join(OPTIMIZERS)}")
    if config.resume and config.checkpoint_dir is None:
        raise click.UsageError("--resume continues from DIR/last.pt: pass --checkpoint-dir DIR")
    _check_spawn_options(config)
    ranks = ranks if ranks is not None else Ranks.from_env()
    if not ranks.is_main:
        echo = _silent  # rank 0 speaks for all; errors still surface on every rank as exceptions
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device, ranks)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    pin: PinMode = "none" if device.type != "cuda" else config.pin  # type: ignore[assignment]
    torch.manual_seed(config.seed)
    val_buffer = config.val_buffer
    if config.spawn_daemon and config.val_data is not None and val_buffer is None:
        val_buffer = config.buffer.with_name(config.buffer.name + "-val")

    with ExitStack() as stack:
        coll = Collective.start(ranks, device)
        stack.callback(coll.close)  # registered first: the group outlives everything below
        spawned: list[SpawnedDaemon] = []
        if config.spawn_daemon:
            assert config.data is not None  # _check_spawn_options
            wanted = [(config.buffer, config.data, "train")]
            if config.val_data is not None and val_buffer is not None:
                wanted.append((val_buffer, config.val_data, "val"))
            # One daemon per box serves all of its ranks: local rank 0 starts it, the others wait.
            for buffer, data, split in wanted if ranks.is_local_main else []:
                daemon = spawn_daemon(buffer, data, split, config, echo, ranks)
                if daemon is not None:
                    # Registered before the loaders: on the way out the loaders close (final progress) first.
                    stack.callback(daemon.stop)
                    spawned.append(daemon)
            for daemon in spawned:
                daemon.wait_ready(config.timeout)
            coll.barrier("the daemons local rank 0 starts", config.timeout + 60)
        stall = config.daemon_timeout or None
        train_loader = stack.enter_context(BufferLoader(
            wait_for_stream(config.buffer, ranks, config.timeout), device=device, timeout=config.timeout, pin=pin,
            stall_timeout=stall,
        ))
        val_loader = None
        if val_buffer is not None:
            val_loader = stack.enter_context(BufferLoader(
                wait_for_stream(val_buffer, ranks, config.timeout), device=device, timeout=config.timeout, pin=pin,
                stall_timeout=stall,
            ))
            if val_loader.classes != train_loader.classes:
                raise click.ClickException(
                    f"{val_buffer} has classes {val_loader.classes[:5]}... but {config.buffer} has "
                    f"{train_loader.classes[:5]}...; both daemons must serve the same class folders"
                )
        if config.spawn_daemon:
            _check_served_job(config, train_loader, config.data)
            if val_loader is not None and config.val_data is not None:
                _check_served_job(config, val_loader, config.val_data)
        epochs = _resolve_epochs(config, train_loader, val_loader)
        _check_equal_steps(coll, train_loader, val_loader, epochs)
        run = _Run(config, device, train_loader, val_loader, epochs, val_buffer, echo, coll)
        if should_stop is not None:
            run.should_stop = should_stop
        if config.spawn_daemon and not ranks.distributed:
            # Under torchrun the other ranks would give up on the daemon while local rank 0 restarts it:
            # there a lost daemon ends the run, and --resume continues it.
            run.recover = _restarter(spawned, config, echo)
        metrics = run.run()
        if config.spawn_daemon and ranks.distributed:
            # Every rank has consumed its last batch before local rank 0 stops the daemon.
            train_loader.close()
            if val_loader is not None:
                val_loader.close()
            coll.barrier("the end of training", config.timeout + 60)
        return metrics


def _silent(_: str) -> None:
    pass


def _restarter(spawned: list[SpawnedDaemon], config: TrainConfig, echo: Callable[[str], None]) -> Recover:
    """``recover`` for the run: restart the daemon this trainer started for the loader's buffer."""
    ours = {d.buffer.resolve(): d for d in spawned}

    def recover(loader: BufferLoader, exc: LoaderError) -> bool:
        buffer = owning_buffer(loader.buffer).resolve()
        daemon = ours.get(buffer)
        if daemon is None:
            return False  # served by a daemon someone else runs: theirs to restart
        owner = daemon_pid(buffer)
        if owner is not None and owner != daemon.proc.pid:
            return False  # another daemon took the buffer over; never kill what is not ours
        daemon.restart(exc, config.daemon_restarts, config.timeout, echo)
        return True

    return recover


def _check_equal_steps(coll: Collective, train: BufferLoader, val: BufferLoader | None, epochs: int) -> None:
    """DDP hangs unless every rank runs the same steps: the daemon pads the ranks' shares, this checks it."""
    mine = (len(train), len(val) if val is not None else None, epochs)
    every = coll.all_gather(mine)
    if any(other != mine for other in every):
        table = "; ".join(f"rank {r}: {t} train steps, {v} val steps, {e} epochs" for r, (t, v, e) in enumerate(every))
        raise click.ClickException(
            f"the ranks would run different numbers of steps ({table}), and DDP would hang at the end; all ranks "
            "must read streams of one daemon job per buffer (the same --world-size, dataset and --batch-size)"
        )


class _Run:
    def __init__(self, config: TrainConfig, device: torch.device, train_loader: BufferLoader,
                 val_loader: BufferLoader | None, epochs: int, val_buffer: Path | None,
                 echo: Callable[[str], None], coll: Collective | None = None) -> None:
        self.config, self.device, self.epochs, self.echo = config, device, epochs, echo
        self.train_loader, self.val_loader, self.val_buffer = train_loader, val_loader, val_buffer
        self.coll = coll if coll is not None else Collective(Ranks())
        self.ranks = self.coll.ranks
        classes = train_loader.classes
        self.k = max(1, min(TOP_K, len(classes)))
        model = build_model(config.model, len(classes), config.pretrained, echo)
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
        self.checkpointer = _Checkpointer(config)
        self.per_epoch: list[dict[str, Any]] = []
        self.epoch = 0
        self.global_step = 0
        self.partial: PassState | None = None  # sums of the train pass a checkpoint interrupted
        self.epoch_lr: float | None = None
        self.resumed_from: dict[str, Any] | None = None
        self.should_stop: Callable[[], bool] = lambda: False
        self.recover: Recover | None = None  # replaces a dead or stuck daemon (--spawn-daemon)
        self.stop_reason: str | None = None

    # -- checkpoint documents

    def _rank_state(self, partial: PassState | None) -> dict[str, Any]:
        """What differs between ranks: the loaders' positions, the pass's sums so far, the RNG."""
        return {
            "loaders": {
                "train": self.train_loader.state_dict(),
                "val": self.val_loader.state_dict() if self.val_loader is not None else None,
            },
            "partial": asdict(partial) if partial is not None else None,
            "rng": _rng_state(self.device),
        }

    def _save(self, partial: PassState | None) -> None:
        """Write the checkpoint (rank 0) with every rank's state; collective: every rank calls it at the same step."""
        if self.checkpointer.path is None:
            return
        states = self.coll.gather(self._rank_state(partial))
        if states is not None:
            self.checkpointer.save(self._doc(states))

    def _doc(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        doc = {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "config": _plain_config(self.config),
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
        saved_world = int(doc.get("world_size", 1))
        if saved_world != self.ranks.world_size:
            how = f"under torchrun with {saved_world} processes in all" if saved_world > 1 else "without torchrun"
            raise CheckpointError(
                f"{path}: the checkpoint was taken with {saved_world} rank(s), this run has "
                f"{self.ranks.world_size}; every rank continues its own stream from its saved position, so "
                f"resume {how}, or use another --checkpoint-dir"
            )
        mine = doc["ranks"][self.ranks.rank] if self.ranks.distributed else doc
        saved = doc.get("config") or {}
        for key in _RESUME_FIXED:
            if key in saved and saved[key] != getattr(self.config, key):
                raise CheckpointError(
                    f"{path}: the checkpoint was taken with --{key} {saved[key]}, this run has --{key} "
                    f"{getattr(self.config, key)}; resume with the checkpoint's settings or use another --checkpoint-dir"
                )
        changed = [f"{k}: {saved[k]!r} -> {v!r}" for k, v in _plain_config(self.config).items()
                   if k in saved and saved[k] != v and k not in ("resume", "quiet", "max_steps", "threads")]
        if changed and self.ranks.is_main:
            logger.warning("resuming %s with changed settings: %s", path, "; ".join(changed))
        try:
            self.net.load_state_dict(doc["model"])
            self.optimizer.load_state_dict(doc["optimizer"])
            self.scheduler.load_state_dict(doc["scheduler"])
        except (KeyError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{path}: does not fit this run ({' '.join(str(exc).split())[:300]})") from None
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
        _set_rng_state(mine["rng"], self.device)
        position = self.train_loader.position
        self.resumed_from = {"epoch": self.epoch, "global_step": self.global_step, "position": list(position)}
        self.echo(f"prefetchd-train: resumed from {path}: epoch {self.epoch + 1}, global step {self.global_step}, "
                  f"next batch epoch {position[0]} step {position[1]}")

    # -- the loop

    def run(self) -> dict[str, Any]:
        config, echo = self.config, self.echo
        if config.resume:
            self._restore()
        m = self.train_loader.manifest
        if not config.quiet:
            echo(
                f"prefetchd-train: {config.model} on {self.device}, {len(self.train_loader.classes)} classes, "
                f"{len(self.train_loader)} steps of {m.batch_size} x {m.image_size}px per epoch, {self.epochs} epochs, "
                f"{config.optimizer} lr {config.peak_lr:g}, buffer {config.buffer} (pin {self.train_loader.pin})"
                + (f", val buffer {self.val_buffer}" if self.val_buffer else "")
                + (f"; {self.ranks.world_size} ranks ({self.coll.backend}), each on its own stream, figures summed "
                   "over the ranks" if self.ranks.distributed else "")
            )
        run_start = time.perf_counter()
        stopped = False
        while self.epoch < self.epochs and not stopped:
            stopped = self._epoch()
        total_s = time.perf_counter() - run_start
        metrics = self._metrics(total_s, finished=not stopped)
        if stopped:
            saved = f", checkpoint {self.checkpointer.path}" if self.checkpointer.path is not None else ""
            echo(f"stopped after global step {self.global_step} ({self.stop_reason}{saved}); continue with --resume")
        else:
            val_top1 = metrics["final_val_top1"]
            echo(
                f"done: {metrics['train_images']} training images in {total_s:.1f} s, final val top-1 "
                + (f"{val_top1:.2%}" if val_top1 is not None else "-")
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
            if config.max_steps is not None and self.global_step >= config.max_steps:
                self.stop_reason = "--max-steps"
            elif terminated:
                self.stop_reason = "SIGTERM"
            stop = self.stop_reason is not None
            if stop or self.checkpointer.due(self.global_step):
                self._save(snapshot())
            return stop

        if self.train_loader.position[0] == epoch:
            tr = run_pass(
                self.model, self.train_loader, self.criterion,
                _ProgressLine(sys.stderr, f"{tag} train", len(self.train_loader), self._progress_shown),
                self.optimizer, self.scheduler,
                topk=self.k, amp=config.amp, start=self.partial, after_step=after_step, recover=self.recover,
            )
        else:  # the checkpoint was taken after the pass's last step
            tr = _stats(self.partial or PassState(), self.k)
        self.partial = None
        if tr.stopped:
            return True
        va = None
        if self.val_loader is not None:
            if self.val_loader.position != (epoch, 0):
                self.val_loader.load_state_dict({**self.val_loader.state_dict(), "epoch": epoch, "step": 0})
            # The bare model: evaluation needs no gradient averaging, so no collective runs in it.
            va = run_pass(
                self.net, self.val_loader, self.criterion,
                _ProgressLine(sys.stderr, f"{tag} val", len(self.val_loader), self._progress_shown),
                topk=self.k, amp=config.amp, recover=self.recover,
            )
        epoch_s = time.perf_counter() - wall + resumed_s
        wait_s = tr.wait_seconds + (va.wait_seconds if va else 0.0)
        tr, va, epoch_s, wait_s, wait_share_max = self._over_ranks(tr, va, epoch_s, wait_s)
        k = self.k
        row: dict[str, Any] = {
            "epoch": epoch,
            "lr": self.epoch_lr,
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
            "cuda_max_memory_mib": (torch.cuda.max_memory_allocated(device) / 2**20
                                    if device.type == "cuda" else None),
            "global_step": self.global_step,
        }
        if self.ranks.distributed:
            row["data_wait_share_max"] = wait_share_max
        self.per_epoch.append(row)
        self.epoch += 1
        val_text = f"val loss {va.loss:.4f} top-1 {va.top1:6.2%} top-{k} {va.topk:6.2%}" if va else "val -"
        memory = f"  cuda max {row['cuda_max_memory_mib']:.0f} MiB" if row["cuda_max_memory_mib"] is not None else ""
        self.echo(
            f"{tag}  train loss {tr.loss:.4f} top-1 {tr.top1:6.2%} top-{k} {tr.topk:6.2%}  {val_text}  "
            f"{row['images_per_s']:.1f} img/s  data-wait {row['data_wait_share']:.1%}{memory}"
        )
        self._save(None)
        self._write_metrics(self._metrics(None, finished=False))
        return False

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
        tr = _stats(reduced[0], tr.k, tr.stopped)
        va = _stats(reduced[1], va.k, va.stopped) if va is not None else None
        return tr, va, maxima[-2], tr.wait_seconds + (va.wait_seconds if va else 0.0), maxima[-1]

    # -- metrics

    def _metrics(self, total_s: float | None, finished: bool) -> dict[str, Any]:
        rows = self.per_epoch
        total_wait = sum(r["data_wait_s"] for r in rows)
        epochs_s = sum(r["epoch_s"] for r in rows)
        train_images = sum(r["train_images"] for r in rows)
        train_s = sum(r["train_s"] for r in rows)
        final = rows[-1] if rows else {}
        return {
            "format": METRICS_FORMAT,
            "version": METRICS_VERSION,
            "config": _plain_config(self.config),
            "device": str(self.device),
            "pin": self.train_loader.pin,
            "world_size": self.ranks.world_size,
            "num_epochs": self.epochs,
            "top_k": self.k,
            "finished": finished,
            "resumed_from": self.resumed_from,
            "stopped_by": self.stop_reason,
            "global_steps": self.global_step,
            "epochs": [{k: (_finite(v) if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
            "final_train_top1": _finite(final["train_top1"]) if final else None,
            "final_val_top1": _finite(final["val_top1"]) if final.get("val_top1") is not None else None,
            f"final_val_top{self.k}": (_finite(final[f"val_top{self.k}"])
                                      if final.get(f"val_top{self.k}") is not None else None),
            "train_images": train_images,
            "data_wait_share": min(1.0, total_wait / epochs_s) if epochs_s > 0 else 0.0,
            "images_per_s": train_images / train_s if train_s > 0 else 0.0,
            "total_s": total_s if total_s is not None else epochs_s,
            "cuda_max_memory_mib": max((r["cuda_max_memory_mib"] or 0.0 for r in rows), default=None)
            if self.device.type == "cuda" else None,
        }

    def _write_metrics(self, metrics: dict[str, Any]) -> None:
        if not self.ranks.is_main:
            return
        if self.config.metrics_json is not None:
            _write_json(self.config.metrics_json, metrics)
        if self.config.metrics_csv is not None:
            _write_csv(self.config.metrics_csv, metrics["epochs"])


def _plain_config(config: TrainConfig) -> dict[str, Any]:
    return {f.name: (str(v) if isinstance(v := getattr(config, f.name), Path) else v) for f in fields(config)}


def _write_atomic(path: Path, text: str) -> None:
    # Atomic, so a dashboard polling the file never reads half a document.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    _write_atomic(path, json.dumps(doc, indent=1, allow_nan=False) + "\n")


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """One row per finished epoch, rewritten whole after each (a resumed run's file continues the same rows)."""
    out = io.StringIO()
    columns = list(rows[0]) if rows else ["epoch"]
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in columns})
    _write_atomic(path, out.getvalue())


# -- CLI ----------------------------------------------------------------------------

_D = TrainConfig  # defaults
_DIR = click.Path(file_okay=False, path_type=Path)


class _Location(click.ParamType):  # type: ignore[type-arg]
    """A local folder (a Path) or an object-storage URL (kept as a string: Path would fold its '//')."""

    name = "DIR|URL"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path | str:
        if isinstance(value, (str, os.PathLike)) and is_url(os.fspath(value)):
            return normalize(value)
        path: Path = _DIR.convert(value, param, ctx)
        return path


_LOCATION = _Location()
_FILE = click.Path(dir_okay=False, path_type=Path)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--buffer", type=click.Path(path_type=Path), required=True, help="Training buffer (the daemon's --buffer).")
@click.option("--val-buffer", type=click.Path(path_type=Path), default=None, help="Buffer of a --split val daemon; evaluated after every epoch.")
@click.option("--epochs", type=click.IntRange(min=1), default=None, help="Epochs to train  [default: the manifest's epochs]")
@click.option("--model", default=_D.model, show_default=True, help="A torchvision classification model name.")
@click.option("--pretrained", is_flag=True, help="Start from torchvision's default weights, if they are in the local torch hub cache (never downloads).")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default=_D.optimizer, show_default=True)
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=None, help="Peak learning rate  [default: 0.05 for sgd, 0.001 for adamw]")
@click.option("--momentum", type=float, default=_D.momentum, show_default=True, help="SGD momentum.")
@click.option("--weight-decay", type=click.FloatRange(min=0), default=None, help="[default: 5e-4 for sgd, 0.05 for adamw]")
@click.option("--warmup-epochs", type=click.FloatRange(min=0), default=_D.warmup_epochs, show_default=True, help="Linear warmup to the peak lr, then cosine to 0 (per step).")
@click.option("--label-smoothing", type=click.FloatRange(min=0, max=1, max_open=True), default=_D.label_smoothing, show_default=True)
@click.option("--amp", is_flag=True, help="bf16 autocast (meant for CUDA; allowed on the CPU).")
@click.option("--seed", type=int, default=_D.seed, show_default=True, help="Model initialisation; also the --seed of spawned daemons.")
@click.option("--device", default=_D.device, show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--pin", type=click.Choice(PIN_MODES), default=_D.pin, show_default=True, help="How batches reach a CUDA device (auto = staging).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=_D.timeout, show_default=True, help="Seconds to wait for the manifest and for each batch, whatever the daemon's state.")
@click.option("--daemon-timeout", type=click.FloatRange(min=0), default=_D.daemon_timeout, show_default=True, help="Seconds without a heartbeat from the daemon that owns a buffer before it counts as stuck (0: never); a dead daemon is noticed within 5 s.")
@click.option("--daemon-restarts", type=click.IntRange(min=0), default=_D.daemon_restarts, show_default=True, help="With --spawn-daemon: restart a daemon that died or got stuck up to N times within 10 minutes, then stop with an error.")
@click.option("--metrics-json", type=_FILE, default=None, help="Write per-epoch and final metrics here (after every epoch).")
@click.option("--metrics-csv", type=_FILE, default=None, help="Write one CSV row per epoch here (after every epoch).")
@click.option("--checkpoint-dir", type=_LOCATION, default=None, help="Save DIR/last.pt at every epoch's end (and see --checkpoint-every); DIR may be a URL such as s3://bucket/run1 (needs prefetchd[s3]; credentials from the standard AWS environment and files).")
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=None, help="Also save every N training steps.")
@click.option("--resume", is_flag=True, help="Continue from DIR/last.pt of --checkpoint-dir (from scratch if there is none).")
@click.option("--max-steps", type=click.IntRange(min=1), default=None, help="Stop after this many training steps in all (resumed runs included), saving a checkpoint.")
@click.option("--spawn-daemon", is_flag=True, help="Start `prefetchd start` for the buffers no daemon serves, and stop it at the end.")
@click.option("--data", type=_LOCATION, default=None, help="With --spawn-daemon: the training class folders (a folder or a URL).")
@click.option("--val-data", type=_LOCATION, default=None, help="With --spawn-daemon: validation class folders (buffer: --val-buffer, else BUFFER-val).")
@click.option("--batch-size", type=click.IntRange(min=1), default=None, help="With --spawn-daemon: the daemons' --batch-size.")
@click.option("--image-size", type=click.IntRange(min=1), default=None, help="With --spawn-daemon: the daemons' --image-size.")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="With --spawn-daemon: the daemons' --workers.")
@click.option("--high-water", type=click.IntRange(min=1), default=None, help="With --spawn-daemon: the daemons' --high-water.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch.set_num_threads for the trainer.")
@click.option("--quiet", "-q", is_flag=True, help="No start line and no progress display (per-epoch lines stay).")
@click.option("--verbose", "-v", is_flag=True, help="Log the loader's waits (INFO).")
def main(verbose: bool, **options: Any) -> None:
    """Train a torchvision model on the batches a prefetchd daemon writes into --buffer.

    Under torchrun (`torchrun --nproc-per-node N -m prefetchd.trainer.train ...`) each rank reads its own
    stream of the buffers, which the daemons produce with --world-size.
    """
    ranks = Ranks.from_env()
    name = f"prefetchd-train[rank {ranks.rank}]" if ranks.distributed else "prefetchd-train"
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format=f"{name}: %(levelname)s %(name)s: %(message)s"
    )
    config = TrainConfig(**options)
    terminations: list[int] = []

    def on_sigterm(signum: int, frame: object) -> None:
        # The first SIGTERM only asks: the run stops after the step in progress, with a
        # checkpoint, and spawned daemons are stopped on the way out. A second one does not wait.
        terminations.append(signum)
        if len(terminations) > 1:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        metrics = train(config, should_stop=lambda: bool(terminations), ranks=ranks)
    except (LoaderError, ProtocolError) as exc:
        click.echo(f"{name}: {' '.join(str(exc).split())}", err=True)
        sys.exit(EXIT_BUFFER)
    except CheckpointError as exc:
        click.echo(f"{name}: {' '.join(str(exc).split())}", err=True)
        sys.exit(EXIT_FAILED)
    except KeyboardInterrupt:
        click.echo(f"{name}: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if metrics["stopped_by"] == "SIGTERM":
        sys.exit(EXIT_TERMINATED)


__all__ = [
    "CHECKPOINT_FORMAT", "EXIT_BUFFER", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_TERMINATED", "LAST_CHECKPOINT",
    "PassState",
    "PassStats", "TrainConfig", "build_model", "load_checkpoint", "main", "run_pass", "save_checkpoint",
    "Ranks", "SpawnedDaemon", "spawn_daemon", "train", "warmup_cosine",
]


if __name__ == "__main__":
    main()
