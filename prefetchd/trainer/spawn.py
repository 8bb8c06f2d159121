"""Daemons this trainer starts (``--spawn-daemon``): start, wait until they serve, restart, stop.

The trainer never imports the daemon: it runs the ``prefetchd start`` command
line, the same a user would type.  A spawned daemon is not tied to the
trainer: if the trainer is killed it keeps filling the buffer, and a restarted
trainer finds it ready.  One that dies or gets stuck during the run is
restarted (``--daemon-restarts`` times within ``RESTART_WINDOW_SECONDS``) and
resumes from progress.json, so the run goes on with the same batch.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prefetchd.buffer_protocol import daemon_owner, stream_dir
from prefetchd.buffer_protocol.layout import DEFAULT_CONSUMER, MANIFEST_NAME, owning_buffer, progress_name
from prefetchd.launch import LaunchError, launch, signals_held, start_argv, stop_daemon_process, wait_ready
from prefetchd.locations import normalize
from prefetchd.trainer.config import TrainConfig
from prefetchd.trainer.passes import Recover
from prefetchd.trainer.errors import DaemonRestartsExhausted, DaemonStuck, LoaderError, OptionError, SetupError
from prefetchd.trainer.loader import BufferLoader
from prefetchd.trainer.ranks import Ranks
from prefetchd.words import agreeing, counted

logger = logging.getLogger(__name__)

DAEMON_STOP_SECONDS = 30.0
DAEMON_KILL_SECONDS = 5.0  # a dead or stuck daemon gets this long after SIGTERM before SIGKILL
RESTART_WINDOW_SECONDS = 600.0  # --daemon-restarts counts the restarts within this window
# The TrainConfig fields that configure the daemon --spawn-daemon starts, and nothing else.
SPAWN_ONLY = ("data", "val_data", "batch_size", "image_size", "workers", "high_water", "drop_last", "reset")


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
        try:
            wait_ready(self.proc, self.buffer, since=self.started, timeout=timeout, streams=self.streams,
                       more_time="pass a larger --timeout")
        except LaunchError as exc:
            raise SetupError(str(exc)) from None

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
            spent = (f"it was restarted {counted(len(self.restarts), 'time')} within {RESTART_WINDOW_SECONDS:.0f} s, the most "
                     f"--daemon-restarts {limit} allows" if limit else "--daemon-restarts 0 allows no restart")
            raise DaemonRestartsExhausted(
                f"the {self.split} daemon this trainer started for {self.buffer} (pid {self.proc.pid}) {what} and "
                f"{spent}; giving up rather than restarting it in a loop. Its own messages, if it wrote any (a killed "
                f"daemon writes none), are above; the last "
                f"failure: {' '.join(str(cause).split())}. Fix the cause, then continue with --resume (and a "
                "--checkpoint-dir)"
            ) from cause
        self.stop(DAEMON_KILL_SECONDS)  # dead or stuck: not worth the graceful wait
        self.restarts.append(now)
        echo(f"prefetchd-train: the {self.split} daemon for {self.buffer} (pid {self.proc.pid}) {what}; restarting "
             f"it ({len(self.restarts)} of at most {limit} restarts within {RESTART_WINDOW_SECONDS:.0f} s)")
        # The loader's words (with its "Restart it with `prefetchd start ...`") are for whoever runs the daemon: here, us.
        logger.info("%s", " ".join(str(cause).split()))
        self.started = time.time()
        with signals_held():  # its stop is registered: the one of ``self.proc``, which must be this one
            self.proc = launch(self.command, stdout=subprocess.DEVNULL)
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
    owner = daemon_owner(buffer)
    if owner is not None:
        echo(f"prefetchd-train: {buffer} is served by the running daemon ({owner}); not starting another")
        return None
    options: dict[str, object] = {"data": data, "split": split, "seed": config.seed, "log_level": "warning",
                                  "epochs": config.epochs}
    streams: tuple[Path, ...] = ()
    if ranks is not None and ranks.distributed:
        options.update(world_size=ranks.world_size, ranks=ranks.ranks_flag())
        streams = tuple(stream_dir(buffer, r, ranks.world_size) for r in ranks.local_ranks)
    options.update(batch_size=config.batch_size, image_size=config.image_size, workers=config.workers,
                   high_water=config.high_water, reset=config.reset or None)
    if split == "train" and config.drop_last:  # validation sees every sample
        options["drop_last"] = True
    if not config.resume:
        # A fresh run starts at epoch 0.  A finished run's position left in the buffer would have the
        # new daemon find every epoch consumed and exit at once with nothing to produce.
        for directory in streams or (buffer,):
            try:
                (directory / progress_name(config.consumer or DEFAULT_CONSUMER)).unlink(missing_ok=True)
            except OSError:
                pass  # not ours to remove: the daemon says what it finds
    cmd = start_argv(buffer, options)
    started = time.time()
    # The daemon's warnings and errors go to our stderr. It is not tied to us: if we are
    # killed it keeps filling the buffer, and a restarted trainer finds it ready.
    proc = launch(cmd, stdout=subprocess.DEVNULL)
    if not config.quiet:
        served = f", ranks {ranks.ranks_flag()} of {ranks.world_size}" if streams and ranks is not None else ""
        echo(f"prefetchd-train: starting the {split} daemon for {buffer} (pid {proc.pid}) on {data}{served}")
    return SpawnedDaemon(proc, buffer, started, streams=streams, command=tuple(cmd), split=split)


def check_spawn_options(config: TrainConfig, ranks: Ranks | None = None) -> None:
    """The daemon flags need --spawn-daemon, and --spawn-daemon needs --data and --epochs, and --val-data
    for a --val-buffer no daemon serves yet; --val-buffer is never the training buffer."""
    if config.val_buffer is not None and config.val_buffer.resolve() == config.buffer.resolve():
        # Validating on the training batches measures nothing; with --spawn-daemon the second
        # daemon would find the buffer owned by the first and blame it.
        raise OptionError(f"--val-buffer {config.val_buffer} is the training --buffer {config.buffer}; a validation "
                          "daemon (--split val) needs a buffer of its own: pass another --val-buffer, or leave it out")
    if not config.spawn_daemon:
        given = ["--" + key.replace("_", "-") for key in SPAWN_ONLY if getattr(config, key) not in (None, False)]
        if given:
            raise OptionError(f"{', '.join(given)} {agreeing(len(given), 'configures', 'configure')} the daemon that "
                              f"--spawn-daemon starts; add --spawn-daemon, or pass {agreeing(len(given), 'it', 'them')} "
                              "to `prefetchd start`")
        return
    if config.data is None:
        raise OptionError("--spawn-daemon needs --data ROOT (the dataset to serve: class folders, a file list, "
                          "shards, local or at a URL)")
    if config.epochs is None:
        raise OptionError("--spawn-daemon needs --epochs N (the daemon produces that many epochs)")
    val = config.val_buffer
    if val is not None and config.val_data is None and daemon_owner(val) is None:
        world = f" --world-size {ranks.world_size} --ranks {ranks.ranks_flag()}" if ranks and ranks.distributed else ""
        raise OptionError(
            f"--val-buffer {val}: no daemon serves it, and --spawn-daemon starts one only with --val-data ROOT "
            f"(the validation dataset). Pass --val-data, or start it yourself: `prefetchd start --buffer {val} "
            f"--data ROOT --split val{world}`"
        )


def check_split(loader: BufferLoader, split: str, given: str) -> None:
    """A validation buffer must hold a --split val job, a training buffer a --split train one: a train
    split's batches are random crops and flips of the training data, and validating on them measures
    nothing; a val split's are centre crops in a fixed order, and training on them (held-out images, as
    likely as not) learns without augmentation or shuffling.  ``given``: how the user named the buffer (a
    flag, or BufferDataModule's argument)."""
    m = loader.manifest
    if m.split == split:
        return
    buffer = owning_buffer(loader.buffer)
    made, wanted, restart = {
        "val": ("random crops and flips", "validation batches", "with --split val"),
        "train": ("centre crops in a fixed order", "training batches", "without --split val"),
    }[split]
    flag = " --split val" if split == "val" else ""
    raise SetupError(
        f"{given} {buffer}: its daemon produces the {m.split} split of {m.dataset_root} ({made}, "
        f"{loader.buffer / MANIFEST_NAME}), not {wanted}. Restart it {restart} (`prefetchd stop --buffer {buffer}`, "
        f"then `prefetchd start --buffer {buffer} --data ROOT{flag} --reset ...`), or pass the buffer of your "
        f"--split {split} daemon"
    )


def check_same_classes(train: BufferLoader, val: BufferLoader) -> None:
    """Label k names the same class in the validation batches as in the training ones: the same classes, or the
    first of them (a validation list of integer labels whose largest is not there, a val tree without the last
    class folder: refused before, with two equal lists of the first five classes, a walk)."""
    t, v = train.classes, val.classes
    if v == t[:len(v)]:
        return
    k = next((i for i, (a, b) in enumerate(zip(t, v)) if a != b), len(t))
    which = (f"label {k} is class {v[k]!r} there and {t[k]!r} in training" if k < len(t) else
             f"label {k} and above ({v[k]!r}, ...) name classes the training data lacks")
    raise SetupError(
        f"{owning_buffer(val.buffer)} serves {counted(len(v), 'class')} and {owning_buffer(train.buffer)} "
        f"{counted(len(t), 'class')}: {which}. Both daemons must serve the same classes (class folders of the same "
        "names; file lists of the same labels)"
    )


def check_held_out(train: BufferLoader, val: BufferLoader) -> None:
    """The validation daemon's samples are none of the training daemon's.  Daemons on one dataset (the same
    indexed files: the same fingerprint) split it apart only with the same --val-fraction: a val side of 0.3
    holds the 0.2 one's and 20 of its training samples, and a training daemon with none trains on every sample.
    Both ran, and the trainer reported a validation accuracy measured on images it trained on (a walk)."""
    t, v = train.manifest, val.manifest
    if t.fingerprint != v.fingerprint or (v.val_fraction is not None and t.val_fraction == v.val_fraction):
        return
    held = f"--val-fraction {t.val_fraction:g}" if t.val_fraction is not None else "no --val-fraction (every sample)"
    kept = f"--val-fraction {v.val_fraction:g}" if v.val_fraction is not None else "no --val-fraction (every sample)"
    raise SetupError(
        f"{owning_buffer(val.buffer)}'s validation samples are training samples too: its daemon and "
        f"{owning_buffer(train.buffer)}'s serve the same dataset ({v.dataset_root}), the training one with {held} and "
        f"the validation one with {kept}. Start both with the same --val-fraction (its two sides never overlap), or "
        "validate on a folder of its own"
    )


def check_served_job(config: TrainConfig, loader: BufferLoader, data: Path | str | None,
                     starter: str = "--spawn-daemon", options: str = "flags") -> None:
    """With --spawn-daemon a daemon that was already running must serve what the flags ask for.
    ``starter`` and ``options``: how the caller's user asks for a daemon and names its settings
    (BufferDataModule's ``data=`` and arguments)."""
    m = loader.manifest
    wrong = []
    if data is not None and normalize(m.dataset_root) != normalize(data) and (
            isinstance(data, str) or Path(m.dataset_root).resolve() != data.resolve()):
        wrong.append(f"dataset {m.dataset_root}, not {data}")
    if config.batch_size is not None and m.batch_size != config.batch_size:
        wrong.append(f"batch size {m.batch_size}, not {config.batch_size}")
    if config.image_size is not None and m.image_size != config.image_size:
        wrong.append(f"image size {m.image_size}, not {config.image_size}")
    if config.drop_last and m.split == "train" and not m.drop_last:
        wrong.append("every epoch's short last batch, not --drop-last")
    if wrong:
        raise SetupError(
            f"the daemon serving {loader.buffer} produces {'; '.join(wrong)}. Stop it (`prefetchd stop --buffer "
            f"{owning_buffer(loader.buffer)}`) to let {starter} start the job asked for, or drop the differing "
            f"{options}"
        )


def restarter(spawned: list[SpawnedDaemon], config: TrainConfig, echo: Callable[[str], None]) -> Recover:
    """``recover`` for the run: restart the daemon this trainer started for the loader's buffer."""
    ours = {d.buffer.resolve(): d for d in spawned}

    def recover(loader: BufferLoader, exc: LoaderError) -> bool:
        buffer = owning_buffer(loader.buffer).resolve()
        daemon = ours.get(buffer)
        if daemon is None:
            return False  # served by a daemon someone else runs: theirs to restart
        owner = daemon_owner(buffer)
        if owner is not None and (not owner.here or owner.pid != daemon.proc.pid):
            return False  # another daemon took the buffer over; never kill what is not ours
        daemon.restart(exc, config.daemon_restarts, config.timeout, echo)
        return True

    return recover


__all__ = [
    "DAEMON_STOP_SECONDS", "SPAWN_ONLY", "SpawnedDaemon", "check_held_out", "check_served_job", "check_spawn_options", "check_split",
    "restarter",
    "spawn_daemon",
]
