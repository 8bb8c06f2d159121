"""The reference trainer behind ``prefetchd-train``: a torchvision model fed from a buffer.

This module is the run and its wiring (its command line, parsed before torch is imported, is
``command``); the rooms behind it are those
``prefetchd.trainer``'s docstring lists, each saying its own job.

Per epoch it prints loss, top-1, top-5, images/s and the *data-wait share*,
the fraction of the epoch spent inside the loaders' ``next()``: a share near
zero means the daemon keeps the model fed.

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

import dataclasses
import faulthandler
import logging
import os
import signal
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NoReturn

import click
import torch

from prefetchd.access import EXIT_NO_ACCESS
from prefetchd.buffer_protocol import ProtocolError
from prefetchd.launch import TERMINATION_SIGNALS, signals_held
from prefetchd.trainer.checkpoint import CheckpointPlan, existing_checkpoint
from prefetchd.trainer.collective import Collective, is_peer_failure, peer_failed
from prefetchd.trainer.command import main  # `python -m prefetchd.trainer.train`, as torchrun runs it
from prefetchd.trainer.config import OPTIMIZERS, TrainConfig
from prefetchd.trainer.model import check_model_name
from prefetchd.trainer.engine import Run
from prefetchd.trainer.preflight import (agree_on_checkpoints, agree_on_options, check_access, check_equal_steps,
                                        check_metrics_paths, resolve_device, resolve_epochs)
from prefetchd.trainer.errors import (CheckpointError, DaemonGone, DaemonStuck, LoaderError, NoAccess, OptionError,
                                      PeerFailed, SetupError)
from prefetchd.trainer.gpu import PinMode
from prefetchd.trainer.loader import BufferLoader
from prefetchd.trainer.ranks import Ranks, wait_for_stream
from prefetchd.trainer.spawn import (
    SpawnedDaemon, check_held_out, check_same_classes, check_served_job, check_spawn_options, check_split, restarter,
    spawn_daemon,
)

EXIT_OK = 0
EXIT_FAILED = 1  # a configuration problem found before training (SetupError), a bad checkpoint
EXIT_USAGE = 2  # a bad option value, options that contradict each other (OptionError); click's code for bad flags
EXIT_BUFFER = 3  # the buffer could not deliver: LoaderError / ProtocolError
# EXIT_NO_ACCESS (prefetchd.access): this user may not read --buffer or --val-buffer, nor write its progress there
# (NoAccess, at the start or mid-run: AccessLost), as `prefetchd status` and `show`
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # SIGTERM: stopped at a step boundary with a checkpoint (SIGHUP likewise: 129)
SIGNAL_NAMES = {signal.Signals(s).name for s in TERMINATION_SIGNALS}  # a metrics document's stopped_by


logger = logging.getLogger(__name__)


def warn_of_another_size(train_buffer: Path, train: BufferLoader, val_buffer: Path, val: BufferLoader) -> None:
    """Say so when validation batches are not the size training's are: a model validated at 224 px after
    training at 32 px scores chance, with nothing else to tell why (a val daemon started without the train
    daemon's --image-size).  Not refused: validating at a larger size on purpose is a known gain."""
    trained, validated = train.manifest.image_size, val.manifest.image_size
    if trained != validated:
        logger.warning(
            "%s serves %d x %d images but %s trains at %d x %d: the model is validated at another size than it "
            "is trained at. If that is not on purpose, start the validation daemon with --image-size %d",
            val_buffer, validated, validated, train_buffer, trained, trained, trained)


def train(
    config: TrainConfig, echo: Callable[[str], None] = click.echo, should_stop: Callable[[], bool] | None = None,
    ranks: Ranks | None = None, training: Callable[[], None] = lambda: None,
    stop_signal: Callable[[], str] | None = None,
) -> dict[str, Any]:
    """Run the whole training; returns the metrics document (also written to ``metrics_json``).

    ``should_stop`` is asked after every training step and while the run waits for a batch
    (under torchrun: on any rank, and the ranks stop together); True ends the run there, with a checkpoint, as
    ``--max-steps`` does (``main`` wires it to SIGTERM and SIGHUP); ``stop_signal`` names the signal then (the
    metrics' ``stopped_by``; SIGTERM without it, or where another rank's signal stopped this one).  ``training`` is called once the
    daemons, the loaders and the manifests are there, before the checkpoint is loaded.
    ``ranks`` defaults to what torchrun's environment says (one rank without it).
    """
    if config.optimizer not in OPTIMIZERS:
        raise OptionError(f"--optimizer {config.optimizer}: choose one of {', '.join(OPTIMIZERS)}")
    check_model_name(config.model)
    ranks = ranks if ranks is not None else Ranks.from_env()
    check_spawn_options(config, ranks)
    val_buffer = config.val_buffer
    if config.spawn_daemon and config.val_data is not None and val_buffer is None:
        val_buffer = config.buffer.with_name(config.buffer.name + "-val")
    check_access(config.buffer, val_buffer)
    if config.checkpoint_dir is None and ranks.is_main:  # the other ranks follow rank 0's
        if config.resume:
            raise OptionError("--resume continues from DIR/last.pt: pass --checkpoint-dir DIR")
        if config.checkpoint_every is not None:  # ran to the end and saved nothing (a user's walk)
            raise OptionError(f"--checkpoint-every {config.checkpoint_every} saves DIR/last.pt that often: pass "
                              "--checkpoint-dir DIR")
    if not ranks.is_main:
        echo = _silent  # rank 0 speaks for all; errors still surface on every rank as exceptions
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device, ranks)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    pin: PinMode = "none" if device.type != "cuda" else config.pin  # type: ignore[assignment]
    torch.manual_seed(config.seed)

    with ExitStack() as stack:
        coll = Collective.start(ranks, device)
        stack.callback(coll.close)  # registered first: the group outlives everything below
        agree_on_options(config, val_buffer is not None, coll)
        plan = agree_on_checkpoints(config, coll)
        check_metrics_paths(config, coll)
        config = dataclasses.replace(config, resume=plan.resume)  # the daemons local rank 0 starts resume too
        spawned: list[SpawnedDaemon] = []
        if config.spawn_daemon:
            assert config.data is not None  # check_spawn_options
            wanted = [(config.buffer, config.data, "train")]
            if config.val_data is not None and val_buffer is not None:
                wanted.append((val_buffer, config.val_data, "val"))
            # One daemon per box serves all of its ranks: local rank 0 starts it, the others wait.
            for buffer, data, split in wanted if ranks.is_local_main else []:
                with signals_held():  # a stop signal between the launch and its stop's registration left it running
                    daemon = spawn_daemon(buffer, data, split, config, echo, ranks)
                    if daemon is not None:
                        # Registered before the loaders: on the way out the loaders close (final progress) first.
                        stack.callback(daemon.stop)
                        spawned.append(daemon)
            for daemon in spawned:
                daemon.wait_ready(config.timeout)
            coll.barrier("at the start, while local rank 0 starts the daemons", config.timeout + 60)
        stall = config.daemon_timeout or None
        train_loader = stack.enter_context(BufferLoader(
            wait_for_stream(config.buffer, ranks, config.timeout), device=device, timeout=config.timeout, pin=pin,
            stall_timeout=stall, consumer=config.consumer, start=(0, 0),
        ))
        check_split(train_loader, "train", "--buffer")
        val_loader = None
        if val_buffer is not None:
            val_loader = stack.enter_context(BufferLoader(
                wait_for_stream(val_buffer, ranks, config.timeout, "val"), device=device, timeout=config.timeout, pin=pin,
                stall_timeout=stall, consumer=config.consumer, start=(0, 0),
            ))
            check_split(val_loader, "val", "--val-buffer")
            check_same_classes(train_loader, val_loader)
            check_held_out(train_loader, val_loader)
            if ranks.is_main:  # once, not once a rank
                warn_of_another_size(config.buffer, train_loader, val_buffer, val_loader)
        if config.spawn_daemon:
            check_served_job(config, train_loader, config.data)
            if val_loader is not None and config.val_data is not None:
                check_served_job(config, val_loader, config.val_data)
        epochs = resolve_epochs(config, train_loader, val_loader)
        check_equal_steps(coll, train_loader, val_loader, epochs)
        run = Run(config, device, train_loader, val_loader, epochs, val_buffer, echo, coll, plan)
        if should_stop is not None:
            run.should_stop = should_stop
        if stop_signal is not None:
            run.stop_signal = stop_signal
        if config.spawn_daemon and not ranks.distributed:
            # Under torchrun the other ranks would give up on the daemon while local rank 0 restarts it:
            # there a lost daemon ends the run, and --resume continues it.
            run.recover = restarter(spawned, config, echo)
        training()
        metrics = run.run()
        if config.spawn_daemon and ranks.distributed:
            # Every rank has consumed its last batch before local rank 0 stops the daemon.
            train_loader.close()
            if val_loader is not None:
                val_loader.close()
            coll.barrier("at the end of training", config.timeout + 60)
        return metrics


