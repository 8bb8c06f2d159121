"""Many ranks: where a ``prefetchd-train`` process stands under torchrun, and which stream it reads.

torchrun starts one trainer per rank and says where each stands in its
environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``).
Rank ``r`` of ``W`` reads the stream ``stream_dir(buffer, r, W)`` that one
daemon per box produces for all of the box's ranks (``prefetchd start
--world-size W --ranks a-b``); the daemon pads every rank's share to the same
number of samples, so every rank runs the same number of steps and DDP's
collectives always pair up.

What the ranks agree on before their process group is in ``rank_store``; what
they ask of each other once it stands, in ``collective``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from prefetchd.buffer_protocol import Manifest, daemon_owner, stream_dir
from prefetchd.buffer_protocol.layout import MANIFEST_NAME
from prefetchd.trainer.errors import LoaderError, LoaderTimeout, SetupError
from prefetchd.trainer.daemon_status import owner_status, served_world, unserved_rank
from prefetchd.trainer.manifest_wait import DATA_FORMS, STATUS_LOOK_SECONDS, FailedDaemon, why_no_manifest
from prefetchd.trainer.wait_bounds import DEFAULT_TIMEOUT, MORE_TIME, buffer_path, check_timeout

logger = logging.getLogger(__name__)

TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK")
_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class Ranks:
    """This process's place among the trainer's ranks (one rank without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.world_size and 0 <= self.local_rank < self.local_world_size
                and self.local_rank <= self.rank and self.local_ranks.stop <= self.world_size):
            raise SetupError(
                f"RANK {self.rank}, WORLD_SIZE {self.world_size}, LOCAL_RANK {self.local_rank}, LOCAL_WORLD_SIZE "
                f"{self.local_world_size} do not fit together; launch the trainer with torchrun, which sets them"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Ranks:
        """The ranks torchrun describes in the environment; one rank when it describes none."""
        env = os.environ if environ is None else environ
        present = [name for name in TORCHRUN_VARS if name in env]
        if not present:
            return cls()
        missing = [name for name in TORCHRUN_VARS if name not in env]
        if missing:
            raise SetupError(
                f"{', '.join(present)} {'is' if len(present) == 1 else 'are'} set but {', '.join(missing)} not: "
                "launch the trainer with torchrun (which sets them all), or unset them to train as one process"
            )
        values = {}
        for name in (*TORCHRUN_VARS, "LOCAL_WORLD_SIZE"):
            text = env.get(name)
            if text is None:  # not set by a hand-made launch: one box holds every rank
                continue
            try:
                values[name] = int(text)
            except ValueError:
                raise SetupError(f"{name}={text!r} in the environment is not a number; launch "
                                           "the trainer with torchrun, which sets it") from None
        world, rank, local_rank = values["WORLD_SIZE"], values["RANK"], values["LOCAL_RANK"]
        if "LOCAL_WORLD_SIZE" not in values and rank != local_rank:
            # This box's first rank is not 0: it is one box of several, whose ranks only LOCAL_WORLD_SIZE tells.
            # Taken for one box holding every rank, it started a daemon for ranks past the world (a traceback).
            raise SetupError(
                f"LOCAL_WORLD_SIZE is not set, and this box's ranks begin at {rank - local_rank} (RANK={rank}, "
                f"LOCAL_RANK={local_rank}): a launcher that runs ranks on several boxes must set LOCAL_WORLD_SIZE to "
                "the number of ranks on each box, as torchrun does (under SLURM: SLURM_NTASKS_PER_NODE); without it "
                "prefetchd takes one box to hold every rank"
            )
        return cls(rank=rank, world_size=world, local_rank=local_rank,
                   local_world_size=values.get("LOCAL_WORLD_SIZE", world))

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, writes metrics and checkpoints."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Local rank 0: the one that starts this box's daemons."""
        return self.local_rank == 0

    @property
    def local_ranks(self) -> range:
        """The ranks on this box; torchrun gives each box one contiguous block of ranks."""
        first = self.rank - self.local_rank
        return range(first, first + self.local_world_size)

    def ranks_flag(self) -> str:
        """The daemon's ``--ranks`` for this box, e.g. ``8-15``."""
        r = self.local_ranks
        return str(r.start) if len(r) == 1 else f"{r.start}-{r.stop - 1}"


# -- which stream this rank reads ------------------------------------------------------


def _split_flag(split: str) -> str:
    """What a suggested `prefetchd start` adds for the split the caller reads: " --split val", or nothing."""
    return " --split val" if split == "val" else ""


def _world_mismatch(buffer: Path, served: int, manifest: Path, ranks: Ranks, split: str) -> SetupError:
    found = f"the daemon of {buffer} produces streams for --world-size {served} ({manifest})"
    if ranks.distributed:
        w = ranks.world_size
        other = (f"launch torchrun with {served} processes in all (--nnodes x --nproc-per-node = {served})"
                 if served > 1 else "run the trainer as one process, without torchrun")
        return SetupError(
            f"{found}, but torchrun runs {w} ranks (WORLD_SIZE={w}). Restart the daemon for {w} ranks "
            f"(`prefetchd stop --buffer {buffer}`, then `prefetchd start --buffer {buffer} ...{_split_flag(split)} "
            f"--world-size {w} --reset`: "
            f"--reset deletes the batches of --world-size {served}), "
            f"or {other}"
        )
    return SetupError(
        f"{found}, but this trainer runs as one process (not under torchrun). Launch it under torchrun or "
        f"`accelerate launch` with {served} processes in all (e.g. `torchrun --nproc-per-node {served} train.py` "
        f"or `... -m prefetchd.trainer.train`; Lightning: `Trainer(strategy=\"ddp\", devices={served})`), or "
        f"restart the daemon without --world-size and with --reset (which deletes the batches of --world-size {served})"
    )


def wait_for_stream(buffer: Path, ranks: Ranks, timeout: float, split: str = "train") -> Path:
    """This rank's stream directory of ``buffer``, once the daemon has written its manifest there.

    ``split`` is what the caller reads the buffer for: the command that starts a missing daemon says it.

    A daemon producing for another number of ranks would leave this rank
    waiting for a stream that never comes (or hand it another rank's share):
    that is refused at once, naming both numbers and the fix.
    """
    if buffer.exists() and not buffer.is_dir():
        raise LoaderError(f"{buffer} is not a directory; pass the daemon's --buffer directory")
    own = stream_dir(buffer, ranks.rank, ranks.world_size)
    deadline = time.monotonic() + timeout
    next_look = time.monotonic()
    logged = False
    failed = FailedDaemon(buffer, timeout)
    while True:
        served = served_world(buffer)
        if served is not None and served[0] != ranks.world_size:
            raise _world_mismatch(buffer, served[0], served[1], ranks, split)
        if served is not None and served[0] > 1 and served[1].parent == buffer:
            # A manifest of a many-rank job at the top: this is one rank's stream directory, not the buffer.
            raise SetupError(
                f"{buffer} is the stream of one rank (its {MANIFEST_NAME} says rank "
                f"{Manifest.read(buffer).rank} of --world-size {served[0]}), not a buffer; every rank finds its own "
                f"stream under the buffer: pass the daemon's --buffer, {buffer.parent}"
            )
        there = (own / MANIFEST_NAME).is_file()
        if there or time.monotonic() >= next_look:
            # Also once the stream is there: an earlier run of the job may have left it (its daemon restarted
            # with fewer --ranks), and the batches waited for would never come.
            next_look = time.monotonic() + STATUS_LOOK_SECONDS
            owner, status = owner_status(own)
            unserved = unserved_rank(own, owner, status) if ranks.distributed else None
            if unserved is not None:
                raise SetupError(
                    f"{unserved}. Restart it with this box's ranks (`prefetchd stop --buffer {buffer}`, then `prefetchd "
                    f"start --buffer {buffer} ... --world-size {ranks.world_size} --ranks {ranks.ranks_flag()}`), or "
                    "point this box's ranks at a buffer of their own daemon")
            if there:
                return own
            failed.check(owner, status)
        if time.monotonic() >= deadline:
            raise LoaderTimeout(failed.timed_out(_no_stream_message(buffer, own, ranks, timeout, split)))
        if not logged:
            logger.info("waiting up to %g s for %s", timeout, own / MANIFEST_NAME)
            logged = True
        time.sleep(_POLL_SECONDS)


def rank_stream(buffer: str | os.PathLike[str], timeout: float = DEFAULT_TIMEOUT) -> Path:
    """The stream of ``buffer`` that this process reads: the buffer itself as one process, its
    rank's stream directory under torchrun, ``accelerate launch`` or any launcher that sets
    torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, and ``LOCAL_WORLD_SIZE`` where the ranks span
    several boxes).  Pass it to BufferLoader.

    It waits up to ``timeout`` seconds for the daemon's manifest, which says whether the job has a stream per
    rank (the daemon's --world-size) and which ranks it serves; LoaderTimeout past that."""
    return wait_for_stream(buffer_path(buffer), Ranks.from_env(), check_timeout(timeout))


def _no_stream_message(buffer: Path, own: Path, ranks: Ranks, timeout: float, split: str = "train") -> str:
    world = _split_flag(split) + (f" --world-size {ranks.world_size}" if ranks.distributed else "")
    owner = daemon_owner(buffer)
    if owner is not None:
        extra = (f"; it may produce only other ranks: its --ranks must include {ranks.rank}"
                 if ranks.distributed else "")
        return (f"{own}: the daemon ({owner}) owns {buffer} but wrote no manifest.json there within "
                f"{timeout:g} s{extra}; {why_no_manifest(buffer)}")
    where = "does not exist" if not own.exists() else "has no manifest.json"
    return (f"{own} {where} after waiting {timeout:g} s for the daemon's manifest.json, and no prefetchd daemon "
            f"owns {buffer}. Start one with `prefetchd start --buffer {buffer} --data ROOT{world}` (ROOT: the "
            f"{'validation ' if split == 'val' else ''}{DATA_FORMS}), or {MORE_TIME} if one is still starting")


__all__ = ["Ranks", "TORCHRUN_VARS", "wait_for_stream"]
