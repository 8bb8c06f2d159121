"""The loader's state in a checkpoint: where to resume, and whether it fits the buffer's job.

``BufferLoader.state_dict()`` names the (epoch, step) of the next batch and the job
it belongs to; ``load_state_dict`` accepts it only for the same job, because a
different dataset, seed, batch size, split ... would give other batches at the same
position (the daemon's batches are a pure function of the job and the position).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefetchd.buffer_protocol import Manifest
from prefetchd.buffer_protocol.layout import MAX_EPOCH
from prefetchd.trainer.errors import StateMismatch
from prefetchd.trainer.job_command import job_command
from prefetchd.trainer.rank_state import STATE_FORMAT as EVERY_RANK_FORMAT
from prefetchd.trainer.rank_state import a_mapping, check_format

STATE_FORMAT = "prefetchd.loader_state"
STATE_VERSION = 1


def loader_state(manifest: Manifest, epoch: int, step: int) -> dict[str, Any]:
    """The state dict of a loader at (epoch, step) of ``manifest``'s job."""
    return {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "epoch": epoch,
        "step": step,
        "fingerprint": manifest.fingerprint,
        "producer": manifest.producer,
        "identity": {key: getattr(manifest, key) for key in Manifest.IDENTITY},
    }


def resume_position(state: object, manifest: Manifest, buffer: Path, what: str = "loader state") -> tuple[int, int]:
    """The (epoch, step) ``state`` resumes at; StateMismatch when it belongs to another dataset or
    job, or points past the end of ``manifest``'s job.  ``what`` names it in messages (``start=(0, 9)``)."""
    m = manifest
    state = a_mapping(state, what, "BufferLoader")
    if state.get("format") == EVERY_RANK_FORMAT:  # was "loader state has epoch=None, step=None" (a user's walk)
        raise StateMismatch(
            "loader state holds every rank's position (EveryRank's or BufferDataModule's state_dict): load it "
            "through EveryRank(loader).load_state_dict, as accelerator.register_for_checkpointing(EveryRank(loader)) "
            "does where the run that saved it registered EveryRank too"
        )
    check_format(state, STATE_FORMAT, STATE_VERSION, what, "BufferLoader")  # another format's keys mean other things
    epoch, step = as_count(state.get("epoch")), as_count(state.get("step"))
    if epoch is None or step is None:
        raise StateMismatch(
            f"{what} has epoch={state.get('epoch')!r}, step={state.get('step')!r}; expected non-negative "
            "integers from BufferLoader.state_dict()"
        )
    fingerprint = state.get("fingerprint")
    if fingerprint is None:  # "the checkpoint was taken on another dataset" said of a hand-made dict (a review)
        raise StateMismatch(f"loader state {dict(state)!r:.80} has no fingerprint: expected the dict "
                            "BufferLoader.state_dict() returns, saved whole")
    if fingerprint != m.fingerprint:
        raise StateMismatch(
            f"loader state is for dataset fingerprint {fingerprint!r}, but the daemon of {buffer} "
            f"serves {m.dataset_root!r} (fingerprint {m.fingerprint!r}): the checkpoint was taken on "
            "another dataset (or its files changed since: a rewritten file changes the fingerprint). Start "
            "the daemon on the checkpoint's dataset, or train from scratch (prefetchd-train without --resume, "
            "or another --checkpoint-dir; Lightning: fit without ckpt_path; your own loop without "
            "loader.load_state_dict)"
        )
    identity = state.get("identity")
    if isinstance(identity, Mapping):
        differ = [key for key in Manifest.IDENTITY if key in identity and identity[key] != getattr(m, key)]
        if differ:
            diffs = [f"{key}: checkpoint {identity[key]!r}, buffer {getattr(m, key)!r}" for key in differ]
            raise StateMismatch(
                f"loader state does not fit the job in {buffer} ({'; '.join(diffs)}), so resuming "
                f"would not see the same batches; {_serve_again(m, identity, differ, buffer)}"
            )
    if epoch > MAX_EPOCH:  # else the loader fails at the batch's name, and the daemon ignores the progress file
        raise StateMismatch(f"{what} is at epoch {epoch}, past {MAX_EPOCH}, the last epoch a buffer's batch names "
                            "hold; epochs count from 0 (pass the epoch, not a step or sample count)")
    spe = m.steps_per_epoch
    if step >= max(spe, 1):
        raise StateMismatch(f"{what} has step {step}, but an epoch of {buffer} has {spe} steps (0-{max(spe, 1) - 1}; "
                            f"the next epoch's first is epoch {epoch + 1} step 0): steps count within an epoch")
    if m.epochs is not None and (epoch, step) > (m.epochs, 0):
        raise StateMismatch(
            f"{what} is at epoch {epoch} step {step}, past the end of the job in {buffer} "
            f"({m.epochs} epochs); restart the daemon with a larger --epochs"
        )
    return epoch, step


# What a submitted job sets (samples_per_epoch follows from the split and val_fraction): a daemon serving jobs,
# such as a service's, is given the checkpoint's by `prefetchd submit`, which a trainer user may run.
SUBMITTABLE = {"split", "seed", "batch_size", "image_size", "val_fraction", "augmentation", "drop_last",
               "samples_per_epoch"}


def _serve_again(m: Manifest, identity: Mapping[str, Any], differ: list[str], buffer: Path) -> str:
    """How to have the checkpoint's job served: the daemon restarted with its settings, or (where a job
    can set every one that differs) that job submitted."""
    restart = "restart the daemon with the checkpoint's settings"
    if not set(differ) <= SUBMITTABLE:
        return restart
    try:
        wanted = dataclasses.replace(m, **{key: identity[key] for key in differ})
        command = job_command(wanted, buffer, "submit")
    except (TypeError, ValueError):  # a checkpoint's value of another type: the restart advice alone
        return restart
    return f"{restart}, or submit them as a job (a service's daemon takes one from trainer users): `{command} --replace`"


def as_count(value: object) -> int | None:
    """``value`` as a non-negative int where it is one, also a numpy or torch integer (``for epoch in
    np.arange(n)``: refused as "not a non-negative integer" before); else None."""
    if isinstance(value, bool):
        return None
    try:
        count = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None
    return count if count >= 0 else None