def _silent(_: str) -> None:
    pass


def _resumable(config: TrainConfig, second_signal: bool) -> str:
    """What ``--resume`` continues from after Ctrl-C or a second SIGTERM, which stop without saving; after
    Ctrl-C, that one SIGTERM would have saved."""
    path = CheckpointPlan.of(config).path
    if path is None:
        return " (no --checkpoint-dir: nothing to resume from" + (
            ")" if second_signal else "; SIGTERM instead stops after the step with a checkpoint)")
    try:
        there = existing_checkpoint(path)
    except CheckpointError:
        there = None
    if there is None:
        return f" before a checkpoint was saved in {config.checkpoint_dir}"
    return f"; --resume continues from the last checkpoint, {there}" + (
        "" if second_signal else " (SIGTERM instead saves one first)")


class StopNow(KeyboardInterrupt):
    """A second SIGTERM/SIGHUP: stop without waiting for the step, as Ctrl-C does (a KeyboardInterrupt, so that
    a checkpoint being written is finished first), but said and exited as that signal (143), not as Ctrl-C."""


class TerminatedBeforeTraining(BaseException):
    """SIGTERM came before the first step: ``main``'s handler raises it wherever the run waits then (a
    BaseException, as KeyboardInterrupt is: no ``except Exception`` on the way swallows it)."""


