"""The command that has the daemon serve a loader's job again: the restart a loader's errors
advise, and the submit a resume of another job's state asks for.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from prefetchd.buffer_protocol import Manifest, ProtocolError
from prefetchd.buffer_protocol.layout import STREAM_PREFIX, owning_buffer
from prefetchd.buffer_protocol.manifest import augmentation_options, exact_number
from prefetchd.launch import option_args
from prefetchd.words import rank_ranges


def job_command(m: Manifest, stream: Path, verb: str = "start") -> str:
    """The ``prefetchd start`` (or ``submit``) that serves ``m``'s job on the buffer of ``stream``
    again: every flag of the job's identity (a daemon started with others would refuse the buffer
    as another job's) and its epochs, so that the daemon resumes from progress.json.

    ``start`` leaves out what its defaults give (``--seed 0``); ``submit`` does not, since a job
    takes what it leaves out from the daemon's own settings, a service's ``seed = 7`` say: its
    command gave the job seed 7 again, and the same StateMismatch.  (An augmentation, a
    ``--val-fraction`` or a ``--transform`` that the job has not, no flag can unset.)"""
    buffer = owning_buffer(stream)
    every = verb == "submit"
    options: dict[str, object] = {
        "data": m.dataset_root,
        "split": m.split if every or m.split != "train" else None,
        "val_fraction": exact_number(m.val_fraction) if m.val_fraction is not None else None,
        "batch_size": m.batch_size,
        "image_size": m.image_size,
        "seed": m.seed if every or m.seed else None,
        "world_size": m.world_size if every or m.world_size > 1 else None,
        "ranks": _served_ranks(m, buffer) if every or m.world_size > 1 else None,
        **augmentation_options(m.augmentation),
        "drop_last": m.drop_last if every else m.drop_last or None,
        "epochs": m.epochs,
    }
    return shlex.join(["prefetchd", verb, "--buffer", str(buffer), *option_args(options)])


def _served_ranks(m: Manifest, buffer: Path) -> str:
    """The ranks whose streams the daemon that wrote ``m`` produced, as ``--ranks`` takes them (``0-3,6``):
    those whose manifest names the same producer."""
    ranks = [m.rank]
    for directory in sorted(buffer.glob(f"{STREAM_PREFIX}*")):
        try:
            other = Manifest.read(directory)
        except (ProtocolError, OSError):
            continue
        if other.producer == m.producer and other.rank != m.rank:
            ranks.append(other.rank)
    return rank_ranges(ranks)


__all__ = ["job_command"]
