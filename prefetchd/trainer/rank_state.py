"""Loader positions in checkpoints that rank 0 alone writes (Lightning, Accelerate's ``save_state``).

Each rank reads its own stream, so each has its own loader state (the stream's
identity names its rank); a checkpoint written by rank 0 must hold all of them.
``gather_states`` collects them when the checkpoint is taken (every rank takes
part, as both frameworks call ``state_dict`` on every rank), and ``own_state``
gives each rank its own back on resume::

    accelerator.register_for_checkpointing(EveryRank(train_loader))

With one process nothing is gathered and the state holds one position.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch.distributed as dist

from prefetchd.trainer.errors import StateMismatch
from prefetchd.trainer.ranks import Ranks

STATE_FORMAT = "prefetchd.rank_states"
STATE_VERSION = 1


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def gather_states(own: dict[str, Any]) -> dict[str, Any]:
    """Every rank's ``own`` state, in rank order (a collective: every rank must call it)."""
    states: list[Any] = [own]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        states = [None] * dist.get_world_size()
        dist.all_gather_object(states, own)
    return {"format": STATE_FORMAT, "version": STATE_VERSION, "ranks": states}


def own_state(state: Mapping[str, Any], ranks: Ranks) -> dict[str, Any]:
    """This rank's part of a :func:`gather_states` state."""
    if "fingerprint" in state and "ranks" not in state:  # was "not written by prefetchd's EveryRank" (a user's walk)
        raise StateMismatch(
            "the checkpoint's loader state is one loader's position (BufferLoader.state_dict), not every rank's: "
            "load it with loader.load_state_dict, as register_for_checkpointing(loader) does where the run that "
            "saved it registered the loader itself")
    if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
        raise StateMismatch(
            f"the checkpoint's loader state has format {state.get('format')!r} version {state.get('version')!r}; "
            f"this prefetchd reads {STATE_FORMAT!r} version {STATE_VERSION}: it was not written by prefetchd's "
            "EveryRank or BufferDataModule"
        )
    states = state.get("ranks")
    if not isinstance(states, list) or len(states) != ranks.world_size:
        count = len(states) if isinstance(states, list) else "no"
        raise StateMismatch(
            f"the checkpoint holds the loader positions of {count} ranks but this run has {ranks.world_size}; "
            "resume with as many processes as the checkpoint was taken with"
        )
    return dict(states[ranks.rank])


class EveryRank:
    """A loader whose ``state_dict`` holds every rank's position, for checkpoints rank 0 writes.

    ``ranks`` defaults to what torchrun's environment says (``accelerate launch`` sets it).
    """

    def __init__(self, loader: Stateful, ranks: Ranks | None = None) -> None:
        self.loader = loader
        self._ranks = ranks

    def state_dict(self) -> dict[str, Any]:
        return gather_states(self.loader.state_dict())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        ranks = self._ranks if self._ranks is not None else Ranks.from_env()
        self.loader.load_state_dict(own_state(state, ranks))


__all__ = ["EveryRank", "gather_states", "own_state"]