def run(verbose: bool, options: dict[str, Any]) -> None:
    """``prefetchd-train`` (``command.main``) once its options parsed: train, and leave with the exit code
    that says how it ended."""
    # A crash in native code (a signal such as SIGSEGV or SIGABRT) prints where each Python thread was;
    # to the process's own stderr, which a caller's replacement (click's test runner) may not have.
    if not faulthandler.is_enabled() and sys.__stderr__ is not None:
        faulthandler.enable(sys.__stderr__)
    try:
        ranks = Ranks.from_env()
    except SetupError as exc:
        raise click.ClickException(str(exc)) from None
    name = f"prefetchd-train[rank {ranks.rank}]" if ranks.distributed else "prefetchd-train"
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format=f"{name}: %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = TrainConfig(**options)
    except ValueError as exc:  # a value the option types cannot refuse, such as a bad --consumer name
        raise click.UsageError(str(exc)) from None
    terminations: list[int] = []
    started: list[bool] = []

    def on_sigterm(signum: int, frame: object) -> None:
        # The first SIGTERM (or SIGHUP: a closed terminal, which ended the run on the spot without a word, its
        # spawned daemons left running; a user's walk) only asks: the run stops after the step in progress (or
        # the wait), with a checkpoint, and spawned daemons are stopped on the way out. A second one does not
        # wait. Before training (daemons starting, a wait for the manifest of up to --timeout) there is
        # nothing to save: it stops at once.
        terminations.append(signum)
        if not started:
            raise TerminatedBeforeTraining
        if len(terminations) > 1:
            raise StopNow

    def stop_signal() -> str:
        return signal.Signals(terminations[0]).name if terminations else "SIGTERM"

    previous = {s: signal.signal(s, on_sigterm) for s in TERMINATION_SIGNALS}
    try:
        metrics = train(config, should_stop=lambda: bool(terminations), ranks=ranks,
                        training=lambda: started.append(True), stop_signal=stop_signal)
    except TerminatedBeforeTraining:
        click.echo(f"{name}: stopped by {stop_signal()} before training began; nothing was trained, so nothing to "
                   "save", err=True)
        _leave(signal_exit(stop_signal()), ranks)
    except NoAccess as exc:  # before LoaderError (AccessLost is both) and SetupError; every rank says it alike
        click.echo(f"{name}: {exc}", err=True)
        _leave(EXIT_NO_ACCESS, ranks)
    except (LoaderError, ProtocolError) as exc:
        told = " ".join(str(exc).split())
        if isinstance(exc, (DaemonGone, DaemonStuck)) and config.spawn_daemon and ranks.distributed:
            # Its restart command names the job, not how this run started it (--workers, --high-water, ...).
            told += (". Under torchrun a lost daemon ends the run (local rank 0 does not restart it while the other "
                     "ranks wait). No need to start it by hand as above: run this same command again with --resume, "
                     "which starts the daemons again and goes on from the last checkpoint")
        click.echo(f"{name}: {told}", err=True)
        _leave(EXIT_BUFFER, ranks)
    except OptionError as exc:  # before SetupError, which it is
        raise click.UsageError(str(exc)) from None
    except SetupError as exc:  # under torchrun every rank may say it: which one does
        raise click.ClickException(f"rank {ranks.rank}: {exc}" if ranks.distributed else str(exc)) from None
    except (CheckpointError, PeerFailed) as exc:
        click.echo(f"{name}: {' '.join(str(exc).split())}", err=True)
        _leave(EXIT_FAILED, ranks)
    except RuntimeError as exc:
        if not (ranks.distributed and is_peer_failure(exc)):
            raise
        # DDP's gradient all-reduce lost a rank that left; that rank said why.
        click.echo(f"{name}: {peer_failed(ranks, 'in the gradient all-reduce of DDP')}", err=True)
        _leave(EXIT_FAILED, ranks)
    except KeyboardInterrupt as exc:
        second = signal.Signals(terminations[-1]).name if isinstance(exc, StopNow) else None
        how = f"stopped by a second {second} without waiting for the step" if second else "interrupted"
        click.echo(f"{name}: {how}{_resumable(config, second is not None) if ranks.is_main else ''}", err=True)
        _leave(signal_exit(second) if second else EXIT_INTERRUPTED, ranks)  # the signal said is the one exited as
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    stopped_by = metrics["stopped_by"]
    _leave(signal_exit(stopped_by) if stopped_by in SIGNAL_NAMES else EXIT_OK, ranks)


def signal_exit(name: str) -> int:
    """The exit code of a run that signal ``name`` stopped, as a process the signal killed has: 143 for SIGTERM."""
    return 128 + signal.Signals[name]


def _leave(code: int, ranks: Ranks) -> NoReturn:
    """Exit with ``code``; a rank under torchrun without tearing the interpreter down.

    DistributedDataParallel keeps its process group alive after ``destroy_process_group``, and with it
    gloo's worker and transport threads: they still run once the model is deleted and collected
    (torch's reducer is never freed). Python's shutdown and the C++ destructors of ``exit()`` then run
    beside them. In CI a rank that had stopped cleanly, the checkpoint saved, died of SIGABRT on its way
    out ("terminate called without an active exception"), and torchrun reported that rank as failed.
    Everything a rank writes is closed by now (loaders, checkpoint, metrics, spawned daemons), so it
    flushes its output and leaves with its code, past both.
    """
    if not ranks.distributed:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


__all__ = [
    "EXIT_BUFFER", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_NO_ACCESS", "EXIT_OK", "EXIT_TERMINATED", "EXIT_USAGE", "main", "train",
]


if __name__ == "__main__":
    main()
